"""Zeros that an op with a pole turns into inf: ``log(softmax(x))`` where softmax flushed small probabilities.

The inf is made by ``log``/``reciprocal``/``rsqrt``/``x / d``, but its cause is the op upstream that returned 0
for values that are nonzero in the fp32 reference (an underflow), however few of them: a partial flush is enough
for one ``log(0) = -inf``. Decided from the op registry's ``POLE`` kind and the reference comparison.
"""

from __future__ import annotations

from ampdoctor.findings._analysis import flush_of
from ampdoctor.findings._common import ALIAS_OPS, op_base
from ampdoctor.findings._context import Context
from ampdoctor.trace import Kind, OpRecord, ops_with

POLES = ops_with(Kind.POLE)


def _producer(ctx: Context, x: OpRecord) -> OpRecord:
    """Through views and copies to the op that computed the values."""
    while x.kind == "op" and op_base(x.op) in ALIAS_OPS and x.inputs and x.inputs[0] >= 0:
        x = ctx.records[x.inputs[0]]
    return x


def flushed_pole_input(ctx: Context, r: OpRecord) -> tuple[OpRecord, float] | None:
    """``(producer, extra zeros)`` when pole op ``r`` made inf from an input holding zeros the reference does not."""
    if r.kind != "op" or op_base(r.op) not in POLES:
        return None
    if r.stats.get("n_posinf", 0) + r.stats.get("n_neginf", 0) == 0:
        return None
    for i in r.inputs:
        if i < 0:
            continue
        x = ctx.records[i]
        f = flush_of(ctx, x)
        if f is not None and f[0] > 0 and f[1] > 0:
            return _producer(ctx, x), f[0]
    return None


__all__ = ["POLES", "flushed_pole_input"]
