"""Parameter coverage: unused-parameters -- trainable parameters that get no gradient, told apart by data flow:
unwired (their values never reach the loss) or cut off (they reach it, but autograd's graph is broken between)."""

from __future__ import annotations

from typing import Any

from ampdoctor.findings._common import group_by_owner
from ampdoctor.findings._context import Context
from ampdoctor.findings._graph import ancestors
from ampdoctor.findings._registry import RUN_END, SETUP_CRASHED_COVERAGE, SETUP_UNWIRED, Candidate, rule
from ampdoctor.findings._types import Finding, FixProposal


def _reaching_loss(ctx: Context, names: list[str]) -> set[str]:
    """The parameters among ``names`` whose values reach step 0's loss through the traced ops (inputs lineage);
    empty when the step has no traced loss."""
    loss = [i for i in ctx.target.trace.marks.get("loss", []) if ctx.records[i].step == 0]
    if not loss:
        return set()
    anc: set[int] = set()
    for i in loss:
        anc |= ancestors(ctx, i)
    wanted = set(names)
    return {r.name for r in ctx.records if r.kind == "param" and r.name in wanted and r.index in anc}


_UNWIRED_FIXES = (
    FixProposal("build the model without the unused part (a constructor option, or delete the module "
                "before training)"),
    FixProposal("under DDP, let it tolerate unused parameters",
                "DistributedDataParallel(model, find_unused_parameters=True)"),
)
_CUT_FIXES = (
    FixProposal("checkpoint with the non-reentrant implementation, which needs no input that requires grad",
                "torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)\n"
                "# transformers: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})"),
    FixProposal("or make the checkpointed block's input require grad (frozen embeddings feed it)",
                "model.enable_input_require_grads()  # transformers; else hidden.requires_grad_(True)"),
    FixProposal("remove the torch.no_grad() / inference_mode() / .detach() between these weights and the loss"),
)


def _explain(owner: str, params: list[str], cut: bool) -> str:
    listed = f"{', '.join(params[:4])}{', ...' if len(params) > 4 else ''}"
    head = f"{len(params)} trainable parameter(s) of {owner or '<root>'} ({listed}) have grad None after backward"
    if cut:
        return (head + ", although their values reach the loss (the traced ops lead from them to it): autograd's "
                "graph is cut between them and the loss. Typical: torch.utils.checkpoint(use_reentrant=True) "
                "around a block none of whose inputs requires grad (frozen embeddings, adapters or LoRA on a "
                "frozen base: the block runs under no_grad and its output is a constant), a forward under "
                "torch.no_grad() / inference_mode(), or a .detach(). These weights shape the loss but are never "
                "trained, in every precision.")
    return (head + ": the module's output never reaches the loss. DDP (find_unused_parameters=False) fails on the "
            "next step, fused/flattening fp16 optimizers break on None grads, and these weights are never trained.")


@rule("unused-parameters", severity="warning", precedence=70,
      summary="trainable parameters get no gradient (None) or are missing from the optimizer")
def unused_parameters(ctx: Context) -> list[Candidate]:
    """Trainable parameters whose ``.grad`` stays ``None`` after backward. Either their module's output never
    reaches the loss (BERT's pooler when the loss uses token states): DDP with ``find_unused_parameters=False``
    then fails on the next step ("Expected to have finished reduction"), fused or flattening fp16 optimizers
    choke on the ``None`` grads, and plain optimizers skip them silently; ``error`` when the run crashed or a
    DDP wrapper is in use, ``warning`` otherwise. Or their values do reach the loss through the traced ops
    while no gradient comes back: the autograd graph is cut (a reentrant ``torch.utils.checkpoint`` whose
    inputs do not require grad, ``no_grad``, ``detach``): an ``error`` when they are in the optimizer passed
    (these weights shape the loss and the user means to train them; evidence ``reaches_loss``, ``in_optimizer``),
    a ``warning`` without an optimizer (a frozen teacher under ``no_grad`` may just lack
    ``requires_grad_(False)``). A functional bug that holds in every precision, it ranks before the numeric causes
    of the same severity (a precision-loss or underflow warning measures a degradation against fp32; these weights
    are not trained at all)."""
    # long: the docstring is this code's entry in docs/codes.md
    out: list[Candidate] = []
    cov = ctx.target.coverage[0] if ctx.target.coverage else None
    if cov is None or ctx.target.forward_only:
        return out
    none = [p.name for p in cov if p.grad_none]
    if none and len(none) < len(cov):
        crashed = ctx.target.exc is not None
        ddp = type(ctx.spec.model).__name__ == "DistributedDataParallel"
        reach = _reaching_loss(ctx, none)
        in_opt = {p.name for p in cov if p.in_optimizer} if ctx.spec.optimizer is not None else set()
        for owner, params in sorted(group_by_owner(none, ctx.target.owners).items()):
            cut = bool(params) and all(p in reach for p in params)
            trained = cut and all(p in in_opt for p in params)  # the user's optimizer means to train them
            ev: dict[str, Any] = {"parameters": params, "count": len(params), "of_trainable": len(cov),
                                  "reaches_loss": cut, "in_optimizer": trained}
            expl = _explain(owner, params, cut)
            if crashed:
                ev["crash"] = f"{type(ctx.target.exc).__name__}: {str(ctx.target.exc).splitlines()[0][:200]}"
                ev["crash_step"] = ctx.target.exc_step
                expl += f" The run crashed at step {ctx.target.exc_step}: {ev['crash']}."
            exclude = FixProposal("leave these parameters out of training",
                                  f"for p in model.{owner}.parameters():\n    p.requires_grad_(False)"
                                  if owner else "", id="exclude_unused", params={"parameters": params})
            fixes = _CUT_FIXES if cut else (exclude, *_UNWIRED_FIXES)
            title = (f"{owner or '<root>'}: {len(params)} trainable parameter(s) reach the loss but never get a "
                     "gradient" if cut else f"{owner or '<root>'}: {len(params)} trainable parameter(s) never get "
                     "a gradient")
            out.append(Candidate(Finding(
                "unused-parameters", "error" if trained or crashed or ddp else "warning", owner, "", "backward",
                title, expl, ev, fixes), SETUP_CRASHED_COVERAGE if crashed else SETUP_UNWIRED))
    out += _missing_from_optimizer(ctx, cov)
    return out


def _missing_from_optimizer(ctx: Context, cov: Any) -> list[Candidate]:
    out: list[Candidate] = []
    missing = [p.name for p in cov if not p.in_optimizer and not p.grad_none]
    for owner, params in sorted(group_by_owner(missing, ctx.target.owners).items()):
        expl = (f"{len(params)} trainable parameter(s) of {owner or '<root>'} get gradients but are not in the "
                "optimizer's param_groups, so they are never updated.")
        out.append(Candidate(Finding(
            "unused-parameters", "warning", owner, "", "optimizer",
            f"{owner or '<root>'}: trainable parameters missing from the optimizer", expl,
            {"parameters": params, "count": len(params)},
            (FixProposal("add them to the optimizer or freeze them",
                         "optimizer.add_param_group({'params': [...]})"),)), RUN_END))
    return out
