"""Render a :class:`~ampdoctor.findings.Report` as one self-contained HTML file (opens offline).

>>> from ampdoctor.report import write_html
>>> write_html(report, "report.html")            # doctest: +SKIP

Needs ``pip install ampdoctor[html]`` (jinja2); imported when a function is called. The figures are inline SVG
drawn by :mod:`ampdoctor.report._svg` (hover tooltips, legend toggles), so a report is a few hundred kilobytes
and nothing is fetched from the network. Model-supplied strings go through jinja2 autoescaping, and the SVG writer
escapes its own text and attributes, so a module named ``</script>`` is shown, never run. The one script is a
dozen lines that toggle legend entries; without it the figures and their tooltips still work.
"""

from __future__ import annotations

import html as _html
import math
import os
from pathlib import Path
from typing import Any

from ampdoctor.findings import Report, RunSummary
from ampdoctor.report import _format as F
from ampdoctor.report._svg import figure_svg
from ampdoctor.report.jsonio import _write_atomic

_LEGEND = {"orientation": "h", "x": 0, "xanchor": "left", "y": -0.22, "yanchor": "top"}
_REF_COLOR = "#1f77b4"
_TARGET_COLOR = "#d62728"
_LINE_STYLE = {  # range-plot reference lines: colour, dash
    "bf16 max": ("#9467bd", "dot"),
    "fp16 max": ("#d62728", "dash"),
    "e4m3 max": ("#ff7f0e", "dashdot"),
    "fp16 smallest normal": ("#2ca02c", "dash"),
    "fp16 smallest subnormal": ("#7f7f7f", "dot"),
}


def render_html(report: Report) -> str:
    """The report as a complete HTML document (str): root cause, lineage, findings, plots, layer table."""
    jinja2 = _import("jinja2")
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ampdoctor.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = F.fmt_num
    env.filters["pct"] = F.fmt_percent
    env.filters["margin"] = F.fmt_margin
    env.filters["fix_status"] = F.fix_status
    env.filters["site"] = F.site
    template = env.get_template("report.html.j2")
    return template.render(**_context(report))


def write_html(report: Report, path: str | os.PathLike[str]) -> Path:
    """Write :func:`render_html` to ``path`` atomically (temporary file + ``os.replace``); returns the path."""
    return _write_atomic(Path(path), render_html(report))


def figures(report: Report) -> list[dict[str, Any]]:
    """Plotly figure specs (``{"id", "data", "layout"}``, plain JSON values) for the report's plots.

    Range per layer (log |max| vs depth with format limits), flush fraction and relative error per layer, and
    the loss-scale timeline when ``summary["scales"]`` exists. Empty ``layers`` gives no per-layer plots.
    """
    rows = F.layer_rows(report)
    out = []
    if rows:
        out.append(_range_figure(report, rows))
        if any(r.flush_fraction is not None or _positive(r.rel_error) is not None for r in rows):
            out.append(_error_figure(rows))
    run = report.run
    scales, skipped = F.scale_timeline(run)
    if scales:
        out.append(_scale_figure(run, scales, skipped))
    return out


# ---------------------------------------------------------------------------------------------------- internals


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as e:
        raise ImportError(f"the HTML report needs {name}: pip install 'ampdoctor[html]' (jinja2)") from e


def _context(report: Report) -> dict[str, Any]:
    rows = F.layer_rows(report)
    facts = []
    run = report.run
    facts.append(("precision", run.precision or "as given (none)"))
    facts += [(label, str(v)) for v, label in ((run.steps, "steps"), (run.device, "device"),
                                               (run.torch_version, "torch")) if v is not None]
    if run.elapsed_s is not None:
        facts.append(("elapsed", f"{run.elapsed_s:.1f} s"))
    if report.source:
        facts.append(("source", report.source))
    if run.loss_target is not None or run.loss_reference is not None:
        facts.append(("loss (last step)", F.loss_text(run)))
    facts += [(label, str(site)) for site, label in ((run.first_nonfinite, "first non-finite"),
                                                     (run.first_nan, "first NaN")) if site is not None]
    if F.scale_text(run):
        facts.append(("loss scale", F.scale_text(run)))
    counts = {sev: sum(f.severity == sev for f in report.findings) for sev in ("error", "warning", "info")}
    figs = figures(report)
    return {
        "report": report,
        "root": report.root_cause,
        "others": report.findings[1:],
        "facts": facts,
        "tally": ", ".join(f"{n} {sev}{'s' if n != 1 else ''}" for sev, n in counts.items() if n) or "no findings",
        "chain": F.chain(report),
        "rows": rows,
        # the range plot's tooltips say everything about a layer; the error plot's name it (the bytes add up)
        "svgs": {fig["id"]: figure_svg(fig, None if fig["id"] != "plot-error" else 1) for fig in figs},
    }


