"""Whole-trace analyses the rules share, each computed once per diagnosis (``Context`` caches them).

:class:`~ampdoctor.findings._context.Context` exposes each as a cached property (``ctx.relative_errors``,
``ctx.underflow_origins``, ...); the functions here compute them and read each other only through those
properties, so every analysis runs at most once however many rules read it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ampdoctor.findings._common import (
    ALIAS_OPS,
    BOUNDS,
    CANCEL_OPS,
    CASTS,
    LOW,
    all_zero,
    counts_known,
    dtype_name,
    feeders,
    finite,
    is_low,
    limits,
    op_base,
    rel,
    unit_roundoff,
)
from ampdoctor.findings._graph import alias_closure
from ampdoctor.trace import Kind, OpRecord, Reduces, op_info, ops_with

if TYPE_CHECKING:
    from ampdoctor.findings._context import Context

PERIODIC_OPS = ops_with(Kind.PERIODIC)
#: a tolerance never exceeds this relative error, whatever the reduction length
TOL_CAP = 0.1
#: tolerance factor on sqrt(K) * u
TOL_FACTOR = 16.0
#: how many cast / view records without a reference of their own are walked up to find an input's sampled errors
TAIL_HOPS = 4


def saturated_records(ctx: Context) -> list[tuple[OpRecord, OpRecord, float, float]]:
    """Bounded-op outputs at their bound in the target much more often than in the reference:
    ``(record, reference, target fraction, reference fraction)``."""
    out = []
    for r in ctx.records:
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) not in BOUNDS or not is_low(r.dtype):
            continue
        s = r.stats
        n = s.get("numel", 0)
        if not n or not finite(r):
            continue
        ref = ctx.ref(r)
        if ref is None:
            continue
        nt, nr = s.get("n_at_limit", 0.0), ref.stats.get("n_at_limit", 0.0)
        excess = nt - nr
        if excess >= 1 and excess >= 0.01 * n and nt > 2 * nr:
            out.append((r, ref, nt / n, nr / n))
    return out


def flush_of(ctx: Context, r: OpRecord) -> tuple[float, float, dict[str, float]] | None:
    """``(excess zeros, elements nonzero in the comparison, comparison stats)`` for record ``r``.

    The comparison is the aligned reference record; for a cast (``_to_copy``) without one, it is the cast's own
    input (a cast that flushes values changes nothing else)."""
    s = r.stats
    if not s or "n_zero" not in s or not finite(r):
        return None
    ref = ctx.ref(r)
    cmp: dict[str, float] | None = None
    if op_base(r.op) in CASTS and r.inputs and r.inputs[0] >= 0:
        src = ctx.records[r.inputs[0]]
        if src.stats and src.stats.get("numel") == s.get("numel") and finite(src):
            cmp = src.stats
    if cmp is None and ref is not None and finite(ref):
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


def flushed_records(ctx: Context) -> dict[int, bool]:
    """Per record: it holds exact zeros for more than half of the values nonzero in its comparison (reference, or
    a cast's input); a record without a comparison counts when it is all zeros computed from flushed inputs.
    Computed for the whole trace, in record order (inputs always precede their users)."""
    flushed: dict[int, bool] = {}
    for r in ctx.records:
        f = flush_of(ctx, r)
        if f is None:
            ins = [j for j in r.inputs if j >= 0]
            flushed[r.index] = bool(r.stats) and all_zero(r.stats) and bool(ins) and all(
                flushed.get(j, False) for j in ins)
        else:
            excess, nonzero, _ = f
            flushed[r.index] = nonzero > 0 and excess > 0.5 * nonzero
    return flushed


def saturated_sources(ctx: Context) -> set[int]:
    """The saturated bounded-op outputs and their pure aliases (their zero derivatives are not underflow)."""
    return alias_closure(ctx, [r.index for r, *_ in ctx.saturated])


def underflow_origins(ctx: Context) -> list[tuple[OpRecord, float, float, dict[str, float]]]:
    """Records where more than half of the values nonzero in the reference become exactly 0, whose inputs were not
    already flushed, whose zeros are not an exact-zero derivative of a saturated activation, and whose reference
    values are small enough to be lost (the reference's |max| is below ``floor / u``: the flushed values matter
    relative to the tensor's own scale). ``(record, flushed fraction, nonzero, comparison stats)``."""
    out = []
    sat = ctx.saturated_sources
    flushed = ctx.flushed
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
        if any(i >= 0 and (flushed.get(i, False) or i in sat) for i in r.inputs):
            continue  # inherited zeros, or the exact-zero derivative of a saturated activation
        out.append((r, excess / nonzero, nonzero, cmp))
    return out



def reduction_length(ctx: Context, r: OpRecord) -> int:
    """K, the number of terms each output element sums (1 for element-wise ops)."""
    base = op_base(r.op)
    reduces = op_info(base).reduces
    recs = ctx.records
    ins = [recs[i] for i in r.inputs if i >= 0]
    try:
        if reduces is Reduces.INNER_0 and ins:
            return max(1, int(ins[0].shape[-1]))
        if reduces is Reduces.INNER_1 and len(ins) >= 2:
            return max(1, int(ins[1].shape[-1]))
        if reduces is Reduces.KERNEL and len(ins) >= 2:
            return max(1, math.prod(ins[1].shape[1:]))
        if reduces is Reduces.KERNEL_GRAD and len(ins) >= 3 and len(ins[1].shape) > 1 and ins[1].shape[1]:
            return max(1, math.prod(ins[2].shape) // int(ins[1].shape[1]))
        if "scaled_dot_product" in base and len(ins) >= 2:  # every SDPA kernel, forward and backward: d + L terms
            return max(1, int(ins[0].shape[-1]) + int(ins[1].shape[-2]))
        if reduces is Reduces.ROW and r.shape:
            return max(1, int(r.shape[-1]))
        if reduces is Reduces.RATIO and ins:
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




def relative_errors(ctx: Context) -> dict[int, float]:
    """Observed relative error of every finite target record vs its reference: ``max`` of the norm's and the
    |max|'s relative errors (both lower bounds of the element-wise error). Records without a reference (casts
    inserted by autocast) carry their input's error plus the change they make."""
    recs = ctx.records
    err: dict[int, float] = {}
    harmful = {o.record.index for o in ctx.harmful_origins()}
    carried = ctx.lineage.carried
    for r in recs:
        if not finite(r):
            # a harmful inf/NaN taints what it touches; a benign one (T5's log(0) discarded by where) does not
            err[r.index] = math.inf if carried.get(r.index, frozenset()) & harmful or r.index in harmful else 0.0
            continue
        if any(i >= 0 and err.get(i, 0.0) == math.inf for i in r.inputs):
            err[r.index] = math.inf  # computed from a harmful inf/NaN (rsqrt(inf) = 0): the overflow explains it
            continue
        ref = ctx.ref(r)
        if ref is not None and finite(ref):
            e = rel(r.stats["absmax"], ref.stats["absmax"])
            if counts_known(r.stats) and counts_known(ref.stats):
                e = max(e, rel(r.stats["norm"], ref.stats["norm"]))
            err[r.index] = e
            continue
        ins = [i for i in r.inputs if i >= 0]
        if not ins:
            err[r.index] = 0.0
            continue
        base = max(err.get(i, 0.0) for i in ins)
        src = recs[ins[0]].stats
        if len(ins) == 1 and src.get("numel") == r.stats.get("numel") and counts_known(src) and counts_known(r.stats):
            base += rel(r.stats["norm"], src.get("norm", 0.0))
        err[r.index] = base
    return err


def _noise_level_reference(ctx: Context, r: OpRecord, ref: OpRecord, k: int) -> bool:
    """The reference result of a sum/difference/matmul is itself at fp32's rounding level of its operands (a
    gradient that is zero in exact arithmetic, like a key bias's under softmax): there is no value to compare."""
    base = op_base(r.op)
    ins = [ctx.records[i] for i in r.inputs if i >= 0]
    if not ins:
        return False
    reduces = op_info(base).reduces
    if reduces is Reduces.INNER_0 and len(ins) >= 2:
        scale = ins[0].stats.get("absmax", 0.0) * ins[1].stats.get("absmax", 0.0)
    elif reduces is Reduces.INNER_1 and len(ins) >= 3:
        scale = max(ins[0].stats.get("absmax", 0.0), ins[1].stats.get("absmax", 0.0) * ins[2].stats.get("absmax", 0.0))
    elif base in CANCEL_OPS:
        scale = max(x.stats.get("absmax", 0.0) for x in ins)
    else:
        return False
    return ref.stats["absmax"] <= 64 * math.sqrt(k) * 2.0 ** -24 * scale


def trig_buffer_sources(ctx: Context) -> list[tuple[OpRecord, OpRecord]]:
    """``(sin/cos record, low-precision leaf)`` pairs: a floating leaf that is not a parameter or the batch (a
    buffer such as RoPE's ``inv_freq``), held in fp16/bf16, feeding a forward ``sin``/``cos`` within 10 steps."""
    recs = ctx.records
    out: list[tuple[OpRecord, OpRecord]] = []
    for r in recs:
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) not in PERIODIC_OPS or r.step != 0:
            continue
        out.extend((r, x) for x in feeders(recs, r, 10)
                   if x.kind == "input" and is_low(x.dtype) and x.stats.get("numel", 0) > 1)
    return out


def precision_loss_records(ctx: Context) -> list[tuple[OpRecord, float, float, float, int, float]]:
    """Records whose own error (observed relative error minus the largest relative error of their inputs) exceeds
    the tolerance: ``(record, error, inherited, tolerance, K, u)``, in trace order."""
    err = ctx.relative_errors
    out = []
    # computed from a flagged record, an underflow origin or a saturated activation: its error is inherited
    tainted: set[int] = set(ctx.saturated_sources) | {r.index for r, *_ in ctx.underflow_origins} | {
        t.index for t, _ in ctx.trig_buffer_sources}  # rotary angles from a low-precision buffer: must-stay-fp32
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
        if ref is None or not finite(r) or not finite(ref) or ref.stats["norm"] == 0:
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
        own = own_error(ctx, r, ref, inherited)
        inherited = e - own  # what the inputs explain (reported as the inherited error)
        if own > tol:
            out.append((r, e, inherited, tol, k, u))
            tainted.add(r.index)
    return out


def inherited_samples(ctx: Context, r: OpRecord) -> tuple[float, float]:
    """``(worst, rms)`` over r's inputs (through casts and views without a reference of their own, which carry
    their input's elements): the largest sampled element error, and the largest relative error of the sampled
    difference ``|t - r| / |r|`` (2-norms) -- what the inputs' elements really carried; the inputs' norms can
    agree with fp32 while their elements do not (errors of both signs)."""
    errs = ctx.element_errors
    worst = rms = 0.0
    for i in r.inputs:
        for _ in range(TAIL_HOPS):
            if i < 0 or i in errs:
                break
            ups = [j for j in ctx.records[i].inputs if j >= 0]
            i = ups[0] if len(ups) == 1 else -1
        if i >= 0 and i in errs:
            worst, rms = max(worst, errs[i]["p99"]), max(rms, errs[i].get("rms", 0.0))
    return worst, rms


#: which two inputs a reduction multiplies, by how the registry says it reduces
_FACTORS = {Reduces.INNER_0: (0, 1), Reduces.INNER_1: (1, 2), Reduces.KERNEL: (0, 1), Reduces.KERNEL_GRAD: (0, 2)}


def _rms(r: OpRecord) -> float:
    n = r.stats.get("numel", 0)
    return r.stats.get("norm", 0.0) / math.sqrt(n) if n else 0.0


def cancellation_gain(ctx: Context, r: OpRecord, k: int) -> float:  # r: the reference record
    """How much a K-term sum of products amplifies its inputs' relative errors: ``sqrt(K) * rms(a) * rms(b) /
    rms(result)`` (from the statistics). Independent errors add in quadrature like the terms, so a sum of terms
    of random sign keeps its inputs' relative error (gain ~1); a sum whose terms cancel (a classifier over pooled
    features of a random-init net, a gradient that sums to nearly 0 over a 2-sample batch) returns a result far
    below its terms, and the same absolute errors are a much larger fraction of it. 1 for other ops."""
    reduces = op_info(op_base(r.op)).reduces
    pair = _FACTORS.get(reduces) if reduces is not None else None
    if pair is None or max(pair) >= len(r.inputs) or min(r.inputs[i] for i in pair) < 0:
        return 1.0
    a, b = (ctx.ref(x) or x for x in (ctx.records[r.inputs[i]] for i in pair))
    out = _rms(r)
    if not counts_known(a.stats) or not counts_known(b.stats) or not counts_known(r.stats):
        return 1.0
    if out == 0:
        return math.inf
    return max(1.0, math.sqrt(k) * _rms(a) * _rms(b) / out)


def own_error(ctx: Context, r: OpRecord, ref: OpRecord, inherited: float) -> float:
    """What r adds to its inputs' error. What the inputs carried is their own (norm / |max|) error or, larger,
    the relative 2-norm of their sampled difference from fp32 (:func:`inherited_samples`), times the reduction's
    :func:`cancellation_gain`. The norm's relative error is an aggregate, compared with that; the |max|'s is one
    element's, compared with the inputs' worst sampled element error too -- a sum of K products moves an output
    element by about the relative error of its terms (more where they cancel), so a bf16 gradient whose inputs are
    off by 100% in a few elements has a |max| 20% off without any rounding of its own (resnet's
    convolution_backward in the zoo: 0.17% median own error when recomputed exactly from its own bf16 inputs)."""
    e_max = rel(r.stats["absmax"], ref.stats["absmax"])
    e_norm = rel(r.stats["norm"], ref.stats["norm"]) if counts_known(r.stats) and counts_known(ref.stats) else 0.0
    worst, rms = inherited_samples(ctx, r)
    inherited = max(inherited, rms) * cancellation_gain(ctx, ref, reduction_length(ctx, r))
    return max(added_error(e_norm, inherited), added_error(e_max, max(inherited, worst)))


def added_error(error: float, inherited: float) -> float:
    """The relative error an op adds to the error ``inherited`` it received: ``(1 + error) / (1 + inherited) - 1``,
    about ``error - inherited`` for small errors. A gradient GradScaler multiplied by S carries error S - 1 against
    the scale-1 reference: the difference of two such errors is S times the rounding noise, their ratio the noise
    (healthy fp16-amp runs with a scaler were flagged for 65536 x fp16 rounding)."""
    return (1.0 + error) / (1.0 + inherited) - 1.0


def output_deviation(ctx: Context) -> float | None:
    """Relative deviation of the first step's loss (or, without a loss, of its model outputs) from the reference."""
    t, ref = ctx.target, ctx.reference
    if ref is None:
        return None
    if t.losses and ref.losses and t.losses[0] is not None and ref.losses[0] is not None:
        d = rel(t.losses[0], ref.losses[0])
        return d if math.isfinite(d) else None  # a non-finite loss is explained by the inf/NaN rules
    err = ctx.relative_errors
    vals = [err.get(i, 0.0) for i in t.output_records if ctx.records[i].step == 0]
    return max(vals) if vals else None


def cancellation_nan_origins(ctx: Context) -> list[tuple[Any, OpRecord | None]]:
    """Harmful NaN origins (NaN from finite inputs, no inf) that are finite in the reference and not explained by
    flushed inputs (0/0 is underflow): ``(origin, the cancelling op upstream or None)``."""
    out: list[tuple[Any, OpRecord | None]] = []
    recs = ctx.records
    err = ctx.relative_errors
    flushed = ctx.flushed
    for o in ctx.harmful_origins():
        r = o.record
        s = r.stats
        if r.kind != "op" or s.get("n_nan", 0) == 0 or s.get("n_posinf", 0) + s.get("n_neginf", 0) > 0:
            continue
        ref = ctx.ref(r)
        if ref is None or not finite(ref) or o.deliberate:
            continue
        if any(i >= 0 and flushed.get(i, False) for i in r.inputs):
            continue
        # walk up to 6 records back for the op with the largest relative error that cancels (sub/add/...)
        best: OpRecord | None = None
        for x in feeders(recs, r, 6):
            if op_base(x.op) in CANCEL_OPS and err.get(x.index, 0.0) > 0.5 and (
                    best is None or err.get(x.index, 0.0) > err.get(best.index, 0.0)):
                best = x
        out.append((o, best))
    return out


def scales_of(ctx: Context) -> list[float]:
    """Loss-scale trajectory: from the run's own scaler, or read from GradScaler's update op in the trace."""
    traced = [r.stats["absmax"] for r in ctx.records if op_base(r.op) == "_amp_update_scale_" and r.stats]
    return traced or list(ctx.target.scales)


def skipped_steps(ctx: Context) -> int:
    """Steps GradScaler skipped: each fall of the scale after a step, step 0 included (measured against the
    scaler's scale before the run; the trajectory holds the scale after each step)."""
    scales = scales_of(ctx)
    sc = getattr(ctx.spec, "scaler", None)
    before = [float(sc.get_scale())] if scales and sc is not None and sc.is_enabled() else []
    seq = before + scales
    return sum(1 for a, b in zip(seq, seq[1:]) if b < a)
