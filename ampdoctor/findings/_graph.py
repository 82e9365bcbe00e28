"""Walks over the traced records: alias closures, ancestors and descendants, and gradient coverage."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ampdoctor.findings._common import SAME_VALUE_OPS, op_base

if TYPE_CHECKING:
    from ampdoctor.findings._context import Context
    from ampdoctor.trace import OpRecord


def alias_closure(ctx: Context, seeds: Iterable[int]) -> set[int]:
    """``seeds`` plus every later record that is a pure alias (detach, view, ...) of one of them."""
    out = set(seeds)
    if not out:
        return out
    start = min(out)
    for r in ctx.records[start + 1:]:
        if r.inputs and op_base(r.op) in SAME_VALUE_OPS:
            if any(i in out for i in r.inputs):
                out.add(r.index)
    return out


def ancestors(ctx: Context, idx: int, limit: int = 200_000) -> set[int]:
    """Indices of every record ``idx`` was computed from (through ``inputs``), ``idx`` included."""
    recs = ctx.records
    seen = {idx}
    stack = [idx]
    while stack and len(seen) < limit:
        for i in recs[stack.pop()].inputs:
            if i >= 0 and i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def descendants(ctx: Context, idx: int) -> set[int]:
    """Indices of every record computed from record ``idx`` (through ``inputs``), ``idx`` included."""
    out = {idx}
    for r in ctx.records[idx + 1:]:
        if any(i in out for i in r.inputs):
            out.add(r.index)
    return out


def gradient_params(ctx: Context, indices: set[int]) -> set[str]:
    """Parameters whose gradient is written (``AccumulateGrad``) by one of the records ``indices``."""
    sizes = param_numels(ctx)
    out: set[str] = set()
    for i in indices:
        r = ctx.records[i]
        if r.node == "AccumulateGrad":
            out.update(accumulated_params(ctx, r, sizes))
    return out


def accumulated_params(ctx: Context, r: OpRecord, sizes: dict[str, int]) -> list[str]:
    """The parameters an ``AccumulateGrad`` record ``r`` may write: owned by its module, of its element count
    (``sizes`` from :func:`param_numels`)."""
    n = int(r.stats.get("numel", -1))
    return [p for p, o in ctx.target.owners.items() if o == r.module and sizes.get(p, n) == n]


def param_numels(ctx: Context) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ctx.records:
        if r.kind == "param" and r.name and r.name not in out:
            out[r.name] = int(r.stats.get("numel", 0))
    return out


def coverage_at(run: Any, step: int) -> dict[str, Any]:
    if run is None or not run.coverage:
        return {}
    cov = run.coverage[min(step, len(run.coverage) - 1)]
    return {p.name: p for p in cov}


def dead_gradients(ctx: Context, step: int, names: set[str] | None = None) -> dict[str, tuple[float, float]]:
    """Parameters whose gradient is entirely zero in the target but not in the reference:
    ``{name: (target zero fraction, reference zero fraction)}``."""
    tcov, rcov = coverage_at(ctx.target, step), coverage_at(ctx.reference, step)
    out: dict[str, tuple[float, float]] = {}
    for name, ps in tcov.items():
        if names is not None and name not in names:
            continue
        rp = rcov.get(name)
        tz = ps.grad_zero
        rz = rp.grad_zero if rp is not None else None
        if isinstance(tz, float) and isinstance(rz, float) and tz >= 1.0 and rz < 1.0:
            out[name] = (tz, rz)
    return out


def zero_fraction(ctx: Context, step: int, names: set[str]) -> tuple[float | None, float | None]:
    """Fraction of gradient elements exactly zero over ``names``, target and reference (numel-weighted)."""
    sizes = param_numels(ctx)
    res: list[float | None] = []
    for run in (ctx.target, ctx.reference):
        cov = coverage_at(run, step)
        num = den = 0.0
        for n in names:
            ps = cov.get(n)
            if ps is None or not isinstance(ps.grad_zero, float):
                continue
            w = float(sizes.get(n, 1))
            num += ps.grad_zero * w
            den += w
        res.append(num / den if den else None)
    return res[0], res[1]
