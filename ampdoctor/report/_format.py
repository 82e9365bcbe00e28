"""Reading a :class:`~ampdoctor.findings.Report` defensively, shared by the terminal and HTML renderers.

The common facts come typed (``Report.run``, ``Report.layer_stats``, ``Finding.evidence``); what is left here
formats numbers (either spelling: after a JSON round trip non-finite numbers are the strings ``"inf"``, ``"-inf"``
and ``"nan"``) and reads the rule-specific summary keys (chain, scales) that have no typed field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ampdoctor.findings import FixProposal, LayerStat, Link, Report, RunSummary, Site
from ampdoctor.trace import dtype_info

#: Horizontal reference lines of the range plot: (label, value).
RANGE_LINES: tuple[tuple[str, float], ...] = (
    ("bf16 max 3.39e+38", 3.3895313892515355e38),
    ("fp16 max 65504", 65504.0),
    ("e4m3 max 448", 448.0),
    ("fp16 smallest normal 6.10e-05", 2.0**-14),
    ("fp16 smallest subnormal 5.96e-08", 2.0**-24),
)


def to_float(value: Any) -> float | None:
    """A number from a report field: floats, ints and ``"inf"``/``"-inf"``/``"nan"`` strings; else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan", "infinity", "-infinity"):
        return float(value.strip())
    return None


def finite(value: Any) -> float | None:
    """Like :func:`to_float` but ``None`` for inf and NaN."""
    x = to_float(value)
    return x if x is not None and math.isfinite(x) else None


def fmt_num(value: Any, *, _nested: bool = False) -> str:
    """Numbers for people: ``1.05e+05``, ``65504``, ``1.6``, ``6.1e-05``, ``inf``; ``-`` when absent.

    Strings pass through; a dict becomes ``k=v, ...`` (``{k=v, ...}`` inside a list), a list ``[a, b]``.
    """
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    x = to_float(value)
    if x is None:
        if isinstance(value, str):
            return value
        if isinstance(value, Mapping):
            inner = ", ".join(f"{k}={fmt_num(v, _nested=True)}" for k, v in value.items())
            return "{" + inner + "}" if _nested else inner
        if isinstance(value, (list, tuple)):
            items = [fmt_num(v, _nested=True) for v in value[:8]]
            more = f", ... ({len(value)} values)" if len(value) > 8 else ""
            return "[" + ", ".join(items) + more + "]"
        return str(value)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    ax = abs(x)
    if ax >= 1e5 or ax < 1e-3:
        return f"{x:.3g}"
    if x == int(x) or ax >= 1e3:
        return f"{x:.0f}"
    return f"{x:.4g}"


def fmt_percent(value: Any) -> str:
    x = finite(value)
    if x is None:
        return "-"
    if x == 0:
        return "0%"
    pct = 100.0 * x
    if pct < 0.1:
        return "<0.1%"
    return f"{pct:.1f}%"


def canonical_dtype(dtype: Any) -> str:
    """``"torch.float16"``, ``"half"`` and ``"float16"`` all become ``"float16"``; unknown names pass through."""
    name = str(dtype or "").strip()
    if name.startswith("torch."):
        name = name[len("torch.") :]
    info = dtype_info(name)
    return info.name if info is not None else name


def format_max(dtype: Any) -> float | None:
    """Largest finite value of the storage format (the value a result must stay under to not become inf)."""
    info = dtype_info(canonical_dtype(dtype))
    return info.max if info is not None else None


# ---------------------------------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class LayerRow:
    """One entry of ``Report.layers`` with every field read defensively."""

    module: str
    depth: int
    phase: str
    op: str
    dtype: str
    ref_absmax: float | None
    target_absmax: float | None
    min_nonzero: float | None
    flush_fraction: float | None
    rel_error: float | None
    nonfinite: int
    margin_bits: float | None  # log2(format max / |max|); -inf when the value itself is inf

    @property
    def overflowed(self) -> bool:
        """The target's |max| is inf."""
        return self.target_absmax is not None and math.isinf(self.target_absmax)

    @property
    def target_nan(self) -> bool:
        return self.target_absmax is not None and math.isnan(self.target_absmax)


def _margin(fmax: float | None, ref: float | None, target: float | None) -> float | None:
    if fmax is None:
        return None
    # The true magnitude (fp32 reference) is what has to fit; the target's own value when there is no reference.
    for v in (ref, target):
        if v is None or math.isnan(v):
            continue
        if math.isinf(v):
            return -math.inf
        if v > 0:
            return math.log2(fmax / v)
    return None


def _layer_format_max(row: LayerStat, dtype: str) -> float | None:
    """The layer's own ``format_max`` when it carries a finite positive one, else the max of its ``dtype``."""
    fmax = finite(row.format_max)
    return fmax if fmax is not None and fmax > 0 else format_max(dtype)


