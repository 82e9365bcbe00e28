"""ampdoctor's own fp8 emulation (precision ``"fp8*"``): what each layer's fp8 casts lost, per tensor role and pass.

Read by the ``fp8-scale`` rule from the run's per-call statistics (:class:`~ampdoctor.precision.fp8.Fp8Stats`),
not from the op trace (the emulated GEMMs run in float32 there). Each role of a linear (``input`` and ``weight`` in
the forward, ``grad_output`` in the backward) is judged on its own: saturation (harmful when clipping adds more
squared error than rounding does), underflow (harmful above 10% flushed, or when an outlier's amax puts the median
into the subnormals), an amax of 0. A layer's roles that lose precision in the same pass make ONE finding (the
ranking keeps one per code, module, op and phase): its title names them all, its top-level evidence is the worst
role's (``role``, ``saturated``, ...), and ``evidence["roles"]`` holds every such role with its own numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ampdoctor.findings._common import fmt, op_base
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import DTypeInfo, Kind, dtype_info, ops_with

#: a layer role flushing more than this fraction of its nonzero values to 0 is a warning (above 1%: info)
EMULATED_FLUSH_WARNING = 0.1
#: the tensor roles each pass quantises, in the order a finding lists them
PASS_ROLES: dict[str, tuple[str, ...]] = {"forward": ("input", "weight"), "backward": ("grad_output",)}
_SEVERITY = {"error": -1, "warning": 0, "info": 1}
#: the numbers ``evidence["roles"][role]`` keeps of each role (those it has)
ROLE_KEYS: tuple[str, ...] = ("severity", "format", "saturated", "numel", "underflowed", "nonzero", "flushed_fraction",
                              "amax", "scale", "amax_history", "first_saturated", "clip_relative", "clip_error_share",
                              "median_abs", "amax_over_median", "median_bits", "format_bits", "zero_amax_tensors",
                              "inf_scale_tensors")


def _format(name: str) -> DTypeInfo:
    info = dtype_info(name)
    assert info is not None, name  # the emulation's formats, "e4m3" / "e5m2", are in the dtype table
    return info


def _clip(t: Any) -> float:
    """How much a saturated tensor's largest value loses: ``1 - (fmax / scale) / amax`` (0 when nothing clips)."""
    fmax = _format(t.format).max
    return max(0.0, 1.0 - fmax / (t.scale * t.amax)) if t.scale > 0 and t.amax > 0 else 0.0


def _bulk(t: Any) -> dict[str, Any]:
    """Where the median |x| of a tensor lands after the per-tensor scale an outlier set (numbers for the evidence)."""
    info = _format(t.format)
    scaled = t.median_abs * t.scale
    out: dict[str, Any] = {"median_abs": t.median_abs, "amax_over_median": t.amax / t.median_abs if t.median_abs
                           else math.inf, "median_scaled": scaled,
                           "flush_below": info.flush_threshold / t.scale if t.scale else math.inf,
                           "subnormal_below": info.smallest_normal / t.scale if t.scale else math.inf}
    bits = round(-math.log2(2 * info.unit_roundoff)) + 1  # significant bits of a normal value (e4m3 4, e5m2 3)
    out["median_bits"] = (bits if scaled >= info.smallest_normal else
                          max(0, math.floor(math.log2(scaled / info.smallest_subnormal)) + 1)
                          if scaled >= info.flush_threshold else 0)
    out["format_bits"] = bits
    return out


def _saturation_part(ts: list[Any]) -> tuple[str | None, dict[str, Any], bool, int]:
    """The saturation sentence, its evidence, whether it is harmful, and the first step that clips.

    Harmful when clipping adds more squared error than rounding makes in the same tensors: delayed scaling's usual
    small amax growth between steps clips a few values by a few percent, less than the rounding of all the others."""
    sat = [t for t in ts if t.saturated]
    if not sat:
        return None, {}, False, 0
    first = min(sat, key=lambda t: (t.step, t.call))
    worst = max(sat, key=_clip)
    clip_sq = sum(t.clip_error_sq for t in ts)
    round_sq = sum(t.error_sq for t in ts) - clip_sq
    share = clip_sq / (clip_sq + round_sq) if clip_sq + round_sq > 0 else 0.0
    ev = {"first_saturated": {"step": first.step, "amax": first.amax, "amax_history": first.amax_history,
                              "scale": first.scale, "saturated": first.saturated},
          "clip_relative": _clip(worst), "clip_error_share": share}
    text = (f"{sum(t.saturated for t in ts)} value(s) saturate at the {worst.format} max, first at step {first.step}"
            + (" (delayed scaling: the scale was computed from an older amax, an amax history below the current "
               f"amax: {fmt(first.amax_history)} < {fmt(first.amax)})" if first.amax_history < first.amax else ""))
    harmful = clip_sq > round_sq
    text += (f"; the largest is clipped by {_clip(worst):.1%} and clipping makes {share:.0%} of the layer's fp8 "
             "error" + ("" if harmful else " (less than rounding does: harmless)"))
    return text, ev, harmful, first.step


