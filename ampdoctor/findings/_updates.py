"""Lost updates at any write into module state, and updates applied to gradients still multiplied by the loss scale.

The trace logs every in-place write into a parameter, a buffer or an accumulated gradient (``trace.WriteRecord``:
optimizer steps, EMA / teacher updates, running statistics, manual SGD, gradient accumulation across
micro-batches) with the update it applied in the stored dtype next to the same write computed one format wider.
Two mechanisms read that log:

- :func:`lost_updates` (code ``low-precision-params``): a write to fp16/bf16 state that leaves most of the
  elements it should change unchanged (each update below half an ulp of the stored value), or whose applied
  size deviates from the exact one, while the fp32 reference's same write (same step, tensor and order) does
  change them. Reported at that write, step by step.
- :func:`scaled_updates` (code ``loss-scaling-misuse``): a write, or an ``optimizer.step``, whose update in the
  target is about ``scale`` times the fp32 reference's -- the gradients it read were still multiplied by the
  GradScaler's scale (the reference runs the same step with loss scaling off, its exact fp32 equivalent).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ampdoctor.findings._common import HALF, feeders, fmt, limits, op_base
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import DTYPES, OpRecord, Role, WriteRecord, unit_roundoff

#: a write loses its update when more than this fraction of the elements it should change keep their value
LOST_FRACTION = 0.5
#: ... or when the update it applies is off the exact one by more than this factor
DEVIATION = 2.0
#: a write blows its update up when it applies more than this many times the fp32 reference's same write (Adam on
#: fp16 state: grad**2 flushed to 0, so the step is m / eps -- or m / 0, an inf the overflow path reports)
BLOWN_UP = 8.0


def _src(w: WriteRecord) -> str:
    return f"{os.path.basename(w.src[0])}:{w.src[1]}" if w.src else ""


def _where(w: WriteRecord) -> str:
    at = f" at {_src(w)}" if w.src else ""
    by = f"code of {w.module}" if w.module else "the training-step code outside every module"
    return f"{w.op} ({'optimizer.step' if w.phase == 'optimizer' and w.module == w.owner else by}{at})"


def _ref_writes(ctx: Context) -> dict[tuple[int, str, str, int], WriteRecord]:
    return {w.key: w for w in ctx.reference.trace.writes} if ctx.reference is not None else {}


def _evidence(w: WriteRecord, ref: WriteRecord | None) -> dict[str, Any]:
    s = w.stats
    moving = s.get("moving", 0.0)
    ev: dict[str, Any] = {w.target: w.name, "tensor": w.name, "written": w.target, "dtype": w.dtype,
                          "step": w.step, "write": w.seq, "op": w.op, "op_module": w.module, "owner": w.owner,
                          "fraction_lost": w.fraction_lost, "moving": int(moving),
                          "mean_update": s["intended"] / moving if moving else 0.0,
                          "applied_ratio": s["applied"] / s["intended"] if s.get("intended") else 0.0,
                          "ulp_at_1": 2 * unit_roundoff(w.dtype)}
    if w.src:
        ev["source"] = _src(w)
    if ref is not None:
        ev["fraction_lost_fp32"] = ref.fraction_lost
        ev["applied_fp32"] = ref.stats.get("applied", math.nan)
    return ev


def _small_factor(ctx: Context, w: WriteRecord) -> tuple[float, str] | None:
    """A literal factor the update was scaled by (the write's op or its feeders, 2 hops: ``(1 - decay) * (e - p)``,
    ``add_(g, alpha=-lr)``) that is below the stored dtype's relative spacing: ``(factor, op)``."""
    if not 0 <= w.index < len(ctx.records) or ctx.records[w.index].op != w.op:
        return None
    r = ctx.records[w.index]
    spacing = 2 * unit_roundoff(w.dtype)
    for x in [r, *feeders(ctx.records, r, 2)]:
        for lit, v in x.literals:
            f = 1 / v if lit.role == Role.FACTOR and op_base(x.op) in ("div", "div_") and v else v
            if lit.role == Role.FACTOR and 0 < abs(f) < spacing:
                return f, x.op
    return None


def _factor_text(factor: tuple[float, str] | None, dtype: str) -> str:
    if factor is None:
        return ""
    f, op = factor
    return (f" The update is scaled by the literal {f:g} (in {op}; for an EMA that is 1 - decay, decay = {1 - f:g}; "
            f"for an optimizer the learning rate), below {dtype}'s spacing at 1.0 ({fmt(2 * unit_roundoff(dtype))}): "
            "a step that small moves a stored value only where the difference it scales is far larger than the "
            "value itself.")


