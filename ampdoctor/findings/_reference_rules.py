"""A non-finite value the fp32 reference makes as well: ``nonfinite-reference`` (not a precision problem)."""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.findings._common import CASTS, base_evidence, dtype_name, fmt, op_base, where
from ampdoctor.findings._context import Context
from ampdoctor.findings._fp8_casts import FP8
from ampdoctor.findings._registry import Candidate, rule
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import OpRecord


def _reaches(records: list[OpRecord], chain: list[int], protected: set[int]) -> str | None:
    if any(i in protected for i in chain):
        return "reaches the loss or a model output"
    if any(records[i].phase == "optimizer" for i in chain):
        return "reaches a parameter update"
    if any(records[i].node == "AccumulateGrad" for i in chain):
        return "reaches a parameter gradient"
    return None


def _target_index(ctx: Context, ref: OpRecord) -> int:
    """Where the fp32 origin sits in the target run (for ranking); its own index when nothing aligns."""
    i = ctx.target_index(ref)
    return ref.index if i is None else i


def _input_ranges(records: list[OpRecord], r: OpRecord) -> list[dict[str, Any]]:
    out = []
    for i in r.inputs[:4]:
        if i < 0:
            continue
        s = records[i].stats
        out.append({"op": records[i].op or records[i].kind, "dtype": dtype_name(records[i].dtype),
                    "min": s.get("min"), "max": s.get("max"), "n_zero": int(s.get("n_zero", 0))})
    return out


@rule("nonfinite-reference", severity="error", precedence=18,
      summary="the fp32 reference makes the same inf/NaN: not a precision problem")
def nonfinite_reference(ctx: Context) -> list[Candidate]:
    """An op creates inf/NaN from finite inputs in the float32 reference too (a division by zero, ``log(0)``,
    ``sqrt`` of a negative number, an exploding value), and that value reaches the loss, a gradient or an
    update. No precision change fixes it: the finding names the first op that makes it *in fp32*, with its
    inputs' ranges and lineage. Deliberate infinities (a ``-inf`` mask fill) and non-finite inputs are left to
    ``masked-row-nan`` and ``nonfinite-input``."""
    ref_run = ctx.reference
    if ref_run is None:
        return []
    recs = ref_run.trace.records
    if not recs:
        return []
    lin = ctx.reference_lineage
    if lin is None:
        return []
    protected = set(ref_run.trace.marks.get("loss", [])) | set(ref_run.trace.marks.get("output", []))
    for o in lin.origins:
        r = recs[o]
        if r.kind != "op" or any(math.isinf(v) for v in r.scalars):
            continue
        if dtype_name(r.dtype) in FP8 and op_base(r.op) in CASTS:
            continue  # the user's own fp8 cast runs in fp32 too: judged by its input (findings/_fp8_casts.py)
        chain = [o, *lin.descendants.get(o, [])]
        why = _reaches(recs, chain, protected)
        if why is None:
            continue
        s = r.stats
        n_nan, n_inf = int(s.get("n_nan", 0)), int(s.get("n_posinf", 0) + s.get("n_neginf", 0))
        ev = base_evidence(r)
        ev.update({"n_nan": n_nan, "n_inf": n_inf, "reference_dtype": dtype_name(r.dtype),
                   "inputs": _input_ranges(recs, r), "scalars": list(r.scalars)})
        fn = lin.first_nan.get(o)
        ev["first_nan"] = None if fn is None else {"op": recs[fn].op, "module": recs[fn].module,
                                                   "phase": recs[fn].phase}
        ins = "; ".join(f"{x['op']} [{fmt(x['min'])}, {fmt(x['max'])}], {x['n_zero']} zero(s)"
                        for x in ev["inputs"]) or "no traced inputs"
        expl = (f"{where(r)} makes {n_inf} inf and {n_nan} NaN from finite inputs in the float32 reference as well "
                f"(inputs: {ins}); the value {why}. This is not a precision problem: no dtype, autocast setting or "
                "loss scale changes it. Guard the operation (a zero divisor, log of 0, sqrt of a negative value) "
                "or fix the data that feeds it.")
        fix = FixProposal("guard the op that makes the non-finite value (an eps in the divisor, a clamp before log)",
                          "y = x / d.clamp_min(torch.finfo(d.dtype).tiny)  # or torch.log(p.clamp_min(...))")
        return [Candidate(Finding(
            "nonfinite-reference", "error", r.module, r.op, r.phase,
            f"{op_base(r.op)} is non-finite in float32 too in {r.module or '<root>'}", expl, ev, (fix,), r.step),
            _target_index(ctx, r))]
    return []
