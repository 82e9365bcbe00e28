"""Literal constants that do not survive the dtype they are written into.

Read by the ``constant-out-of-range`` rule. The decision uses the literal's value, the record's dtype and the
reference comparison only:

* *flushed*: the op adds (or subtracts) a Python number that rounds to 0 in the record's dtype, and the record holds
  zeros where the fp32 reference holds the literal's value;
* *rounded onto ±1*: a literal that is not ±1 becomes exactly ±1 in the dtype (``1 - 1e-6`` in fp16, ``1 - 1e-4`` in
  bf16), so a clamp bound meant to keep values off ±1 lets ±1 through (``atanh(1) = inf``, ``log(1 - 1) = -inf``);
* *no-op*: ``x + c`` whose result equals ``x`` in the dtype (every |x| is beyond ``|c| / u``: ``x + 1e-4`` on values
  ~1 in bf16) while the fp32 reference changes;
* *latent overflow*: a finite literal beyond the dtype's max (``(1 - keep) * -1e9`` in fp16) makes inf where the
  fp32 reference holds the finite value, and nothing harmful comes of it in this run (``sigmoid(-inf) = 0``, a
  softmax row that keeps other entries): a warning, since one change downstream (a row with every entry masked,
  ``inf - inf``) turns it into NaN. ``finfo(dtype).min`` fits its dtype, and a literal ``-inf`` is -inf in fp32
  too (deliberate): neither is reported.

A literal is a Python number the op receives (``.Scalar`` overloads, and numbers in arithmetic, which reach the
dispatcher as numbers) or a one-element leaf tensor (``torch.tensor(eps)``, a 0-dim wrapped number).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampdoctor.findings._common import (
    LOW,
    base_evidence,
    counts_known,
    dtype_name,
    feeders,
    fmt,
    limits,
    op_base,
    spacing_below_one,
    src_text,
    where,
)
from ampdoctor.findings._context import Context, reference_nonfinite
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._remedies import propose
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, Role, op_info, ops_with

#: literal roles whose flush to 0 removes an offset (an eps added, a clamp floor); read from the op registry
ADDITIVE = frozenset({Role.ADDEND, Role.BOUND})
#: literal roles that move values by a fixed amount, bound or scale them: a literal rounded onto ±1 there changes
#: the result (a bound lets ±1 through, a factor multiplies by 1)
SHIFTS = frozenset({Role.ADDEND, Role.BOUND, Role.FACTOR})
#: the role of a literal that moves ``x`` by a fixed amount: a no-op when it rounds away against every |x|
OFFSETS = frozenset({Role.ADDEND})
CLIP_OPS = ops_with(Kind.CLIPS)
_STAT_KEYS = ("absmax", "norm", "n_zero", "min_nonzero", "numel")


def in_dtype(v: float, dtype: str) -> float:
    """``v`` as the dtype stores it."""
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        return v
    return float(torch.tensor(v, dtype=torch.float64).to(dt).to(torch.float64))


def flushed_literals(ctx: Context) -> list[tuple[OpRecord, float, float, int]]:
    """``(record, literal, reference zeros, target zeros)``: a nonzero literal that is 0 in the record's low dtype,
    added where the reference holds fewer zeros than the target (the eps meant to keep a value off 0 is gone)."""
    out: list[tuple[OpRecord, float, float, int]] = []
    for r in ctx.records:
        if r.kind != "op" or dtype_name(r.dtype) not in LOW or not r.literals:
            continue
        lits = [v for lit, v in r.literals
                if lit.role in ADDITIVE and v != 0 and in_dtype(v, dtype_name(r.dtype)) == 0.0]
        if not lits:
            continue
        ref = ctx.ref(r)
        s = r.stats
        if ref is None or "n_zero" not in s or "n_zero" not in ref.stats:
            continue
        if s["n_zero"] > ref.stats["n_zero"]:
            out.append((r, lits[0], ref.stats["n_zero"], int(s["n_zero"])))
    return out


def feeds_harm(ctx: Context, r: OpRecord) -> OpRecord | None:
    """The first harmful non-finite origin computed from ``r`` within 6 steps, if any."""
    for o in ctx.harmful_origins():
        if o.record.index > r.index and any(x.index == r.index for x in feeders(ctx.records, o.record, 6)):
            return o.record
    return None


def flushed_literal_evidence(ctx: Context, r: OpRecord, lit: float, ref_zero: float, zero: int) -> dict[str, Any]:
    dt = dtype_name(r.dtype)
    return {"constant": lit, "constant_in_dtype": in_dtype(lit, dt), "smallest_subnormal": limits(dt)[2],
            "n_zero": zero, "ref_n_zero": int(ref_zero)}


def literals_of(ctx: Context, r: OpRecord, roles: frozenset[Role]) -> list[float]:
    """The literals of ``roles`` that ``r`` reads: its Python numbers in those places (the op registry), and the
    values of one-element leaf tensors among its inputs when the op declares such a literal."""
    out = [v for lit, v in r.literals if lit.role in roles]
    if not any(lit.role in roles for lit in op_info(op_base(r.op)).literals):
        return [v for v in out if math.isfinite(v)]
    for i in r.inputs:
        x = ctx.records[i] if i >= 0 else None
        if x is not None and x.kind == "input" and x.stats.get("numel") == 1 and not x.shape:
            out.append(x.stats.get("absmax", math.nan))
    return [v for v in out if math.isfinite(v)]


def rounded_to_one(ctx: Context) -> list[tuple[OpRecord, float, OpRecord | None]]:
    """``(record, literal, harmful origin it feeds)``: a literal that is not ±1 but is exactly ±1 in the record's low
    dtype, where it matters: it feeds a harmful inf/NaN, or (a clamp) the target lets ±1 through and fp32 does not."""
    out: list[tuple[OpRecord, float, OpRecord | None]] = []
    for r in ctx.records:
        dt = dtype_name(r.dtype)
        if r.kind != "op" or dt not in LOW:
            continue
        lits = [v for v in literals_of(ctx, r, SHIFTS) if abs(v) != 1 and abs(in_dtype(v, dt)) == 1.0]
        if not lits:
            continue
        ref = ctx.ref(r)
        lets_one = op_base(r.op) in CLIP_OPS and ref is not None and r.stats.get("absmax") == 1.0 \
            and ref.stats.get("absmax", 1.0) < 1.0
        harm = feeds_harm(ctx, r)
        if harm is not None and not lets_one and not zeros_between(ctx, r, harm):
            harm = None  # an inf/NaN downstream that this literal's rounding did not make
        if harm is not None or lets_one:
            out.append((r, lits[0], harm))
    return out


def noop_literals(ctx: Context) -> list[tuple[OpRecord, float, OpRecord | None]]:
    """``(record, literal, harmful origin it feeds)``: ``x + c`` / ``x - c`` with ``c`` nonzero in the low dtype whose
    result is ``x`` unchanged (identical statistics) while the fp32 reference's result differs from its input."""
    out: list[tuple[OpRecord, float, OpRecord | None]] = []
    recs = ctx.records
    for r in recs:
        dt = dtype_name(r.dtype)
        if r.kind != "op" or dt not in LOW:
            continue
        lits = [v for v in literals_of(ctx, r, OFFSETS) if v != 0 and in_dtype(v, dt) != 0.0]
        src = next((recs[i] for i in r.inputs if i >= 0 and recs[i].shape == r.shape), None)
        if not lits or src is None or any(r.stats.get(k) != src.stats.get(k) for k in _STAT_KEYS):
            continue
        if not _shows_noop(src.stats, r.stats, lits[0], dt):
            continue
        ref, ref_src = ctx.ref(r), ctx.ref(src)
        if ref is None or ref_src is None or not ref_src.stats.get("norm"):
            continue
        if abs(ref.stats.get("norm", 0.0) - ref_src.stats["norm"]) <= 4 * 2.0 ** -24 * ref_src.stats["norm"]:
            continue  # fp32 does not move the values either: the literal is negligible by design
        harm = feeds_harm(ctx, r)
        out.append((r, lits[0], harm if harm is not None and zeros_between(ctx, r, harm) else None))
    return out


