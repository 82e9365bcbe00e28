"""Integer values rounded by a low precision: positions, ids, indices or counts held in fp16/bf16.

bf16 holds integers exactly only up to 2**8 = 256 (above it every 2nd, then every 4th, ...), fp16 up to
2**11 = 2048. A tensor of integers -- token positions, a diffusion transformer's text/image ids, sort keys, a
``cumsum`` of a mask -- cast or computed in such a dtype beyond that range rounds distinct integers together:
position 257 becomes 256, and everything computed from it (``sin(position * freq)``, an embedding row, an
index) is computed for the wrong integer. Norms hardly move (257 vs 256 is 0.4%), so the norm-based comparison
does not see it; the element samples of the trace (``trace._sample``) do.

Decided by mechanism only: the record's fp32 reference holds integer values (every sampled element), at least two
distinct ones beyond the dtype's exact range, and the target's sampled values differ there. The first such
record is the origin (records computed from it inherit the rounding). Reported as ``precision-loss`` by the
precision-loss rule: an ``error`` when the result deviates downstream (the first step's loss or output by more
than 1%, an op computed from it is wrong by more than 25% in its median element, or a periodic/exponential op
computed from it in any element), a ``warning`` otherwise. Integer
*buffers* that a whole-model cast rounded are a ``setup`` origin instead (``findings/_buffer_origins``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ampdoctor.findings._analysis import output_deviation
from ampdoctor.findings._common import base_evidence, dtype_name, fmt, is_low, op_base, unit_roundoff, where
from ampdoctor.findings._context import Context
from ampdoctor.findings._elementwise import AMPLIFIERS
from ampdoctor.findings._graph import descendants
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import OpRecord

#: a downstream op whose median element error exceeds this makes the rounding an error
ELEMENT_HARM = 0.25


@dataclass(frozen=True)
class IntegerRounding:
    """One record whose integer values the low precision rounded (judged on the trace's element sample)."""

    record: OpRecord
    exact: int  # largest integer the dtype holds exactly (all below it too)
    beyond: int  # sampled elements whose reference integer exceeds ``exact``
    changed: int  # of those, elements the target holds as a different value
    examples: tuple[tuple[float, float], ...]  # (reference, target) pairs of changed elements
    ref_absmax: float


def exact_integers(dtype: torch.dtype | str) -> int:
    """Largest integer up to which ``dtype`` holds every integer exactly (bf16 256, fp16 2048, e4m3 16)."""
    return 2 ** round(-math.log2(unit_roundoff(dtype)))


def _rounding(ctx: Context, r: OpRecord) -> IntegerRounding | None:
    if r.kind not in ("op", "batch") or r.phase != "forward" or not is_low(r.dtype) or not r.sample:
        return None
    ref = ctx.ref_or_cast_input(r)
    if ref is None or not ref.sample or len(ref.sample) != len(r.sample):
        return None
    if not all(math.isfinite(b) and b == round(b) for b in ref.sample):
        return None  # not integer-valued in fp32
    exact = exact_integers(r.dtype)
    beyond = [(b, a) for a, b in zip(r.sample, ref.sample) if abs(b) > exact]
    if len({b for b, _ in beyond}) < 2:
        return None  # one sentinel (a fill value) is not a range of positions or ids
    changed = [(b, a) for b, a in beyond if a != b]
    if not changed:
        return None
    return IntegerRounding(r, exact, len(beyond), len(changed), tuple(changed[:4]),
                           float(ref.stats.get("absmax", max(abs(b) for b, _ in beyond))))


def integer_roundings(ctx: Context) -> list[IntegerRounding]:
    """Every origin of rounded integers in step 0's forward, in trace order (not what is computed from one)."""
    out: list[IntegerRounding] = []
    tainted: set[int] = set()
    for r in ctx.records:
        if r.step != 0:
            break
        if any(i in tainted for i in r.inputs):
            tainted.add(r.index)
            continue
        hit = _rounding(ctx, r)
        if hit is not None:
            out.append(hit)
            tainted.add(r.index)
    return out


def _harm(ctx: Context, hit: IntegerRounding) -> tuple[float | None, OpRecord | None]:
    """``(output deviation, first downstream op that the rounding makes wrong)``: its median element is off by
    more than ELEMENT_HARM, or -- a periodic or exponential function of the integers (``sin(pos * freq)``) --
    some element is (a position encoded as another position, however few positions changed)."""
    errs = ctx.element_errors
    down = sorted(descendants(ctx, hit.record.index) - {hit.record.index})

    def wrong(i: int) -> bool:
        e = errs.get(i)
        if e is None:
            return False
        key = "max" if op_base(ctx.records[i].op) in AMPLIFIERS else "p50"
        return e[key] > ELEMENT_HARM

    lossy = next((ctx.records[i] for i in down if wrong(i)), None)
    return output_deviation(ctx), lossy


def integer_rounding_findings(ctx: Context) -> list[Candidate]:
    """``precision-loss`` candidates, one per rounding origin (:func:`integer_roundings`)."""
    out: list[Candidate] = []
    for hit in integer_roundings(ctx):
        r = hit.record
        dt = dtype_name(r.dtype)
        deviation, lossy = _harm(ctx, hit)
        harmful = (deviation is not None and deviation > 0.01) or lossy is not None
        ev = base_evidence(r)
        ev.update({"mechanism": "integers-rounded", "integers_exact_up_to": hit.exact,
                   "ref_absmax": hit.ref_absmax, "sampled_beyond_exact": hit.beyond,
                   "sampled_changed": hit.changed, "changed_fraction": hit.changed / hit.beyond,
                   "examples": [{"reference": b, "target": a} for b, a in hit.examples],
                   "output_deviation": deviation})
        src = "a batch tensor" if r.kind == "batch" else where(r)
        b0, a0 = hit.examples[0]
        expl = (f"{src} holds integer values (positions, ids, indices) up to {fmt(hit.ref_absmax)} in {dt}, "
                f"which holds integers exactly only up to {hit.exact}: {hit.changed} of the {hit.beyond} sampled "
                f"values beyond it changed (e.g. {b0:g} -> {a0:g}), so distinct integers round together and what "
                "is computed from them is computed for the wrong integer.")
        if lossy is not None:
            ev["lossy_op"] = ctx.describe(lossy)
            ev["lossy_elementwise"] = ctx.element_errors[lossy.index]
            expl += (f" {where(lossy)}, computed from them, is then wrong element by element (median "
                     f"{ev['lossy_elementwise']['p50']:.0%}, max {ev['lossy_elementwise']['max']:.0%} of the "
                     "reference) although it computes exactly what it is given.")
        if deviation is not None:
            expl += f" The step's result deviates {deviation:.2%} from fp32."
        if r.kind == "batch":
            expl += (f" ampdoctor cast this batch tensor to {dt} for precision '{ctx.spec.precision}' (as a "
                     "whole-model cast of the inputs would); under autocast ('-amp') inputs stay float32.")
        fixes = (
            FixProposal("keep integer positions/ids in an integer or float32 tensor: do not cast them to the "
                        "model's dtype", "ids = ids.to(torch.float32)  # or keep torch.long; cast what is "
                        "computed from them (the embedding), not the ids"),
            FixProposal("compute position-dependent values (angles, embeddings) in float32, then cast the result",
                        "emb = torch.cat([(pos.float()[..., None] * freqs.float()).sin(), ...], -1).to(x.dtype)"),
        )
        out.append(Candidate(Finding(
            "precision-loss", "error" if harmful else "warning", r.module, r.op, r.phase,
            f"integers beyond {hit.exact} round together in {dt} in {r.module or '<root>'}", expl, ev, fixes,
            r.step), r.index))
    return out


__all__ = ["IntegerRounding", "exact_integers", "integer_rounding_findings", "integer_roundings"]
