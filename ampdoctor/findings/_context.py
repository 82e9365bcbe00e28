"""What the rules read: the target and reference runs, aligned op by op, and the classified origins.

Alignment key: ``(step, phase, module, op, output position, k)`` where ``k`` counts earlier records with the
same first five fields. Ops that exist in one dtype only (an fp16-only clamp, autocast's casts) shift only
their own count, so the rest stays aligned.

An origin is *harmful* when its lineage reaches the loss, a model output, a gradient written to ``.grad``,
an optimizer-phase value or the input of the op that raised (a crash cuts the lineage short there), or when
a finite record that absorbed it disagrees with the reference
(``rsqrt(inf) = 0`` in an RMSNorm). Otherwise it is *benign* (a ``-inf`` mask softmax absorbs, T5's
``log(0)`` discarded by ``torch.where``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ampdoctor.findings import _analysis, _elementwise
from ampdoctor.findings._common import CASTS, dtype_name, feeders, group_by_owner, limits, op_base
from ampdoctor.precision import RunResult, StepSpec
from ampdoctor.trace import Lineage, OpRecord, analyse_lineage, has_nan, is_nonfinite

AlignKey = tuple[Any, ...]


def align_keys(records: list[OpRecord]) -> list[AlignKey]:
    """The alignment key of every record, in trace order (the records themselves are left untouched)."""
    counts: dict[AlignKey, int] = {}
    out: list[AlignKey] = []
    for r in records:
        base = (r.step, r.phase, r.module, r.op, r.out_pos, r.kind)
        k = counts.get(base, 0)
        counts[base] = k + 1
        out.append((*base, k))
    return out


@dataclass
class Origin:
    record: OpRecord
    harmful: bool
    reasons: list[str]
    deliberate: bool  # the non-finite value is a literal (a -inf mask fill)


@dataclass
class Context:
    """The runs aligned op by op and the classified origins; whole-trace analyses are cached properties."""

    spec: StepSpec
    target: RunResult
    reference: RunResult | None
    lineage: Lineage
    ref_align: dict[AlignKey, OpRecord]
    target_keys: list[AlignKey] = field(default_factory=list)
    ref_keys: list[AlignKey] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)
    protected: set[int] = field(default_factory=set)

    @property
    def records(self) -> list[OpRecord]:
        return self.target.trace.records

    def ref(self, r: OpRecord) -> OpRecord | None:
        """The aligned reference record of target record ``r``, or ``None`` when the op has no counterpart."""
        if self.reference is None or not 0 <= r.index < len(self.target_keys) or self.records[r.index] is not r:
            return None
        cand = self.ref_align.get(self.target_keys[r.index])
        if cand is None or cand.shape != r.shape:
            return None
        return cand

    def ref_or_cast_input(self, r: OpRecord) -> OpRecord | None:
        """:meth:`ref`, or for a cast only the target makes (``t.to(dtype)`` is a no-op in the float32 reference;
        autocast's copies) the cast's own input, which holds the values before the rounding."""
        ref = self.ref(r)
        if ref is not None:
            return ref
        if r.kind == "op" and op_base(r.op) in CASTS and r.inputs and r.inputs[0] >= 0:
            src = self.records[r.inputs[0]]
            return src if src.shape == r.shape else None
        return None

    def target_index(self, ref: OpRecord) -> int | None:
        """The index of the first target record aligned with reference record ``ref`` (``None`` if none is)."""
        if not 0 <= ref.index < len(self.ref_keys):
            return None
        return self._target_by_key.get(self.ref_keys[ref.index])

    @cached_property
    def _target_by_key(self) -> dict[AlignKey, int]:
        out: dict[AlignKey, int] = {}
        for i, k in enumerate(self.target_keys):
            out.setdefault(k, i)
        return out

    def chain(self, origin: int) -> list[int]:
        return [origin, *self.lineage.descendants.get(origin, [])]

    def harmful_origins(self) -> list[Origin]:
        return [o for o in self.origins if o.harmful]

    def describe(self, r: OpRecord) -> dict[str, Any]:
        return {"op": r.op, "module": r.module, "phase": r.phase, "step": r.step, "index": r.index,
                "node": r.node}

    # whole-trace analyses (``findings/_analysis.py``), each computed at most once per diagnosis
    @cached_property
    def saturated(self) -> list[tuple[OpRecord, OpRecord, float, float]]:
        """Bounded-op outputs at their bound far more often than in the reference (``saturated_records``)."""
        return _analysis.saturated_records(self)

    @cached_property
    def saturated_sources(self) -> set[int]:
        return _analysis.saturated_sources(self)

    @cached_property
    def flushed(self) -> dict[int, bool]:
        return _analysis.flushed_records(self)

    @cached_property
    def underflow_origins(self) -> list[tuple[OpRecord, float, float, dict[str, float]]]:
        return _analysis.underflow_origins(self)

    @cached_property
    def relative_errors(self) -> dict[int, float]:
        return _analysis.relative_errors(self)

    @cached_property
    def element_errors(self) -> dict[int, dict[str, float]]:
        return _elementwise.element_errors(self)

    @cached_property
    def decision_changes(self) -> list[dict[str, Any]]:
        return _elementwise.decision_changes(self)

    @cached_property
    def trig_buffer_sources(self) -> list[tuple[OpRecord, OpRecord]]:
        return _analysis.trig_buffer_sources(self)

    @cached_property
    def precision_loss_records(self) -> list[tuple[OpRecord, float, float, float, int, float]]:
        return _analysis.precision_loss_records(self)

    @cached_property
    def cancellation_nan_origins(self) -> list[tuple[Origin, OpRecord | None]]:
        return _analysis.cancellation_nan_origins(self)

    @cached_property
    def reference_lineage(self) -> Lineage | None:
        """Where the fp32 reference's own non-finite values come from (``None`` without a reference)."""
        return None if self.reference is None else analyse_lineage(self.reference.trace.records)

    @cached_property
    def scales(self) -> list[float]:
        """The loss-scale trajectory (``scales_of``)."""
        return _analysis.scales_of(self)

    @cached_property
    def skipped_steps(self) -> int:
        """Optimizer steps GradScaler skipped, step 0 included (``skipped_steps``)."""
        return _analysis.skipped_steps(self)


def agrees(t: OpRecord, ref: OpRecord) -> bool:
    """Finite target record vs its reference: same range and zero pattern within low-precision rounding."""
    a, b = t.stats, ref.stats
    if is_nonfinite(ref):
        return True  # the reference absorbs the same way
    amax_t, amax_r = a["absmax"], b["absmax"]
    scale = max(amax_r, 1e-30)
    if abs(amax_t - amax_r) > 0.1 * scale + 1e-6:
        return False
    extra_zeros = a["n_zero"] - b["n_zero"]
    if extra_zeros >= 1 and b["min_nonzero"] > 2 * limits(t.dtype)[2]:
        return False  # zeros where the reference holds values that would not even round to zero
    nr = max(b["norm"], 1e-30)
    return abs(a["norm"] - b["norm"]) <= 0.1 * nr + 1e-6


def reference_nonfinite(ctx: Context, r: OpRecord) -> bool:
    """The aligned fp32 record of ``r`` holds at least as many inf/NaN as ``r`` itself: fp32 makes them too."""
    ref = ctx.ref(r)
    if ref is None or not is_nonfinite(ref):
        return False
    s, rs = r.stats, ref.stats
    if "n_nan" not in s or "n_nan" not in rs:
        return True
    return rs["n_nan"] + rs["n_posinf"] + rs["n_neginf"] >= s["n_nan"] + s["n_posinf"] + s["n_neginf"]


def _deliberate(r: OpRecord) -> bool:
    return any(math.isinf(v) for v in r.scalars)


def build_context(spec: StepSpec, target: RunResult, reference: RunResult | None) -> Context:
    lineage = analyse_lineage(target.trace.records)
    ref_align: dict[AlignKey, OpRecord] = {}
    ref_keys: list[AlignKey] = []
    if reference is not None:
        ref_records = reference.trace.records
        ref_keys = align_keys(ref_records)
        ref_align = dict(zip(ref_keys, ref_records))
    ctx = Context(spec, target, reference, lineage, ref_align, align_keys(target.trace.records), ref_keys)
    records = target.trace.records
    protected = set(target.trace.marks.get("loss", [])) | set(target.trace.marks.get("output", []))
    ctx.protected = protected
    err = target.trace.error
    crash_inputs = set(err.get("inputs", ())) if err is not None else set()
    for o in lineage.origins:
        rec = records[o]
        reasons: list[str] = []
        chain = ctx.chain(o)
        if any(i in protected for i in chain):
            reasons.append("reaches the loss or a model output")
        if any(records[i].phase == "optimizer" for i in chain):
            reasons.append("reaches a parameter update")
        if any(records[i].node == "AccumulateGrad" for i in chain):
            reasons.append("reaches a parameter gradient")
        if err is not None and crash_inputs.intersection(chain):
            reasons.append(f"feeds {err['op']}, which raised {err['type']}: {err['message']}")
        if not reasons:
            for a in lineage.absorbed.get(o, []):
                ar = records[a]
                ref = ctx.ref(ar)
                if ref is not None and not agrees(ar, ref):
                    reasons.append(
                        f"absorbed by {ar.op} in {ar.module or '<root>'}, whose result disagrees with the fp32 "
                        f"reference (|max| {ar.stats['absmax']:.3g} vs {ref.stats['absmax']:.3g}, zeros "
                        f"{int(ar.stats['n_zero'])} vs {int(ref.stats['n_zero'])})")
                    break
        ctx.origins.append(Origin(rec, bool(reasons), reasons, _deliberate(rec)))
    return ctx


def nan_record(ctx: Context, origin: int) -> OpRecord | None:
    i = ctx.lineage.first_nan.get(origin)
    return None if i is None else ctx.records[i]


def chain_summary(ctx: Context, origin: int) -> list[dict[str, Any]]:
    """origin -> first NaN -> loss, as a list of steps for reports."""
    recs = ctx.records
    out = [dict(ctx.describe(recs[origin]), what="origin")]
    fn = ctx.lineage.first_nan.get(origin)
    if fn is not None and fn != origin:
        out.append(dict(ctx.describe(recs[fn]), what="first NaN"))
    chain = set(ctx.chain(origin))
    for i in ctx.target.trace.marks.get("loss", []):
        if i in chain:
            out.append(dict(ctx.describe(recs[i]), what="loss"))
            break
    else:
        grads = [i for i in ctx.chain(origin) if recs[i].node == "AccumulateGrad"]
        if grads:
            out.append(dict(ctx.describe(recs[grads[0]]), what="gradient"))
    return out


__all__ = ["AlignKey", "Context", "Origin", "agrees", "align_keys", "build_context", "chain_summary", "dtype_name",
           "feeders", "group_by_owner", "has_nan", "limits", "nan_record", "op_base", "reference_nonfinite"]
