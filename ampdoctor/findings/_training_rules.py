"""Rules about the training setup: low-precision-params, loss-scale-collapse, loss-scaling-misuse, fp8-scale."""

from __future__ import annotations

import math
from typing import Any

import torch

from ampdoctor.findings._common import HALF, base_evidence, bf16_fix, dtype_name, fmt, limits, op_base, where
from ampdoctor.findings._context import Context
from ampdoctor.findings._core_rules import scale_explains
from ampdoctor.findings._fp8_casts import clip_candidates
from ampdoctor.findings._fp8_emulated import emulated_candidates
from ampdoctor.findings._registry import RUN_END, RUN_FP8_SCALES, SETUP_CRASH, Candidate, Order, rule
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.findings._updates import lost_updates, scaled_updates
from ampdoctor.trace import DTYPES, OpRecord

FP8 = frozenset(n for n, i in DTYPES.items() if i.fp8)


def _master_fix() -> FixProposal:
    return FixProposal(
        "keep fp32 master weights: parameters and optimizer state in float32, low precision only in autocast",
        "model.float()\nwith torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = loss_fn(model(x), y)",
        id="fp32_master", params={})


@rule("low-precision-params", severity="error", precedence=25,
      summary="trainable parameters or optimizer state in fp16/bf16 without fp32 master weights")
def low_precision_params(ctx: Context) -> list[Candidate]:
    """The optimizer updates fp16/bf16 parameters directly. Updates smaller than half an ulp of the weight
    round away (bf16 has 8 significant bits: a weight of 1.0 ignores any update below 2**-8 = 0.0039); Adam's
    ``eps=1e-8`` is 0 in fp16 and ``grad**2`` underflows, so ``m / (sqrt(v) + eps)`` divides by zero and the
    weights become inf/NaN. Mixed precision keeps fp32 master weights for exactly this reason.

    **Lost updates anywhere.** Every in-place write into fp16/bf16 module state during the step is checked, not only
    ``optimizer.step()``: an EMA / teacher update (``p_ema.mul_(0.999).add_(p, alpha=0.001)``), a running statistic
    in a buffer (``lerp_``, a batch norm's running mean/var), a manual update (``p.data.add_(g, alpha=-lr)``) and the
    accumulation of ``.grad`` across micro-batches (``AccumulateGrad``'s ``add_``). The trace re-runs each such write
    on float32 copies and compares: a write is a lost update when more than half of the elements it should change
    keep their value (the update is below half an ulp of the stored value), or when the update it applies is more
    than 2x off the exact one, while the fp32 reference's same write (same step, tensor and order) does apply it.
    Checked step by step (``steps > 1``: a decaying learning rate that makes updates vanish at step 3 is found at
    step 3). The finding's ``module`` is the module owning the written tensor, ``op`` the write, ``phase`` where it
    ran (``optimizer`` for code after the backward, ``backward`` for gradient accumulation, ``forward`` for
    buffers updated in a forward).

    Evidence of a write: ``parameter`` / ``buffer`` / ``grad`` (the tensor's name, under the key of what was
    written; also ``tensor``), ``written`` (``parameter``, ``buffer`` or ``grad``), ``dtype``, ``step``, ``write``
    (the how-manieth write to that tensor in the step), ``op``, ``op_module`` (the module whose code ran the write;
    ``""`` for the training-step code outside every module), ``owner``, ``source`` (``file:line`` of the user's
    code), ``fraction_lost``, ``moving`` (elements the exact update changes), ``mean_update``, ``applied_ratio``
    (applied / exact update), ``ulp_at_1``, ``fraction_lost_fp32`` and ``applied_fp32`` (the reference's same write),
    and ``update_factor`` / ``update_factor_op`` when a literal factor of the write or its feeders (2 hops) that is
    below the dtype's spacing at 1.0 scaled the update (an EMA's ``(1 - decay) * (e - p)``: 1e-4 for decay 0.9999).

    **Lost, blown up or non-finite.** ``update_is`` says which the write log and the reference show: ``lost``
    (above), ``blown_up`` -- a 16-bit write that applies more than 8x the update of the fp32 reference's same write
    (Adam on fp16 state whose ``grad**2`` flushed to 0 divides by eps alone: ``m / eps``, thousands of times the
    fp32 step; its own wider re-run, fed the same flushed state, cannot see this) with ``applied_vs_fp32``,
    ``mean_applied``, ``mean_applied_fp32``, ``eps`` / ``eps_in_dtype`` and ``flushed_input`` (the feeder that
    flushed, 6 hops) -- or ``nonfinite`` (eps is 0 in the dtype: ``m / 0`` is inf, the optimizer-overflow finding
    above). In a step a blown-up write ranks before a lost one (the lost update of a weight already thrown far is
    its consequence).
    """
    out: list[Candidate] = []
    seen: set[str] = set()
    # 1) a harmful origin inside the optimizer step on low-precision parameters / state
    for o in ctx.harmful_origins():
        r = o.record
        if r.phase != "optimizer" or dtype_name(r.dtype) not in HALF or not r.module or r.module in seen:
            continue
        seen.add(r.module)
        out.append(_optimizer_overflow(ctx, r))
    # 2) any write into fp16/bf16 module state (optimizer, EMA, running statistics, manual updates, gradient
    #    accumulation) whose update rounds away, step by step (the write log sees loop, foreach and fused optimizers)
    out.extend(lost_updates(ctx, seen, _master_fix()))
    return out


