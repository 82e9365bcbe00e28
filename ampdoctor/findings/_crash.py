"""Crashes explained: the op that raised in the target run, its inputs' ranges and the numerics that fed it.

The trace keeps every record made up to the raise and, in ``trace.error``, the failing op with the records of
its inputs (for an integer input -- an index, a ``.long()`` of a computed value -- the floating records it was
computed from). Two explanations follow from that:

- an inf/NaN origin whose lineage reaches the failing op's inputs is harmful (``build_context``): the usual
  rules (overflow, constant-out-of-range, ...) name it; :func:`attach_exception` adds the exception to the
  finding that ranks first;
- no inf/NaN reaches it, but a finite input holds values outside the fp32 reference's range (an index that
  rounds up to the table size, a probability that rounds to 1): :func:`out_of_range_findings` names the op
  whose rounding moved the values out, as ``precision-loss`` (an error).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ampdoctor.findings._common import base_evidence, dtype_name, fmt, is_low, op_base, where
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import OpRecord, is_nonfinite, op_info

if TYPE_CHECKING:
    from ampdoctor.findings._context import Context


def _range(r: OpRecord) -> dict[str, Any]:
    s = r.stats
    out: dict[str, Any] = {"op": r.op or r.kind, "module": r.module, "dtype": dtype_name(r.dtype),
                           "shape": list(r.shape)}
    for k in ("absmax", "min", "max", "n_nan", "n_posinf", "n_neginf", "n_zero", "numel"):
        if k in s:
            out[k] = s[k] if k in ("min", "max", "absmax") else int(s[k])
    return out


def crash_inputs(ctx: Context) -> list[OpRecord]:
    """The records feeding the op that raised (empty when the target did not raise inside a traced op)."""
    err = ctx.target.trace.error
    if ctx.target.exc is None or err is None:
        return []
    return [ctx.records[i] for i in err.get("inputs", ()) if 0 <= i < len(ctx.records)]


def exception_evidence(ctx: Context) -> dict[str, Any] | None:
    """The exception of the target run: type, message, the op that raised, its step and its inputs' ranges."""
    exc = ctx.target.exc
    if exc is None:
        return None
    err = ctx.target.trace.error or {}
    msg = str(exc).splitlines()[0] if str(exc) else ""
    return {"type": type(exc).__name__, "message": msg[:300], "op": err.get("op", ""),
            "module": err.get("module", ""), "phase": err.get("phase", ""), "step": ctx.target.exc_step,
            "inputs": [_range(r) for r in crash_inputs(ctx)]}


def attach_exception(findings: list[Finding], ctx: Context) -> list[Finding]:
    """The first error finding gets the exception in evidence (``exception``) and one sentence about it."""
    ev = exception_evidence(ctx)
    if ev is None:
        return findings
    out = list(findings)
    for i, f in enumerate(out):
        if f.severity != "error":
            continue
        ins = "; ".join(f"{x['op']} in {x['module'] or '<root>'}: |max| {fmt(x.get('absmax'))}"
                        + (f", {x['n_nan']} NaN" if x.get("n_nan") else "")
                        + (f", {x['n_posinf'] + x['n_neginf']} inf" if x.get("n_posinf", 0) + x.get("n_neginf", 0)
                           else "") for x in ev["inputs"][:3])
        txt = (f" The {ctx.spec.precision or 'as-given'} run then raised {ev['type']} in {ev['op'] or 'the step'} "
               f"of {ev['module'] or '<root>'} (step {ev['step']}): \"{ev['message']}\""
               + (f"; its inputs: {ins}." if ins else "."))
        out[i] = dataclasses.replace(f, evidence=f.evidence.replace(exception=ev),
                                     explanation=f.explanation + txt)
        break
    return out


def _g(x: float) -> str:
    return f"{x:.7g}"  # the digits that show a rounding to the edge (0.9998779 vs 1)


def _overshoot(ctx: Context, r: OpRecord) -> float:
    """How far ``r``'s |max| exceeds its reference's, relative to the reference's (0: not beyond it)."""
    ref = ctx.ref(r)
    if ref is None or is_nonfinite(r) or is_nonfinite(ref) or "absmax" not in r.stats or "absmax" not in ref.stats:
        return 0.0
    return max(r.stats["absmax"] - ref.stats["absmax"], 0.0) / max(ref.stats["absmax"], 1e-30)


def _walk_up(ctx: Context, r: OpRecord) -> OpRecord:
    """Up an element-wise chain while the input also leaves its reference's range in the same direction."""
    seen = 0
    while seen < 8:
        ins = [ctx.records[i] for i in r.inputs if i >= 0]
        ops = [x for x in ins if x.kind == "op" and x.stats.get("numel") == r.stats.get("numel")]
        if len(ops) != 1 or op_info(op_base(ops[0].op)).reduces is not None or op_info(op_base(r.op)).reduces \
                is not None or _overshoot(ctx, ops[0]) <= 0:
            return r
        r, seen = ops[0], seen + 1
    return r


def out_of_range_findings(ctx: Context) -> list[Candidate]:
    """The target raised, no inf/NaN reaches the failing op, and a low-precision input of it leaves the fp32
    range: the op whose rounding moved it out (walked up its element-wise chain) is the origin."""
    ins = crash_inputs(ctx)
    if not ins or any(is_nonfinite(r) for r in ins) or ctx.harmful_origins():
        return []
    cands = [(r, _overshoot(ctx, r)) for r in ins if r.kind == "op" and is_low(r.dtype)]
    cands = [(r, o) for r, o in cands if o > 0]
    if not cands:
        return []
    src, over = max(cands, key=lambda x: x[1])
    at = _walk_up(ctx, src)
    ref, sref = ctx.ref(at), ctx.ref(src)
    assert ref is not None and sref is not None
    err = ctx.target.trace.error or {}
    ev = base_evidence(at)
    ev.update({"absmax": at.stats["absmax"], "ref_absmax": ref.stats["absmax"], "overshoot": over,
               "failing_op": err.get("op", ""), "fed_by": ctx.describe(src),
               "fed_absmax": src.stats["absmax"], "fed_ref_absmax": sref.stats["absmax"]})
    dt = dtype_name(at.dtype)
    expl = (f"{where(at)} reaches |max| {_g(at.stats['absmax'])} in {dt} where the fp32 reference stays at "
            f"{_g(ref.stats['absmax'])}: rounding to {dt} moves values past the edge of the valid range. "
            + ("" if src is at else f"Through {where(src)} (|max| {_g(src.stats['absmax'])} vs "
                                    f"{_g(sref.stats['absmax'])}) ")
            + f"they feed {err.get('op', 'the failing op')}, which validates its input.")
    fixes = (FixProposal(f"compute {op_base(at.op)} and the value it feeds in float32",
                         "idx = (p.float() * n).long().clamp_(0, n - 1)  # clamp an index computed from floats"),)
    return [Candidate(Finding("precision-loss", "error", at.module, at.op, at.phase,
                              f"{op_base(at.op)} rounds values out of range in {dt} in {at.module or '<root>'}",
                              expl, ev, fixes, at.step), at.index)]