def _flush_part(ts: list[Any]) -> tuple[str | None, dict[str, Any], bool]:
    """The underflow sentence: what fraction flushes, and where the bulk (median) lands when an outlier set amax."""
    und, nz = sum(t.underflowed for t in ts), sum(t.nonzero for t in ts)
    if not nz or und / nz <= 0.01:
        return None, {}, False
    t = max(ts, key=lambda x: x.underflow_fraction)
    bulk = _bulk(t)
    text = f"{und / nz:.0%} of the nonzero values underflow to 0 in {t.format}"
    if bulk["median_bits"] < bulk["format_bits"]:
        text += (f": amax {fmt(t.amax)} is {fmt(bulk['amax_over_median'])}x the median |x| "
                 f"{fmt(t.median_abs)}, so the per-tensor scale {fmt(t.scale)} puts the median at "
                 f"{fmt(bulk['median_scaled'])}, in {t.format}'s subnormal range ({bulk['median_bits']} "
                 f"significant bit(s) of {bulk['format_bits']}); every |x| below {fmt(bulk['flush_below'])} becomes 0 "
                 f"(an outlier sets the scale of the whole tensor)")
    harmful = und / nz > EMULATED_FLUSH_WARNING or bulk["median_bits"] < bulk["format_bits"]
    return text, bulk, harmful


@dataclass(frozen=True)
class RoleLoss:
    """What one tensor role of one layer lost over the run: its sentences, numbers and verdicts."""

    role: str
    severity: str  # "error" (a scale of inf: NaN), "warning" or "info"
    parts: tuple[str, ...]
    evidence: dict[str, Any]
    step: int  # the first step it saturates (0 without saturation)
    tensors: tuple[Any, ...]
    sat_bad: bool
    flush_bad: bool

    @property
    def title(self) -> str:
        flush = next((p for p in self.parts if "underflow" in p), None)
        return (flush.split(":")[0] if self.flush_bad and flush and not self.sat_bad
                else self.parts[0].split(";")[0])

    @property
    def short(self) -> str:
        """A few words for a title listing several roles: what it loses, in numbers."""
        ev = self.evidence
        if self.sat_bad or (ev["saturated"] and not self.flush_bad):
            return (f"{self.role} {ev['saturated']}/{ev['numel']} values saturate ({ev['format']}, first at step "
                    f"{self.step})")
        if ev["underflowed"]:
            return f"{self.role} {ev['flushed_fraction']:.0%} of its nonzero values flush to 0 ({ev['format']})"
        return f"{self.role} amax 0 in {ev['zero_amax_tensors']} tensor(s)"

    @property
    def outlier_bulk(self) -> bool:
        """An outlier's amax pushed the median into the subnormals (per-channel scaling or smoothing helps)."""
        return self.flush_bad and self.evidence.get("median_bits", 99) < self.evidence.get("format_bits", 0)