def _optimizer_overflow(ctx: Context, r: OpRecord) -> Candidate:
    """An inf/NaN the optimizer step computes from finite inputs in the parameters' 16-bit dtype."""
    t, recs = ctx.target, ctx.records
    ev: dict[str, Any] = base_evidence(r)
    eps = t.optimizer_info.get("defaults", {}).get("eps")
    ev["optimizer"] = t.optimizer_info.get("type", "")
    if isinstance(eps, float):
        ev["eps"] = eps
        ev["eps_in_dtype"] = _round_to(eps, dtype_name(r.dtype))
    zeros = [recs[i] for i in r.inputs if i >= 0 and recs[i].stats.get("n_zero", 0) > 0]
    ev["zero_inputs"] = len(zeros)
    expl = (f"{where(r)} updates {dtype_name(r.dtype)} parameters of {r.module} and produces "
            f"{int(r.stats['n_nan'])} NaN / {int(r.stats['n_posinf'] + r.stats['n_neginf'])} inf from finite "
            "inputs: the optimizer's arithmetic runs in the parameters' low precision.")
    if isinstance(eps, float):
        expl += (f" Its eps={eps:g} is {fmt(ev['eps_in_dtype'])} in {dtype_name(r.dtype)} (smallest subnormal "
                 f"{fmt(limits(r.dtype)[2])}), so the denominator sqrt(v) + eps is 0 where grad**2 underflowed.")
    if ev.get("eps_in_dtype") == 0.0:
        ev["update_is"] = "nonfinite"
        expl += (" The update m / 0 is not lost to rounding but infinite (0 / 0 = NaN where m is 0 as well); fp32, "
                 "where eps and grad**2 are nonzero, takes a step of about the learning rate.")
    fixes = (_master_fix(),
             FixProposal("if the weights must stay low precision, use an eps the dtype can hold",
                         "torch.optim.Adam(params, eps=1e-4)  # fp16 holds 1e-4, not 1e-8"))
    # rank with the first optimizer op on this module in that step: the flushed grad**2 that precedes the
    # division belongs to the same cause
    first = min((x.index for x in recs if x.phase == "optimizer" and x.step == r.step and x.module == r.module),
                default=r.index)
    return Candidate(Finding("low-precision-params", "error", r.module, r.op, "optimizer",
                             _overflow_title(r, ev), expl, ev, fixes, r.step), first)


