"""Casts to a float8 dtype made by the user's own code: values clipped at the format max, or flushed to 0.

Read by the ``fp8-scale``, ``overflow`` and ``underflow`` rules. A cast ``(x * s).to(torch.float8_e4m3fn)`` (or
``x.to(f8)`` with no scale, or ``x / s``) is judged from its own input and output only, so it does not matter
that the fp32 reference runs the same user code: the input's |max| against the format's overflow threshold
(the max plus half its spacing: e4m3 464, e5m2 61440), and the zeros the cast makes where its input held none.
What an out-of-range value becomes is read from the cast's output, as it happened (torch 2.13 on CPU saturates
e4m3fn at ±448, inf included; e5m2 returns ±inf; other kernels may return NaN for e4m3fn).

Mechanism -> code: clipped values with a scale tensor or number feeding the cast are ``fp8-scale`` (the scale is
wrong for the data: stale, or from another tensor); clipped values without any scale are ``overflow`` (the data
does not fit the format at all); more than half of the nonzero values flushed to 0 is ``underflow``. Evidence
carries the unscaled |max| (``amax``), the ``scale`` used, and the scale that would fit, ``fmax / amax``.

Delayed scaling (the Transformer-Engine recipe: ``scale = fmax / max(amax_history) / 2**margin``, the history
updated after the cast) is recognised by lineage, not by names: the scale tensor the cast's multiplication reads was
produced in an *earlier step* (a buffer or attribute written then, not recomputed from the data now). When such a
cast clips, the values grew past what the older amax allowed; the evidence adds the step the scale was computed in,
the amax it was computed from (the reduction feeding it, when traced), the largest |x| the stale scale represents
(``fmax / scale``) and the margin that would have fit.
ampdoctor's own fp8 emulation (precision ``"fp8*"``) is reported from its per-layer statistics instead
(``_fp8_emulated``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ampdoctor.findings._common import CASTS, base_evidence, dtype_name, finite, fmt, limits, op_base, where
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import Candidate
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import FP8_DTYPES, Kind, OpRecord, Role, dtype_info, op_info, ops_with

FP8 = frozenset(dtype_name(d) for d in FP8_DTYPES)
#: a cast that flushes more than this fraction of its nonzero input values is an underflow
FLUSH_FRACTION = 0.5
#: ops that hand the scale on unchanged (a view, a copy, a cast of the stored scale) on the way to the multiplication
_PASS_ON = ops_with(Kind.SAME_ELEMENTS) | ops_with(Kind.CAST)


@dataclass(frozen=True)
class DelayedScale:
    """The scale a cast reads was produced in an earlier step: ``written`` made it, ``history_amax`` is the |max| of
    the reduction it was computed from (``None`` when none is traced)."""

    written: OpRecord
    history_amax: float | None


@dataclass(frozen=True)
class Fp8Cast:
    """One cast to fp8 and what it did. ``scale``/``scale_op`` describe the multiplier applied just before (``None``
    when the cast reads unscaled data); ``amax`` is the |max| of the data before that scale."""

    record: OpRecord
    source: OpRecord
    fmax: float
    threshold: float
    amax: float
    scaled_absmax: float
    scale: float | None
    scale_applied_as: str | None
    scale_op: OpRecord | None
    n_clipped: int
    became: str
    n_flushed: int
    nonzero: int
    consumer: OpRecord | None
    delayed: DelayedScale | None = None

    @property
    def clipped(self) -> bool:
        return self.scaled_absmax > self.threshold and self.n_clipped > 0

    @property
    def flushed(self) -> bool:
        return self.nonzero > 0 and self.n_flushed > FLUSH_FRACTION * self.nonzero

    @property
    def fitting_scale(self) -> float | None:
        """The multiplier that maps the data's |max| onto the format's max (``fmax / amax``)."""
        return self.fmax / self.amax if self.amax > 0 and math.isfinite(self.amax) else None

    @property
    def scale_max(self) -> float | None:
        """The largest unscaled |x| the scale maps into the format: ``fmax / scale`` (``fmax * divisor``)."""
        if self.scale is None or not self.scale or not math.isfinite(self.scale):
            return None
        return self.fmax * self.scale if self.scale_applied_as == "div" else self.fmax / self.scale

    @property
    def fitting_margin(self) -> int | None:
        """The smallest ``m`` such that the stale scale divided by ``2**m`` fits the data (delayed scaling)."""
        top = self.scale_max
        if top is None or top <= 0 or not math.isfinite(self.amax) or self.amax <= top:
            return None
        return math.ceil(math.log2(self.amax / top))


def _delayed(ctx: Context, cast: OpRecord, sc: OpRecord | None) -> DelayedScale | None:
    """The scale record ``sc`` (walked up through views, copies and casts made this step) was produced in a step
    before the cast's: delayed scaling. Its history amax: the nearest reduction feeding it in that step (the
    max over the history, or the amax written into a one-entry history)."""
    recs = ctx.records
    for _ in range(4):
        if sc is None or sc.step < cast.step:
            break
        ins = [recs[i] for i in sc.inputs if i >= 0]
        if sc.kind != "op" or op_base(sc.op) not in _PASS_ON or len(ins) != 1:
            return None
        sc = ins[0]
    if sc is None or sc.step >= cast.step:
        return None
    seen, todo = {sc.index}, [sc]
    for _ in range(64):  # breadth first, within the scale's own step
        if not todo:
            break
        x = todo.pop(0)
        if x is not sc and x.kind == "op" and _reduces(recs, x):
            return DelayedScale(sc, x.stats.get("absmax"))
        for i in x.inputs:
            if i >= 0 and i not in seen and recs[i].step == sc.step:
                seen.add(i)
                todo.append(recs[i])
    return DelayedScale(sc, None)


def _reduces(recs: list[OpRecord], x: OpRecord) -> bool:
    """``x`` holds fewer elements than an input it reads (an amax, a max over the history)."""
    n = x.stats.get("numel", 0)
    return any(i >= 0 and recs[i].stats.get("numel", 0) > n for i in x.inputs)


def overflow_threshold(dtype: str) -> float:
    """The smallest magnitude that no longer rounds to the format's max: max + half its spacing (e4m3 464)."""
    info = dtype_info(dtype)
    if info is None:
        return math.inf
    top = 2.0 ** math.floor(math.log2(info.max))
    return info.max + top * info.unit_roundoff


