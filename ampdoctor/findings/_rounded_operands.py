"""A value rounded to a low precision, then subtracted from a value of the same size: the difference keeps only
the digits the rounding left.

A noise schedule ``alphas_cumprod`` cast to the latents' bf16 (diffusers' ``add_noise`` casts it to the sample
dtype), or read from a buffer that a whole-model cast rounded, holds values near 1 spaced 2**-8 apart; ``1 - a``
then carries the rounding of ``a`` (relative error ~u) multiplied by ``|a| / |1 - a|``: at the small timesteps
``a = 0.9991`` rounds to 1 and ``sqrt(1 - a)`` adds no noise at all. The same happens to ``1 - sigma`` of a
flow-matching schedule near sigma = 1. Norms hardly move (the large differences are accurate), so the norm-based
comparison does not see it; the element samples do.

Decided by mechanism only: a cancelling op (sub, rsub, add) of step 0's forward in a low precision, one of whose
operands is -- through views, copies and gathers -- a cast to that precision of float32 values or a floating
buffer read in it, cancels at least 4 bits (``|operand| / |result| >= 16`` in the reference) and is wrong by
more than 25% in some sampled element while that operand is accurate to its rounding. A ``warning``; an
``error`` when the op returns exact zeros where the fp32 reference is nonzero (the operand rounded onto the value
it is subtracted from: the difference is gone, not just noisy). Reported as ``precision-loss`` at the cancelling
op, with the rounded operand as ``rounded_operand``.
"""

from __future__ import annotations

import math

from ampdoctor.findings._common import (
    ALIAS_OPS,
    CANCEL_OPS,
    CASTS,
    SAME_VALUE_OPS,
    base_evidence,
    dtype_name,
    fmt,
    is_low,
    op_base,
    unit_roundoff,
    where,
)
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, ops_with

#: a sampled element of the difference off by more than this (relative) makes the finding
ELEMENT_HARM = 0.25
#: the reference's |operand| / |result| at least this: 4 bits cancel
MIN_GAIN = 16.0
#: views, copies and gathers pass values through; at most this many are walked back
HOPS = 4
PASS_VALUES = ALIAS_OPS | SAME_VALUE_OPS | ops_with(Kind.GATHERS)


def _floating_inputs(ctx: Context, r: OpRecord) -> list[OpRecord]:
    return [ctx.records[i] for i in r.inputs if i >= 0]


def _rounded_origin(ctx: Context, r: OpRecord) -> OpRecord | None:
    """``r`` itself or the record it passes values through from (views, copies, gathers: ``HOPS`` at most) when
    that is a cast of float32 values to a low precision or a low-precision buffer read."""
    for _ in range(HOPS + 1):
        if r.kind == "input" and r.name and is_low(r.dtype):
            return r
        ins = _floating_inputs(ctx, r)
        if r.kind == "op" and op_base(r.op) in CASTS and is_low(r.dtype) and len(ins) == 1 and not is_low(
                ins[0].dtype):
            return r
        if r.kind != "op" or op_base(r.op) not in PASS_VALUES or not ins:
            return None
        r = ins[0]  # the first input: the one whose values pass (embedding's weight, index's self)
    return None


def _candidates(ctx: Context) -> list[tuple[OpRecord, OpRecord, dict[str, float]]]:
    """``(cancelling op, rounded operand, its element errors)`` of step 0's forward."""
    out: list[tuple[OpRecord, OpRecord, dict[str, float]]] = []
    errs = ctx.element_errors
    for c in ctx.records:
        if c.step != 0:
            break
        if c.kind != "op" or c.phase != "forward" or op_base(c.op) not in CANCEL_OPS or not is_low(c.dtype):
            continue
        ref, ec = ctx.ref(c), errs.get(c.index)
        if ref is None or ec is None or ec["max"] <= ELEMENT_HARM or not 0 < ref.stats.get("absmax", 0) < math.inf:
            continue
        ins = _floating_inputs(ctx, c)
        gain = max((x.stats.get("absmax", 0.0) for x in ins), default=0.0) / ref.stats["absmax"]
        if gain < MIN_GAIN:
            continue
        for x in ins:
            origin = _rounded_origin(ctx, x)
            ex = errs.get(x.index)
            if origin is not None and (ex is None or ex["max"] <= 4 * unit_roundoff(c.dtype)):
                out.append((c, origin, ec))
                break
    return out


def _explain(ctx: Context, c: OpRecord, origin: OpRecord, ec: dict[str, float], zeros: int) -> tuple[str, dict]:
    ref = ctx.ref(c)
    assert ref is not None
    dt = dtype_name(c.dtype)
    in_max = max(x.stats.get("absmax", 0.0) for x in _floating_inputs(ctx, c))
    ev = base_evidence(c)
    what = (f"the buffer {origin.name}" if origin.kind == "input" else f"the {dt} cast {where(origin)}")
    ev.update({"mechanism": "rounded-operand-cancelled", "elementwise": ec, "operand_absmax": in_max,
               "ref_absmax": ref.stats["absmax"], "digits_cancelled": math.log2(in_max / ref.stats["absmax"]),
               "unit_roundoff": unit_roundoff(c.dtype), "zeros_created": zeros,
               "rounded_operand": {"op": origin.op or "<leaf>", "module": origin.module, "name": origin.name,
                                   "index": origin.index}})
    expl = (f"{where(c)} subtracts values rounded by {what} (|max| {fmt(in_max)}, u = "
            f"{fmt(unit_roundoff(c.dtype))}) from values of the same size: the fp32 difference reaches only |max| "
            f"{fmt(ref.stats['absmax'])}, ~{ev['digits_cancelled']:.0f} bits below its operands, so the operand's "
            f"rounding becomes an error of up to {ec['max']:.0%} of the difference (median {ec['p50']:.1%}) "
            "although the operand itself is accurate to its rounding.")
    if zeros:
        expl += (f" {zeros} element(s) come out exactly 0 where fp32 is nonzero: the operand rounded onto the value "
                 "it is subtracted from, and the difference (a noise level, a weight 1 - x) is gone.")
    return expl, ev


def rounded_operand_findings(ctx: Context) -> list[Candidate]:
    """``precision-loss`` candidates at cancelling ops whose rounded operand loses the difference (at most 5)."""
    out: list[Candidate] = []
    for c, origin, ec in _candidates(ctx)[:5]:
        ref = ctx.ref(c)
        assert ref is not None
        zeros = max(0, int(c.stats.get("n_zero", 0) - ref.stats.get("n_zero", 0)))
        expl, ev = _explain(ctx, c, origin, ec, zeros)
        fixes = [FixProposal("compute the difference in float32 and cast what is computed from it",
                             "a = alphas_cumprod[t]  # float32\nnoise_scale = (1 - a).sqrt().to(x.dtype)")]
        if origin.kind == "input" and origin.name:
            fixes.insert(0, FixProposal(
                f"keep the buffer {origin.name} in float32 after the model cast",
                f"model.get_buffer({origin.name!r}).data = model.get_buffer({origin.name!r}).float()",
                id="keep_fp32_buffers", params={"buffers": [origin.name]}))
        out.append(Candidate(Finding(
            "precision-loss", "error" if zeros else "warning", c.module, c.op, c.phase,
            f"{op_base(c.op)} in {c.module or '<root>'} cancels the digits of a value rounded to {dtype_name(c.dtype)}",
            expl, ev, tuple(fixes), c.step), c.index))
    return out


__all__ = ["rounded_operand_findings"]