def _overflow_title(r: OpRecord, ev: dict[str, Any]) -> str:
    """What the step made (NaN from 0/0 is no overflow) and, when it is the cause, the eps the dtype cannot hold."""
    dt = dtype_name(r.dtype)
    made = "NaN" if not r.stats["n_posinf"] + r.stats["n_neginf"] else "inf/NaN"
    cause = f": eps={ev['eps']:g} is 0 in {dt}" if ev.get("eps_in_dtype") == 0.0 and ev.get("eps") else ""
    return f"{r.module}: optimizer step on {dt} parameters produces {made}{cause}"


def _round_to(x: float, dt: str) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(DTYPES[dt].dtype).float())


@rule("loss-scale-collapse", severity="error", precedence=35,
      summary="the dynamic loss scale keeps falling and optimizer steps are skipped")
def loss_scale_collapse(ctx: Context) -> list[Candidate]:
    """GradScaler halves the scale and skips ``optimizer.step()`` whenever a gradient is inf/NaN. When an op
    produces non-finite gradients on every step, the scale falls 65536 -> 64 in 10 steps and on towards 0,
    the weights never change, and nothing is printed. The finding names the op that makes the non-finite
    gradients (the scaler is only the symptom).

    **Normal back-off is no collapse.** A skipped step whose every inf/NaN origin is a backward value that fits
    the format unscaled (the fp32 reference's value, which runs at scale 1, is below the max: only the scale
    pushed it over; read at the reference step with the target's weights -- after ``j`` skips the target's step
    ``s`` repeats the reference's step ``s - j``) is GradScaler backing off towards the scale the gradients
    need -- its first steps from 65536, or again when gradients grow -- and one halving closer to it. Only skips
    with an origin no scale removes (unscaled beyond the max, a forward inf, a scale already <= 1) or with no
    origin found make a collapse; the finding names the first of them. Evidence: ``scales``, ``skipped_steps``,
    ``steps``, ``backoff_steps`` (skips the scale explains), ``collapse_steps`` (the others), ``origin``."""
    scales = ctx.scales
    if len(scales) < 3:
        return []
    drops = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
    if drops < 2 or scales[-1] >= scales[0]:
        return []
    backoff, collapse = _skips_by_cause(ctx)
    if not collapse:
        return []  # every skip is the scaler backing off from a scale only it made too large
    first_bad = collapse[0]
    origins = [o.record for o in ctx.harmful_origins()]
    at_step = [r for r in origins if r.step == first_bad]
    grad_origin = next((r for r in at_step if r.phase == "backward"), at_step[0] if at_step else None)
    if grad_origin is None and origins:
        grad_origin = next((r for r in origins if r.phase == "backward"), origins[0])
    ev: dict[str, Any] = {"scales": scales, "skipped_steps": ctx.skipped_steps, "steps": len(scales),
                          "backoff_steps": backoff, "collapse_steps": collapse}
    module, op, phase = "", "", "backward"
    order: Order | int = RUN_END
    expl = (f"The loss scale fell from {fmt(scales[0])} to {fmt(scales[-1])} over {len(scales)} steps "
            f"({drops} reductions): each reduction is a skipped optimizer step with inf/NaN gradients. "
            f"{len(collapse)} of the skipped steps (from step {first_bad}) hold inf/NaN that no loss scale removes"
            + (f"; {len(backoff)} others are GradScaler's normal back-off" if backoff else "") + ".")
    if grad_origin is not None:
        module, op, phase, order = grad_origin.module, grad_origin.op, grad_origin.phase, grad_origin.index
        ev["origin"] = ctx.describe(grad_origin)
        if grad_origin.node:
            ev["autograd_node"] = grad_origin.node
        expl += (f" The non-finite gradients start at {where(grad_origin)}"
                 + (f" ({grad_origin.node})" if grad_origin.node else "") + "; fix that op, not the scaler.")
    fixes = (bf16_fix(ctx.spec.precision),
             FixProposal("stop training when steps keep being skipped (watch the scale)",
                         "if scaler.get_scale() < 1.0: raise RuntimeError('loss scale collapsed')"))
    return [Candidate(Finding("loss-scale-collapse", "error", module, op, phase,
                              f"loss scale collapsed to {fmt(scales[-1])}", expl, ev, fixes,
                              grad_origin.step if grad_origin is not None else first_bad), order)]