def _scale_of(ctx: Context, src: OpRecord) -> tuple[float, str, OpRecord | None, float] | None:
    """``(scale, "mul"|"div", scale record, unscaled |max|)`` when ``src`` multiplies (or divides) data by a scale:
    a Python number or a tensor with fewer elements than the data (per-tensor, per-row, per-channel)."""
    info = op_info(op_base(src.op))
    if not any(lit.role is Role.FACTOR for lit in info.literals) or src.kind != "op":
        return None  # not a multiplication or division (the registry's ops with a factor literal)
    how = "div" if "div" in op_base(src.op) else "mul"  # div, div_, true_divide
    ins = [ctx.records[i] for i in src.inputs if i >= 0]
    if len(ins) == 1 and len(src.scalars) == 1:
        return src.scalars[0], how, None, ins[0].stats.get("absmax", math.nan)
    if len(ins) != 2:
        return None
    data, sc = sorted(ins, key=lambda x: -x.stats.get("numel", 0))
    if sc.stats.get("numel", 0) >= data.stats.get("numel", 0) or (how == "div" and sc is ins[0]):
        return None
    return sc.stats.get("absmax", math.nan), how, sc, data.stats.get("absmax", math.nan)


def fp8_casts(ctx: Context) -> list[Fp8Cast]:
    """Every traced cast from a wider float into an fp8 dtype whose input is finite (user code; none in an emulated
    fp8 run, which reports its own statistics)."""
    if ctx.target.fp8 is not None:
        return []
    recs = ctx.records
    out: list[Fp8Cast] = []
    for r in recs:
        dt = dtype_name(r.dtype)
        if r.kind != "op" or dt not in FP8 or op_base(r.op) not in CASTS or not r.inputs or r.inputs[0] < 0:
            continue
        src = recs[r.inputs[0]]
        if dtype_name(src.dtype) in FP8 or not finite(src) or not r.stats:
            continue
        s, ss = r.stats, src.stats
        n_bad = s.get("n_posinf", 0) + s.get("n_neginf", 0) + s.get("n_nan", 0)
        became = "NaN" if s.get("n_nan", 0) else "inf" if n_bad else f"±{fmt(limits(dt)[0])} (saturated)"
        sc = _scale_of(ctx, src)
        scale, how, sc_rec, amax = (sc if sc is not None else (None, None, None, ss["absmax"]))
        nonzero = int(ss["numel"] - ss["n_zero"])
        out.append(Fp8Cast(r, src, limits(dt)[0], overflow_threshold(dt), amax, ss["absmax"], scale, how, sc_rec,
                           int(n_bad + s.get("n_at_max", 0)), became, int(max(s["n_zero"] - ss["n_zero"], 0)),
                           nonzero, _consumer(recs, r), _delayed(ctx, r, sc_rec)))
    return out


