"""The underflow rule: values nonzero in fp32 become exactly 0 in the target dtype.

The origins (first ops that flush values their inputs still held) are ``ctx.underflow_origins``.
"""

from __future__ import annotations

import math

from ampdoctor.findings._buffer_origins import buffer_candidates
from ampdoctor.findings._common import (
    base_evidence,
    bf16_fix,
    dtype_name,
    fmt,
    is_low,
    keep_fp32_fix,
    limits,
    op_base,
    where,
)
from ampdoctor.findings._context import Context
from ampdoctor.findings._fp8_casts import flush_candidates, without_fp8_casts
from ampdoctor.findings._graph import (
    accumulated_params,
    alias_closure,
    ancestors,
    dead_gradients,
    descendants,
    gradient_params,
    param_numels,
)
from ampdoctor.findings._registry import Candidate, rule
from ampdoctor.findings._remedies import propose
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, ops_with


def _zeroes_loss(ctx: Context, r: OpRecord, loss_idx: set[int]) -> bool:
    """The loss is (an alias of) the flushed record, or the target's first loss is 0 where fp32's is not."""
    down = alias_closure(ctx, [r.index])
    return bool(any(i in loss_idx for i in down) or (
        ctx.target.losses and ctx.reference is not None and ctx.reference.losses
        and ctx.target.losses[0] == 0.0 and ctx.reference.losses[0] not in (0.0, None)))


def _constants_nearby(recs: list[OpRecord], r: OpRecord) -> list[float]:
    """Literals below the flush threshold in the 40 records from ``r`` on, in its module and step."""
    return [c for i in range(r.index, min(r.index + 40, len(recs))) for c in _small_constants(recs[i])
            if recs[i].module == r.module and recs[i].step == r.step]


def _small_constants(r: OpRecord) -> list[float]:
    floor = limits(r.dtype)[2]
    return [v for _, v in r.literals if v != 0 and math.isfinite(v) and abs(v) < floor / 2]


@rule("underflow", severity="warning", precedence=42,
      summary="values nonzero in fp32 become exactly 0 in the target dtype (below its smallest subnormal)")
def underflow(ctx: Context) -> list[Candidate]:
    """More than half of the values that are nonzero in the fp32 reference are exactly 0 in the target: they fell
    below the dtype's smallest subnormal (fp16 2**-24 = 5.96e-8; bf16 9.2e-41; e4m3 2**-9; e5m2 2**-16).
    Typical: fp16 backward without loss scaling (d loss / d out = 1e-6 / N), Adam's ``grad**2`` in fp16. The origin
    is the first op that flushes them from inputs that still held them; values merely rounded to the subnormal
    floor are evidence, not the origin. An inf/NaN made by dividing by such zeros (``m / (sqrt(0) + 0)``, 0/0)
    has this underflow as its root cause. Severity ``error`` when it zeroes the gradient of parameters (all-zero
    in the target, not in the reference) that would have moved them (the optimizer's update from the fp32 gradient,
    ``lr * g / (g + eps)`` for Adam-type, is at least half an fp32 ulp of the parameter's |max|; without an
    optimizer, the gradient is above 2**-24 of the step's largest), the loss, or feeds an inf/NaN that reaches
    the loss, a gradient or an update; ``warning`` otherwise. A buffer the model cast flushed (tiny variances) is
    a ``setup`` origin (owner); a user's fp8 cast flushing most values is an error at the cast (``amax``,
    ``scale``, ``fitting_scale``)."""
    # long: the docstring is this code's entry in docs/codes.md
    out: list[Candidate] = flush_candidates(ctx)  # the user's own fp8 casts, with their scale
    origins = without_fp8_casts(ctx, ctx.underflow_origins)
    if not origins:
        return out + _pole_candidates(ctx) + buffer_candidates(ctx, "flushed")
    recs = ctx.records
    harmful_anc: dict[int, set[int]] = {o.record.index: ancestors(ctx, o.record.index)
                                        for o in ctx.harmful_origins()}
    loss_idx = set(ctx.target.trace.marks.get("loss", []))
    seen_phases: set[str] = set()
    for r, frac, nonzero, cmp in origins:
        if r.phase in seen_phases:
            continue  # one origin per phase, the earliest: later ones are usually the same cause
        seen_phases.add(r.phase)
        floor = limits(r.dtype if is_low(r.dtype) else "float16")[2]
        dt = dtype_name(r.dtype)
        ev = base_evidence(r)
        ev.update({"flushed_fraction": frac, "n_flushed": int(round(frac * nonzero)), "numel": int(r.stats["numel"]),
                   "ref_absmax": cmp["absmax"], "ref_min_nonzero": cmp["min_nonzero"], "format_min_subnormal": floor,
                   "format_min_normal": limits(r.dtype)[1]})
        # evidence: inputs already pushed onto the subnormal floor
        sub_in = [recs[i] for i in r.inputs if i >= 0 and recs[i].stats.get("n_subnormal", 0) > 0]
        if sub_in:
            x = sub_in[0]
            ev["subnormal_input"] = {"op": x.op, "module": x.module, "n_subnormal": int(x.stats["n_subnormal"]),
                                     "numel": int(x.stats["numel"]), "absmax": x.stats["absmax"]}
        # consequences
        dead = dead_gradients(ctx, r.step, gradient_params(ctx, descendants(ctx, r.index))) if r.phase in (
            "forward", "backward") else {}
        feeds = sorted(o for o, anc in harmful_anc.items() if r.index in anc)
        loss_zero = _zeroes_loss(ctx, r, loss_idx)
        consts = _constants_nearby(recs, r)
        if dead:
            ev["dead_parameters"] = sorted(dead)[:20]
            ev["n_dead_parameters"] = len(dead)
        if feeds:
            ev["feeds_nonfinite"] = [ctx.describe(recs[i]) for i in feeds[:3]]
        if consts:
            ev["constants_below_floor"] = sorted(set(consts))
        grads = _grad_absmax(ctx, r.step) if dead else {}
        lost = {p: grads[p] for p in dead if p in grads}
        if lost:
            ev["ref_lost_gradient_absmax"] = max(lost.values())
        harmless = bool(dead) and len(lost) == len(dead) and all(
            _negligible(ctx, p, g, grads) for p, g in lost.items())
        severity = "error" if (dead and not harmless) or feeds or loss_zero else "warning"
        expl = (f"{where(r)} returns exactly 0 for {frac:.1%} of the {int(nonzero)} values that are nonzero in fp32: "
                f"the reference values reach only |max| {fmt(cmp['absmax'])} (smallest nonzero "
                f"{fmt(cmp['min_nonzero'])}), below {dt}'s smallest subnormal {fmt(floor)}"
                + (f" (smallest normal {fmt(limits(r.dtype)[1])})" if is_low(r.dtype) else "") + ".")
        expl += _consequences(dt, sub_in, consts, dead, [recs[i] for i in feeds], loss_zero)
        if harmless:
            expl += (f" But their fp32 gradients are tiny (|max| {fmt(max(lost.values()))}): the update "
                     "they would have made is under half an fp32 ulp of the parameters (or below fp32's resolution "
                     "next to the step's other gradients): what is lost would have moved nothing; a warning.")
        out.append(Candidate(Finding(
            "underflow", severity, r.module, r.op, r.phase,
            f"{op_base(r.op)} flushes {frac:.0%} of its values to 0 in {dt} in {r.module or '<root>'}"
            + (f" ({r.phase})" if r.phase != "forward" else ""), expl, ev, _fixes(ctx, r), r.step), r.index))
    return out + _pole_candidates(ctx) + buffer_candidates(ctx, "flushed")