def role_loss(role: str, ts: list[Any], recipe: Any) -> RoleLoss | None:
    """The precision one role of a layer loses over the run's calls ``ts``; ``None`` when it loses none."""
    worst = max(ts, key=lambda t: t.amax)
    zero_amax = sum(1 for t in ts if t.amax == 0)
    ev: dict[str, Any] = {"role": role, "format": worst.format, "saturated": sum(t.saturated for t in ts),
                          "underflowed": sum(t.underflowed for t in ts), "nonzero": sum(t.nonzero for t in ts),
                          "numel": sum(t.numel for t in ts), "amax": worst.amax, "scale": worst.scale,
                          "amax_history": worst.amax_history, "zero_amax_tensors": zero_amax,
                          "amax_floor": recipe.amax_floor, "scaling": recipe.scaling}
    sat_text, sat_ev, sat_bad, first_step = _saturation_part(ts)
    flush_text, flush_ev, flush_bad = _flush_part(ts)
    ev.update(sat_ev)
    ev.update(flush_ev)
    ev["flushed_fraction"] = ev["underflowed"] / ev["nonzero"] if ev["nonzero"] else 0.0
    parts = [p for p in (sat_text, flush_text) if p]
    inf_scale = sum(1 for t in ts if not math.isfinite(t.scale))  # amax 0 and no floor: fmax / 0
    ev["inf_scale_tensors"] = inf_scale
    if inf_scale:
        parts.append(f"{inf_scale} tensor(s) got scale {_format(worst.format).max:g} / amax 0 = inf (the recipe has "
                     f"no amax floor: amax_floor={recipe.amax_floor:g}), and 0 * inf = NaN in the quantised tensor")
    elif zero_amax:
        parts.append(f"{zero_amax} tensor(s) have amax 0; the scale was floored at {recipe.amax_floor:g} instead of "
                     "becoming inf/NaN")
    if not parts:
        return None
    severity = "error" if inf_scale else "warning" if sat_bad or flush_bad else "info"
    ev["severity"] = severity
    return RoleLoss(role, severity, tuple(parts), ev, first_step, tuple(ts), sat_bad, flush_bad)


def _recipe_fixes(recipe: Any, ts: list[Any]) -> tuple[FixProposal, ...]:
    """A delayed recipe's own remedies, as ``fp8_recipe`` fixes of the whole recipe (its fields, one changed): the
    margin that covers the largest saturated amax's jump over its scale (``ts``: saturated tensors; none for a
    flush), and current (dynamic) scaling. A dynamic recipe cannot clip; it gets neither."""
    if recipe.scaling != "delayed":
        return ()
    fields = {"format": recipe.format, "scaling": recipe.scaling, "amax_history_len": recipe.amax_history_len,
              "margin": recipe.margin, "amax_floor": recipe.amax_floor}
    over = max((t.scale * t.amax / _format(t.format).max for t in ts if t.saturated and t.scale > 0), default=0.0)
    out: tuple[FixProposal, ...] = ()
    if over > 1 and math.isfinite(over):
        margin = recipe.margin + max(1, math.ceil(math.log2(over)))
        out += (FixProposal(f"a margin of {margin} bit(s) in the fp8 recipe: the amax grew {over:.3g}x beyond what "
                            "the delayed scale maps to the format max (all layers get the headroom)",
                            f"Fp8Recipe(..., margin={margin})  # TE: DelayedScaling(margin={margin})",
                            id="fp8_recipe", params={**fields, "margin": margin}),)
    return out + (FixProposal("current (dynamic) scaling in the fp8 recipe: each tensor scaled by its own amax",
                              "Fp8Recipe(scaling='dynamic')  # TE: Float8CurrentScaling()", id="fp8_recipe",
                              params={**fields, "scaling": "dynamic"}),)


def _fixes(module: str, losses: list[RoleLoss], recipe: Any) -> tuple[FixProposal, ...]:
    """One set of fixes for a layer's pass: keeping it out of fp8, the recipe changes that cover every harmful
    saturation of its roles, per-channel scaling when an outlier set a role's scale."""
    bad = [x for x in losses if x.severity != "info"]
    if not bad:  # harmless saturation or a few flushed values need no fix
        return ()
    saturated = [t for x in bad if x.sat_bad for t in x.tensors]
    fixes = (FixProposal(f"keep {module or '<root>'} out of fp8 (TE: fp8_autocast(enabled=False) around it)", "",
                         id="keep_fp32", params={"modules": [module]}),
             *_recipe_fixes(recipe, saturated))
    if any(x.evidence.get("inf_scale_tensors") for x in bad):
        fields = {"format": recipe.format, "scaling": recipe.scaling, "amax_history_len": recipe.amax_history_len,
                  "margin": recipe.margin, "amax_floor": 1e-12}
        fixes = (FixProposal("floor amax in the fp8 recipe (1e-12, as torchao; TE keeps the previous scale)",
                             "Fp8Recipe(..., amax_floor=1e-12)", id="fp8_recipe", params=fields),) + fixes
    if any(x.outlier_bulk for x in bad):
        fixes += (FixProposal("scale per channel / per block instead of per tensor, or smooth the outlier "
                              "channel into the weights (SmoothQuant)", ""),)
    return fixes


