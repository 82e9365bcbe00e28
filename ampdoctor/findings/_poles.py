"""Zeros that an op with a pole turns into inf: ``log(softmax(x))`` where softmax flushed small probabilities.

The inf is made by ``log``/``reciprocal``/``rsqrt``/``x / d`` (or ``pow`` with a negative exponent: the backward
of ``(1 - p) ** 0.5`` is ``0.5 * (1 - p) ** -0.5``), but its cause is the op upstream that returned 0 for values
that are nonzero in the fp32 reference, however few of them: a partial flush is enough for one ``log(0) = -inf``.
That op is an underflow, or -- when the zeros are ``1 - p`` of a ``p`` that a saturating activation rounded to
exactly 1 -- the saturation (:func:`saturated_feeder`). Decided from the op registry's ``POLE`` kind and the
reference comparison.
"""

from __future__ import annotations

from ampdoctor.findings._analysis import flush_of
from ampdoctor.findings._common import ALIAS_OPS, op_base
from ampdoctor.findings._context import Context
from ampdoctor.trace import Kind, OpRecord, ops_with

POLES = ops_with(Kind.POLE)
#: ``pow(x, e)`` is a pole at x = 0 when e < 0 (a number exponent >= 0 is none); its inf is judged by its zero input
#: and finite reference
POWERS = frozenset({"pow"})


def _producer(ctx: Context, x: OpRecord) -> OpRecord:
    """Through views and copies to the op that computed the values."""
    while x.kind == "op" and op_base(x.op) in ALIAS_OPS and x.inputs and x.inputs[0] >= 0:
        x = ctx.records[x.inputs[0]]
    return x


def flushed_pole_input(ctx: Context, r: OpRecord) -> tuple[OpRecord, float] | None:
    """``(producer, extra zeros)`` when pole op ``r`` made inf from an input holding zeros the reference does not."""
    if r.kind != "op" or op_base(r.op) not in POLES | POWERS:
        return None
    if r.stats.get("n_posinf", 0) + r.stats.get("n_neginf", 0) == 0:
        return None
    if op_base(r.op) in POWERS and not _finite_reference(ctx, r):
        return None  # a power that overflows fp32 too, or whose reference is missing: not a pole hit
    if op_base(r.op) in POWERS and r.scalars and min(r.scalars) >= 0:
        return None  # x ** 2 (or 2 ** x) has no pole: its inf is an overflow, not a zero turned into inf
    for i in r.inputs:
        if i < 0:
            continue
        x = ctx.records[i]
        f = flush_of(ctx, x)
        if f is not None and f[0] > 0 and f[1] > 0:
            return _producer(ctx, x), f[0]
    return None


def _finite_reference(ctx: Context, r: OpRecord) -> bool:
    ref = ctx.ref(r)
    s = ref.stats if ref is not None else None
    return bool(s) and s.get("n_posinf", 0) + s.get("n_neginf", 0) + s.get("n_nan", 0) == 0  # type: ignore[union-attr]


def saturated_feeder(ctx: Context, producer: OpRecord) -> OpRecord | None:
    """The saturated activation (``ctx.saturated_sources``) the zeros of ``producer`` were computed from, if any:
    ``1 - sigmoid(x)`` is exactly 0 once sigmoid rounds to 1, with no value below the subnormal range."""
    sat = ctx.saturated_sources
    if not sat:
        return None
    seen, stack = {producer.index}, [producer.index]
    while stack and len(seen) < 64:  # a few ops back: the saturated value feeds the zeros directly
        for i in ctx.records[stack.pop()].inputs:
            if i < 0 or i in seen:
                continue
            if i in sat:  # the bounded op itself or an alias of it (detach, view): the nearest op before
                return max((r for r, *_ in ctx.saturated if r.index <= i), key=lambda r: r.index, default=None)
            seen.add(i)
            stack.append(i)
    return None


__all__ = ["POLES", "flushed_pole_input", "saturated_feeder"]
