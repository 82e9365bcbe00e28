"""Rounded arguments of functions that read their argument's *absolute* error: sin/cos and softmax.

``sin(t * f)`` turns an argument off by ``d`` into a phase off by ``d`` radians; ``softmax(l)`` (shift-invariant
along its rows) turns logits off by ``d`` into probabilities off by a factor ``e**d``. A rounding to fp16/bf16
makes a *relative* error of u, i.e. an absolute error of ``|x| * u``: harmless at small magnitudes, a different
value at large ones --

- a diffusion timestep in [0, 1000] cast to bf16 (998.39 -> 1000) embedded by ``sin(t * f)`` at f = 1: 1.6
  radians, that element encodes another timestep (the sin/cos may even run in float64);
- BLOOM's ALiBi bias ``slope * key`` cast to bf16 at key ~380 (190, spacing 1): neighbouring keys 0.5 apart get
  the same bias, the attention probabilities move by up to e**0.5.

Norms and medians hardly move (most frequencies are low, most keys far), so the norm-based and median-based
checks do not see it; the element samples of the argument (``trace._sample``) do. Integer values rounded together
(positions, ids) are reported by ``findings._integer_values`` first; this covers float values.

Decided by mechanism only, on step 0's forward: a ``sin``/``cos`` whose argument's sampled absolute error against
fp32 reaches :data:`PHASE_LOST` radians and whose result is off by more than :data:`VALUE_LOST` of its unit
amplitude in some element; a (log-)softmax whose argument's sampled absolute error reaches :data:`LOGIT_LOST`
(sentinel-sized logits -- masks -- left out: |logit| >= :data:`SENTINEL`; so is an origin that holds or reads
sentinel-sized values: a fully masked row's differences; the origin must hold or add an offset -- a cast, an
add, a GEMM with a bias -- not scale it: ``100 * cos`` scales the differences with the values) and whose result
is off by more than :data:`VALUE_LOST` in some element (probabilities relative to the element, log-probabilities
absolutely).
Reported as ``precision-loss`` (an error) at the rounding site upstream (within :data:`DEPTH` hops of the
argument: a cast to fp16/bf16, a low-precision op, a batch tensor ampdoctor cast, whose sampled output differs
from fp32): the one with the largest absolute error, the earliest of those within a factor 2 of it (a rounded
value passed on keeps its error: where it was first rounded is where to fix it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ampdoctor.findings._analysis import output_deviation
from ampdoctor.findings._common import (
    ALIAS_OPS,
    CASTS,
    base_evidence,
    dtype_name,
    feeders,
    fmt,
    is_low,
    keep_fp32_fix,
    op_base,
    unit_roundoff,
    where,
)
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, adds_an_offset, ops_with

PERIODIC = ops_with(Kind.PERIODIC)
SOFTMAX = ops_with(Kind.SOFTMAX)
#: a sin/cos argument off by this many radians in some sampled element encodes another value (about 29 degrees)
PHASE_LOST = 0.5
#: a softmax argument off by this much in some sampled element moves that probability by e**0.25 = 1.28x
LOGIT_LOST = 0.25
#: ... when the function's result is then off by more than this (sin/cos: of its unit amplitude; softmax: of the
#: element, relative; log_softmax: absolutely, a factor e**0.25 on the probability) in some sampled element
VALUE_LOST = 0.25
#: values at least this large are mask sentinels (-1e4, -1e9, finfo.min), not values: their rounding is moot, and
#: differences that a rounding at a sentinel's magnitude lost (a fully masked row) are no values either
SENTINEL = 4096.0
#: an argument's error beyond this many times ``|max| * u`` is not rounding at its magnitude (carried damage)
ROUNDING_SLACK = 4.0
#: hops searched upstream of the argument for the rounding site (through views, casts and float64 arithmetic)
DEPTH = 8


@dataclass(frozen=True)
class LostArgument:
    """A sin/cos/softmax whose argument lost what the function reads, and the record upstream that rounded it."""

    func: OpRecord
    origin: OpRecord
    arg_absmax: float  # |max| of the argument (the reference's)
    arg_error: float  # largest sampled |target - reference| of the argument
    value_error: float  # sin/cos: largest sampled |target - reference|; softmax: largest element error
    origin_error: float  # largest sampled |target - reference| of the origin's output
    origin_absmax: float


def _max_abs_diff(ctx: Context, r: OpRecord, bound: float = math.inf) -> float | None:
    """Largest sampled ``|target - reference|`` of ``r`` over elements whose reference is below ``bound``."""
    ref = ctx.ref_or_cast_input(r)
    if ref is None or not r.sample or len(r.sample) != len(ref.sample):
        return None
    d = [abs(a - b) for a, b in zip(r.sample, ref.sample) if math.isfinite(a) and math.isfinite(b) and abs(b) < bound]
    return max(d) if d else None


def _argument(ctx: Context, r: OpRecord) -> OpRecord | None:
    """r's first input, through casts without a reference of their own (autocast's copies)."""
    i = next((j for j in r.inputs if j >= 0), -1)
    arg = ctx.records[i] if i >= 0 else None
    for _ in range(4):
        if arg is None or ctx.ref(arg) is not None or op_base(arg.op) not in CASTS:
            break
        ups = [j for j in arg.inputs if j >= 0]
        arg = ctx.records[ups[0]] if len(ups) == 1 else None
    return arg


def _origin(ctx: Context, arg: OpRecord) -> tuple[OpRecord, float] | None:
    """Among ``arg`` and its feeders (:data:`DEPTH` hops) that put values into a low precision (a cast to it, an
    op in it, a batch tensor cast to it) with a sampled error: the largest absolute error, the earliest in trace
    order of those within a factor 2 of it."""
    cands: list[tuple[OpRecord, float]] = []
    for x in [arg, *feeders(ctx.records, arg, DEPTH)]:
        if x.kind not in ("op", "batch") or not is_low(x.dtype) or op_base(x.op) in ALIAS_OPS:
            continue
        d = _max_abs_diff(ctx, x, SENTINEL)
        cmp = ctx.ref_or_cast_input(x)
        size = float((cmp or x).stats.get("absmax", 0.0))
        if d is not None and 0 < d <= ROUNDING_SLACK * size * unit_roundoff(x.dtype):  # a rounding, not a mismatch
            cands.append((x, d))
    if not cands:
        return None
    top = max(d for _, d in cands)
    return min(((x, d) for x, d in cands if d >= top / 2), key=lambda c: c[0].index)


def _adds_an_offset(x: OpRecord) -> bool:
    """``x`` is a batch tensor or adds an offset as it is (the op registry's :func:`adds_an_offset`)."""
    return x.kind == "batch" or adds_an_offset(x.op)


def _sentinel_sized(ctx: Context, o: OpRecord) -> bool:
    """``o`` or an input of it holds sentinel-sized values in the reference: the digits went to a mask."""
    xs = [o, *(ctx.records[i] for i in o.inputs if i >= 0)]
    return any(float((ctx.ref(x) or x).stats.get("absmax", 0.0)) >= SENTINEL for x in xs)


def _lost(ctx: Context, r: OpRecord) -> tuple[OpRecord, float, float] | None:
    """``(argument, its error, the result's error)`` when ``r`` is a sin/cos/softmax whose argument lost it."""
    periodic = op_base(r.op) in PERIODIC
    if not periodic and op_base(r.op) not in SOFTMAX:
        return None
    arg = _argument(ctx, r)
    if arg is None:
        return None
    if periodic:
        value_err = _max_abs_diff(ctx, r)
        arg_err = _max_abs_diff(ctx, arg)
    else:  # probabilities: relative error per element; log-probabilities: absolute (a factor e**d on p)
        log = "log_softmax" in op_base(r.op)
        value_err = _max_abs_diff(ctx, r, SENTINEL) if log else ctx.element_errors.get(r.index, {}).get("max")
        arg_err = _max_abs_diff(ctx, arg, SENTINEL)
    if value_err is None or value_err <= VALUE_LOST or arg_err is None:
        return None
    return (arg, arg_err, value_err) if arg_err >= (PHASE_LOST if periodic else LOGIT_LOST) else None


def lost_arguments(ctx: Context, skip: set[int]) -> list[LostArgument]:
    """Every sin/cos/softmax of step 0's forward whose argument lost what it reads, with its origin (one per
    origin, in trace order); origins in ``skip`` (explained already: rounded integers) are left out, and so is an
    argument whose error exceeds what rounding at its own magnitude explains (:data:`ROUNDING_SLACK` times
    ``|max| * u``): damage carried from upstream (an overflow a clamp hid) is not this mechanism."""
    out: list[LostArgument] = []
    seen: set[int] = set()
    for r in ctx.records:
        if r.step != 0:
            break
        if r.kind != "op" or r.phase != "forward" or r.out_pos > 0:
            continue
        lost = _lost(ctx, r)
        origin = _origin(ctx, lost[0]) if lost is not None else None
        if lost is None or origin is None or origin[0].index in seen or origin[0].index in skip:
            continue
        arg, arg_err, value_err = lost
        o, o_err = origin
        arg_absmax = float((ctx.ref(arg) or arg).stats.get("absmax", 0.0))
        if arg_err > ROUNDING_SLACK * arg_absmax * unit_roundoff(o.dtype) or _sentinel_sized(ctx, o):
            continue
        if op_base(r.op) in SOFTMAX and not _adds_an_offset(o):
            continue
        seen.add(o.index)
        ref_o = ctx.ref(o)
        out.append(LostArgument(r, o, arg_absmax, arg_err, value_err, o_err,
                                float((ref_o or o).stats.get("absmax", 0.0))))
    return out


def _explanation(ctx: Context, hit: LostArgument) -> str:
    o, p = hit.origin, hit.func
    src = "a batch tensor" if o.kind == "batch" else where(o)
    head = (f"{src} rounds values up to {fmt(hit.origin_absmax)} into {dtype_name(o.dtype)} (u = "
            f"{fmt(unit_roundoff(o.dtype))}: off by up to {fmt(hit.origin_error)} in the sampled elements). ")
    if op_base(p.op) in PERIODIC:
        body = (f"{where(p)} computes a periodic function of them: its argument (|max| {fmt(hit.arg_absmax)}) is off "
                f"by up to {fmt(hit.arg_error)} radians, so it encodes another value -- its result is off by up to "
                f"{fmt(hit.value_error)} of its unit amplitude -- although the rounding's relative error is only u "
                "and the sin/cos computes exactly what it is given (a timestep, sigma, position or coordinate "
                "embedded at a high frequency).")
    else:
        body = (f"{where(p)} normalizes logits of |max| {fmt(hit.arg_absmax)} computed from them: softmax reads "
                f"only their differences, which are off by up to {fmt(hit.arg_error)} -- a factor up to "
                f"{math.exp(hit.arg_error):.2f} on a probability (an element is off by {hit.value_error:.0%}) -- "
                "although the rounding's relative error is only u: a large common offset (a position bias, a "
                "temperature) spends the digits the differences need.")
    return head + body


def _returns_model_output(ctx: Context, module: str) -> bool:
    """Whether ``module``'s result is the model's output: the op producing a returned tensor ran inside it."""
    marks = set(ctx.target.trace.marks.get("output", []))
    return any(r.index in marks and (r.module == module or r.module.startswith(module + "."))
               for r in ctx.records)


def absolute_arg_findings(ctx: Context, skip: set[int]) -> list[Candidate]:
    """``precision-loss`` errors, one per rounding origin (:func:`lost_arguments`)."""
    out: list[Candidate] = []
    for hit in lost_arguments(ctx, skip):
        o, p = hit.origin, hit.func
        dt = dtype_name(o.dtype)
        periodic = op_base(p.op) in PERIODIC
        deviation = output_deviation(ctx)
        ev = base_evidence(o)
        ev.update({"mechanism": "phase-lost" if periodic else "logit-differences-lost", "function_op":
                   ctx.describe(p), "argument_absmax": hit.arg_absmax, "argument_abs_error": hit.arg_error,
                   "function_error": hit.value_error, "origin_abs_error": hit.origin_error,
                   "origin_absmax": hit.origin_absmax, "unit_roundoff": unit_roundoff(o.dtype),
                   "output_deviation": deviation})
        expl = _explanation(ctx, hit)
        if deviation is not None:
            expl += f" The step's result deviates {deviation:.2%} from fp32."
        if o.kind == "batch":
            expl += (f" ampdoctor cast this batch tensor to {dt} for precision '{ctx.spec.precision}' (as a "
                     "whole-model cast of the inputs would); under autocast ('-amp') inputs stay float32.")
        fixes = [FixProposal("keep the value (timestep, sigma, position, bias) in float32 up to the function, then "
                             "cast its result",
                             "emb = sinusoidal_embedding(t.float()).to(x.dtype)  # or: probs = (scores.float() + "
                             "bias.float()).softmax(-1).to(x.dtype)"),
                 FixProposal("compute the argument in float32 with autocast off",
                             "with torch.autocast(device_type, enabled=False):\n    ang = pos.float() @ freqs.float()")]
        if o.module:
            fixes.append(keep_fp32_fix(o.module, fp32_outputs=_returns_model_output(ctx, o.module)))
        what = "loses their phase" if periodic else "loses their differences"
        out.append(Candidate(Finding(
            "precision-loss", "error", o.module, o.op, o.phase,
            f"{op_base(p.op)} of values rounded to {dt} {what} in {p.module or '<root>'}", expl, ev,
            tuple(fixes), o.step), o.index))
    return out


__all__ = ["DEPTH", "LOGIT_LOST", "PHASE_LOST", "ROUNDING_SLACK", "SENTINEL", "VALUE_LOST", "LostArgument",
           "absolute_arg_findings", "lost_arguments"]
