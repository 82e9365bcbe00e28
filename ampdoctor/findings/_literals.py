"""Literal constants that do not survive the dtype they are written into: a small ``eps`` that flushes to 0.

Read by the ``constant-out-of-range`` rule. The decision uses the literal's value, the record's dtype and the
reference comparison only: the op adds (or subtracts) a Python number that rounds to 0 in the record's dtype,
and the record holds zeros where the fp32 reference holds the literal's value.
"""

from __future__ import annotations

from typing import Any

import torch

from ampdoctor.findings._common import LOW, dtype_name, feeders, limits
from ampdoctor.findings._context import Context
from ampdoctor.trace import OpRecord, Role

#: literal roles whose flush to 0 removes an offset (an eps added, a clamp floor); read from the op registry
ADDITIVE = frozenset({Role.ADDEND, Role.BOUND})


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


__all__ = ["feeds_harm", "flushed_literal_evidence", "flushed_literals", "in_dtype"]