def _consumer(recs: list[OpRecord], r: OpRecord) -> OpRecord | None:
    """The first op that reads the fp8 tensor (a dequantizing cast, ``_scaled_mm``)."""
    return next((x for x in recs[r.index + 1:r.index + 32] if r.index in x.inputs), None)


def cast_evidence(c: Fp8Cast) -> dict[str, Any]:
    r = c.record
    ev = base_evidence(r)
    ev.update({"fp8_dtype": dtype_name(r.dtype), "format_max": c.fmax, "overflow_threshold": c.threshold,
               "amax": c.amax, "scaled_absmax": c.scaled_absmax, "scale": c.scale,
               "scale_applied_as": c.scale_applied_as, "fitting_scale": c.fitting_scale,
               "n_clipped": c.n_clipped, "out_of_range_becomes": c.became, "n_flushed": c.n_flushed,
               "nonzero": c.nonzero, "cast_input": {"op": c.source.op, "module": c.source.module}})
    if c.consumer is not None:
        ev["consumer"] = {"op": c.consumer.op, "module": c.consumer.module}
    if c.scale_op is not None:
        ev["scale_source"] = {"op": c.scale_op.op or c.scale_op.kind, "module": c.scale_op.module,
                              "numel": int(c.scale_op.stats.get("numel", 0))}
    d = c.delayed
    if d is not None:
        ev["delayed_scaling"] = {"scale_step": d.written.step, "steps_old": r.step - d.written.step,
                                 "written_by": {"op": d.written.op or d.written.kind, "module": d.written.module,
                                                "phase": d.written.phase, "step": d.written.step},
                                 "history_amax": d.history_amax, "scale_max": c.scale_max,
                                 "amax_growth": c.amax / d.history_amax if d.history_amax else None,
                                 "fitting_margin": c.fitting_margin}
    return ev


def _delayed_text(c: Fp8Cast) -> str:
    d = c.delayed
    if d is None:
        return ""
    held = f" (|max| {fmt(d.history_amax)})" if d.history_amax is not None else ""
    grew = f", {c.amax / d.history_amax:.3g}x the amax the history held" if d.history_amax else ""
    m = c.fitting_margin
    fit = (f" dividing this scale by a further 2**{m} (a margin), or computing it from the current amax, would fit"
           if m is not None else "")
    return (f" Delayed scaling: the scale was computed from an older amax{held}, written by {d.written.op} in "
            f"{d.written.module or '<root>'} at step {d.written.step}; it represents values up to "
            f"|{fmt(c.scale_max or math.nan)}|, and at step {c.record.step} the data reach |{fmt(c.amax)}|{grew}:"
            f"{fit or ' the scale is stale'}.")


def _scale_text(c: Fp8Cast) -> str:
    if c.scale is None:
        return "no scale is applied before the cast"
    op = "multiplies by" if c.scale_applied_as == "mul" else "divides by"
    return f"the code {op} the scale {fmt(c.scale)} first (data |max| {fmt(c.amax)})"


def _fit_text(c: Fp8Cast) -> str:
    fit = c.fitting_scale
    if fit is None:
        return ""
    if c.scale_applied_as == "div":
        return f" A divisor of amax / fmax = {fmt(1 / fit)} (or larger) fits."
    return f" A scale of fmax / amax = {fmt(fmt_scale(fit))} (or smaller) fits."


def fmt_scale(v: float) -> float:
    return float(f"{v:.4g}")


def _fixes(c: Fp8Cast) -> tuple[FixProposal, ...]:
    if c.delayed is not None:
        m = c.fitting_margin or 1
        delayed = (FixProposal(f"delayed scaling: divide the scale by a further 2**{m} (or more) so the values may "
                               "grow between steps, and take the max over the amax history",
                               f"scale = fmax / amax_history.max() / 2 ** (margin + {m})", params={"margin": m}),)
        return delayed + _current_fixes(c)
    return _current_fixes(c) + (
        FixProposal("with delayed scaling, take the max over a longer amax history and add a margin (scale / 2**m)"),)


