"""Registered buffers as origins: damage already in a buffer's stored value when the step starts.

A whole-model cast (``model.half()``, ``.to(torch.bfloat16)``) rounds every floating buffer. The trace names
each leaf read from a registered floating buffer (:attr:`OpRecord.name`); this module compares that leaf in the
target run with the same leaf in the fp32 reference, by mechanism only (never by the buffer's name):

* ``nonfinite``: inf/NaN in the target where fp32 holds finite values (a mask built with
  ``torch.finfo(torch.float32).min``, a large table) -- reported under ``overflow``;
* ``flushed``: values nonzero in fp32 that are exactly 0 in the target (tiny variances, scales) -- ``underflow``;
* ``inexact``: an integer-valued buffer (positions, indices, counts) beyond the integers the target dtype holds
  exactly (fp16 2048, bf16 256): distinct integers round together -- ``must-stay-fp32``.

The finding is at phase ``setup`` on the owning module. It is an ``error`` ranked before every traced op when the
damage reaches a symptom: a harmful non-finite origin or a precision loss computed from the buffer (for
``inexact``, also anything the reading module computes afterwards: integer casts break the floating lineage);
otherwise a ``warning``. A flush that only drops values below the rounding of the buffer's own largest entry
(``u * |max|``) from a buffer that only enters sums of products (GEMM / convolution kernels, through views and
casts) changes no result beyond that sum's rounding: a ``warning`` with ``negligible`` in evidence, however many
symptoms lie downstream (a conv-STFT's DFT kernel: ``cos(pi / 2)`` is 6e-17 in float32, 0 in fp16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampdoctor.findings._common import (
    ALIAS_OPS,
    CASTS,
    SAME_VALUE_OPS,
    dtype_name,
    fmt,
    is_low,
    limits,
    op_base,
    unit_roundoff,
)
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import SETUP_BUFFER, Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, ops_with

#: the rule (code) that reports each kind of damage
CODE_OF = {"nonfinite": "overflow", "flushed": "underflow", "inexact": "must-stay-fp32"}


@dataclass(frozen=True)
class BufferDamage:
    """One registered buffer whose target value at the start of the step is damaged relative to fp32."""

    record: OpRecord  # the buffer's first leaf record in the target trace (step 0)
    kind: str  # "nonfinite" | "flushed" | "inexact"
    count: int  # damaged elements
    harmful: bool
    symptom: OpRecord | None
    evidence: dict[str, Any]


def _nonfinite(s: dict[str, float]) -> int:
    return int(s.get("n_nan", 0) + s.get("n_posinf", 0) + s.get("n_neginf", 0))


def _user_buffers(ctx: Context) -> dict[str, torch.Tensor]:
    model = getattr(ctx.spec.model, "module", ctx.spec.model)
    try:
        return {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    except Exception:  # noqa: BLE001 - a model without named_buffers: nothing to compare
        return {}


#: ops that pass a buffer's values on unchanged (views, copies, casts): followed to the ops that compute with them
_PASSES = ALIAS_OPS | SAME_VALUE_OPS | CASTS


def _only_contracted(ctx: Context, leaf: OpRecord) -> bool:
    """Whether every op of step 0 that computes with ``leaf``'s values (through views, copies and casts) is a GEMM
    or convolution, which sums them in products with other values (and at least one does)."""
    passing, gemms = {leaf.index}, 0
    for r in ctx.records[leaf.index + 1:]:
        if r.step != 0:
            break
        if not any(i in passing for i in r.inputs):
            continue
        base = op_base(r.op or "")
        if base in _PASSES:
            passing.add(r.index)
        elif base in ops_with(Kind.GEMM):
            gemms += 1
        else:
            return False
    return gemms > 0


def _largest_flushed(value: torch.Tensor | None, dtype: torch.dtype) -> tuple[float, float] | None:
    """``(largest |value| that is nonzero in float32 and 0 in dtype, |max|)`` of a float32 buffer."""
    if value is None or value.dtype != torch.float32 or not value.numel():
        return None
    v = value.detach()
    lost = (v != 0) & (v.to(dtype) == 0)
    if not bool(lost.any()):
        return None
    return float(v[lost].abs().max()), float(v.abs().max())


def _inexact(value: torch.Tensor | None, dtype: torch.dtype) -> tuple[int, int]:
    """``(elements changed, largest exact integer)`` of an integer-valued fp32 buffer rounded to ``dtype``."""
    exact = 2 ** round(-math.log2(unit_roundoff(dtype)))
    if value is None or value.dtype != torch.float32 or not value.numel():
        return 0, exact
    v = value.detach()
    if not bool(torch.isfinite(v).all()) or float(v.abs().max()) <= exact or not bool((v == v.round()).all()):
        return 0, exact
    return int((v.to(dtype).float() != v).sum()), exact


def _downstream(ctx: Context, leaf: OpRecord, by_module: bool) -> tuple[set[int], set[str]]:
    """Records of step 0 computed from ``leaf`` (and, with ``by_module``, everything the modules that read it run
    afterwards, their submodules included), and the modules that read it."""
    out = {leaf.index}
    readers: set[str] = {leaf.module} if leaf.module else set()  # the module that first read it
    for r in ctx.records[leaf.index + 1:]:
        if r.step != 0:
            break
        if any(i in out for i in r.inputs):
            out.add(r.index)
            if leaf.index in r.inputs and r.module:
                readers.add(r.module)
        elif by_module and _inside(r.module, readers):
            out.add(r.index)
    return out, readers


def _inside(module: str, scopes: set[str]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in scopes)


def _symptom(ctx: Context, down: set[int]) -> OpRecord | None:
    """The first harmful non-finite origin or precision-loss record in ``down``."""
    hits = [o.record for o in ctx.origins if o.harmful and o.record.index in down]
    hits += [r for r, *_ in ctx.precision_loss_records if r.index in down]
    return min(hits, key=lambda r: r.index) if hits else None


def buffer_damage(ctx: Context) -> list[BufferDamage]:
    """Every named buffer leaf of step 0 whose target value is damaged relative to its fp32 reference."""
    out: list[BufferDamage] = []
    seen: set[str] = set()
    values: dict[str, torch.Tensor] | None = None
    for r in ctx.records:
        if r.step != 0:
            break
        if r.kind != "input" or not r.name or r.name in seen or not is_low(r.dtype):
            continue
        seen.add(r.name)
        ref = ctx.ref(r)
        if ref is None or ref.kind != "input" or not r.stats or not ref.stats:
            continue
        s, rs = r.stats, ref.stats
        ev: dict[str, Any] = {"buffer": r.name, "dtype": dtype_name(r.dtype), "numel": int(s.get("numel", 0)),
                              "shape": list(r.shape), "ref_absmax": rs.get("absmax", math.nan),
                              "format_max": limits(r.dtype)[0]}
        kind, count = "", 0
        if _nonfinite(s) > _nonfinite(rs):
            kind, count = "nonfinite", _nonfinite(s) - _nonfinite(rs)
            ev.update(n_nan=int(s["n_nan"]), n_inf=int(s["n_posinf"] + s["n_neginf"]))
        elif s.get("n_zero", 0) > rs.get("n_zero", 0):
            kind, count = "flushed", int(s["n_zero"] - rs["n_zero"])
            ev.update(ref_min_nonzero=rs.get("min_nonzero", math.nan), smallest_subnormal=limits(r.dtype)[2])
        else:
            if values is None:
                values = _user_buffers(ctx)
            count, exact = _inexact(values.get(r.name), r.dtype)
            if count:
                kind = "inexact"
                ev.update(integers_exact_up_to=exact)
        if not kind:
            continue
        ev["damaged"] = count
        down, readers = _downstream(ctx, r, by_module=kind == "inexact")
        symptom = _symptom(ctx, down)
        if kind == "flushed":
            if values is None:
                values = _user_buffers(ctx)
            flushed = _largest_flushed(values.get(r.name), r.dtype)
            if flushed is not None:
                ev["largest_flushed"] = flushed[0]
                if flushed[0] <= unit_roundoff(r.dtype) * flushed[1] and _only_contracted(ctx, r):
                    ev["negligible"] = True
                    symptom = None
        err = ctx.target.trace.error or {}
        crashed = (symptom is None and not ev.get("negligible") and bool(err) and err.get("step") == 0
                   and _inside(err.get("module", ""), readers))
        if symptom is not None:
            ev["symptom"] = {"op": symptom.op or "<leaf>", "module": symptom.module, "index": symptom.index}
        elif crashed:
            ev["exception"] = {"op": err.get("op", ""), "module": err.get("module", ""), "type": err.get("type", ""),
                               "message": err.get("message", "")}
        out.append(BufferDamage(r, kind, count, symptom is not None or crashed, symptom, ev))
    return out


def _explain(d: BufferDamage, owner: str) -> tuple[str, str]:
    ev, dt, name = d.evidence, d.evidence["dtype"], d.record.name
    where = f"the buffer {name} of {owner or '<root>'}"
    if d.kind == "nonfinite":
        title = f"buffer {name} holds inf/NaN in {dt} (finite in fp32)"
        what = (f"{where} holds {d.count} inf/NaN of {ev['numel']} values in {dt}; in fp32 its |max| is "
                f"{fmt(ev['ref_absmax'])}, beyond {dt}'s max {fmt(ev['format_max'])} (a value written for float32, "
                "such as torch.finfo(torch.float32).min, stored in the low dtype by the model cast)")
    elif d.kind == "flushed":
        title = f"buffer {name}: values nonzero in fp32 are 0 in {dt}"
        what = (f"{where} has {d.count} values that are nonzero in fp32 (smallest {fmt(ev['ref_min_nonzero'])}) "
                f"but exactly 0 in {dt}: they lie below its smallest subnormal")
    else:
        title = f"buffer {name} holds integers beyond {dt}'s exact range"
        what = (f"{where} holds integer values up to {fmt(ev['ref_absmax'])}, but {dt} holds integers exactly only "
                f"up to {ev['integers_exact_up_to']}: {d.count} of {ev['numel']} values changed (distinct positions "
                "or indices now tie)")
    if d.symptom is not None:
        sym = d.symptom
        tail = (f" The damage is in the stored value before any op runs; it shows downstream at "
                f"{sym.op or 'a leaf'} in {sym.module or '<root>'} (record #{sym.index}).")
    elif "exception" in ev:
        exc = ev["exception"]
        tail = (f" The damage is in the stored value before any op runs; {exc['op']} in {exc['module'] or '<root>'} "
                f"then raised {exc['type']}: {exc['message']}")
    elif ev.get("negligible"):
        tail = (f" Each flushed value (the largest {fmt(ev['largest_flushed'])}) is below the rounding of the "
                f"buffer's largest entry ({fmt(ev['ref_absmax'])}) in {dt}, and the buffer only enters sums of "
                "products (GEMM / convolution kernels): the flush changes no result beyond that sum's rounding.")
    else:
        tail = " Nothing downstream shows it in this step (a latent hazard)."
    return title, what + "." + tail


def _fixes(d: BufferDamage, owner: str, precision: str | None) -> tuple[FixProposal, ...]:
    name = d.record.name
    attr = name.rsplit(".", 1)[-1]
    fixes = [FixProposal(
        "keep the buffer in float32 after the model cast (restore its float32 value)",
        f"model.half()\nmodel.get_submodule({owner!r}).{attr} = fp32_value  # the value before the cast",
        id="keep_fp32_buffers", params={"buffers": [name], "modules": [owner] if owner else []})]
    if d.kind == "nonfinite":
        fixes.append(FixProposal("build the constant for the dtype it is used in, at forward time",
                                 "mask = torch.full_like(scores, torch.finfo(scores.dtype).min).triu(1)"))
    elif d.kind == "inexact":
        fixes.append(FixProposal("store integer positions/indices in an integer buffer (int64), not a float one",
                                 "self.register_buffer('positions', torch.arange(n), persistent=False)"))
    if precision in ("fp16", "bf16"):
        low = "float16" if precision == "fp16" else "bfloat16"
        fixes.append(FixProposal("use autocast instead of casting the model: buffers then stay float32",
                                 f"with torch.autocast(device_type, dtype=torch.{low}):\n    loss = model(x).sum()",
                                 id="switch_precision", params={"precision": f"{precision}-amp"}))
    return tuple(fixes)


def buffer_candidates(ctx: Context, kind: str) -> list[Candidate]:
    """The findings of :func:`buffer_damage` of one ``kind`` (for the rule of :data:`CODE_OF` ``[kind]``)."""
    out: list[Candidate] = []
    for d in buffer_damage(ctx):
        if d.kind != kind:
            continue
        owner = d.record.name.rsplit(".", 1)[0] if "." in d.record.name else ""
        title, expl = _explain(d, owner)
        f = Finding(CODE_OF[kind], "error" if d.harmful else "warning", owner, "", "setup", title, expl,
                    dict(d.evidence), _fixes(d, owner, ctx.spec.precision), 0)
        out.append(Candidate(f, SETUP_BUFFER if d.harmful else d.record.index))
    return out


__all__ = ["CODE_OF", "BufferDamage", "buffer_candidates", "buffer_damage"]