def _lost(w: WriteRecord) -> bool:
    s = w.stats
    if w.dtype not in HALF or not s.get("moving") or not all(map(math.isfinite, s.values())):
        return False
    ratio = s["applied"] / s["intended"] if s["intended"] > 0 else 1.0
    return w.fraction_lost > LOST_FRACTION or not 1 / DEVIATION <= ratio <= DEVIATION


def _typical_steps(ctx: Context) -> dict[tuple[int, str], float]:
    """Per (step, op): the median per-element update of the fp32 reference's parameter writes -- the size of a
    healthy step of that optimizer op in this run."""
    per: dict[tuple[int, str], list[float]] = {}
    for r in ctx.reference.trace.writes if ctx.reference is not None else ():
        n, a = r.stats.get("numel", 0.0), r.stats.get("applied", math.nan)
        if r.target == "parameter" and n > 0 and math.isfinite(a):
            per.setdefault((r.step, r.op), []).append(a / n)
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


def _blown_up(ctx: Context, w: WriteRecord, ref: WriteRecord | None,
              typical: dict[tuple[int, str], float]) -> float | None:
    """``applied / applied_fp32`` when a 16-bit write applies more than :data:`BLOWN_UP` times the update of the
    fp32 reference's same write (both finite; a ratio a loss scale explains is ``loss-scaling-misuse``'s), else
    None. The write log's own re-run cannot see this: computed wider from the same flushed inputs, the exact update
    is as large. Parameters only: a buffer's write (BatchNorm's running statistics, an EMA of activations) follows
    the activations it averages, whose low-precision error is the precision rules' to judge -- at initialisation a
    running mean moves by ~0.1 x a batch mean near 0, so a ratio to fp32's tiny update says nothing."""
    if ref is None or w.dtype not in HALF or w.target != "parameter":
        return None
    a, r = w.stats.get("applied", math.nan), ref.stats.get("applied", math.nan)
    if not (math.isfinite(a) and math.isfinite(r) and r > 0 and a > BLOWN_UP * r):
        return None
    # and beyond a healthy step of the same op: a write whose fp32 update is itself noise (a conv bias before a
    # BatchNorm, whose true gradient is 0: Adam moves it ~lr * g / eps in fp32, ~lr in bf16) is not blown up
    n = w.stats.get("numel", 0.0)
    step = typical.get((w.step, w.op))
    if n > 0 and step is not None and a / n <= BLOWN_UP * step:
        return None
    scales = ctx.target.step_scales
    if w.step < len(scales) and _scale_ratio(a, r, scales[w.step]) is not None:
        return None
    return a / r


def _fixes(w: WriteRecord, master: FixProposal) -> tuple[FixProposal, ...]:
    if w.target == "buffer":
        return (FixProposal(f"keep {w.name} in float32 (updates of {w.dtype} state below half an ulp vanish)",
                            f"model.get_buffer({w.name!r}).data = model.get_buffer({w.name!r}).float()",
                            id="keep_fp32_buffers", params={"buffers": [w.name]}),)
    shadow = FixProposal("keep an fp32 copy of the state and write the update there; cast when you read it",
                         "shadow = {n: p.detach().float() for n, p in model.named_parameters()}\n"
                         "shadow[n].mul_(decay).add_(p.float(), alpha=1 - decay)  # then p.copy_(shadow[n])")
    return (master, shadow) if w.target == "parameter" else (master,)


def _lost_mass(w: WriteRecord) -> float:
    """The mean exact update per element that the write dropped (what ranks the lost writes of one step)."""
    s = w.stats
    return s["intended"] / s["moving"] * w.fraction_lost if s.get("moving") else 0.0


def _rank(w: WriteRecord, blown: float | None) -> tuple[int, float]:
    """Within a step a blown-up write ranks before a lost one (a lost update of a weight the blow-up already moved
    far is its consequence), then the larger excess / lost update."""
    s = w.stats
    return (0, -blown) if blown is not None else (1, -_lost_mass(w) if s.get("moving") else 0.0)


def _worst_per_owner(ctx: Context, seen: set[str]) -> list[tuple[WriteRecord, WriteRecord | None, float | None]]:
    """Per owning module not in ``seen``: its first step with a lost or blown-up write, and there the write that
    blows up most, else drops the largest update (AdamW's weight decay ``mul_(1 - lr * wd)`` and its ``addcdiv_``
    can both be lost). Each with its reference write and its blow-up ratio (None for a lost one)."""
    refs, typical = _ref_writes(ctx), _typical_steps(ctx)
    best: dict[str, tuple[WriteRecord, WriteRecord | None, float | None]] = {}
    for w in ctx.target.trace.writes:
        if w.owner in seen:
            continue
        ref = refs.get(w.key)
        blown = _blown_up(ctx, w, ref, typical)
        if blown is None:
            if not _lost(w):
                continue
            if ref is not None and (ref.fraction_lost > LOST_FRACTION or not ref.stats.get("changed")):
                continue  # fp32 loses it too (or the reference's write changes nothing): not the stored precision
        old = best.get(w.owner)
        if old is None or (w.step == old[0].step and _rank(w, blown) < _rank(old[0], old[2])):
            best[w.owner] = (w, ref, blown)
    return list(best.values())