def _pass_finding(module: str, phase: str, losses: list[RoleLoss], recipe: Any, order: Any) -> Candidate:
    """One finding for the roles of a layer that lose precision in one pass (worst first in its top evidence)."""
    name = module or "<root>"
    main = min(losses, key=lambda x: _SEVERITY[x.severity])  # the first role of the worst severity
    listed = [x for x in losses if x.severity == main.severity] + [x for x in losses if x.severity != main.severity]
    ev = dict(main.evidence)
    ev["roles"] = {x.role: {k: x.evidence[k] for k in ROLE_KEYS if k in x.evidence} for x in losses}
    ev["roles_losing"] = [x.role for x in listed]
    expl = " ".join(f"fp8 {x.role} of {name} ({x.evidence['format']}, {recipe.scaling} scaling): "
                    + "; ".join(x.parts) + "." for x in listed)
    if len(losses) == 1:
        title = f"fp8 {main.role} of {name}: {main.title}"
    else:
        title = f"fp8 {' and '.join(x.role for x in listed)} of {name}: " + "; ".join(x.short for x in listed)
    return Candidate(Finding("fp8-scale", main.severity, module, "aten.linear.default", phase, title, expl, ev,
                             _fixes(module, losses, recipe), main.step), order)


def emulated_candidates(ctx: Any, order: Any) -> list[Candidate]:
    """Per-layer fp8 saturation / underflow / zero-amax from the emulated fp8 run (precision ``"fp8*"``).

    Saturation is harmful when it clips the largest value by more than the format's rounding error (delayed
    scaling's small amax growth between steps clips by less: ``info``); underflow when more than 10% of the nonzero
    values flush, or when an outlier's amax puts the median |x| into the subnormal range. One candidate per layer
    and pass, listing its roles that lose precision. ``order``: the registry slot the candidates rank in."""
    stats = ctx.target.fp8
    if stats is None:
        return []
    out: list[Candidate] = []
    for module, tensors in stats.by_module().items():  # modules in order of first use
        for phase, roles in PASS_ROLES.items():
            losses = [loss for role in roles if (ts := [t for t in tensors if t.role == role])
                      and (loss := role_loss(role, ts, stats.recipe)) is not None]
            if losses:
                out.append(_pass_finding(module, phase, losses, stats.recipe, order))
    # the earliest step first, its forward before its backward (a clipped forward changes the gradients after it);
    # stable: then the model's order
    return sorted(out, key=lambda c: (c.finding.step or 0, c.finding.phase == "backward"))


_GEMMS = ops_with(Kind.GEMM)
_VIEWS = ops_with(Kind.VIEW) | ops_with(Kind.SAME_ELEMENTS)


def _weight_param(recs: list[Any], i: int) -> Any:
    """The parameter record that record ``i`` is (or a view of: ``t``, ``transpose``, ``view``), else ``None``."""
    for _ in range(4):
        if i < 0:
            return None
        r = recs[i]
        if r.kind == "param":
            return r
        if r.kind != "op" or op_base(r.op) not in _VIEWS or not r.inputs:
            return None
        i = r.inputs[0]
    return None


def unquantised_gemms(ctx: Any) -> list[dict[str, Any]]:
    """In an emulated fp8 run: the forward GEMMs that multiply by a weight parameter but ran outside ``F.linear``, so
    the emulation never quantised them (transformers' ``Conv1D`` is an ``addmm``; ``nn.MultiheadAttention`` calls
    its projections inside one torch function; convolutions) - one entry per module and op, first step only."""
    stats = ctx.target.fp8
    if stats is None:
        return []
    recs = ctx.records
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for r in recs:
        if r.kind != "op" or r.step != 0 or r.phase != "forward" or op_base(r.op) not in _GEMMS:
            continue
        weight = next((w for i in r.inputs if (w := _weight_param(recs, i)) is not None and len(w.shape) >= 2), None)
        if weight is not None:
            seen.setdefault((r.module, r.op), {"module": r.module, "op": r.op, "weight": weight.name,
                                               "weight_shape": list(weight.shape)})
    return list(seen.values())


__all__ = ["EMULATED_FLUSH_WARNING", "PASS_ROLES", "RoleLoss", "emulated_candidates", "role_loss",
           "unquantised_gemms"]
