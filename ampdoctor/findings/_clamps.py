"""Hidden overflow: an inf the target makes and a guard catches (clamp, clip, ``nan_to_num``, ``where(isinf...)``,
a saturating cast to fp8) is still an overflow at the op that made it.

Read by the ``overflow`` rule. Decided from lineage and the reference only: an origin of inf (finite inputs, inf
output) whose aligned fp32 record is finite, absorbed by an op of kind :attr:`~ampdoctor.trace.Kind.CLIPS` (or a
cast to fp8) whose output is finite. The guard may run in both runs (``torch.clamp(h, -65000, 65000)``: it clips
fp32's 1.4e5 and fp16's inf alike, so nothing downstream disagrees) or in the target only (T5's
``if hidden_states.dtype == torch.float16: clamp(...)``); either way the values it replaced were out of range in
the target and in range in the reference, and what reaches the rest of the model is the guard's bound, not the
value. A guard that never clips sees no inf and is never reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ampdoctor.findings._common import CASTS, base_evidence, dtype_name, fmt, limits, op_base, src_text, where
from ampdoctor.findings._context import Context, reference_nonfinite
from ampdoctor.findings._fp8_casts import FP8
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, ops_with

CLIPS = ops_with(Kind.CLIPS)


@dataclass(frozen=True)
class Caught:
    """An inf origin ``record`` and the guard that replaced its values (``guard``), with the reference's |max|."""

    record: OpRecord
    guard: OpRecord
    ref_absmax: float


def _is_guard(r: OpRecord) -> bool:
    base = op_base(r.op)
    return base in CLIPS or (base in CASTS and dtype_name(r.dtype) in FP8)


def caught_overflows(ctx: Context) -> list[Caught]:
    """Every inf origin made from finite inputs, finite in the aligned reference, that a guard absorbs."""
    out: list[Caught] = []
    for o in ctx.origins:
        r = o.record
        s = r.stats
        if r.kind != "op" or o.deliberate or s.get("n_posinf", 0) + s.get("n_neginf", 0) == 0:
            continue
        ref = ctx.ref(r)
        if ref is None or reference_nonfinite(ctx, r) or "absmax" not in ref.stats:
            continue
        guard = next((ctx.records[a] for a in ctx.lineage.absorbed.get(r.index, []) if _is_guard(ctx.records[a])),
                     None)
        if guard is not None:
            out.append(Caught(r, guard, ref.stats["absmax"]))
    return out


def handled(ctx: Context) -> set[int]:
    """Origins reported here (the generic overflow loop leaves them alone)."""
    return {c.record.index for c in caught_overflows(ctx)}


def _guard_evidence(ctx: Context, c: Caught) -> dict[str, Any]:
    g = c.guard
    gref = ctx.ref(g)
    tensor_bounds = [ctx.records[i].stats.get("absmax", 0.0) for i in g.inputs[1:]
                     if i >= 0 and ctx.records[i].stats.get("numel") == 1]
    ev: dict[str, Any] = {"op": g.op, "module": g.module, "phase": g.phase, "dtype": dtype_name(g.dtype),
                          "bounds": list(g.scalars), "bound_absmax": max(tensor_bounds, default=None),
                          "output_absmax": g.stats.get("absmax"), "in_reference": gref is not None}
    if g.src:
        ev["source"] = src_text(g)
    return ev


def caught_candidates(ctx: Context, fixes: Callable[[Context, OpRecord], list[FixProposal]]) -> list[Candidate]:
    """``overflow`` at each caught origin, with the guard as ``caught_by``."""
    out: list[Candidate] = []
    for c in caught_overflows(ctx):
        r, g = c.record, c.guard
        dt, fmax = dtype_name(r.dtype), limits(r.dtype)[0]
        n_inf = int(r.stats["n_posinf"] + r.stats["n_neginf"])
        ev = base_evidence(r)
        ev.update({"format_max": fmax, "n_inf": n_inf, "ref_absmax": c.ref_absmax, "ratio_to_max": c.ref_absmax / fmax,
                   "caught_by": _guard_evidence(ctx, c)})
        only = "" if ctx.ref(g) is not None else " (a guard that runs in the target only)"
        bound = f" with values up to |{fmt(g.stats['absmax'])}|" if "absmax" in g.stats else ""
        at = f" [{src_text(r)}]" if r.src else ""
        expl = (f"{where(r)}{at} produced {n_inf} inf value(s) in {dt} from finite inputs: the fp32 reference reaches "
                f"|max| {fmt(c.ref_absmax)}, {c.ref_absmax / fmax:.2f}x {dt}'s max {fmt(fmax)}. {op_base(g.op)} in "
                f"{g.module or '<root>'}{only} catches them and replaces them{bound}, so nothing downstream is inf, "
                "but the layer's output is the guard's bound instead of its value: the overflow is hidden, not fixed.")
        out.append(Candidate(Finding(
            "overflow", "error", r.module, r.op, r.phase,
            f"{op_base(r.op)} overflows {dt} in {r.module or '<root>'} (caught by {op_base(g.op)})", expl, ev,
            tuple(fixes(ctx, r)), r.step), r.index))
    return out


__all__ = ["CLIPS", "Caught", "caught_candidates", "caught_overflows", "handled"]