def _positive(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) and x > 0 else None


def _log_range(values: list[Any]) -> dict[str, Any]:
    """A log-axis range of whole decades, at least two wide, so plotly labels decades (1e-4) and not digits."""
    finite = [v for v in (_positive(x) for x in values) if v is not None]
    if not finite:
        return {}
    lo, hi = math.floor(math.log10(min(finite))), math.ceil(math.log10(max(finite)))
    if hi - lo < 2:
        lo, hi = lo - 1, hi + 1
    return {"range": [lo, hi], "dtick": max(1, math.ceil((hi - lo) / 8))}


def _hover(r: F.LayerRow) -> str:
    # plotly renders a few HTML tags in hover text; model strings are escaped so they show literally
    parts = [
        f"<b>{_html.escape(r.module or '<root>', quote=False)}</b>",
        _html.escape(" · ".join(x for x in (r.op, r.dtype, r.phase) if x), quote=False),
        f"reference |max| {F.fmt_num(r.ref_absmax)}, target |max| {F.fmt_num(r.target_absmax)}",
        f"margin {F.fmt_margin(r.margin_bits)} bits, flush {F.fmt_percent(r.flush_fraction)}, "
        f"rel. error {F.fmt_num(r.rel_error)}, non-finite {r.nonfinite}",
    ]
    return "<br>".join(parts)


#: forward and backward rows: (phase, suffix of the trace name, line dash)
_PHASE_LINES = (("forward", "", "solid"), ("backward", " (backward)", "dot"))


def _phase_rows(rows: list[F.LayerRow]) -> list[tuple[list[F.LayerRow], str, str]]:
    """``(rows of the phase, name suffix, dash)`` for the forward rows, then the backward ones."""
    return [([r for r in rows if (r.phase == "backward") == (phase == "backward")], suffix, dash)
            for phase, suffix, dash in _PHASE_LINES]


def _layer_line(name: str, sub: list[F.LayerRow], ys: list[Any], color: str, dash: str, *, yaxis: str | None = None,
                **tail: Any) -> dict[str, Any]:
    """A lines+markers trace over layer depth, hovering each row's numbers (``tail``: more keys at the end)."""
    trace: dict[str, Any] = {"type": "scatter", "mode": "lines+markers", "name": name, "x": [r.depth for r in sub],
                             "y": ys}
    if yaxis is not None:
        trace["yaxis"] = yaxis
    trace.update({"text": [_hover(r) for r in sub], "hovertemplate": "%{text}<extra></extra>",
                  "line": {"color": color, "dash": dash}, **tail})
    return trace


def _show_bf16(report: Report, rows: list[F.LayerRow], values: list[float]) -> bool:
    """Whether the bf16 range lines are shown (else only in the legend): a bf16 run or values beyond fp16."""
    precision = report.run.precision or ""
    return precision.startswith("bf16") or any(v > 1e30 for v in values) or any(r.dtype == "bfloat16" for r in rows)


def _absmax_lines(rows: list[F.LayerRow]) -> list[dict[str, Any]]:
    """The reference's and the target's |max| per layer, forward and backward."""
    data: list[dict[str, Any]] = []
    for sub, suffix, dash in _phase_rows(rows):
        for name, color, get in (
            ("reference |max|", _REF_COLOR, lambda r: r.ref_absmax),
            ("target |max|", _TARGET_COLOR, lambda r: r.target_absmax),
        ):
            ys = [_positive(get(r)) for r in sub]
            if sub and not all(y is None for y in ys):
                data.append(_layer_line(name + suffix, sub, ys, color, dash, marker={"size": 6}, connectgaps=False))
    return data


def _nonfinite_markers(rows: list[F.LayerRow], top: float) -> list[dict[str, Any]]:
    """Markers at the top of the plot where the target's |max| is inf or nan."""
    data: list[dict[str, Any]] = []
    for name, pick, symbol in (
        ("target |max| = inf (overflow)", lambda r: r.overflowed, "x"),
        ("target |max| = nan", lambda r: r.target_nan, "circle-open"),
    ):
        marked = [r for r in rows if pick(r)]
        if marked:
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": name,
                    "x": [r.depth for r in marked],
                    "y": [top] * len(marked),
                    "text": [_hover(r) for r in marked],
                    "hovertemplate": "%{text}<extra></extra>",
                    "marker": {"symbol": symbol, "size": 11, "color": _TARGET_COLOR},
                }
            )
    return data