def _shows_noop(s_in: dict[str, float], s_out: dict[str, float], lit: float, dt: str) -> bool:
    """Identical statistics prove ``x + c == x`` only where they can: every value finite (the statistics are over
    finite values, so an inf input and its inf output look alike whatever ``c`` does), counts known (not the lite
    tier), no zeros (``0 + c`` is ``c``), and ``c`` rounding away even against the smallest magnitude."""
    nonfinite = ("n_nan", "n_posinf", "n_neginf")
    if any(s.get(k, math.nan) != 0 for s in (s_in, s_out) for k in nonfinite):
        return False
    if not (counts_known(s_in) and counts_known(s_out)) or not s_in.get("numel") or s_in.get("n_zero", 1) != 0:
        return False
    m = s_in.get("min_nonzero", math.nan)
    if not math.isfinite(m) or m <= 0:
        return False
    return in_dtype(m + abs(lit), dt) == m and in_dtype(m - abs(lit), dt) == m


def zeros_between(ctx: Context, r: OpRecord, harm: OpRecord) -> bool:
    """Between ``r`` and the harmful ``harm`` (within 6 hops), a record holds exact zeros where fp32 holds values: the
    offset the literal should have kept is gone (``(h + eps) - 1 = 0``), and the inf/NaN is made from it."""
    recs = ctx.records
    for x in feeders(recs, harm, 6):
        if x.index > r.index and _extra_zeros(ctx, x) and not any(i >= 0 and _extra_zeros(ctx, recs[i])
                                                                  for i in x.inputs) \
                and any(y.index == r.index for y in feeders(recs, x, 6)):
            return True  # x makes its own zeros (not inherited), downstream of the literal
    return False