def _skips_by_cause(ctx: Context) -> tuple[list[int], list[int]]:
    """The skipped steps split into GradScaler's normal back-off (every inf/NaN origin of the step is a backward
    value that fits the format unscaled: ``scale_explains``) and the others (no scale removes them)."""
    scales = ctx.scales
    sc = ctx.spec.scaler
    seq = ([float(sc.get_scale())] if sc is not None and sc.is_enabled() else []) + scales
    first = len(seq) - len(scales)  # without the scale before the run, step 0's own skip is not seen
    skipped = [s + 1 - first for s in range(len(seq) - 1) if seq[s + 1] < seq[s]]
    by_step: dict[int, list[OpRecord]] = {}
    for o in ctx.harmful_origins():
        by_step.setdefault(o.record.step, []).append(o.record)
    backoff: list[int] = []
    collapse: list[int] = []
    for s in skipped:
        recs = by_step.get(s, [])
        explained = bool(recs) and all(scale_explains(ctx, r) is not None for r in recs)
        (backoff if explained else collapse).append(s)
    return backoff, collapse


@rule("loss-scaling-misuse", severity="error", precedence=22,
      summary="the loss-scaling recipe is broken: clipping before unscale_, unscaling fp16 gradients, ...")
def loss_scaling_misuse(ctx: Context) -> list[Candidate]:
    """The GradScaler recipe is applied wrongly: ``scaler.unscale_`` on fp16 gradients (fp16 parameters; the
    scaler refuses: "Attempting to unscale FP16 gradients"), gradients clipped while still multiplied by the
    scale (``clip_grad_norm_`` before ``scaler.unscale_``, so the threshold is effectively divided by the
    scale), or a scaler that scales a loss already scaled.

    **Updates on scaled gradients.** The fp32 reference runs the step with loss scaling off (scaling by a power of
    two is exact in fp32), so it applies the update the user means. An ``optimizer.step()`` that reads gradients
    about ``scale`` times (within 2x) the reference's -- ``scaler.scale(loss).backward(); optimizer.step()`` with no
    ``scaler.step`` -- is an error at the first op of that optimizer step, module ``""``; evidence ``step``,
    ``grad_norm``, ``grad_norm_fp32``, ``ratio``, ``loss_scale``. A write into a parameter from the training-step code
    whose update is ``scale`` times the reference's (a manual update reading ``.grad`` before ``unscale_``) is an
    error at that write, with the write's evidence above plus ``ratio`` and ``loss_scale``. A gradient norm is
    "clipping before unscale_" only when its value reaches an in-place write (the clip's ``mul_`` of the
    gradients); a norm computed for logging is not misuse.

    **Attribution of loop code.** Ops run by the training-step code after the backward, outside every module and
    outside ``optimizer.step`` (clipping, weight averaging, manual updates), belong to module ``""`` with the source
    line of the user's statement, like loss math before the backward; the module owning a written parameter is in
    the evidence (``owner``), never the op's module.
    """
    # long: the docstring is this code's entry in docs/codes.md
    out: list[Candidate] = []
    exc = ctx.target.exc
    if exc is not None and "unscale FP16 gradients" in str(exc):
        low = sorted(n for n, d in ctx.target.param_dtypes.items() if d == "float16")
        owner = ctx.target.owners.get(low[0], "") if low else ""
        ev = {"message": str(exc).splitlines()[0], "fp16_parameters": low[:20], "count": len(low)}
        expl = ("GradScaler.unscale_ refused fp16 gradients: the parameters themselves are fp16 (the model was "
                "cast with .half()), so there are no fp32 master weights to unscale into. Keep the parameters in "
                "fp32 and let autocast run the ops in fp16.")
        out.append(Candidate(Finding("loss-scaling-misuse", "error", owner, "", "optimizer",
                                     "GradScaler used with fp16 parameters", expl, ev, (_master_fix(),),
                                     ctx.target.exc_step or 0), SETUP_CRASH))
    # updates (optimizer.step or a manual write) that read gradients still multiplied by the scale
    out += scaled_updates(ctx)
    # clipping before unscale_: a norm over gradients in the optimizer phase before the unscale op of a step,
    # whose result feeds an in-place write (the clip's mul_ of the gradients; a norm for logging is no clipping)
    recs = ctx.records
    for step in sorted({r.step for r in recs}):
        unscale = next((r for r in recs if r.step == step and "non_finite_check_and_unscale" in r.op), None)
        first_unscale_idx = None
        for r in recs:
            if r.step == step and r.phase == "optimizer" and "unscale" in r.op:
                first_unscale_idx = r.index
                break
        if unscale is None and first_unscale_idx is None:
            continue
        limit = first_unscale_idx if first_unscale_idx is not None else math.inf
        clip = next((r for r in recs if r.step == step and r.phase == "optimizer" and r.index < limit
                     and op_base(r.op) in ("_foreach_norm", "linalg_vector_norm", "norm")
                     and _feeds_write(recs, r.index)), None)
        if clip is not None:
            ev = base_evidence(clip)
            ev["grad_norm_seen"] = clip.stats.get("absmax")
            expl = (f"{where(clip)} computes a gradient norm before scaler.unscale_: the gradients are still "
                    "multiplied by the loss scale, so clipping compares a scaled norm with your threshold.")
            out.append(Candidate(Finding("loss-scaling-misuse", "warning", clip.module, clip.op, "optimizer",
                                         "gradients clipped before scaler.unscale_", expl, ev, (FixProposal(
                                             "unscale first, then clip",
                                             "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_("
                                             "model.parameters(), 1.0)\nscaler.step(optimizer)"),), step),
                                   clip.index))
            break
    return out


