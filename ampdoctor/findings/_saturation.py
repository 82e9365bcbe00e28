"""The saturation rule: a bounded activation (tanh, sigmoid, softmax) rounds to its bound in low precision.

The comparison with the fp32 reference is ``ctx.saturated`` (``findings/_analysis.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampdoctor.findings._common import (
    BOUNDS,
    base_evidence,
    dtype_name,
    fmt,
    keep_fp32_fix,
    op_base,
    spacing_below_one,
    unit_roundoff,
    where,
)
from ampdoctor.findings._context import Context
from ampdoctor.findings._graph import (
    alias_closure,
    ancestors,
    dead_gradients,
    zero_fraction,
)
from ampdoctor.findings._registry import Candidate, rule
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import OpRecord


def saturation_threshold(op: str, dtype: torch.dtype | str) -> float:
    """Smallest |x| whose ``op(x)`` rounds to the bound in ``dtype`` (fp16 tanh: 4.5055, bf16 tanh: 3.466)."""
    s = spacing_below_one(dtype)
    if op == "tanh":  # tanh(x) >= 1 - s/2 rounds to 1
        return 0.5 * math.log((2 - s / 2) / (s / 2))
    if op == "sigmoid":  # sigmoid(x) >= 1 - s/2 rounds to 1
        return math.log(2 / s - 1)
    return math.log(2 / s)  # softmax: the others' total below s/2 of the max



def _backward_of(ctx: Context, r: OpRecord) -> OpRecord | None:
    """The backward op of bounded record ``r`` (``tanh_backward`` reading r's saved output)."""
    want = BOUNDS[op_base(r.op)].backward
    aliases = alias_closure(ctx, [r.index])
    for b in ctx.records[r.index + 1:]:
        if b.phase == "backward" and b.step == r.step and op_base(b.op) == want and any(
                i in aliases for i in b.inputs):
            return b
    return None


@rule("saturation", severity="warning", precedence=45,
      summary="tanh/sigmoid/softmax outputs round to their bound in low precision, so their gradient is exactly 0")
def saturation(ctx: Context) -> list[Candidate]:
    """A bounded activation returns exactly its bound in the target dtype where the fp32 reference does not.
    Near the bound the dtype's spacing decides: fp16 holds no value between 1 - 2**-11 and 1, so
    ``tanh(x)`` for |x| >= 4.5055 is exactly ±1 (bf16: |x| >= 3.466); ``sigmoid(x)`` is exactly 1 for
    x >= 8.318 in fp16; a softmax row is exactly one-hot once the runner-up trails by ~8.3. The derivative
    ``1 - y**2`` (``y(1 - y)``, ``y(g - sum(g y))``) is then exactly 0 -- and loss scaling cannot help because
    ``0 * scale = 0``. Severity ``error`` when parameters that feed the op receive exactly-zero gradients in the
    target but not in the reference (the layers below stop learning), or when the exact bound becomes a harmful
    inf downstream: ``1 - p`` is then exactly 0 and a pole turns it into inf (``log(1 - p)`` in a hand-written
    BCE, the backward of a focal loss's ``(1 - p) ** gamma`` with gamma < 1) -- the saturation, not an underflow
    or an overflow, is the root cause (evidence ``zeros_op``, ``pole_op``); ``info`` when no backward op reads the
    saturated output (a forward-only run, or its gradient is not needed): rounding to the bound then moves each value
    by at most half the spacing below 1 and changes nothing its consumers compute, so it must not outrank the error
    its input carried in (evidence ``input_relative_error``, the input's relative error against fp32: a GELU-tanh
    whose argument is already off after accumulated bf16 error); ``warning`` otherwise. Evidence: fraction at
    the bound in target vs reference, the input |max|, the threshold, the dtype's spacing below 1, the gradient
    zero fraction of the upstream parameters."""
    out: list[Candidate] = []
    poles = _pole_hits(ctx)
    for r, ref, ft, fr in ctx.saturated:
        facts = _facts(ctx, r, ref, ft, fr)
        pole = poles.get(r.index)
        if pole is None and not facts.dead and (facts.bwd_zero is None or facts.bwd_zero < 0.5) and ft < 0.5:
            continue  # a few saturated entries whose gradient still flows elsewhere (GELU-tanh's x path)
        base, dt = op_base(r.op), dtype_name(r.dtype)
        expl, ev = _explanation(facts), facts.evidence
        inert = pole is None and not facts.dead and facts.bwd is None
        if inert:
            expl += _inert_text(ctx, facts)
        if pole is not None:
            zeros, inf_op = pole
            ev = dict(ev, zeros_op=ctx.describe(zeros), pole_op=inf_op.op, pole=ctx.describe(inf_op),
                      n_inf=int(inf_op.stats["n_posinf"] + inf_op.stats["n_neginf"]))
            zref = ctx.ref(zeros)
            held = f"values down to {fmt(zref.stats.get('min_nonzero', math.nan))}" if zref else "nonzero values"
            expl += (f" Computed from these exact bounds, {where(zeros)} returns exactly 0 where fp32 holds {held} "
                     f"(1 - p of a p that is exactly 1), and {where(inf_op)} maps those zeros to inf (a pole at 0: "
                     "log(0), 1/0, 0 ** negative); the inf reaches the loss or the gradients.")
        out.append(Candidate(Finding(
            "saturation", "error" if facts.dead or pole is not None else "info" if inert else "warning",
            r.module, r.op, r.phase,
            f"{base} saturates to {BOUNDS[base].text} in {dt} in {r.module or '<root>'}"
            + (": gradients below it are exactly zero" if facts.dead else "")
            + (f", and {op_base(pole[1].op)} turns the exact 0 it leaves into inf" if pole is not None else ""),
            expl, ev, _fixes(facts), r.step), r.index))
    return out


def _inert_text(ctx: Context, s: _Saturated) -> str:
    """Why a saturation no backward reads is no cause: rounding to the bound moves each value by at most half the
    spacing below 1; what the input already carried from upstream (its relative error) is what differs."""
    txt = (" No backward op reads it in this run (forward only, or its gradient is not needed): at the bound each "
           f"value moves by at most {fmt(spacing_below_one(s.r.dtype) / 2)}, so the saturation itself changes "
           "nothing its consumers compute.")
    e = ctx.relative_errors.get(s.inp.index) if s.inp is not None else None
    if e is not None and math.isfinite(e):
        s.evidence["input_relative_error"] = e
        if e > 16 * unit_roundoff(s.r.dtype):
            txt += (f" Its input already deviates from fp32 by {e:.1%}: that error was carried in from upstream "
                    "(see the precision-loss findings before it), not made here.")
    return txt


def _pole_hits(ctx: Context) -> dict[int, tuple[OpRecord, OpRecord]]:
    """Saturated record index -> (the op whose zeros it made, the pole op that turned them into a harmful inf)."""
    from ampdoctor.findings._poles import flushed_pole_input, saturated_feeder

    out: dict[int, tuple[OpRecord, OpRecord]] = {}
    for o in ctx.harmful_origins():
        hit = flushed_pole_input(ctx, o.record)
        sat = saturated_feeder(ctx, hit[0]) if hit is not None else None
        if hit is not None and sat is not None and sat.index not in out:
            out[sat.index] = (hit[0], o.record)
    return out


@dataclass(frozen=True)
class _Saturated:
    """What one saturated record tells: the record, its input, its backward op and the upstream parameters."""

    r: OpRecord
    ft: float
    fr: float
    inp: OpRecord | None
    ref_in: OpRecord | None
    bwd: OpRecord | None
    bwd_zero: float | None
    upstream: set[str]
    dead: dict[str, tuple[float, float]]
    zt: float | None
    zr: float | None
    evidence: dict[str, Any]


def _facts(ctx: Context, r: OpRecord, ref: OpRecord, ft: float, fr: float) -> _Saturated:
    base = op_base(r.op)
    recs = ctx.records
    inp = next((recs[i] for i in r.inputs if i >= 0), None)
    ref_in = ctx.ref(inp) if inp is not None else None
    ev = base_evidence(r)
    ev.update({
        "fraction_at_limit": ft, "ref_fraction_at_limit": fr, "n_at_limit": int(r.stats["n_at_limit"]),
        "ref_n_at_limit": int(ref.stats["n_at_limit"]), "bound": BOUNDS[base].text,
        "spacing_below_1": spacing_below_one(r.dtype), "saturation_threshold": saturation_threshold(base, r.dtype),
    })
    if inp is not None:
        ev["input_absmax"] = inp.stats.get("absmax")
        ev["input_module"] = inp.module
    if ref_in is not None:
        ev["ref_input_absmax"] = ref_in.stats.get("absmax")
    bwd = _backward_of(ctx, r)
    bwd_zero = None
    if bwd is not None:
        bref = ctx.ref(bwd)
        n = max(bwd.stats.get("numel", 0), 1)
        bwd_zero = bwd.stats.get("n_zero", 0) / n
        ev["grad_zero_fraction"] = bwd_zero
        ev["backward_op"] = bwd.op
        if bref is not None:
            ev["ref_grad_zero_fraction"] = bref.stats.get("n_zero", 0) / n
    upstream = {recs[i].name for i in ancestors(ctx, r.index) if recs[i].kind == "param" and recs[i].name}
    dead = dead_gradients(ctx, r.step, upstream) if upstream else {}
    zt, zr = zero_fraction(ctx, r.step, upstream) if upstream else (None, None)
    if zt is not None:
        ev["upstream_grad_zero_fraction"] = zt
        ev["ref_upstream_grad_zero_fraction"] = zr
        ev["upstream_parameters"] = len(upstream)
    if dead:
        ev["dead_parameters"] = sorted(dead)[:20]
        ev["n_dead_parameters"] = len(dead)
    return _Saturated(r, ft, fr, inp, ref_in, bwd, bwd_zero, upstream, dead, zt, zr, ev)


def _explanation(s: _Saturated) -> str:
    r, inp, ref_in = s.r, s.inp, s.ref_in
    base, dt = op_base(r.op), dtype_name(r.dtype)
    in_txt = ""
    if inp is not None:
        in_txt = (f" Its input (from {inp.module or '<root>'}) reaches |x| = {fmt(inp.stats['absmax'])}"
                  + (f" (reference {fmt(ref_in.stats['absmax'])})" if ref_in is not None else "")
                  + f"; in {dt} every |x| >= {saturation_threshold(base, r.dtype):.4g} gives exactly "
                  f"{BOUNDS[base].text}.")
    expl = (f"{where(r)} returns exactly {BOUNDS[base].text} for {s.ft:.1%} of its outputs in {dt} "
            f"(fp32 reference: {s.fr:.1%}): {dt} has no value between 1 - {fmt(spacing_below_one(r.dtype))} "
            f"and 1.{in_txt}")
    if s.bwd is not None and s.bwd_zero is not None:
        expl += (f" Its backward {op_base(s.bwd.op)} is exactly 0 for {s.bwd_zero:.1%} of the elements; loss scaling "
                 "cannot bring a 0 back.")
    if s.dead:
        expl += (f" {len(s.dead)} of the {len(s.upstream)} parameters feeding it get an all-zero gradient in {dt} and "
                 "not in fp32: everything below this layer stops learning, with no inf/NaN and no skipped step.")
    elif s.zt is not None and s.zr is not None:
        expl += f" Upstream gradients exactly zero: {s.zt:.1%} (reference {s.zr:.1%})."
    return expl


def _fixes(s: _Saturated) -> tuple[FixProposal, ...]:
    r, inp = s.r, s.inp
    producer = inp.module if inp is not None and inp.module and inp.module != r.module else ""
    mods = [m for m in (producer, r.module) if m]
    fixes: list[FixProposal] = []
    if mods:
        f = keep_fp32_fix(r.module or producer)
        fixes.append(FixProposal(
            f"compute {' and '.join(f'`{m}`' for m in mods)} in float32 (autocast disabled, input upcast): "
            "fp32 resolves 1 - y**2 down to ~1e-7", f.snippet, f.id, {"modules": mods}))
    fixes.append(FixProposal(
        "keep the pre-activations out of the flat region: normalize the input (LayerNorm before the activation), "
        "lower the learning rate / apply weight decay to the bias that drifted",
        "h = torch.tanh(layer_norm(dense(x)))"))
    fixes.append(FixProposal(
        "bfloat16 does not help here: its spacing below 1 is 2**-8, coarser than fp16's 2**-11"))
    return tuple(fixes)
