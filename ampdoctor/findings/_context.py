"""What the rules read: the target and reference runs, aligned op by op, and the classified origins.

Alignment key: ``(step, phase, module, op, output position, k)`` where ``k`` counts earlier records with the
same first five fields. Ops that exist in one dtype only (an fp16-only clamp, autocast's casts) shift only
their own count, so the rest stays aligned.

An origin is *harmful* when its lineage reaches the loss, a model output, a gradient written to ``.grad``,
or an optimizer-phase value, or when a finite record that absorbed it disagrees with the reference
(``rsqrt(inf) = 0`` in an RMSNorm). Otherwise it is *benign* (a ``-inf`` mask softmax absorbs, T5's
``log(0)`` discarded by ``torch.where``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampdoctor.precision import RunResult, StepSpec
from ampdoctor.trace import Lineage, OpRecord, dtype_limits
from ampdoctor.trace._lineage import analyse_lineage, has_nan, is_nonfinite

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)))}


def dtype_name(d: torch.dtype | str) -> str:
    return str(d).replace("torch.", "")


def limits(d: torch.dtype | str) -> tuple[float, float, float]:
    dt = _DTYPES.get(dtype_name(d)) if isinstance(d, str) else d
    if dt is None:
        return math.inf, 0.0, 0.0
    return dtype_limits(dt)


def op_base(op: str) -> str:
    """``"aten.mm.default"`` -> ``"mm"``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


def align_key(r: OpRecord, k: int) -> tuple[Any, ...]:
    return (r.step, r.phase, r.module, r.op, r.out_pos, r.kind, k)


def build_alignment(records: list[OpRecord]) -> dict[tuple[Any, ...], OpRecord]:
    counts: dict[tuple[Any, ...], int] = {}
    out: dict[tuple[Any, ...], OpRecord] = {}
    for r in records:
        base = (r.step, r.phase, r.module, r.op, r.out_pos, r.kind)
        k = counts.get(base, 0)
        counts[base] = k + 1
        key = align_key(r, k)
        r.align = key
        out[key] = r
    return out


@dataclass
class Origin:
    record: OpRecord
    harmful: bool
    reasons: list[str]
    deliberate: bool  # the non-finite value is a literal (a -inf mask fill)


@dataclass
class Context:
    spec: StepSpec
    target: RunResult
    reference: RunResult | None
    lineage: Lineage
    ref_align: dict[tuple[Any, ...], OpRecord]
    origins: list[Origin] = field(default_factory=list)
    protected: set[int] = field(default_factory=set)

    @property
    def records(self) -> list[OpRecord]:
        return self.target.trace.records

    def ref(self, r: OpRecord) -> OpRecord | None:
        """The aligned reference record, or ``None`` when the op has no counterpart."""
        if self.reference is None or not r.align:
            return None
        cand = self.ref_align.get(r.align)
        if cand is None or cand.shape != r.shape:
            return None
        return cand

    def chain(self, origin: int) -> list[int]:
        return [origin, *self.lineage.descendants.get(origin, [])]

    def harmful_origins(self) -> list[Origin]:
        return [o for o in self.origins if o.harmful]

    def describe(self, r: OpRecord) -> dict[str, Any]:
        return {"op": r.op, "module": r.module, "phase": r.phase, "step": r.step, "index": r.index,
                "node": r.node}


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
    ref_align: dict[tuple[Any, ...], OpRecord] = {}
    if reference is not None:
        ref_align = build_alignment(reference.trace.records)
    build_alignment(target.trace.records)
    ctx = Context(spec, target, reference, lineage, ref_align)
    records = target.trace.records
    protected = set(target.trace.marks.get("loss", [])) | set(target.trace.marks.get("output", []))
    ctx.protected = protected
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


def group_by_owner(names: Iterable[str], owners: dict[str, str]) -> dict[str, list[str]]:
    """Parameter names grouped by the module that registers them, in first-seen order."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(owners.get(n, n.rpartition(".")[0]), []).append(n)
    return out


def feeders(records: list[OpRecord], record: OpRecord, depth: int, follow: Any = None) -> list[OpRecord]:
    """Records feeding ``record`` within ``depth`` hops, breadth first, each once. With ``follow``, only records for
    which ``follow(x)`` is true are returned and walked through."""
    out: list[OpRecord] = []
    frontier, seen = list(record.inputs), set()
    for _ in range(depth):
        nxt: list[int] = []
        for i in frontier:
            if i < 0 or i in seen:
                continue
            seen.add(i)
            x = records[i]
            if follow is not None and not follow(x):
                continue
            out.append(x)
            nxt.extend(x.inputs)
        frontier = nxt
    return out


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


__all__ = ["Context", "Origin", "agrees", "build_context", "chain_summary", "dtype_name", "feeders", "group_by_owner",
           "has_nan", "limits", "nan_record", "op_base", "reference_nonfinite"]