def _grad_absmax(ctx: Context, step: int) -> dict[str, float]:
    """Per parameter, the reference gradient's |max| in ``step`` (from the ``AccumulateGrad`` records), unscaled."""
    sizes = param_numels(ctx)
    ref_run = ctx.reference
    scale = ref_run.step_scales[step] if ref_run is not None and step < len(ref_run.step_scales) else 1.0
    out: dict[str, float] = {}
    for r in ctx.records:
        if r.node != "AccumulateGrad" or r.step != step or r.phase != "backward":
            continue
        ref = ctx.ref(r)
        g = ref.stats.get("absmax") if ref is not None else None
        if g is None or not math.isfinite(g) or not scale:
            continue
        for p in accumulated_params(ctx, r, sizes):
            out[p] = max(out.get(p, 0.0), g / scale)
    return out


def _param_absmax(ctx: Context, name: str) -> float | None:
    return next((r.stats.get("absmax") for r in ctx.records if r.kind == "param" and r.name == name), None)


def _negligible(ctx: Context, name: str, g: float, grads: dict[str, float]) -> bool:
    """The lost gradient (fp32 |max| ``g``) would have moved nothing. With the optimizer's lr known: its update
    (``lr * g / (g + eps)`` for an Adam-type optimizer, the first step's ``m / (sqrt(v) + eps)``; ``lr * g``
    otherwise) is under half an fp32 ulp of the parameter's largest value, or under 2**-24 of the step's other
    updates. Otherwise: ``g`` is below fp32's resolution next to the step's largest gradient."""
    defaults = ctx.target.optimizer_info.get("defaults", {})
    lr, eps = defaults.get("lr"), defaults.get("eps")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        w = _param_absmax(ctx, name)
        if w is None or not math.isfinite(w):
            return False
        adam = isinstance(eps, float) and eps > 0
        update = lr * g / (g + eps) if adam else lr * g
        if update <= 2.0**-25 * w:
            return True
        if adam:  # below fp32's resolution next to the step's other updates (about lr each): also at w = 0
            return g / (g + eps) <= 2.0**-24
    return bool(grads) and g <= 2.0**-24 * max(grads.values())


