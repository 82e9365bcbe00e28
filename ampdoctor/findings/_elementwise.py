"""Precision loss measured element by element, and decisions the low precision changed.

Read by the ``precision-loss`` rule. Two measurements, both from what the trace keeps per step-0 output
(``trace._sample``): the values at 64 fixed positions, the same in the target and the reference run, and the
integer outputs of decision ops (argmax, topk, sort, ``max.dim``).

- **Element-wise error.** Per record, ``|t - r| / max(|r|, floor)`` over the sampled positions, with ``floor``
  1/16 of the reference sample's RMS (an element far below the tensor's typical size is judged against that
  size, not its own): the median (p50), p99 and max, and the sign flips (elements whose sign differs where
  ``|r| > floor``). A record's *own* error is its p50 minus the largest p50 of its inputs. A periodic function
  of a large argument (``sin(position * freq)``) or an exponential turns the argument's small *relative* error
  into a large absolute one: the norm and |max| of the result hardly change, the elements do.
- **Decisions.** The target's indices are compared with the reference's row by row (argmax/``max.dim``:
  each output element is a row; topk: the set of chosen indices per row; sort: the order per row), and the tie
  counts (rows whose chosen value equals the next candidate's) tell whether rounding created ties.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ampdoctor.findings._analysis import TOL_FACTOR, reduction_length
from ampdoctor.findings._common import ALIAS_OPS, CASTS, LOW, dtype_name, feeders, is_low, op_base, unit_roundoff
from ampdoctor.trace import Kind, OpRecord, ops_with

if TYPE_CHECKING:
    from ampdoctor.findings._context import Context

#: a record whose own median element error exceeds this is flagged (the typical element is wrong by 25%)
ELEMENT_WARN = 0.25
#: the relative-error floor is this fraction of the reference sample's RMS
FLOOR = 1.0 / 16
#: an amplifier's (sin/cos/exp) median element error is a warning above ``max(TOL_FACTOR * u, AMPLIFIED_FLOOR)``
#: (u of the low precision its argument was computed in; capped at ELEMENT_WARN): bf16 6.25%, fp16 5% --
#: rounding the result itself costs u, the rest is the argument's rounding turned into phase (sin) or scale (exp)
AMPLIFIED_FLOOR = 0.05
AMPLIFIERS = ops_with(Kind.PERIODIC) | ops_with(Kind.EXPONENTIAL)
PICKS_K, ORDERS, THRESHOLDS = ops_with(Kind.PICKS_K), ops_with(Kind.ORDERS), ops_with(Kind.THRESHOLDS)
GATHERS, MASKS = ops_with(Kind.GATHERS), ops_with(Kind.MASKS)
#: ops whose relative condition number is their input's magnitude (softmax, exp)
CONDITION_BY_INPUT = (ops_with(Kind.SOFTMAX) & ops_with(Kind.BOUNDED)) | ops_with(Kind.EXPONENTIAL)


def sample_error(t: OpRecord, ref: OpRecord) -> dict[str, float] | None:
    """``{p50, p99, max, rms, sign_flips, n}`` of the element-wise relative error of ``t`` against ``ref`` (``rms``:
    the sampled difference's 2-norm over the reference sample's)."""
    if not t.sample or len(t.sample) != len(ref.sample) or t.shape != ref.shape:
        return None
    pairs = [(a, b) for a, b in zip(t.sample, ref.sample) if math.isfinite(a) and math.isfinite(b)]
    if not pairs:
        return None
    rms = math.sqrt(sum(b * b for _, b in pairs) / len(pairs))
    if rms == 0:
        return None
    floor = FLOOR * rms
    errs = sorted(abs(a - b) / max(abs(b), floor) for a, b in pairs)
    n = len(errs)
    flips = sum(1 for a, b in pairs if abs(b) > floor and (a > 0) != (b > 0))
    diff = math.sqrt(sum((a - b) ** 2 for a, b in pairs) / len(pairs))
    return {"p50": errs[(n - 1) // 2], "p99": errs[min(n - 1, math.ceil(0.99 * n) - 1)], "max": errs[-1],
            "rms": diff / rms, "sign_flips": flips, "n": n}


def element_errors(ctx: Context) -> dict[int, dict[str, float]]:
    """Per step-0 record with a sampled reference: its element-wise error (:func:`sample_error`)."""
    out: dict[int, dict[str, float]] = {}
    for r in ctx.records:
        if r.step != 0:
            break
        ref = ctx.ref(r)
        if ref is None:
            continue
        e = sample_error(r, ref)
        if e is not None:
            out[r.index] = e
    return out


def own_element_error(ctx: Context, r: OpRecord) -> tuple[float, float] | None:
    """``(p50 of r, largest p50 of its inputs)``: what r adds is the difference."""
    errs = ctx.element_errors
    e = errs.get(r.index)
    if e is None:
        return None
    ins = [i for i in r.inputs if i >= 0]
    return e["p50"], max((errs[i]["p50"] for i in ins if i in errs), default=0.0)


#: a cancelling op whose typical (median) sampled element is off by this much of its own is rounding noise there
ELEMENT_NOISE = 0.5


def typical_cancellation(ctx: Context, r: OpRecord, operand_absmax: float,
                         deviation: float) -> tuple[dict[str, float], str] | None:
    """A difference whose norm hides its cancellation (a few large elements dominate the norm and |max|; the
    typical element cancels completely): evidence ``typical_result`` (the median |element| of r's fp32 sample),
    ``element_own_error`` (r's own median element error) and the text, when the operands' rounding
    ``operand_absmax * u`` reaches that typical true element and the typical element is off by
    :data:`ELEMENT_NOISE` or more of r's own; None otherwise."""
    ref, own = ctx.ref(r), own_element_error(ctx, r)
    if ref is None or own is None or not ref.sample:
        return None
    vals = sorted(abs(v) for v in ref.sample if math.isfinite(v))
    if not vals:
        return None
    typical, u, mine = vals[(len(vals) - 1) // 2], unit_roundoff(r.dtype), own[0] - own[1]
    if mine < ELEMENT_NOISE or operand_absmax * u < typical or typical <= 0:
        return None
    ev = {"operand_absmax": operand_absmax, "digits_cancelled": math.log2(operand_absmax / typical),
          "typical_result": typical, "element_own_error": mine, "output_deviation": deviation}
    what = "loss" if ctx.target.losses and ctx.target.losses[0] is not None else "output"
    txt = (f" Catastrophic cancellation, element by element: operands of |max| {operand_absmax:.3g} give a typical "
           f"(median sampled) result of only {typical:.3g}; the operands' rounding ({operand_absmax * u:.3g}) is as "
           f"large as that, so the typical element is rounding noise (off by {mine:.0%} of its own) while a few "
           f"larger elements keep the norm close. The step's {what} deviates from fp32 by {deviation:.1%}.")
    return ev, txt


def element_loss_records(ctx: Context, skip: set[int]) -> list[tuple[OpRecord, float, float]]:
    """Forward records of step 0 touching a low precision whose own median element error exceeds
    :data:`ELEMENT_WARN`: ``(record, p50, inherited p50)``. Records computed from one in ``skip`` (already
    explained) or from a flagged one are not flagged again."""
    tainted = set(skip)
    decided = bool(ctx.decision_changes)  # values picked by a changed decision (a gather) are explained by it
    out: list[tuple[OpRecord, float, float]] = []
    for r in ctx.records:
        if r.step != 0:
            break
        if r.index in tainted or any(i in tainted for i in r.inputs) or decided and r.index_src:
            tainted.add(r.index)
            continue
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) in CASTS | ALIAS_OPS or r.out_pos > 0:
            continue
        if not is_low(r.dtype) and not any(dtype_name(d) in LOW for d in r.input_dtypes):
            continue
        if not [i for i in r.inputs if i >= 0]:
            continue  # made from scratch (arange, full): nothing it could have lost
        if reduction_length(ctx, r) > 1:
            continue  # each output element mixes all K terms' errors: its median is no per-element comparison
        own = own_element_error(ctx, r)
        if own is None:
            continue
        e, inh = own
        if e - inh > ELEMENT_WARN:
            out.append((r, e, inh))
            tainted.add(r.index)
    return out


def _key(d: Any, counts: dict[tuple[Any, ...], int]) -> tuple[Any, ...]:
    base = (d.phase, d.module, d.op, d.out_pos)
    k = counts.get(base, 0)
    counts[base] = k + 1
    return (*base, k)


def _rows(d: Any) -> list[tuple[int, ...]]:
    """The decisions of ``d`` as rows: one index per element (argmax), a set (topk), an order (sort)."""
    idx = d.indices
    base = op_base(d.op)
    width = d.shape[-1] if base in PICKS_K | ORDERS | THRESHOLDS and d.shape else 1
    rows = [tuple(idx[i:i + width]) for i in range(0, len(idx), width)]
    return [tuple(sorted(r)) for r in rows] if base in PICKS_K else rows


def decision_changes(ctx: Context) -> list[dict[str, Any]]:
    """Decision ops whose choice differs from the reference in at least one row, in trace order."""
    if ctx.reference is None:
        return []
    counts: dict[tuple[Any, ...], int] = {}
    ref = {_key(d, counts): d for d in ctx.reference.trace.decisions}
    counts = {}
    out = []
    for d in ctx.target.trace.decisions:
        rd = ref.get(_key(d, counts))
        if rd is None or d.indices is None or rd.indices is None or d.shape != rd.shape:
            continue
        a, b = _rows(d), _rows(rd)
        changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if not changed:
            continue
        out.append({"decision": d, "changed_rows": changed, "rows": len(a),
                    "examples": [{"row": i, "target": list(a[i]), "reference": list(b[i])} for i in changed[:5]],
                    "ties_target": d.ties, "ties_reference": rd.ties})
    return out


def _decision_sites(ctx: Context, d: Any) -> list[OpRecord]:
    """The decision input and its op feeders (4 hops) computed in a low precision, the decision's own module's first
    and of them those with a low-precision output (see :func:`decision_source`); ``[]`` when none is low."""
    if not 0 <= d.input_index < len(ctx.records):
        return []
    ops = _low_ops(ctx, ctx.records[d.input_index], 4)
    local = [x for x in ops if _inside(x.module, d.module)] or ops
    return [x for x in local if is_low(x.dtype)] or local


def decision_source(ctx: Context, d: Any) -> OpRecord | None:
    """The op a changed decision is blamed on: among the decision input and its op feeders (4 hops, through
    views and casts) computed in a low precision -- those inside the decision's own module when there are any (the
    scores it compares are computed there; an input rounded upstream is not what decides) and of them the ones
    whose *output* is low precision (where a value is rounded) when there are any -- the one with the largest own
    element error, else the nearest of them; the input itself when none is low precision. A softmax / exp right
    before the decision is weighed against its input by condition numbers: blamed itself when its inputs are below
    1 in magnitude, its producer when the input's rounding carried through dominates (:func:`input_rounding`)."""
    if not 0 <= d.input_index < len(ctx.records):
        return None
    sites = _decision_sites(ctx, d)
    if not sites:
        return ctx.records[d.input_index]
    if _rounds_coarser_than_its_input(ctx, sites[0]):
        return sites[0]
    if input_rounding(ctx, d) is not None:
        return sites[1]  # the nearest feeder whose low-precision output holds the rounded logits
    return _largest_own(ctx, sites, sites[0])


#: the input's rounding carried through must exceed the softmax's own by this factor to move the blame upstream
CONDITION_MARGIN = 4.0


def input_rounding(ctx: Context, d: Any) -> dict[str, Any] | None:
    """For a decision right after a low-precision softmax / exp whose low-precision input's own rounding, carried
    through, exceeds the op's own: ``{"softmax", "producer", "input_absmax", "input_spread", "carried", "own"}``.
    An input rounded at ``|l| u_in`` moves each probability by that much relatively (``d p / p = d l``); the
    softmax's own rounding is ``u`` times its relative condition on the shifted inputs, at most the input's spread
    ``max l - min l`` (``|l - max l|`` in a row) or 1. Logits on a large common offset (|l| ~60, bf16 spacing 0.25,
    differences ~0.05) are decided by the op that rounded them, not by the softmax."""
    sites = _decision_sites(ctx, d)
    if len(sites) < 2:
        return None
    x = sites[0]
    if op_base(x.op) not in CONDITION_BY_INPUT or not is_low(x.dtype) or not x.inputs:
        return None
    i = x.inputs[0]
    if not 0 <= i < len(ctx.records):
        return None
    src = ctx.records[i]
    amax, spread = src.stats.get("absmax", math.nan), _spread(src.stats)
    if not is_low(src.dtype) or not (math.isfinite(amax) and math.isfinite(spread)):
        return None
    carried = amax * unit_roundoff(dtype_name(src.dtype))
    own = max(spread, 1.0) * unit_roundoff(dtype_name(x.dtype))
    if carried <= CONDITION_MARGIN * own:
        return None
    return {"softmax": x.op, "producer": sites[1].op, "input_absmax": amax, "input_spread": spread,
            "carried": carried, "own": own}


def _spread(s: dict[str, float]) -> float:
    """``max - min`` of a record's values: from the cheap tier's range, else bounded by the magnitudes (``|x|`` in
    ``[min_nonzero, absmax]`` with no zeros: values of one sign differ by at most ``absmax - min_nonzero``; a
    common offset is what makes that small)."""
    if "min" in s and "max" in s:
        return s["max"] - s["min"]
    if s.get("n_zero", 1.0) > 0 or "min_nonzero" not in s:
        return s.get("absmax", math.nan)
    return s.get("absmax", math.nan) - s["min_nonzero"]


def _rounds_coarser_than_its_input(ctx: Context, x: OpRecord) -> bool:
    """A low-precision softmax or exp of inputs below 1 in magnitude: its relative condition number is ``|input|``
    (``d p / p = d l``), so the input's rounding (``|l| * u``) moves the result by less than rounding the result
    itself (``u``) -- probabilities of a near-uniform router rounded to bf16 tie where their logits did not."""
    if op_base(x.op) not in CONDITION_BY_INPUT or not is_low(x.dtype) or not x.inputs:
        return False
    i = x.inputs[0]
    return 0 <= i < len(ctx.records) and ctx.records[i].stats.get("absmax", math.inf) < 1.0


def _inside(module: str, parent: str) -> bool:
    return not parent or module == parent or module.startswith(parent + ".")


def decision_steers(ctx: Context, d: Any) -> int:
    """How many later ops pick values by integers computed from the decision's scores (``x[idx]``, a gather, an
    embedding lookup: :data:`GATHERS`; for a threshold's mask also ``masked_fill`` / ``where``: :data:`MASKS`): a
    changed decision there routes values to different computation. An integer used otherwise (``0 * idx``, a
    metric) does not count."""
    use = GATHERS | MASKS if op_base(d.op) in THRESHOLDS else GATHERS
    return sum(1 for r in ctx.records if d.input_index in r.index_src and op_base(r.op) in use)


def _low_ops(ctx: Context, r: OpRecord, depth: int) -> list[OpRecord]:
    """``r`` and its op feeders (``depth`` hops, through views and casts) that compute in or from a low precision."""
    return [x for x in [r, *feeders(ctx.records, r, depth)] if x.kind == "op" and op_base(x.op) not in CASTS | ALIAS_OPS
            and (is_low(x.dtype) or any(dtype_name(d) in LOW for d in x.input_dtypes))]


def _low_u(x: OpRecord) -> float:
    return max(unit_roundoff(d) for d in [dtype_name(x.dtype), *map(dtype_name, x.input_dtypes)])


def _largest_own(ctx: Context, ops: list[OpRecord], default: OpRecord) -> OpRecord:
    def own(r: OpRecord) -> float:
        o = own_element_error(ctx, r)
        return -1.0 if o is None else o[0] - o[1]
    best = max(ops, key=own)
    return best if own(best) > 0 else default


def amplified_records(ctx: Context, skip: set[int]) -> list[tuple[OpRecord, OpRecord, float]]:
    """Step-0 forward amplifiers (sin, cos, exp) whose median element error exceeds the amplified threshold and
    whose argument was computed in a low precision: ``(amplifier, origin, threshold)``. The origin is, among the
    amplifier and its low-precision feeders (4 hops), the op with the largest own element error -- the
    amplifier itself when it runs in the low precision on a rounded argument (its own error is the amplified one),
    the op upstream that lost the argument's digits (a subtraction of a large offset) when it is in fp32
    (autocast runs exp in float32 on a bf16 argument). Origins in ``skip`` are explained already."""
    out: list[tuple[OpRecord, OpRecord, float]] = []
    for r in ctx.records:
        if r.step != 0:
            break
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) not in AMPLIFIERS or r.out_pos > 0:
            continue
        e = ctx.element_errors.get(r.index)
        ops = _low_ops(ctx, r, 4)
        if e is None or not ops:
            continue
        thr = min(max(TOL_FACTOR * max(_low_u(x) for x in ops), AMPLIFIED_FLOOR), ELEMENT_WARN)
        if e["p50"] <= thr:
            continue
        origin = _largest_own(ctx, ops, ops[0])
        if origin.index not in skip:
            out.append((r, origin, thr))
    return out