def _current_fixes(c: Fp8Cast) -> tuple[FixProposal, ...]:
    return (
        FixProposal("compute the scale from the tensor being cast (current scaling), with a floor on amax",
                    "amax = x.abs().amax().float().clamp(min=1e-12)\n"
                    f"scale = torch.finfo(torch.{dtype_name(c.record.dtype)}).max / amax\n"
                    f"q = (x * scale).to(torch.{dtype_name(c.record.dtype)})",
                    params={"fitting_scale": c.fitting_scale}),
        FixProposal("saturate explicitly before the cast, so no kernel turns out-of-range values into NaN/inf",
                    f"q = (x * scale).clamp(-{fmt(c.fmax)}, {fmt(c.fmax)}).to(torch.{dtype_name(c.record.dtype)})"),
    )


def clip_candidates(ctx: Context, code: str) -> list[Candidate]:
    """Casts that clip at the format max: ``fp8-scale`` when a scale feeds the cast, ``overflow`` when none does."""
    out: list[Candidate] = []
    for c in fp8_casts(ctx):
        if not c.clipped or (code == "fp8-scale") != (c.scale is not None):
            continue
        r, dt = c.record, dtype_name(c.record.dtype)
        expl = (f"{where(r)} casts values up to |{fmt(c.scaled_absmax)}| into {dt}, whose max is {fmt(c.fmax)} "
                f"(anything above {fmt(c.threshold)} is out of range): {c.n_clipped} value(s) end at or beyond the max "
                f"and become {c.became} (a cast neither scales nor reports: torch saturates e4m3fn on CPU, e5m2 "
                f"gives inf, some kernels give NaN); {_scale_text(c)}.{_fit_text(c)}{_delayed_text(c)}")
        title = (f"fp8 cast clips at {fmt(c.fmax)} in {r.module or '<root>'}: the scale does not fit the data"
                 if c.scale is not None else f"values overflow {dt} in a cast in {r.module or '<root>'}")
        if c.delayed is not None:
            title = (f"fp8 cast clips at {fmt(c.fmax)} in {r.module or '<root>'} at step {r.step}: delayed scaling "
                     f"with a stale amax (scale from step {c.delayed.written.step})")
        out.append(Candidate(Finding(code, "error", r.module, r.op, r.phase, title, expl, cast_evidence(c),
                                     _fixes(c), r.step), r.index))
    return out


def flush_candidates(ctx: Context) -> list[Candidate]:
    """Casts that flush most nonzero values to 0 (a scale far too small, or data far below the format's floor)."""
    out: list[Candidate] = []
    for c in fp8_casts(ctx):
        if not c.flushed or c.clipped:
            continue
        r, dt = c.record, dtype_name(c.record.dtype)
        floor = limits(dt)[2]
        expl = (f"{where(r)} returns exactly 0 for {c.n_flushed} of the {c.nonzero} nonzero values it casts to {dt} "
                f"(smallest subnormal {fmt(floor)}): the values cast reach only |{fmt(c.scaled_absmax)}|, far below "
                f"the max {fmt(c.fmax)}; {_scale_text(c)}.{_fit_text(c)}")
        ev = cast_evidence(c)
        ev.update({"flushed_fraction": c.n_flushed / c.nonzero, "format_min_subnormal": floor})
        out.append(Candidate(Finding(
            "underflow", "error", r.module, r.op, r.phase,
            f"fp8 cast flushes {c.n_flushed / c.nonzero:.0%} of its values to 0 in {r.module or '<root>'}", expl, ev,
            _fixes(c), r.step), r.index))
    return out


def handled(ctx: Context) -> set[int]:
    """Record indices of the fp8 casts reported here (the generic rules leave them alone)."""
    return {c.record.index for c in fp8_casts(ctx) if c.clipped or c.flushed}


def without_fp8_casts(ctx: Context, origins: list[Any]) -> list[Any]:
    """``origins`` (tuples whose first item is a record) without the fp8 casts reported here."""
    done = handled(ctx)
    return [o for o in origins if o[0].index not in done]


__all__ = ["FP8", "DelayedScale", "Fp8Cast", "cast_evidence", "clip_candidates", "flush_candidates", "fp8_casts",
           "handled", "overflow_threshold", "without_fp8_casts"]

