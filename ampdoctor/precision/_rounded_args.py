"""``check``'s rounded-argument reason (:mod:`ampdoctor.precision.triage`): a sin/cos or (log-)softmax whose float32
argument is large enough that a 16-bit rounding at its magnitude can move it by what the function reads, decided
from the errors the guard step measures.

The precision-loss rule (``findings._absolute_args``) reports such a function when its argument's sampled error
reaches the threshold it reads and the rounding origin it picks upstream -- the earliest low-precision value
carrying at least half the largest sampled error of its candidates -- holds or adds an offset (for a softmax).
Here the float32 run names the candidates (:func:`argument_candidates`), the guard step samples their arguments
and possible origins (:func:`sample_keys`, :class:`~ampdoctor.trace.KeyedSamples`: the positions the float32 run
sampled) and :func:`argument_reasons` escalates only where the measurement (within :data:`MEASURED_SLACK`), or
for what it could not measure the size, leaves the rule a way to fire.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ampdoctor.trace import (
    ALIAS_OPS,
    Kind,
    TraceResult,
    adds_an_offset,
    dtype_info,
    feeders,
    op_base,
    ops_with,
    record_keys,
    unit_roundoff,
)

#: the absolute error a sin/cos (radians) or a softmax (logits) reads, and the rounding slack, that the
#: precision-loss rule's rounded-argument check uses (``findings._absolute_args``: PHASE_LOST, LOGIT_LOST,
#: ROUNDING_SLACK, SENTINEL; equal by test): an argument of float32 |max| A can lose that only if A * u * slack does
ABS_ARG_LOST = {"periodic": 0.5, "softmax": 0.25}
ABS_ARG_SLACK = 4.0
ABS_ARG_SENTINEL = 4096.0
ABS_ARG_DEPTH = 8
#: the guard step measures the errors the rule reads (the same elements of the same runs); a measured error this
#: factor below the rule's threshold still escalates (what could differ: a nondeterministic reduction on a GPU)
MEASURED_SLACK = 2.0
#: ops whose output is a view or a copy of their first input: the same dtype
_SAME_DTYPE = ops_with(Kind.VIEW) | ops_with(Kind.COPY)


def argument_candidates(ref: TraceResult, dtype: torch.dtype) -> list[tuple[Any, str]]:
    """The float32 run's sin/cos and (log-)softmax whose argument is large enough that the format's rounding at its
    magnitude can move it by what the function reads (a phase, a logit difference), with their kind."""
    kinds = {"periodic": ops_with(Kind.PERIODIC), "softmax": ops_with(Kind.SOFTMAX)}
    u = unit_roundoff(dtype)
    out = []
    for r in ref.records:
        if r.phase != "forward" or not r.inputs or r.inputs[0] < 0:
            continue
        kind = next((k for k, ops in kinds.items() if op_base(r.op) in ops), None)
        a = ref.records[r.inputs[0]].stats.get("absmax", 0.0) if kind is not None else 0.0
        if kind is None or (kind == "softmax" and a >= ABS_ARG_SENTINEL):
            continue  # a mask sentinel: its rounding is moot (the rule leaves it out too)
        if a * u * ABS_ARG_SLACK >= ABS_ARG_LOST[kind]:
            out.append((r, kind))
    return out


def _owner(records: list[Any], x: Any) -> Any:
    """The record whose element sample ``x`` shares (a view shares its source's statistics row and sample)."""
    while x.inputs and x.inputs[0] >= 0 and records[x.inputs[0]].row == x.row:
        x = records[x.inputs[0]]
    return x


def sample_keys(records: list[Any], cands: list[tuple[Any, str]]) -> set[tuple[str, str, str, int]]:
    """The keys of the records the guard step samples for ``cands``: each argument and every value upstream of it
    (:data:`ABS_ARG_DEPTH` hops) with its inputs, as the sample owners the float32 run's samples belong to."""
    keys = record_keys(records)
    want: set[tuple[str, str, str, int]] = set()
    for r, _ in cands:
        x0 = records[r.inputs[0]]
        for x in [x0, *feeders(records, x0, ABS_ARG_DEPTH)]:
            for y in [x, *(records[i] for i in x.inputs if i >= 0)]:
                key = keys.get(_owner(records, y).index)
                if key is not None:
                    want.add(key)
    return want


class _Measure:
    """Sampled ``|target - float32|`` of a float32 record's values in the guard step (``None``: not measured)."""

    def __init__(self, records: list[Any], samples: dict[Any, tuple[float, ...]]) -> None:
        self.records, self.samples, self.keys = records, samples, record_keys(records)

    def __call__(self, x: Any, bound: float = ABS_ARG_SENTINEL, cast: torch.dtype | None = None) -> float | None:
        """Over elements whose float32 value is below ``bound``; ``cast``: of the target's values rounded to it
        (what a cast autocast inserted holds)."""
        o = _owner(self.records, x)
        t = self.samples.get(self.keys.get(o.index, ("", "", "", -1)))
        if t is None or not o.sample or len(t) != len(o.sample):
            return None
        if cast is not None:
            t = tuple(torch.tensor(t, dtype=torch.float64).to(cast).to(torch.float64).tolist())
        d = [abs(a - b) for a, b in zip(t, o.sample) if math.isfinite(a) and math.isfinite(b) and abs(b) < bound]
        return max(d) if d else None


def argument_reasons(ref: TraceResult, target: list[Any], dtype: torch.dtype, fmt: str,
                      samples: dict[Any, tuple[float, ...]] | None = None) -> list[str]:
    """A sin/cos or (log-)softmax whose float32 argument is large enough that rounding at its magnitude can move it
    by what the function reads (a phase, a logit difference), whose argument the guard step measured off by that
    much (or could not measure), and upstream of which the target held a value in ``dtype`` that could be the
    rule's rounding site: the precision-loss rule compares their elements, the cheap guard step samples only these
    (a timestep cast before its sinusoid, an ALiBi bias, drifted logits)."""
    u = unit_roundoff(dtype)
    low = _low_in_target(ref.records, target)
    measure = _Measure(ref.records, samples or {})
    for r, kind in argument_candidates(ref, dtype):
        arg = ref.records[r.inputs[0]]
        err = measure(arg, ABS_ARG_SENTINEL if kind == "softmax" else math.inf)
        if err is not None and err * MEASURED_SLACK < ABS_ARG_LOST[kind]:
            continue  # measured: the argument keeps what the function reads
        if _rounding_site(ref.records, r.inputs[0], low, kind, u, measure, dtype):
            a = _absmax(arg)
            got = f"measured off by {err:.3g}" if err is not None else "not measured"
            return [f"{r.op} in {r.module or '<root>'} reads the absolute error of an argument of |max| {a:.4g}: "
                    f"{fmt}'s rounding there (u = {u:.3g}) can move it by {ABS_ARG_LOST[kind]:g} ({got})"]
    return []


def _low_in_target(ref: list[Any], target: list[Any]) -> set[int]:
    """Indices of float32 records that the target step held in a low precision: the record itself is low, or its
    twin (same phase, module, op and occurrence) in the cheap target trace is."""
    twins = {key: t.dtype for key, t in keyed(target)}
    keys = {r.index: key for key, r in keyed(ref)}
    out: set[int] = set()
    for r in ref:
        dt = twins.get(keys[r.index], r.dtype) if r.index in keys else r.dtype
        if r.index in keys and op_base(r.op) in _SAME_DTYPE and r.inputs and r.inputs[0] >= 0:
            if r.inputs[0] in out:  # a view holds its input's values: its occurrences shift with autocast's extra
                out.add(r.index)  # ones, its input's dtype does not
            continue
        info = dtype_info(dt) if dt is not None else None
        if info is not None and info.low_precision:
            out.add(r.index)
    return out


def _rounding_site(records: list[Any], arg: int, low: set[int], kind: str, u: float, measure: _Measure,
                   dtype: torch.dtype) -> bool:
    """Whether the precision-loss rule could find its rounding site for this argument: among the argument and its
    feeders (:data:`ABS_ARG_DEPTH` hops), a value held low in the target, or an input the target cast into low
    precision for one (autocast), that for a softmax adds an offset (a product scales the differences with the
    values) -- and that could be the rule's choice, the earliest site carrying at least half the largest sampled
    error of any candidate. When the argument itself was low, that is at least half the argument's error (the rule
    reports only one >= ``ABS_ARG_LOST``; its value's sample owner is a candidate). A site the guard step measured is
    ruled out by its sampled error (0, or below half that, with :data:`MEASURED_SLACK`), one it did not by its size
    (its rounding, within ``ABS_ARG_SLACK``, cannot be that)."""
    x0 = records[arg]
    top = 0.0  # a lower bound on the largest candidate error the rule weighs
    if arg in low:
        d0 = measure(x0)
        top = max(ABS_ARG_LOST[kind], d0 / MEASURED_SLACK if d0 is not None else 0.0)
    sites: list[tuple[float, float | None]] = []  # (|max|, sampled error) of each possible origin
    for x in [x0, *feeders(records, x0, ABS_ARG_DEPTH)]:
        if x.kind not in ("op", "batch") or x.index not in low or op_base(x.op or "") in ALIAS_OPS:
            continue
        if kind == "periodic" or x.kind == "batch" or adds_an_offset(x.op):
            sites.append((_absmax(x), measure(x)))
        for i in x.inputs:  # an input autocast cast to low for x: the cast holds its value as it is (an offset)
            if i >= 0 and i not in low and records[i].stats:
                sites.append((_absmax(records[i]), measure(records[i], cast=dtype)))
    for size, d in sites:
        ruled_out = (d == 0 or d * MEASURED_SLACK < top / 2) if d is not None else (
            ABS_ARG_SLACK * size * u < top / 2)
        if not ruled_out:
            return True
    return False


def _absmax(r: Any) -> float:
    return float(r.stats.get("absmax", 0.0))


def keyed(records: list[Any], ops_only: bool = True) -> Iterator[tuple[tuple[str, str, str, int], Any]]:
    """Records with their (phase, module, op, occurrence) key: how a cheap target record finds its float32 twin
    (autocast's extra casts are other ops and do not shift the count). ``ops_only``: op records only."""
    seen: dict[tuple[str, str, str], int] = {}
    for r in records:
        if ops_only and (r.kind != "op" or not r.op):
            continue
        key = (r.phase, r.module, op_base(r.op))
        n = seen[key] = seen.get(key, -1) + 1
        yield (*key, n), r


__all__ = ["ABS_ARG_DEPTH", "ABS_ARG_LOST", "ABS_ARG_SENTINEL", "ABS_ARG_SLACK", "MEASURED_SLACK",
           "argument_candidates", "argument_reasons", "keyed", "sample_keys"]
