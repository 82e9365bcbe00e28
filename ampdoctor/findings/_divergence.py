"""The fp32 reference diverges as well: ``reference-diverges`` (not a precision problem), and the precision
findings such a run makes past the point where fp32 already diverged, tempered (:func:`temper`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ampdoctor.findings._common import fmt
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import RUN_END, Candidate, rule
from ampdoctor.findings._types import Finding, FixProposal

#: the reference diverges when its loss on the same batch grows to at least this many times its first value
GROWTH = 10.0
#: codes whose numbers follow the magnitudes a diverging run reaches (an overflow of exploded weights, a lost
#: update of a weight thrown far): past the reference's divergence they are a consequence, not the cause
TEMPERED = frozenset({"overflow", "nan-from-inf", "underflow", "precision-loss", "saturation", "low-precision-params",
                      "loss-scale-collapse"})


def divergence(ctx: Context) -> dict[str, Any] | None:
    """``{"step", "growth", "losses"}`` when the reference's finite, positive losses (one per step, the same batch)
    reach :data:`GROWTH` times the first: ``step`` is the first step that does; None otherwise."""
    ref = ctx.reference
    if ref is None or ctx.target.forward_only or len(ref.losses) < 3:
        return None
    finite: list[float] = []
    for v in ref.losses:
        if v is None or not math.isfinite(v):
            break  # a non-finite reference loss is nonfinite-reference's; its finite prefix still counts
        finite.append(v)
    if len(finite) < 2 or finite[0] <= 0 or min(finite) <= 0:
        return None
    step = next((s for s, v in enumerate(finite) if v >= GROWTH * finite[0]), None)
    if step is None:
        return None
    return {"step": step, "growth": max(finite) / finite[0], "losses": list(ref.losses)}


def _losses(vals: list[float | None]) -> str:
    return ", ".join("-" if v is None else fmt(v) for v in vals)


@rule("reference-diverges", severity="info", precedence=95,
      summary="the fp32 reference diverges as well (its loss grows while finite): not a precision problem")
def reference_diverges(ctx: Context) -> list[Candidate]:
    """The float32 reference, run on the same batch with the same optimizer, diverges by itself: its loss grows to
    at least 10x its first value (finite; a reference that reaches inf/NaN is also ``nonfinite-reference``). A
    learning rate too high, no warmup or no gradient clipping: no dtype, autocast setting or loss scale fixes it.
    Severity ``info`` (it is not what the run's precision broke), module ``""``, op ``""``, phase ``optimizer``
    (the updates diverge), ``step`` the first step whose reference loss is 10x the first. Evidence:
    ``loss_reference`` and ``loss_target`` (per step), ``growth`` (largest finite reference loss / first),
    ``diverged_step``, ``lr`` (the optimizer's default learning rate, when known).

    **Findings past the divergence are tempered.** An error of a code whose numbers follow magnitudes
    (``overflow``, ``nan-from-inf``, ``underflow``, ``precision-loss``, ``saturation``, ``low-precision-params``,
    ``loss-scale-collapse``) at a step at or after ``diverged_step`` is lowered to a warning and says that fp32
    diverges as well (evidence ``reference_diverges``: the diverged step): fp16's range ending first on weights
    that explode in fp32 too is a consequence, and switching precision would not make the run train."""
    d = divergence(ctx)
    if d is None:
        return []
    lr = ctx.target.optimizer_info.get("defaults", {}).get("lr")
    ev: dict[str, Any] = {"loss_reference": d["losses"], "loss_target": list(ctx.target.losses),
                          "growth": d["growth"], "diverged_step": d["step"]}
    if isinstance(lr, (int, float)):
        ev["lr"] = float(lr)
    expl = (f"The fp32 reference diverges as well: on the same batch its loss per step is {_losses(d['losses'])} "
            f"({fmt(d['growth'])}x the first; 10x from step {d['step']}), next to the target's "
            f"{_losses(list(ctx.target.losses))}. This is not a precision problem: the fp32 run does not train "
            "either" + (f" (learning rate {lr:g})" if isinstance(lr, (int, float)) else "")
            + ". Lower the learning rate, add warmup or clip the gradient norm first; judge precision on a run "
            "that trains in fp32.")
    fixes = (FixProposal("lower the learning rate (or warm it up) and clip the gradient norm",
                         "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                         "for g in optimizer.param_groups:\n    g['lr'] *= 0.1"),)
    return [Candidate(Finding("reference-diverges", "info", "", "", "optimizer",
                              f"fp32 diverges as well (loss x{fmt(d['growth'])}): not a precision problem", expl, ev,
                              fixes, d["step"]), RUN_END)]


def temper(ctx: Context, candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` with the errors of :data:`TEMPERED` codes at or after the reference's divergence lowered to
    warnings that say so (unchanged when the reference trains)."""
    d = divergence(ctx)
    if d is None:
        return candidates
    out = []
    for c in candidates:
        f = c.finding
        if f.severity == "error" and f.code in TEMPERED and f.step >= d["step"]:
            note = (f" The fp32 reference diverges as well from step {d['step']} (loss "
                    f"{_losses(d['losses'])}): at this step the run has already left training, so this is a "
                    "consequence of the divergence rather than a precision problem (see reference-diverges).")
            ev = dict(f.evidence)
            ev["reference_diverges"] = d["step"]
            f = Finding(f.code, "warning", f.module, f.op, f.phase, f.title, f.explanation + note, ev, f.fixes, f.step)
            c = dataclasses.replace(c, finding=f)
        out.append(c)
    return out


__all__ = ["divergence", "reference_diverges", "temper"]