def layer_rows(report: Report) -> list[LayerRow]:
    rows = []
    for i, entry in enumerate(report.layers or ()):  # i: the fallback depth, the entry's place in the table
        if not isinstance(entry, Mapping):
            continue
        raw = LayerStat.of(entry)
        dtype = canonical_dtype(raw.dtype)
        rows.append(
            LayerRow(
                module=raw.module or "",
                depth=raw.depth if raw.depth is not None else i,
                phase=raw.phase or "",
                op=raw.op or "",
                dtype=dtype,
                ref_absmax=raw.ref_absmax,
                target_absmax=raw.target_absmax,
                min_nonzero=raw.min_nonzero,
                flush_fraction=raw.flush_fraction,
                rel_error=raw.rel_error,
                nonfinite=raw.nonfinite or 0,
                margin_bits=_margin(_layer_format_max(raw, dtype), raw.ref_absmax, raw.target_absmax),
            )
        )
    rows.sort(key=lambda r: (r.depth, r.phase != "forward"))
    return rows


def least_headroom(rows: Iterable[LayerRow], limit: int = 12) -> list[LayerRow]:
    """The ``limit`` layers closest to (or past) their format's max, least margin first; ties by depth."""

    def key(r: LayerRow) -> tuple[float, int, int]:
        margin = r.margin_bits if r.margin_bits is not None and not math.isnan(r.margin_bits) else math.inf
        return (margin, -r.nonfinite, r.depth)

    return sorted(rows, key=key)[:limit]


def fmt_margin(bits: float | None) -> str:
    if bits is None or math.isnan(bits):
        return "-"
    if math.isinf(bits):
        return "overflow" if bits < 0 else "-"
    return f"{bits:+.1f}"


# ---------------------------------------------------------------------------------------------------- summary


def site(entry: Any) -> str:
    """``aten.mm.default in encoder.block.0 (forward, step 0)`` from a :class:`Site` or a
    ``{"op","module","phase","step"}`` mapping; ``-`` for anything else."""
    s = entry if isinstance(entry, Site) else Site.of(entry)
    return "-" if s is None else str(s)


def chain(report: Report) -> list[Link]:
    """The lineage chain (origin -> first NaN -> loss) of the report's summary, typed."""
    return list(report.run.chain)


def loss_text(run: RunSummary) -> str:
    """``target nan, fp32 reference 3.472`` from the last entries of ``loss_target`` / ``loss_reference``."""
    parts = [f"{label} {fmt_num(losses[-1] if losses else None)}"
             for losses, label in ((run.loss_target, "target"), (run.loss_reference, "fp32 reference"))
             if losses is not None]
    return ", ".join(parts) or "-"


def fix_status(fix: FixProposal) -> str:
    if fix.verified is True:
        return "verified ✓"
    if fix.verified is False:
        return "failed ✗"
    return "untried"


def _run(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    return summary if isinstance(summary, RunSummary) else RunSummary.of(summary)


def scale_timeline(summary: RunSummary | Mapping[str, Any]) -> tuple[list[float | None], list[int]]:
    """Loss scale after each step and the steps GradScaler skipped.

    GradScaler halves the scale on every skipped step and never lowers it otherwise, so a step whose scale is
    below the previous one was skipped. An explicit ``summary["skipped"]`` list of step indices wins. Step 0 has no
    previous scale: it was skipped when its scale is below ``summary["initial_scale"]`` or, without that, when
    ``skipped_steps`` counts one more skipped step than the drops show.
    """
    run = _run(summary)
    if run.scales is None:
        return [], []
    scales = list(run.scales)
    if run.skipped is not None:
        return scales, list(run.skipped)
    skipped = [i for i in range(1, len(scales))
               if (now := scales[i]) is not None and (before := scales[i - 1]) is not None and now < before]
    first = scales[0] if scales else None
    if run.initial_scale is not None and first is not None:
        step0 = first < run.initial_scale
    else:
        step0 = run.skipped_steps == len(skipped) + 1
    if step0 and scales:
        skipped.insert(0, 0)
    return scales, skipped


def scale_text(summary: RunSummary | Mapping[str, Any]) -> str:
    """``32768 -> 64 after 10 steps, 10 skipped`` (``""`` without ``scales``)."""
    run = _run(summary)
    scales, skipped = scale_timeline(run)
    if not scales:
        return ""
    count = run.skipped_steps
    if count is not None or run.initial_scale is not None or run.skipped is not None:
        skipped_text = f", {count if count is not None else len(skipped)} skipped"
    else:  # whether step 0 was skipped is unknown
        skipped_text = f", at least {len(skipped)} skipped" if skipped else ""
    known = [x for x in scales if x is not None]
    if not known:
        span = "-"
    elif len(known) == 1:
        span = fmt_num(known[0])
    else:
        span = f"{fmt_num(known[0])} -> {fmt_num(known[-1])}"
    steps = f"{len(scales)} step{'' if len(scales) == 1 else 's'}"
    return f"{span} after {steps}{skipped_text}"