def lost_updates(ctx: Context, seen: set[str], master: FixProposal) -> list[Candidate]:
    """``low-precision-params`` at each write into fp16/bf16 module state that rounds its update away or blows it
    up against the fp32 reference: one per owning module not in ``seen`` (which it extends). Within a step, a
    blown-up write ranks first, then the write dropping the largest update (the positions of the step's writes
    are handed out in that order)."""
    found = _worst_per_owner(ctx, seen)
    slots: dict[int, list[int]] = {}
    for w, _, _ in found:
        slots.setdefault(w.step, []).append(w.index)
    for v in slots.values():
        v.sort(reverse=True)
    out: list[Candidate] = []
    for w, ref, blown in sorted(found, key=lambda p: (p[0].step, _rank(p[0], p[2]))):
        seen.add(w.owner)
        ev = _evidence(w, ref)
        if blown is None:
            finding = _lost_finding(ctx, w, ref, ev, master)
        else:
            finding = _blown_finding(ctx, w, blown, ev, master)
        out.append(Candidate(finding, slots[w.step].pop()))
    return out


_WHAT = {"parameter": "parameter", "buffer": "buffer", "grad": "accumulated gradient of"}


def _lost_finding(ctx: Context, w: WriteRecord, ref: WriteRecord | None, ev: dict[str, Any],
                  master: FixProposal) -> Finding:
    factor = _small_factor(ctx, w)
    if factor is not None:
        ev["update_factor"], ev["update_factor_op"] = factor
    ev["update_is"] = "lost"
    expl = (f"In step {w.step}, {_where(w)} writes the {w.dtype} {_WHAT[w.target]} {w.name}: {w.fraction_lost:.0%} of "
            f"the {ev['moving']} elements it should change kept their old value and the update it applied is "
            f"{ev['applied_ratio']:.0%} of the exact one (mean exact update {fmt(ev['mean_update'])}; the ulp "
            f"at 1.0 is {fmt(ev['ulp_at_1'])}, so any update below half an ulp of the stored value rounds "
            "away)" + (f"; the fp32 reference's same write loses {ref.fraction_lost:.0%}" if ref else "")
            + ". The update is silently dropped." + _factor_text(factor, w.dtype))
    title = f"{w.owner or '<root>'}: {w.dtype} {w.target} updates by {w.op.split('.')[1]} are lost to rounding"
    return Finding("low-precision-params", "error", w.owner, w.op, w.phase, title, expl, ev, _fixes(w, master),
                   w.step)


def _flushed_feeder(ctx: Context, w: WriteRecord) -> OpRecord | None:
    """The record feeding the write (6 hops: ``addcdiv_(p, m, sqrt(v) / c + eps)`` with ``v`` from
    ``addcmul_(g, g)``) that flushed most of its values to 0 where the reference's are nonzero: an underflow origin
    (its inputs were not flushed yet) first, else the nearest."""
    if not 0 <= w.index < len(ctx.records) or ctx.records[w.index].op != w.op:
        return None
    flushed = [x for x in feeders(ctx.records, ctx.records[w.index], 6) if ctx.flushed.get(x.index)]
    origins = {r.index for r, *_ in ctx.underflow_origins}
    return next((x for x in flushed if x.index in origins), flushed[0] if flushed else None)