def _extra_zeros(ctx: Context, x: OpRecord) -> bool:
    ref = ctx.ref(x)
    if ref is None or not counts_known(x.stats) or not counts_known(ref.stats):
        return False
    return x.stats.get("n_zero", 0) > ref.stats.get("n_zero", 0)


def _explain(ctx: Context, r: OpRecord, lit: float, harm: OpRecord | None, what: str) -> tuple[str, dict[str, Any]]:
    dt = dtype_name(r.dtype)
    ev = base_evidence(r)
    ev.update({"constant": lit, "constant_in_dtype": in_dtype(lit, dt), "mechanism": what,
               "spacing_below_1": spacing_below_one(dt)})
    at = f" [{src_text(r)}]" if r.src else ""
    val = f"the literal {lit:.7g}, which is {in_dtype(lit, dt):g} in {dt}"
    if what == "rounded":
        expl = (f"{where(r)}{at} uses {val} ({dt} holds nothing between 1 - {fmt(spacing_below_one(dt))} and 1): "
                "a bound meant to keep values off ±1 lets ±1 through.")
    else:
        ref = ctx.ref(r)
        ev["absmax"] = r.stats.get("absmax")
        expl = (f"{where(r)}{at} adds {val}, but against values up to |{fmt(r.stats.get('absmax', math.nan))}| it "
                f"rounds away: the result equals the input exactly in {dt}, where the fp32 reference changes "
                f"(|max| {fmt(ref.stats['absmax']) if ref is not None else '?'}); the op is a no-op.")
    if harm is not None:
        ev["consequence"] = ctx.describe(harm)
        expl += f" The values it should have changed then make inf/NaN at {where(harm)}."
    return expl, ev


def out_of_range_literal(ctx: Context, r: OpRecord) -> float | None:
    """A literal in ``r``'s arguments (a Python number or a one-element leaf tensor) beyond its dtype's range."""
    fmax = limits(r.dtype)[0]
    for v in r.scalars:
        if math.isfinite(v) and abs(v) > fmax:
            return v
    for i in r.inputs:
        if i < 0:
            continue
        src = ctx.records[i]
        if src.kind in ("input", "batch") and src.stats.get("numel") == 1 and src.stats["absmax"] > fmax:
            return src.stats["absmax"] * (-1 if src.stats.get("n_neginf", 0) else 1)
    return None