def _feeds_write(recs: list[OpRecord], index: int) -> bool:
    """Whether the value of record ``index`` reaches an in-place write later in its step (lineage forward)."""
    reached = {index}
    step = recs[index].step
    for r in recs[index + 1:]:
        if r.step != step:
            break
        if any(i in reached for i in r.inputs):
            if op_base(r.op).endswith("_"):
                return True
            reached.add(r.index)
    return False


@rule("fp8-scale", severity="error", precedence=12,
      summary="an fp8 scaling factor is invalid (amax 0 -> inf/NaN scale) or stale (saturates at the format max)")
def fp8_scale(ctx: Context) -> list[Candidate]:
    """fp8 tensors carry a scale: ``scale = amax / fp8_max`` (or its inverse). An all-zero tensor (a LoRA B
    initialised to zeros, a zero-padded row) has amax 0, so the scale is 0 and ``x / scale = 0 / 0 = NaN``;
    a delayed scale computed from an amax history below the current amax saturates values at the format
    max (448 for e4m3). Real recipes floor amax (e.g. 1e-12) and use a margin. Any cast to a float8 dtype in
    the user's own code (``(x * s).to(f8)``, ``x / s``, the operands of ``torch._scaled_mm``) whose scaled input
    exceeds the format's max plus half its spacing is this error at the cast; evidence: ``amax`` (of the data
    before the scale), ``scale``, ``scale_applied_as`` (mul/div), ``scaled_absmax``, ``fitting_scale`` (fmax /
    amax), ``n_clipped``, ``out_of_range_becomes`` (saturated, inf or NaN, as the output shows), ``consumer``.
    Delayed scaling is told by lineage: when the scale tensor the cast reads was produced in an earlier step (a
    buffer written after last step's cast), ``delayed_scaling`` adds ``scale_step``, ``written_by``,
    ``history_amax`` (the amax the scale came from), ``scale_max`` (the largest |x| the stale scale represents),
    ``amax_growth`` and ``fitting_margin`` (the further ``2**m`` that fits); the finding's ``step`` is the first
    step that clips. In the emulated fp8 run (precision ``"fp8*"``) too: ``step`` is the first step a layer's role
    saturates, ``first_saturated`` its amax and the history amax its scale came from; saturation that adds less
    squared error than the layer's rounding (``clip_error_share`` < 50%: delayed scaling's usual small amax growth
    between steps) is ``info``. An outlier that sets a layer's per-tensor amax (``amax_over_median``) pushes the
    bulk into the subnormal range: a warning when more than 10% of the nonzero values flush or the median keeps fewer
    significant bits than the format (``median_abs``, ``median_scaled``, ``median_bits``, ``flush_below``); the
    verified fix keeps that layer out of fp8 (``keep_fp32``). One emulated finding per layer and pass: the roles that
    lose precision in it (``input`` and ``weight`` forward, ``grad_output`` backward) are listed in ``roles_losing``
    and the title, each with its own numbers in ``roles[role]`` (``saturated``, ``numel``, ``flushed_fraction``,
    ``amax``, ``scale``, ``first_saturated``, ``severity``); the top-level evidence is the first worst role's. A
    recipe without an amax floor (``amax_floor=0``) that meets an all-zero tensor gets scale inf and NaN: an error
    at the layer (``inf_scale_tensors``), fixed by the recipe with ``amax_floor=1e-12`` (``fp8_recipe``)."""
    out: list[Candidate] = emulated_candidates(ctx, RUN_FP8_SCALES)  # ampdoctor's emulated fp8 layers
    out += clip_candidates(ctx, "fp8-scale")  # the user's own fp8 casts
    recs = ctx.records
    for o in ctx.harmful_origins():
        r = o.record
        if op_base(r.op) not in ("div", "mul", "reciprocal", "true_divide"):
            continue
        chain = ctx.chain(r.index)
        fp8_cast = next((recs[i] for i in chain if dtype_name(recs[i].dtype) in FP8), None)
        if fp8_cast is None:
            continue
        zero_in = [recs[i] for i in r.inputs if i >= 0 and recs[i].stats.get("n_zero", 0) > 0]
        if not zero_in:
            continue
        sc = min(zero_in, key=lambda x: x.stats.get("numel", 0))
        ev = base_evidence(r)
        ev.update({"zero_scale_entries": int(sc.stats["n_zero"]), "scale_numel": int(sc.stats["numel"]),
                   "fp8_dtype": dtype_name(fp8_cast.dtype), "fp8_max": limits(fp8_cast.dtype)[0],
                   "n_nan": int(r.stats["n_nan"])})
        expl = (f"{where(r)} divides by an fp8 scale with {int(sc.stats['n_zero'])} zero entr(ies) of "
                f"{int(sc.stats['numel'])} (amax 0: an all-zero tensor or row), giving {int(r.stats['n_nan'])} NaN "
                f"(0/0) that are cast to {dtype_name(fp8_cast.dtype)} at {where(fp8_cast)}; {o.reasons[0]}.")
        fixes = (FixProposal("floor amax before computing the scale",
                             "amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)", id="fp8_amax_floor",
                             params={"amax_floor": 1e-12}),
                 FixProposal("skip quantisation of all-zero tensors/blocks",
                             "if amax == 0: return x  # nothing to scale"))
        out.append(Candidate(Finding("fp8-scale", "error", r.module, r.op, r.phase,
                                     f"fp8 scale from amax 0 in {r.module or '<root>'}", expl, ev, fixes, r.step),
                             r.index))
    return out