def _blown_finding(ctx: Context, w: WriteRecord, ratio: float, ev: dict[str, Any], master: FixProposal) -> Finding:
    """A 16-bit write whose update is ``ratio`` times the fp32 reference's: the update is too large, not lost."""
    n = max(w.stats.get("numel", 0.0), 1.0)
    ev.update({"update_is": "blown_up", "applied_vs_fp32": ratio, "mean_applied": w.stats["applied"] / n,
               "mean_applied_fp32": ev["applied_fp32"] / n})
    eps = ctx.target.optimizer_info.get("defaults", {}).get("eps") if w.phase == "optimizer" else None
    flushed = _flushed_feeder(ctx, w)
    cause = ""
    if flushed is not None:
        ev["flushed_input"] = ctx.describe(flushed)
        cause = (f" Its denominator comes from {flushed.op} in {flushed.module or '<root>'}, which flushes most of "
                 f"its values to 0 in {w.dtype} (below the smallest subnormal {fmt(limits(w.dtype)[2])}; "
                 "for Adam: grad**2) where fp32 keeps them")
    if isinstance(eps, float):
        in_dt = float(torch.tensor(eps).to(DTYPES[w.dtype].dtype).float())
        ev["eps"], ev["eps_in_dtype"] = eps, in_dt
        cause += ((", so " if cause else " ") + f"the division is by eps={eps:g} ({fmt(in_dt)} in {w.dtype}) "
                  "instead of sqrt(v) + eps: each update is about m / eps")
    expl = (f"In step {w.step}, {_where(w)} writes the {w.dtype} {_WHAT[w.target]} {w.name} with an update "
            f"{fmt(ratio)} times the fp32 reference's same write (mean |update| per element "
            f"{fmt(ev['mean_applied'])} against {fmt(ev['mean_applied_fp32'])}): the update is not lost to rounding "
            "but blown up." + (cause + "." if cause else "")
            + " The weights jump far from where fp32 training takes them.")
    title = (f"{w.owner or '<root>'}: {w.dtype} {w.target} updates by {w.op.split('.')[1]} are {fmt(ratio)}x "
             "the fp32 update (blown up)")
    fixes = _fixes(w, master)
    if isinstance(eps, float) and w.dtype == "float16":
        fixes += (FixProposal("if the weights must stay low precision, use an eps the dtype can hold",
                              "torch.optim.Adam(params, eps=1e-4)  # fp16 holds 1e-4 next to a flushed grad**2"),)
    return Finding("low-precision-params", "error", w.owner, w.op, w.phase, title, expl, ev, fixes, w.step)


def _scale_ratio(target: float, ref: float, scale: float) -> float | None:
    """``target / ref`` when it is within a factor of 2 of a loss scale above 8, else None."""
    if not (scale > 8 and ref > 0 and math.isfinite(target) and math.isfinite(ref)):
        return None
    ratio = target / ref
    return ratio if ratio > 0 and abs(math.log2(ratio / scale)) <= 1 else None


_UNSCALE_FIX = FixProposal("let the scaler unscale the gradients before anything reads them",
                           "scaler.scale(loss).backward()\nscaler.unscale_(optimizer)  # only if you clip or read "
                           ".grad\nscaler.step(optimizer)\nscaler.update()")


def scaled_updates(ctx: Context) -> list[Candidate]:
    """``loss-scaling-misuse`` where an update reads gradients still multiplied by the loss scale."""
    t, r = ctx.target, ctx.reference
    if r is None or not t.step_scales:
        return []
    for step, (gn, scale) in enumerate(zip(t.grad_norms, t.step_scales)):
        ref_gn = r.grad_norms[step] if step < len(r.grad_norms) else math.nan
        ratio = _scale_ratio(gn, ref_gn, scale)
        if ratio is None:
            continue
        starts = t.trace.marks.get("optimizer_step", [])
        first = t.trace.records[starts[step]] if step < len(starts) and starts[step] < len(t.trace.records) else None
        ev: dict[str, Any] = {"step": step, "grad_norm": gn, "grad_norm_fp32": ref_gn, "ratio": ratio,
                              "loss_scale": scale}
        expl = (f"In step {step}, optimizer.step() read gradients with norm {fmt(gn)} where the fp32 run (no loss "
                f"scaling) has {fmt(ref_gn)}: {fmt(ratio)} times larger, the loss scale {fmt(scale)}. The gradients "
                "were never unscaled (optimizer.step() instead of scaler.step(optimizer)), so every update is "
                f"{fmt(scale)} times too large.")
        op = first.op if first is not None else ""
        return [Candidate(Finding("loss-scaling-misuse", "error", "", op, "optimizer",
                                  "optimizer step on gradients still multiplied by the loss scale", expl, ev,
                                  (_UNSCALE_FIX,), step), first.index if first is not None else 0)]
    refs = _ref_writes(ctx)
    for w in t.trace.writes:
        ref = refs.get(w.key)
        scale = t.step_scales[w.step] if w.step < len(t.step_scales) else 0.0
        if ref is None or w.phase != "optimizer" or w.module:
            continue  # only the step code's own writes: optimizer.step's are judged by the gradients it read
        ratio = _scale_ratio(w.stats.get("applied", math.nan), ref.stats.get("applied", math.nan), scale)
        if ratio is None:
            continue
        ev = _evidence(w, ref)
        ev.update({"ratio": ratio, "loss_scale": scale})
        expl = (f"In step {w.step}, {_where(w)} updates {w.name} by {fmt(ratio)} times what the fp32 run (no loss "
                f"scaling) applies, the loss scale {fmt(scale)}: the update reads .grad before scaler.unscale_.")
        return [Candidate(Finding("loss-scaling-misuse", "error", w.owner, w.op, w.phase,
                                  f"{w.owner or '<root>'}: update applied to gradients still multiplied by the "
                                  "loss scale", expl, ev, (_UNSCALE_FIX,), w.step), w.index)]
    return []