def latent_literal_candidates(ctx: Context) -> list[Candidate]:
    """``constant-out-of-range`` warnings: an op that turns a finite literal beyond its low dtype's max into inf,
    where the aligned fp32 record is finite, with no harm in this run (a harmful origin is an error elsewhere)."""
    out: list[Candidate] = []
    for o in ctx.origins:
        r = o.record
        dt = dtype_name(r.dtype)
        if o.harmful or o.deliberate or r.kind != "op" or dt not in LOW or ctx.ref(r) is None \
                or reference_nonfinite(ctx, r) or r.stats.get("n_posinf", 0) + r.stats.get("n_neginf", 0) == 0:
            continue
        v = out_of_range_literal(ctx, r)
        if v is None:
            continue
        absorbed = [ctx.records[a] for a in ctx.lineage.absorbed.get(r.index, [])]
        ev = base_evidence(r)
        ev.update({"constant": v, "constant_in_dtype": in_dtype(v, dt), "format_max": limits(dt)[0],
                   "mechanism": "latent", "n_inf": int(r.stats["n_posinf"] + r.stats["n_neginf"])})
        if absorbed:
            ev["absorbed_by"] = ctx.describe(absorbed[0])
        at = f" [{src_text(r)}]" if r.src else ""
        by = f" ({op_base(absorbed[0].op)} in {absorbed[0].module or '<root>'} absorbs it)" if absorbed else ""
        expl = (f"{where(r)}{at} uses the literal {v:g}, which is {in_dtype(v, dt):g} in {dt} (max "
                f"{fmt(limits(dt)[0])}): it makes {ev['n_inf']} inf value(s) where the fp32 reference holds "
                f"{v:g}. Nothing is damaged in this run{by}, but the values are inf, not large: a row with every "
                "entry masked, a subtraction of two of them or a product with 0 makes NaN.")
        out.append(Candidate(Finding(
            "constant-out-of-range", "warning", r.module, r.op, r.phase,
            f"literal {v:g} is {in_dtype(v, dt):g} in {dt} in {r.module or '<root>'} (latent)", expl, ev,
            (propose("mask-finfo-min", modules=[r.module]),), r.step), r.index))
    return out


def _fixes(r: OpRecord, what: str) -> tuple[FixProposal, ...]:
    if what == "rounded":
        return (FixProposal("write the bound in the tensor's dtype: 1 - finfo(dtype).eps is below 1 in every format",
                            "one = 1 - torch.finfo(x.dtype).eps  # fp16: 0.999; bf16: 0.992\n"
                            "x = x.clamp(-one, one)"),
                FixProposal(f"compute `{r.module or '<root>'}` in float32 (the bound survives there)", "",
                            id="keep_fp32", params={"modules": [r.module]} if r.module else {}))
    return (FixProposal("scale the literal to the dtype's resolution at the values it meets",
                        "x = x + torch.finfo(x.dtype).eps * x.abs().clamp_min(1)  # or compute this in float32"),
            FixProposal(f"compute `{r.module or '<root>'}` in float32", "", id="keep_fp32",
                        params={"modules": [r.module]} if r.module else {}))


def rounded_literal_candidates(ctx: Context) -> list[Candidate]:
    """``constant-out-of-range`` for literals rounded onto ±1 and no-op offsets: error when they make a harmful
    inf/NaN (they precede it: the root cause); otherwise a warning for a bound that lets ±1 through, and info for a
    no-op offset (an eps guard against values far above it rounds away by design until the values get small)."""
    out: list[Candidate] = []
    for what, hits in (("rounded", rounded_to_one(ctx)), ("no-op", noop_literals(ctx))):
        for r, lit, harm in hits:
            dt = dtype_name(r.dtype)
            expl, ev = _explain(ctx, r, lit, harm, what)
            mod = r.module or "<root>"
            title = (f"literal {lit:.7g} is {in_dtype(lit, dt):g} in {dt} in {mod}" if what == "rounded"
                     else f"literal {lit:g} is a no-op in {dt} in {mod}")
            severity = "error" if harm is not None else "warning" if what == "rounded" else "info"
            out.append(Candidate(Finding(
                "constant-out-of-range", severity, r.module, r.op, r.phase, title,
                expl, ev, _fixes(r, what), r.step), r.index))
    return out


__all__ = ["OFFSETS", "SHIFTS", "feeds_harm", "flushed_literal_evidence", "flushed_literals", "in_dtype",
           "latent_literal_candidates", "literals_of", "noop_literals", "out_of_range_literal",
           "rounded_literal_candidates", "rounded_to_one", "zeros_between"]
