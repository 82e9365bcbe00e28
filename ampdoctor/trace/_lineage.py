"""Lineage of non-finite values: which record created them from finite inputs, and where they went.

An *origin* is a record whose output holds inf/NaN while none of its traced floating inputs does. Every
later record with a non-finite input and a non-finite output carries the origins of its inputs forward;
a record with a non-finite input and a finite output *absorbs* them (softmax of a partially masked row,
``rsqrt(inf) = 0``, a clamp, a cast to an integer type is not traced and so ends the chain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ampdoctor.trace._mode import OpRecord


def is_nonfinite(r: OpRecord) -> bool:
    s = r.stats
    if not s:
        return False
    if "n_nan" in s:
        return (s["n_nan"] + s["n_posinf"] + s["n_neginf"]) > 0
    mn, mx = s["min"], s["max"]
    return not (-float("inf") < mn <= mx < float("inf"))


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


def has_nan(r: OpRecord) -> bool:
    return r.stats.get("n_nan", 0) > 0


@dataclass
class Lineage:
    """``origins`` in order; ``descendants[o]`` non-finite records carrying origin ``o``;
    ``absorbed[o]`` finite records that consumed it; ``first_nan[o]`` the first NaN in its chain."""

    origins: list[int] = field(default_factory=list)
    carried: dict[int, frozenset[int]] = field(default_factory=dict)
    descendants: dict[int, list[int]] = field(default_factory=dict)
    absorbed: dict[int, list[int]] = field(default_factory=dict)
    first_nan: dict[int, int] = field(default_factory=dict)


def analyse_lineage(records: list[OpRecord]) -> Lineage:
    lin = Lineage()
    carried = lin.carried
    for r in records:
        nf_inputs = [i for i in r.inputs if i >= 0 and i in carried]
        if is_nonfinite(r):
            if not nf_inputs:
                lin.origins.append(r.index)
                lin.descendants[r.index] = []
                lin.absorbed[r.index] = []
                carried[r.index] = frozenset((r.index,))
                if has_nan(r):
                    lin.first_nan[r.index] = r.index
            else:
                origins: frozenset[int] = frozenset().union(*(carried[i] for i in nf_inputs))
                carried[r.index] = origins
                nan_in = any(has_nan(records[i]) for i in nf_inputs)
                for o in origins:
                    lin.descendants[o].append(r.index)
                    if has_nan(r) and not nan_in and o not in lin.first_nan:
                        lin.first_nan[o] = r.index
        elif nf_inputs:
            for o in frozenset().union(*(carried[i] for i in nf_inputs)):
                lin.absorbed[o].append(r.index)
    return lin