def _format_limits(lo: float, hi: float, show_bf16: bool) -> list[dict[str, Any]]:
    """Horizontal lines at the formats' limits (bf16's only in the legend unless ``show_bf16``)."""
    data: list[dict[str, Any]] = []
    for label, value in F.RANGE_LINES:
        key = label.rsplit(" ", 1)[0]
        color, dash = _LINE_STYLE.get(key, ("#7f7f7f", "dot"))
        trace: dict[str, Any] = {
            "type": "scatter",
            "mode": "lines",
            "name": label,
            "x": [lo, hi],
            "y": [value, value],
            "hovertemplate": f"{label}<extra></extra>",
            "line": {"color": color, "dash": dash, "width": 1},
        }
        if label.startswith("bf16") and not show_bf16:
            trace["visible"] = "legendonly"
        data.append(trace)
    return data


def _range_figure(report: Report, rows: list[F.LayerRow]) -> dict[str, Any]:
    depths = [float(r.depth) for r in rows]
    lo, hi = min(depths), max(depths)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    values = [v for r in rows for v in (_positive(r.ref_absmax), _positive(r.target_absmax)) if v is not None]
    show_bf16 = _show_bf16(report, rows, values)
    visible_lines = [v for label, v in F.RANGE_LINES if show_bf16 or not label.startswith("bf16")]
    top = 4.0 * max(values + visible_lines)
    data = _absmax_lines(rows) + _nonfinite_markers(rows, top) + _format_limits(lo, hi, show_bf16)
    layout = {
        "title": {"text": "Range per layer: fp32 reference vs target precision"},
        "xaxis": {"title": {"text": "layer depth (order of first execution)"}},
        "yaxis": {"title": {"text": "|max| (log scale)"}, "type": "log", "exponentformat": "e"},
        "hovermode": "closest",
        "height": 560,
        "margin": {"t": 60, "r": 20},
        "legend": _LEGEND,
    }
    return {"id": "plot-range", "data": data, "layout": layout}


def _error_figure(rows: list[F.LayerRow]) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for sub, suffix, dash in _phase_rows(rows):
        flush = [r.flush_fraction if r.flush_fraction is not None and math.isfinite(r.flush_fraction) else None
                 for r in sub]
        rel = [_positive(r.rel_error) for r in sub]
        for name, ys, color, axis in (
            ("flush fraction", flush, "#2ca02c", "y"),
            ("relative error", rel, "#9467bd", "y2"),
        ):
            if not all(y is None for y in ys):
                data.append(_layer_line(name + suffix, sub, ys, color, dash, yaxis=axis))
    layout = {
        "title": {"text": "Values flushed to zero and relative error per layer"},
        "xaxis": {"title": {"text": "layer depth (order of first execution)"}},
        "yaxis": {"title": {"text": "flush fraction"}, "tickformat": ".1%", "rangemode": "tozero"},
        "yaxis2": {
            "title": {"text": "relative error vs fp32 (log)"},
            "type": "log",
            "exponentformat": "e",
            "overlaying": "y",
            "side": "right",
            **_log_range([v for t in data if t["yaxis"] == "y2" for v in t["y"]]),
        },
        "hovermode": "closest",
        "height": 440,
        "margin": {"t": 60},
        "showlegend": True,
        "legend": _LEGEND,
    }
    return {"id": "plot-error", "data": data, "layout": layout}


def _scale_figure(run: RunSummary, scales: list[float | None], skipped: list[int]) -> dict[str, Any]:
    steps = list(range(len(scales)))
    data: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": "loss scale",
            "x": steps,
            "y": [_positive(s) for s in scales],
            "line": {"color": _REF_COLOR, "shape": "hv"},
        }
    ]
    if skipped:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "skipped step",
                "x": skipped,
                "y": [_positive(scales[i]) if i < len(scales) else None for i in skipped],
                "marker": {"symbol": "x", "size": 11, "color": _TARGET_COLOR},
            }
        )
    for losses, name, color in ((run.loss_target, "loss (target)", "#ff7f0e"),
                                (run.loss_reference, "loss (fp32)", "#7f7f7f")):
        if losses is not None and len(losses) > 1:
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": name,
                    "x": list(range(len(losses))),
                    "y": [F.finite(v) for v in losses],
                    "yaxis": "y2",
                    "line": {"color": color, "dash": "dot"},
                }
            )
    layout = {
        "title": {"text": "Loss scale and skipped steps"},
        "xaxis": {"title": {"text": "step"}, **({"dtick": 1} if len(scales) <= 20 else {})},
        "yaxis": {
            "title": {"text": "loss scale after the step (log)"},
            "type": "log",
            "exponentformat": "e",
            **_log_range(scales),
        },
        "yaxis2": {"title": {"text": "loss"}, "overlaying": "y", "side": "right", "rangemode": "tozero"},
        "hovermode": "x unified",
        "height": 420,
        "margin": {"t": 60},
        "showlegend": True,
        "legend": _LEGEND,
    }
    return {"id": "plot-scale", "data": data, "layout": layout}