def _pole_candidates(ctx: Context) -> list[Candidate]:
    """A harmful inf made by a pole (log, 1/x, rsqrt, x / d) from zeros an upstream op flushed: the underflow there
    is the root cause, however few values it flushed (``log(softmax(x))``: probabilities below 6e-8 become 0)."""
    from ampdoctor.findings._poles import flushed_pole_input, saturated_feeder

    out: list[Candidate] = []
    for o in ctx.harmful_origins():
        hit = flushed_pole_input(ctx, o.record)
        if hit is None or saturated_feeder(ctx, hit[0]) is not None:
            continue  # no pole hit, or zeros 1 - p of a saturated p: the saturation rule reports it
        src, extra = hit
        r = o.record
        dt = dtype_name(src.dtype)
        ref = ctx.ref(src)
        ev = base_evidence(src)
        ev.update({"n_flushed": int(extra), "format_min_subnormal": limits(src.dtype)[2], "pole_op": r.op,
                   "pole": ctx.describe(r), "n_inf": int(r.stats["n_posinf"] + r.stats["n_neginf"])})
        if ref is not None:
            ev["ref_min_nonzero"] = ref.stats.get("min_nonzero")
        expl = (f"{where(src)} returns exactly 0 for {int(extra)} value(s) that are nonzero in fp32"
                + (f" (smallest there {fmt(ref.stats['min_nonzero'])})" if ref is not None else "")
                + f", below {dt}'s smallest subnormal {fmt(limits(src.dtype)[2])}; {where(r)} then maps them to "
                f"inf ({op_base(r.op)}(0)), and the inf {o.reasons[0]}. The inf is not an overflow: its cause is "
                "this underflow.")
        fixes: list[FixProposal] = []
        if op_base(src.op) in ops_with(Kind.SOFTMAX) and op_base(r.op) in ops_with(Kind.LOG):
            fixes.append(propose("log-softmax", modules=[_common_scope(src.module, r.module)]))
        fixes.append(FixProposal("keep the value off 0 before the pole, with the dtype's own limit",
                                 "y = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))"))
        if src.module:
            fixes.append(keep_fp32_fix(src.module))
        out.append(Candidate(Finding(
            "underflow", "error", src.module, src.op, src.phase,
            f"{op_base(src.op)} flushes values to 0 that {op_base(r.op)} turns into inf in {src.module or '<root>'}",
            expl, ev, tuple(fixes), src.step), src.index))
    return out


def _common_scope(a: str, b: str) -> str:
    """The innermost module that runs both ``a`` and ``b`` (``""``: the root)."""
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    n = 0
    while n < min(len(pa), len(pb)) and pa[n] == pb[n]:
        n += 1
    return ".".join(pa[:n])


def _consequences(dt: str, sub_in: list[OpRecord], consts: list[float], dead: dict[str, tuple[float, float]],
                  feeds: list[OpRecord], loss_zero: bool) -> str:
    """The explanation's second half: the subnormal input, small constants, dead gradients, what the zeros feed."""
    expl = ""
    if sub_in:
        x = sub_in[0]
        expl += (f" Its input from {x.op} in {x.module or '<root>'} was already on the subnormal floor "
                 f"({int(x.stats['n_subnormal'])} of {int(x.stats['numel'])} values subnormal, |max| "
                 f"{fmt(x.stats['absmax'])}).")
    if consts:
        expl += (f" The constant(s) {', '.join(f'{c:g}' for c in sorted(set(consts)))} used here round to 0 in "
                 f"{dt}.")
    if dead:
        expl += (f" {len(dead)} parameter(s) get an all-zero gradient in {dt} and not in fp32 "
                 f"({', '.join(sorted(dead)[:4])}{', ...' if len(dead) > 4 else ''}): they stop learning.")
    if feeds:
        expl += f" These zeros feed the inf/NaN made by {where(feeds[0])} (a division by zero)."
    if loss_zero:
        expl += " The loss itself is 0."
    return expl


def _fixes(ctx: Context, r: OpRecord) -> tuple[FixProposal, ...]:
    """Loss scaling for a backward underflow, fp32 master weights for an optimizer one, fp32 for the module, bf16."""
    fixes: list[FixProposal] = []
    if r.phase in ("backward",):
        fixes.append(FixProposal(
            "use dynamic loss scaling: the scaled gradients stay above the subnormal floor",
            "scaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(optimizer)\n"
            "scaler.update()", id="grad_scaler", params={}))
    if r.phase == "optimizer":
        fixes.append(FixProposal(
            "keep fp32 master weights and optimizer state (the update math then runs in fp32)",
            "model.float()  # + torch.autocast for the forward", id="fp32_master", params={}))
    if r.module and r.phase == "forward":
        fixes.append(keep_fp32_fix(r.module))
    bf16 = bf16_fix(ctx.spec.precision)
    fixes.append(FixProposal("use bfloat16 (smallest normal 1.2e-38: the same exponent range as fp32)", bf16.snippet,
                             bf16.id, bf16.params))
    return tuple(fixes)

