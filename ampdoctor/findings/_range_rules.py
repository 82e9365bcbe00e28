"""Rules for values that stay finite but lose their meaning: saturation, underflow, precision-loss.

Each rule compares a target record with its aligned fp32 reference record (``ctx.ref``). The statistics a
record carries are summaries (|max|, smallest nonzero, counts of zeros / subnormals / values at a bound, L2
norm), so the relative errors computed here are *lower bounds* of the element-wise error: what is flagged is
real, a small element-wise error spread evenly over a tensor can go unseen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ampdoctor.findings._context import Context, dtype_name, feeders, limits, op_base
from ampdoctor.findings._core_rules import base_evidence, bf16_fix, fmt, keep_fp32_fix, where
from ampdoctor.findings._registry import Candidate, rule
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import OpRecord
from ampdoctor.trace._lineage import is_nonfinite

LOW = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}

#: ops whose output holds (a subset of) the values of their input: a zero or a bound passes through unchanged.
ALIAS_OPS = {
    "detach", "alias", "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "squeeze", "unsqueeze", "clone", "contiguous", "select", "slice", "as_strided", "lift_fresh", "unfold",
    "flatten", "narrow", "split", "split_with_sizes", "chunk", "unbind", "cat", "stack",
}
#: bounded activations: their backward op, and what the bound means
BOUNDED = {
    "tanh": ("tanh_backward", "±1"),
    "sigmoid": ("sigmoid_backward", "0 or 1"),
    "_softmax": ("_softmax_backward_data", "1"),
    "softmax": ("_softmax_backward_data", "1"),
}
CASTS = {"_to_copy", "to", "_to_copy_", "copy_"}
MATMULS_A0 = {"mm", "bmm", "matmul", "linear", "_scaled_mm"}   # reduction length = inputs[0].shape[-1]
MATMULS_A1 = {"addmm", "baddbmm", "addbmm", "addmv"}           # inputs[1].shape[-1]
ROW_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "cumsum", "logsumexp",
           "_safe_softmax", "native_group_norm"}
CANCEL_OPS = {"sub", "add", "rsub", "addcmul", "addcdiv", "sum", "mean", "var", "lerp"}
#: relative error above which precision-loss is a warning (below it: info)
WARN_REL = 0.05
#: a tolerance never exceeds this relative error, whatever the reduction length
TOL_CAP = 0.1
#: tolerance factor on sqrt(K) * u
TOL_FACTOR = 16.0


# --------------------------------------------------------------------------------------------------------------
# shared numerics
# --------------------------------------------------------------------------------------------------------------
def unit_roundoff(dtype: torch.dtype | str) -> float:
    """u = half the spacing of the dtype at 1: fp16 2**-11, bf16 2**-8, fp32 2**-24, e4m3 2**-4, e5m2 2**-3."""
    name = dtype_name(dtype)
    try:
        dt = getattr(torch, name)
        return float(torch.finfo(dt).eps) / 2
    except (AttributeError, TypeError):
        return 2.0 ** -24


def spacing_below_one(dtype: torch.dtype | str) -> float:
    """Distance between 1 and the largest representable value below 1 (fp16: 2**-11, bf16: 2**-8)."""
    return unit_roundoff(dtype)


def saturation_threshold(op: str, dtype: torch.dtype | str) -> float:
    """Smallest |x| whose ``op(x)`` rounds to the bound in ``dtype`` (fp16 tanh: 4.5055, bf16 tanh: 3.466)."""
    s = spacing_below_one(dtype)
    if op == "tanh":  # tanh(x) >= 1 - s/2 rounds to 1
        return 0.5 * math.log((2 - s / 2) / (s / 2))
    if op == "sigmoid":  # sigmoid(x) >= 1 - s/2 rounds to 1
        return math.log(2 / s - 1)
    return math.log(2 / s)  # softmax: the others' total below s/2 of the max


def is_low(dtype: torch.dtype | str) -> bool:
    return dtype_name(dtype) in LOW


_KNOWN = ("absmax", "n_zero", "numel", "norm", "n_nan")


def _finite(r: OpRecord) -> bool:
    """Full statistics, all known (a failed statistic is a row of NaN), and no inf/NaN in the values."""
    s = r.stats
    if not s or "n_nan" not in s or any(s.get(k) != s.get(k) for k in _KNOWN):
        return False
    return not is_nonfinite(r)


def counts_known(s: dict[str, float]) -> bool:
    """False for the trace's lite tier (optimizer-phase outputs, parameter leaves): one ``aminmax`` pass, so zeros,
    subnormals and the norm are unknown (they read 0) and ``min_nonzero`` reads inf even though |max| > 0."""
    return not (s.get("absmax", 0.0) > 0 and s.get("min_nonzero") == math.inf)


def all_zero(s: dict[str, float]) -> bool:
    """Every value is exactly 0 (true in both tiers: |max| 0 and nothing non-finite)."""
    return s.get("absmax") == 0 and not (s.get("n_nan", 0) or s.get("n_posinf", 0) or s.get("n_neginf", 0))


def alias_closure(ctx: Context, seeds: Iterable[int]) -> set[int]:
    """``seeds`` plus every later record that is a pure alias (detach, view, ...) of one of them."""
    out = set(seeds)
    if not out:
        return out
    start = min(out)
    for r in ctx.records[start + 1:]:
        if r.inputs and op_base(r.op) in ("detach", "alias", "view", "_unsafe_view", "t", "expand", "clone",
                                           "contiguous", "reshape", "transpose", "permute"):
            if any(i in out for i in r.inputs):
                out.add(r.index)
    return out


def ancestors(ctx: Context, idx: int, limit: int = 200_000) -> set[int]:
    """Indices of every record ``idx`` was computed from (through ``inputs``), ``idx`` included."""
    recs = ctx.records
    seen = {idx}
    stack = [idx]
    while stack and len(seen) < limit:
        for i in recs[stack.pop()].inputs:
            if i >= 0 and i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def descendants(ctx: Context, idx: int) -> set[int]:
    """Indices of every record computed from record ``idx`` (through ``inputs``), ``idx`` included."""
    out = {idx}
    for r in ctx.records[idx + 1:]:
        if any(i in out for i in r.inputs):
            out.add(r.index)
    return out


def gradient_params(ctx: Context, indices: set[int]) -> set[str]:
    """Parameters whose gradient is written (``AccumulateGrad``) by one of the records ``indices``."""
    sizes = param_numels(ctx)
    owners = ctx.target.owners
    out: set[str] = set()
    for i in indices:
        r = ctx.records[i]
        if r.node != "AccumulateGrad":
            continue
        n = int(r.stats.get("numel", -1))
        out.update(p for p, o in owners.items() if o == r.module and sizes.get(p, n) == n)
    return out


def param_numels(ctx: Context) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ctx.records:
        if r.kind == "param" and r.name and r.name not in out:
            out[r.name] = int(r.stats.get("numel", 0))
    return out


def coverage_at(run: Any, step: int) -> dict[str, Any]:
    if run is None or not run.coverage:
        return {}
    cov = run.coverage[min(step, len(run.coverage) - 1)]
    return {p.name: p for p in cov}


def dead_gradients(ctx: Context, step: int, names: set[str] | None = None) -> dict[str, tuple[float, float]]:
    """Parameters whose gradient is entirely zero in the target but not in the reference:
    ``{name: (target zero fraction, reference zero fraction)}``."""
    tcov, rcov = coverage_at(ctx.target, step), coverage_at(ctx.reference, step)
    out: dict[str, tuple[float, float]] = {}
    for name, ps in tcov.items():
        if names is not None and name not in names:
            continue
        rp = rcov.get(name)
        tz = ps.grad_zero
        rz = rp.grad_zero if rp is not None else None
        if isinstance(tz, float) and isinstance(rz, float) and tz >= 1.0 and rz < 1.0:
            out[name] = (tz, rz)
    return out


def zero_fraction(ctx: Context, step: int, names: set[str]) -> tuple[float | None, float | None]:
    """Fraction of gradient elements exactly zero over ``names``, target and reference (numel-weighted)."""
    sizes = param_numels(ctx)
    res: list[float | None] = []
    for run in (ctx.target, ctx.reference):
        cov = coverage_at(run, step)
        num = den = 0.0
        for n in names:
            ps = cov.get(n)
            if ps is None or not isinstance(ps.grad_zero, float):
                continue
            w = float(sizes.get(n, 1))
            num += ps.grad_zero * w
            den += w
        res.append(num / den if den else None)
    return res[0], res[1]


# --------------------------------------------------------------------------------------------------------------
# saturation
# --------------------------------------------------------------------------------------------------------------
def saturated_records(ctx: Context) -> list[tuple[OpRecord, OpRecord, float, float]]:
    """Bounded-op outputs at their bound in the target much more often than in the reference:
    ``(record, reference, target fraction, reference fraction)``."""
    cached = ctx.__dict__.get("_ampdoctor_sat_records")
    if cached is not None:
        return cached
    out = []
    for r in ctx.records:
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) not in BOUNDED or not is_low(r.dtype):
            continue
        s = r.stats
        n = s.get("numel", 0)
        if not n or not _finite(r):
            continue
        ref = ctx.ref(r)
        if ref is None:
            continue
        nt, nr = s.get("n_at_limit", 0.0), ref.stats.get("n_at_limit", 0.0)
        excess = nt - nr
        if excess >= 1 and excess >= 0.01 * n and nt > 2 * nr:
            out.append((r, ref, nt / n, nr / n))
    ctx.__dict__["_ampdoctor_sat_records"] = out
    return out


def _backward_of(ctx: Context, r: OpRecord) -> OpRecord | None:
    """The backward op of bounded record ``r`` (``tanh_backward`` reading r's saved output)."""
    want = BOUNDED[op_base(r.op)][0]
    aliases = alias_closure(ctx, [r.index])
    for b in ctx.records[r.index + 1:]:
        if b.phase == "backward" and b.step == r.step and op_base(b.op) == want and any(
                i in aliases for i in b.inputs):
            return b
    return None


@rule("saturation", severity="warning", precedence=45,
      summary="tanh/sigmoid/softmax outputs round to their bound in low precision, so their gradient is exactly 0")
def saturation(ctx: Context) -> list[Candidate]:
    """A bounded activation returns exactly its bound in the target dtype where the fp32 reference does not.
    Near the bound the dtype's spacing decides: fp16 holds no value between 1 - 2**-11 and 1, so
    ``tanh(x)`` for |x| >= 4.5055 is exactly ±1 (bf16: |x| >= 3.466); ``sigmoid(x)`` is exactly 1 for
    x >= 8.318 in fp16; a softmax row is exactly one-hot once the runner-up trails by ~8.3. The derivative
    ``1 - y**2`` (``y(1 - y)``, ``y(g - sum(g y))``) is then exactly 0 -- and loss scaling cannot help because
    ``0 * scale = 0``. Severity ``error`` when parameters that feed the op receive exactly-zero gradients in the
    target but not in the reference (the layers below stop learning), ``warning`` otherwise. Evidence: fraction at
    the bound in target vs reference, the input |max|, the threshold, the dtype's spacing below 1, the gradient
    zero fraction of the upstream parameters."""
    out: list[Candidate] = []
    for r, ref, ft, fr in saturated_records(ctx):
        base = op_base(r.op)
        recs = ctx.records
        inp = next((recs[i] for i in r.inputs if i >= 0), None)
        ref_in = ctx.ref(inp) if inp is not None else None
        thr = saturation_threshold(base, r.dtype)
        ev = base_evidence(r)
        ev.update({
            "fraction_at_limit": ft, "ref_fraction_at_limit": fr, "n_at_limit": int(r.stats["n_at_limit"]),
            "ref_n_at_limit": int(ref.stats["n_at_limit"]), "bound": BOUNDED[base][1],
            "spacing_below_1": spacing_below_one(r.dtype), "saturation_threshold": thr,
        })
        if inp is not None:
            ev["input_absmax"] = inp.stats.get("absmax")
            ev["input_module"] = inp.module
        if ref_in is not None:
            ev["ref_input_absmax"] = ref_in.stats.get("absmax")
        bwd = _backward_of(ctx, r)
        bwd_zero = None
        if bwd is not None:
            bref = ctx.ref(bwd)
            n = max(bwd.stats.get("numel", 0), 1)
            bwd_zero = bwd.stats.get("n_zero", 0) / n
            ev["grad_zero_fraction"] = bwd_zero
            ev["backward_op"] = bwd.op
            if bref is not None:
                ev["ref_grad_zero_fraction"] = bref.stats.get("n_zero", 0) / n
        upstream = {recs[i].name for i in ancestors(ctx, r.index) if recs[i].kind == "param" and recs[i].name}
        dead = dead_gradients(ctx, r.step, upstream) if upstream else {}
        zt, zr = zero_fraction(ctx, r.step, upstream) if upstream else (None, None)
        if zt is not None:
            ev["upstream_grad_zero_fraction"] = zt
            ev["ref_upstream_grad_zero_fraction"] = zr
            ev["upstream_parameters"] = len(upstream)
        if dead:
            ev["dead_parameters"] = sorted(dead)[:20]
            ev["n_dead_parameters"] = len(dead)
        if not dead and (bwd_zero is None or bwd_zero < 0.5) and ft < 0.5:
            continue  # a few saturated entries whose gradient still flows elsewhere (GELU-tanh's x path)
        severity = "error" if dead else "warning"
        dt = dtype_name(r.dtype)
        in_txt = ""
        if inp is not None:
            in_txt = (f" Its input (from {inp.module or '<root>'}) reaches |x| = {fmt(inp.stats['absmax'])}"
                      + (f" (reference {fmt(ref_in.stats['absmax'])})" if ref_in is not None else "")
                      + f"; in {dt} every |x| >= {thr:.4g} gives exactly {BOUNDED[base][1]}.")
        expl = (f"{where(r)} returns exactly {BOUNDED[base][1]} for {ft:.1%} of its outputs in {dt} "
                f"(fp32 reference: {fr:.1%}): {dt} has no value between 1 - {fmt(spacing_below_one(r.dtype))} "
                f"and 1.{in_txt}")
        if bwd is not None and bwd_zero is not None:
            expl += (f" Its backward {op_base(bwd.op)} is exactly 0 for {bwd_zero:.1%} of the elements; loss scaling "
                     "cannot bring a 0 back.")
        if dead:
            expl += (f" {len(dead)} of the {len(upstream)} parameters feeding it get an all-zero gradient in {dt} and "
                     "not in fp32: everything below this layer stops learning, with no inf/NaN and no skipped step.")
        elif zt is not None and zr is not None:
            expl += f" Upstream gradients exactly zero: {zt:.1%} (reference {zr:.1%})."
        producer = inp.module if inp is not None and inp.module and inp.module != r.module else ""
        mods = [m for m in (producer, r.module) if m]
        fixes: list[FixProposal] = []
        if mods:
            f = keep_fp32_fix(r.module or producer)
            fixes.append(FixProposal(
                f"compute {' and '.join(f'`{m}`' for m in mods)} in float32 (autocast disabled, input upcast): "
                "fp32 resolves 1 - y**2 down to ~1e-7", f.snippet, f.id, {"modules": mods}))
        fixes.append(FixProposal(
            "keep the pre-activations out of the flat region: normalize the input (LayerNorm before the activation), "
            "lower the learning rate / apply weight decay to the bias that drifted",
            "h = torch.tanh(layer_norm(dense(x)))"))
        fixes.append(FixProposal(
            "bfloat16 does not help here: its spacing below 1 is 2**-8, coarser than fp16's 2**-11"))
        out.append(Candidate(Finding(
            "saturation", severity, r.module, r.op, r.phase,  # type: ignore[arg-type]
            f"{base} saturates to {BOUNDED[base][1]} in {dt} in {r.module or '<root>'}"
            + (": gradients below it are exactly zero" if dead else ""),
            expl, ev, tuple(fixes), r.step), r.index))
    return out


# --------------------------------------------------------------------------------------------------------------
# underflow
# --------------------------------------------------------------------------------------------------------------
def flush_of(ctx: Context, r: OpRecord) -> tuple[float, float, dict[str, float]] | None:
    """``(excess zeros, elements nonzero in the comparison, comparison stats)`` for record ``r``.

    The comparison is the aligned reference record; for a cast (``_to_copy``) without one, it is the cast's own
    input (a cast that flushes values changes nothing else)."""
    s = r.stats
    if not s or "n_zero" not in s or not _finite(r):
        return None
    ref = ctx.ref(r)
    cmp: dict[str, float] | None = None
    if op_base(r.op) in CASTS and r.inputs and r.inputs[0] >= 0:
        src = ctx.records[r.inputs[0]]
        if src.stats and src.stats.get("numel") == s.get("numel") and _finite(src):
            cmp = src.stats
    if cmp is None and ref is not None and _finite(ref):
        cmp = ref.stats
    if cmp is None:
        return None
    c_zero = cmp["numel"] if all_zero(cmp) else cmp["n_zero"]
    if not counts_known(cmp):  # lite tier: only |max| is known; it bounds every value, the smallest included
        cmp = dict(cmp, min_nonzero=cmp["absmax"])
    nonzero = cmp["numel"] - c_zero
    if all_zero(s):
        return nonzero, nonzero, cmp
    if not counts_known(s) or not counts_known(cmp):
        return None  # a partial flush cannot be measured without counts
    return s["n_zero"] - c_zero, nonzero, cmp


def _flushed_cached(ctx: Context, i: int) -> bool:
    """Record ``i`` holds exact zeros for more than half of the values nonzero in its comparison (reference, or
    a cast's input); a record without a comparison counts when it is all zeros computed from flushed inputs.
    Computed once for the whole trace, in record order (inputs always precede their users)."""
    cache: dict[int, bool] | None = ctx.__dict__.get("_ampdoctor_flushed")
    if cache is None:
        cache = {}
        for r in ctx.records:
            f = flush_of(ctx, r)
            if f is None:
                ins = [j for j in r.inputs if j >= 0]
                cache[r.index] = bool(r.stats) and all_zero(r.stats) and bool(ins) and all(
                    cache.get(j, False) for j in ins)
            else:
                excess, nonzero, _ = f
                cache[r.index] = nonzero > 0 and excess > 0.5 * nonzero
        ctx.__dict__["_ampdoctor_flushed"] = cache
    return cache.get(i, False)


def _saturated_sources(ctx: Context) -> set[int]:
    cache = ctx.__dict__.get("_ampdoctor_saturated")
    if cache is None:
        cache = alias_closure(ctx, [r.index for r, *_ in saturated_records(ctx)])
        ctx.__dict__["_ampdoctor_saturated"] = cache
    return cache


def underflow_origins(ctx: Context) -> list[tuple[OpRecord, float, float, dict[str, float]]]:
    """Records where more than half of the values nonzero in the reference become exactly 0, whose inputs were not
    already flushed, whose zeros are not an exact-zero derivative of a saturated activation, and whose reference
    values are small enough to be lost (the reference's |max| is below ``floor / u``: the flushed values matter
    relative to the tensor's own scale). ``(record, flushed fraction, nonzero, comparison stats)``."""
    cached = ctx.__dict__.get("_ampdoctor_underflow")
    if cached is not None:
        return cached
    out = []
    sat = _saturated_sources(ctx)
    for r in ctx.records:
        if r.kind != "op" or not is_low(r.dtype) and not any(dtype_name(d) in LOW for d in r.input_dtypes):
            continue
        f = flush_of(ctx, r)
        if f is None:
            continue
        excess, nonzero, cmp = f
        if nonzero <= 0 or excess <= 0.5 * nonzero:
            continue
        floor = limits(r.dtype)[2] if is_low(r.dtype) else min(limits(d)[2] for d in r.input_dtypes
                                                                 if dtype_name(d) in LOW)
        u = unit_roundoff(r.dtype if is_low(r.dtype) else "float16")
        if cmp["min_nonzero"] > floor or cmp["absmax"] > floor / u:
            continue  # nothing below the floor, or the flushed values are negligible next to the tensor's max
        if any(i >= 0 and (_flushed_cached(ctx, i) or i in sat) for i in r.inputs):
            continue  # inherited zeros, or the exact-zero derivative of a saturated activation
        out.append((r, excess / nonzero, nonzero, cmp))
    ctx.__dict__["_ampdoctor_underflow"] = out
    return out


def _small_constants(r: OpRecord) -> list[float]:
    floor = limits(r.dtype)[2]
    return [v for v in r.scalars if v != 0 and math.isfinite(v) and abs(v) < floor / 2]


@rule("underflow", severity="warning", precedence=42,
      summary="values nonzero in fp32 become exactly 0 in the target dtype (below its smallest subnormal)")
def underflow(ctx: Context) -> list[Candidate]:
    """More than half of the values that are nonzero in the fp32 reference are exactly 0 in the target: they fell
    below the dtype's smallest subnormal (fp16 2**-24 = 5.96e-8; bf16 9.2e-41; e4m3 2**-9; e5m2 2**-16).
    Typical: fp16 backward without loss scaling (d loss / d out = 1e-6 / N), Adam's ``grad**2`` in fp16. The origin
    is the first op that flushes them from inputs that still held them; values merely rounded to the subnormal
    floor are evidence, not the origin. An inf/NaN made by dividing by such zeros (``m / (sqrt(0) + 0)``, 0/0)
    has this underflow as its root cause. Severity ``error`` when it zeroes the gradient of parameters (all-zero
    in the target, not in the reference), the loss, or feeds an inf/NaN that reaches the loss, a gradient or an
    update; ``warning`` otherwise."""
    out: list[Candidate] = []
    origins = underflow_origins(ctx)
    if not origins:
        return out
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
        down = alias_closure(ctx, [r.index])
        loss_zero = any(i in loss_idx for i in down) or (
            ctx.target.losses and ctx.reference is not None and ctx.reference.losses
            and ctx.target.losses[0] == 0.0 and ctx.reference.losses[0] not in (0.0, None))
        consts = [c for i in range(r.index, min(r.index + 40, len(recs))) for c in _small_constants(recs[i])
                  if recs[i].module == r.module and recs[i].step == r.step]
        if dead:
            ev["dead_parameters"] = sorted(dead)[:20]
            ev["n_dead_parameters"] = len(dead)
        if feeds:
            ev["feeds_nonfinite"] = [ctx.describe(recs[i]) for i in feeds[:3]]
        if consts:
            ev["constants_below_floor"] = sorted(set(consts))
        severity = "error" if dead or feeds or loss_zero else "warning"
        expl = (f"{where(r)} returns exactly 0 for {frac:.1%} of the {int(nonzero)} values that are nonzero in fp32: "
                f"the reference values reach only |max| {fmt(cmp['absmax'])} (smallest nonzero "
                f"{fmt(cmp['min_nonzero'])}), below {dt}'s smallest subnormal {fmt(floor)}"
                + (f" (smallest normal {fmt(limits(r.dtype)[1])})" if is_low(r.dtype) else "") + ".")
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
            f0 = recs[feeds[0]]
            expl += f" These zeros feed the inf/NaN made by {where(f0)} (a division by zero)."
        if loss_zero:
            expl += " The loss itself is 0."
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
        fixes.append(bf16_fix(ctx.spec.precision))
        fixes[-1] = FixProposal(
            "use bfloat16 (smallest normal 1.2e-38: the same exponent range as fp32)", fixes[-1].snippet,
            fixes[-1].id, fixes[-1].params)
        out.append(Candidate(Finding(
            "underflow", severity, r.module, r.op, r.phase,  # type: ignore[arg-type]
            f"{op_base(r.op)} flushes {frac:.0%} of its values to 0 in {dt} in {r.module or '<root>'}"
            + (f" ({r.phase})" if r.phase != "forward" else ""), expl, ev, tuple(fixes), r.step), r.index))
    return out


# --------------------------------------------------------------------------------------------------------------
# precision-loss
# --------------------------------------------------------------------------------------------------------------
def reduction_length(ctx: Context, r: OpRecord) -> int:
    """K, the number of terms each output element sums (1 for element-wise ops)."""
    base = op_base(r.op)
    recs = ctx.records
    ins = [recs[i] for i in r.inputs if i >= 0]
    try:
        if base in MATMULS_A0 and ins:
            return max(1, int(ins[0].shape[-1]))
        if base in MATMULS_A1 and len(ins) >= 2:
            return max(1, int(ins[1].shape[-1]))
        if base in ("convolution", "_convolution", "conv2d", "conv1d") and len(ins) >= 2:
            return max(1, math.prod(ins[1].shape[1:]))
        if "scaled_dot_product" in base and len(ins) >= 2:
            return max(1, int(ins[0].shape[-1]) + int(ins[1].shape[-2]))
        if base in ROW_OPS and r.shape:
            return max(1, int(r.shape[-1]))
        if base in ("sum", "mean", "var", "std", "var_mean", "linalg_vector_norm", "norm", "prod", "amax") and ins:
            n_in = math.prod(ins[0].shape) or 1
            n_out = math.prod(r.shape) or 1
            return max(1, n_in // n_out)
    except (IndexError, TypeError):
        return 1
    return 1


def tolerance(ctx: Context, r: OpRecord) -> tuple[float, int, float]:
    """``(tolerance, K, u)``: ``min(16 * sqrt(K) * u, 0.1)`` with u the unit roundoff of the lowest precision the
    op touches."""
    dts = [dtype_name(r.dtype), *[dtype_name(d) for d in r.input_dtypes]]
    u = max(unit_roundoff(d) for d in dts)
    k = reduction_length(ctx, r)
    return min(TOL_FACTOR * math.sqrt(k) * u, TOL_CAP), k, u


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if b == 0:
        return 0.0 if a == 0 else math.inf
    return abs(a - b) / abs(b)


def relative_errors(ctx: Context) -> dict[int, float]:
    """Observed relative error of every finite target record vs its reference: ``max`` of the norm's and the
    |max|'s relative errors (both lower bounds of the element-wise error). Records without a reference (casts
    inserted by autocast) carry their input's error plus the change they make."""
    cached = ctx.__dict__.get("_ampdoctor_relerr")
    if cached is not None:
        return cached
    recs = ctx.records
    err: dict[int, float] = {}
    harmful = {o.record.index for o in ctx.harmful_origins()}
    carried = ctx.lineage.carried
    for r in recs:
        if not _finite(r):
            # a harmful inf/NaN taints what it touches; a benign one (T5's log(0) discarded by where) does not
            err[r.index] = math.inf if carried.get(r.index, frozenset()) & harmful or r.index in harmful else 0.0
            continue
        if any(i >= 0 and err.get(i, 0.0) == math.inf for i in r.inputs):
            err[r.index] = math.inf  # computed from a harmful inf/NaN (rsqrt(inf) = 0): the overflow explains it
            continue
        ref = ctx.ref(r)
        if ref is not None and _finite(ref):
            e = _rel(r.stats["absmax"], ref.stats["absmax"])
            if counts_known(r.stats) and counts_known(ref.stats):
                e = max(e, _rel(r.stats["norm"], ref.stats["norm"]))
            err[r.index] = e
            continue
        ins = [i for i in r.inputs if i >= 0]
        if not ins:
            err[r.index] = 0.0
            continue
        base = max(err.get(i, 0.0) for i in ins)
        src = recs[ins[0]].stats
        if len(ins) == 1 and src.get("numel") == r.stats.get("numel") and counts_known(src) and counts_known(r.stats):
            base += _rel(r.stats["norm"], src.get("norm", 0.0))
        err[r.index] = base
    ctx.__dict__["_ampdoctor_relerr"] = err
    return err


def _noise_level_reference(ctx: Context, r: OpRecord, ref: OpRecord, k: int) -> bool:
    """The reference result of a sum/difference/matmul is itself at fp32's rounding level of its operands (a
    gradient that is zero in exact arithmetic, like a key bias's under softmax): there is no value to compare."""
    base = op_base(r.op)
    ins = [ctx.records[i] for i in r.inputs if i >= 0]
    if not ins:
        return False
    if base in MATMULS_A0 and len(ins) >= 2:
        scale = ins[0].stats.get("absmax", 0.0) * ins[1].stats.get("absmax", 0.0)
    elif base in MATMULS_A1 and len(ins) >= 3:
        scale = max(ins[0].stats.get("absmax", 0.0), ins[1].stats.get("absmax", 0.0) * ins[2].stats.get("absmax", 0.0))
    elif base in CANCEL_OPS:
        scale = max(x.stats.get("absmax", 0.0) for x in ins)
    else:
        return False
    return ref.stats["absmax"] <= 64 * math.sqrt(k) * 2.0 ** -24 * scale


def trig_buffer_sources(ctx: Context) -> list[tuple[OpRecord, OpRecord]]:
    """``(sin/cos record, low-precision leaf)`` pairs: a floating leaf that is not a parameter or the batch (a
    buffer such as RoPE's ``inv_freq``), held in fp16/bf16, feeding a forward ``sin``/``cos`` within 10 steps."""
    cached = ctx.__dict__.get("_ampdoctor_trig")
    if cached is not None:
        return cached
    recs = ctx.records
    out: list[tuple[OpRecord, OpRecord]] = []
    for r in recs:
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) not in ("sin", "cos") or r.step != 0:
            continue
        out.extend((r, x) for x in feeders(recs, r, 10)
                   if x.kind == "input" and is_low(x.dtype) and x.stats.get("numel", 0) > 1)
    ctx.__dict__["_ampdoctor_trig"] = out
    return out


def precision_loss_records(ctx: Context) -> list[tuple[OpRecord, float, float, float, int, float]]:
    """Records whose own error (observed relative error minus the largest relative error of their inputs) exceeds
    the tolerance: ``(record, error, inherited, tolerance, K, u)``, in trace order."""
    cached = ctx.__dict__.get("_ampdoctor_ploss")
    if cached is not None:
        return cached
    err = relative_errors(ctx)
    out = []
    # computed from a flagged record, an underflow origin or a saturated activation: its error is inherited
    tainted: set[int] = set(_saturated_sources(ctx)) | {r.index for r, *_ in underflow_origins(ctx)} | {
        t.index for t, _ in trig_buffer_sources(ctx)}  # rotary angles from a low-precision buffer: must-stay-fp32
    for r in ctx.records:
        if r.step != 0:
            break  # after an optimizer step target and reference hold different weights: only step 0 compares ops
        if r.index in tainted:
            continue
        if any(i in tainted for i in r.inputs):
            tainted.add(r.index)
            continue
        if r.kind != "op" or r.phase not in ("forward", "backward") or op_base(r.op) in CASTS | ALIAS_OPS:
            continue
        if r.out_pos > 0:
            continue  # auxiliary outputs (a layer norm's saved mean / rstd) are checked through their users
        if not is_low(r.dtype) and not any(dtype_name(d) in LOW for d in r.input_dtypes):
            continue
        ref = ctx.ref(r)
        if ref is None or not _finite(r) or not _finite(ref) or ref.stats["norm"] == 0:
            continue
        if not counts_known(r.stats) or not counts_known(ref.stats):
            continue
        e = err.get(r.index, 0.0)
        ins = [i for i in r.inputs if i >= 0]
        inherited = max((err.get(i, 0.0) for i in ins), default=0.0)
        if not math.isfinite(e) or not math.isfinite(inherited):
            continue
        if not ins:
            continue  # a constant made from scratch (torch.finfo(dtype).min differs by design)
        tol, k, u = tolerance(ctx, r)
        if _noise_level_reference(ctx, r, ref, k):
            continue
        own = e - inherited
        if own > tol:
            out.append((r, e, inherited, tol, k, u))
            tainted.add(r.index)
    ctx.__dict__["_ampdoctor_ploss"] = out
    return out


def output_deviation(ctx: Context) -> float | None:
    """Relative deviation of the first step's loss (or, without a loss, of its model outputs) from the reference."""
    t, ref = ctx.target, ctx.reference
    if ref is None:
        return None
    if t.losses and ref.losses and t.losses[0] is not None and ref.losses[0] is not None:
        d = _rel(t.losses[0], ref.losses[0])
        return d if math.isfinite(d) else None  # a non-finite loss is explained by the inf/NaN rules
    err = relative_errors(ctx)
    vals = [err.get(i, 0.0) for i in t.output_records if ctx.records[i].step == 0]
    return max(vals) if vals else None


def cancellation_nan_origins(ctx: Context) -> list[tuple[Any, OpRecord | None]]:
    """Harmful NaN origins (NaN from finite inputs, no inf) that are finite in the reference and not explained by
    flushed inputs (0/0 is underflow): ``(origin, the cancelling op upstream or None)``."""
    out: list[tuple[Any, OpRecord | None]] = []
    recs = ctx.records
    err = relative_errors(ctx)
    for o in ctx.harmful_origins():
        r = o.record
        s = r.stats
        if r.kind != "op" or s.get("n_nan", 0) == 0 or s.get("n_posinf", 0) + s.get("n_neginf", 0) > 0:
            continue
        ref = ctx.ref(r)
        if ref is None or not _finite(ref) or o.deliberate:
            continue
        if any(i >= 0 and _flushed_cached(ctx, i) for i in r.inputs):
            continue
        # walk up to 6 records back for the op with the largest relative error that cancels (sub/add/...)
        best: OpRecord | None = None
        for x in feeders(recs, r, 6):
            if op_base(x.op) in CANCEL_OPS and err.get(x.index, 0.0) > 0.5 and (
                    best is None or err.get(x.index, 0.0) > err.get(best.index, 0.0)):
                best = x
        out.append((o, best))
    return out


@rule("precision-loss", severity="warning", precedence=50,
      summary="no inf/NaN, but an op's result deviates from fp32 beyond what rounding explains")
def precision_loss(ctx: Context) -> list[Candidate]:
    """An op's finite result deviates from the fp32 reference by more than rounding to the dtype explains.

    Tolerance: the unit roundoff u of the lowest precision the op touches (fp16 2**-11, bf16 2**-8, e4m3 2**-4)
    and the number K of terms each output sums (matmul: the inner dimension, conv: C_in * kernel size, softmax /
    norms: the row length, element-wise: 1). Summing K rounded terms gives a relative error of about sqrt(K) * u
    typically (random rounding errors add in quadrature; K * u is the worst case), so an op is flagged when its
    *own* error exceeds ``min(16 * sqrt(K) * u, 0.1)``: fp16 element-wise 0.0078, fp16 matmul with K=1024 0.1
    (cap), bf16 element-wise 0.0625. The observed error is the relative error of the tensor's L2 norm or of its
    |max| against the reference (a lower bound of the element-wise error). A layer's *own* error is what it
    adds to the error its inputs already carried: ``error(output) - max(error(inputs))`` -- a matmul that
    receives a 3% error and returns 3.1% is not the culprit; a subtraction that receives 0.2% and returns 80%
    (catastrophic cancellation: ``x - mean(x)`` of values with a large common offset, ``E[x**2] - E[x]**2``)
    is. Everything computed from a flagged op inherits its error and is not flagged again; only the first step is
    compared (after an optimizer step the two runs hold different weights). Severity ``warning`` at a 5% own error
    or more; smaller own errors are ``info`` and reported only when the first step's loss (or output) deviates by
    more than 1% and no inf/NaN explains it. At most five ops, the largest own errors. A NaN made from finite
    inputs where the reference is finite (``sqrt`` of a variance that cancellation made negative) is an ``error``
    reported at the cancelling op."""
    out: list[Candidate] = []
    for o, cancel in cancellation_nan_origins(ctx):
        r = o.record
        at = cancel or r
        err = relative_errors(ctx)
        ev = base_evidence(at)
        ref = ctx.ref(r)
        ev.update({"nan_op": ctx.describe(r), "n_nan": int(r.stats["n_nan"]),
                   "ref_absmax": ref.stats["absmax"] if ref is not None else None})
        txt = ""
        if cancel is not None:
            cref = ctx.ref(cancel)
            ins = [ctx.records[i] for i in cancel.inputs if i >= 0]
            in_max = max((x.stats.get("absmax", 0.0) for x in ins), default=0.0)
            ev.update({"relative_error": err.get(cancel.index), "operand_absmax": in_max,
                       "result_absmax": cancel.stats["absmax"],
                       "ref_result_absmax": cref.stats["absmax"] if cref is not None else None,
                       "unit_roundoff": unit_roundoff(cancel.dtype)})
            if cref is not None and cref.stats["absmax"] > 0 and in_max > 0:
                ev["digits_cancelled"] = math.log2(in_max / cref.stats["absmax"])
            txt = (f"{where(cancel)} subtracts operands of |max| {fmt(in_max)} whose true difference is only "
                   f"|max| {fmt(ev['ref_result_absmax'] or 0.0)}: in {dtype_name(cancel.dtype)} (u = "
                   f"{fmt(unit_roundoff(cancel.dtype))}) the rounding error of the operands "
                   f"({fmt(in_max * 2 * unit_roundoff(cancel.dtype))}) "
                   f"exceeds the result, which comes out wrong by {fmt(err.get(cancel.index, 0.0))}x its size and "
                   "can change sign. ")
        expl = (f"{txt}{where(r)} then returns {int(r.stats['n_nan'])} NaN from finite inputs while the fp32 "
                f"reference is finite (|max| {fmt(ev['ref_absmax'] or 0.0)}): a value that must be positive "
                "(a variance) became negative or zero. The NaN " + (o.reasons[0] if o.reasons else "spreads") + ".")
        fixes = [
            FixProposal("compute the statistic in a cancellation-free form and in float32",
                        "var = x.float().var(-1, unbiased=False, keepdim=True)  # two-pass, not E[x^2]-E[x]^2"),
        ]
        if at.module:
            fixes.append(keep_fp32_fix(at.module))
        out.append(Candidate(Finding(
            "precision-loss", "error", at.module, at.op, at.phase,  # type: ignore[arg-type]
            f"catastrophic cancellation in {at.module or '<root>'} turns into NaN", expl, ev, tuple(fixes), at.step),
            at.index))
    flagged = precision_loss_records(ctx)
    # one finding per (module, op, phase), the largest own error; at most 5, the largest
    best: dict[tuple[str, str, str], tuple[OpRecord, float, float, float, int, float]] = {}
    for item in flagged:
        r, e, inh = item[0], item[1], item[2]
        key = (r.module, r.op, r.phase)
        if key not in best or e - inh > best[key][1] - best[key][2]:
            best[key] = item
    top = sorted(best.values(), key=lambda x: -(x[1] - x[2]))[:5]
    deviation = output_deviation(ctx)
    if deviation is None or deviation <= 0.01 or ctx.harmful_origins():
        top = [x for x in top if x[1] - x[2] >= WARN_REL]  # small own errors the result does not show: not reported
    for r, e, inh, tol, k, u in sorted(top, key=lambda x: x[0].index):
        ref = ctx.ref(r)
        assert ref is not None
        own = e - inh
        severity = "warning" if own >= WARN_REL else "info"
        dt = dtype_name(r.dtype)
        ev = base_evidence(r)
        ev.update({"relative_error": e, "inherited_error": inh, "own_error": own, "tolerance": tol,
                   "reduction_length": k, "unit_roundoff": u, "norm": r.stats["norm"], "ref_norm": ref.stats["norm"],
                   "absmax": r.stats["absmax"], "ref_absmax": ref.stats["absmax"]})
        ins = [ctx.records[i] for i in r.inputs if i >= 0]
        in_max = max((x.stats.get("absmax", 0.0) for x in ins), default=0.0)
        sub_in = sum(int(x.stats.get("n_subnormal", 0)) for x in ins)
        if sub_in:
            ev["subnormal_inputs"] = sub_in
        cancelling = op_base(r.op) in CANCEL_OPS and in_max > 0 and ref.stats["absmax"] > 0 and (
            in_max / ref.stats["absmax"] > 1 / (16 * u))
        if cancelling:
            ev["operand_absmax"] = in_max
            ev["digits_cancelled"] = math.log2(in_max / ref.stats["absmax"])
        expl = (f"{where(r)} deviates from the fp32 reference by {own:.2%} beyond the {inh:.2%} its inputs carried "
                f"(norm {fmt(r.stats['norm'])} vs {fmt(ref.stats['norm'])}, |max| {fmt(r.stats['absmax'])} vs "
                f"{fmt(ref.stats['absmax'])}); rounding to {dt} explains about sqrt(K) * u = "
                f"{math.sqrt(k) * u:.2g} (K = {k}, u = {fmt(u)}; flagged above {tol:.2g}).")
        if cancelling:
            expl += (f" Catastrophic cancellation: operands of |max| {fmt(in_max)} give a result of |max| "
                     f"{fmt(ref.stats['absmax'])}, so ~{ev['digits_cancelled']:.0f} of the leading bits cancel and "
                     f"{dt}'s rounding of the operands dominates the result.")
        if sub_in:
            expl += (f" Its inputs hold {sub_in} subnormal value(s) (below {fmt(limits(r.dtype)[1])}, where {dt} keeps "
                     "fewer significant bits)" + ("; loss scaling lifts backward values out of that range."
                                                  if r.phase == "backward" else "."))
        fixes = [keep_fp32_fix(r.module)] if r.module else []
        if sub_in and r.phase == "backward":
            fixes.insert(0, FixProposal(
                "use dynamic loss scaling so the gradients stay in the normal range",
                "scaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()", id="grad_scaler", params={}))
        if cancelling:
            fixes.append(FixProposal("remove the large common offset before the low-precision part (center or "
                                     "normalize the inputs in float32)", "x = (x.float() - x.float().mean(-1, "
                                     "keepdim=True)).to(x.dtype)"))
        if dt == "bfloat16":
            fixes.append(FixProposal("use float16 with loss scaling for this part: 3 more mantissa bits "
                                     "(u = 2**-11 instead of 2**-8)", id="switch_precision",
                                     params={"precision": "fp16-amp"}))
        out.append(Candidate(Finding(
            "precision-loss", severity, r.module, r.op, r.phase,  # type: ignore[arg-type]
            f"{op_base(r.op)} loses {own:.1%} accuracy in {dt} in {r.module or '<root>'}", expl, ev, tuple(fixes),
            r.step), r.index))
    return out


__all__ = [
    "ALIAS_OPS", "BOUNDED", "CASTS", "alias_closure", "ancestors", "cancellation_nan_origins", "dead_gradients",
    "descendants", "flush_of", "is_low", "precision_loss_records", "reduction_length", "relative_errors",
    "saturated_records", "saturation_threshold", "spacing_below_one", "tolerance", "trig_buffer_sources",
    "underflow_origins", "unit_roundoff",
]
