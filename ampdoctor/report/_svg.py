"""Draw the report's figure specs (plotly-shaped dicts from :func:`ampdoctor.report.html.figures`) as inline SVG.

A few kilobytes of our own code instead of the 4.8 MB plotly.js bundle: the report stays one offline file of a
few hundred kilobytes. What the specs use is drawn: scatter traces (lines, markers, ``x`` / ``circle-open``
symbols, dashes, ``hv`` steps, gaps at ``None``), linear and log axes (whole decades), a right-hand ``y2`` axis,
``.1%`` tick labels, ``legendonly`` traces and a legend. Interactive without a script: every point column carries
its hover text as an SVG ``<title>`` (the browser's tooltip); with the page's small script a legend click hides
or shows a trace. Every string is escaped here (text nodes and attributes), so model names cannot add markup.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

WIDTH = 960
#: a line trace with more points than this is drawn without its markers (a dense line says the same in less)
MAX_MARKERS = 200
_DASH = {"solid": "", "dot": "2,3", "dash": "7,4", "dashdot": "7,3,2,3"}
_TAG = re.compile(r"<br\s*/?>|</?b>", re.IGNORECASE)


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def hover_plain(text: str) -> str:
    """Plotly hover HTML (``<b>``, ``<br>``, entities) as plain text with line breaks, unescaped."""
    return html.unescape(_TAG.sub(lambda m: "\n" if m.group(0).lower().startswith("<br") else "", text))


class _Axis:
    """A linear or log axis from data values to pixels (``lo``/``hi`` in axis units: log10 for log axes)."""

    def __init__(self, spec: dict[str, Any], values: Iterable[float], p0: float, p1: float) -> None:
        self.log = spec.get("type") == "log"
        self.fmt = spec.get("tickformat", "")
        vals = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not self.log)]
        if self.log:
            lo, hi = spec.get("range") or ([math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))]
                                          if vals else [0, 1])
            self.dtick = spec.get("dtick") or max(1, math.ceil((hi - lo) / 8))
        else:
            lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
            if spec.get("rangemode") == "tozero":
                lo, hi = min(lo, 0.0), max(hi, 0.0)
            pad = (hi - lo) * 0.05 or 0.5
            lo, hi = lo - (0 if spec.get("rangemode") == "tozero" and lo == 0 else pad), hi + pad
            self.dtick = spec.get("dtick") or _nice_step((hi - lo) / 6)
        self.lo, self.hi = float(lo), float(hi) if hi != lo else float(lo) + 1.0
        self.p0, self.p1 = p0, p1

    def unit(self, v: float) -> float:
        return math.log10(v) if self.log else v

    def px(self, v: float | None) -> float | None:
        if v is None or not math.isfinite(v) or (self.log and v <= 0):
            return None
        u = (self.unit(v) - self.lo) / (self.hi - self.lo)
        return self.p0 + u * (self.p1 - self.p0)

    def ticks(self) -> list[tuple[float, str]]:
        start = math.ceil(self.lo / self.dtick - 1e-9) * self.dtick
        out: list[tuple[float, str]] = []
        u = start
        while u <= self.hi + 1e-9 and len(out) < 40:
            v = 10.0**u if self.log else u
            out.append((v, self._label(v)))
            u += self.dtick
        return out

    def _label(self, v: float) -> str:
        if self.log:
            return f"1e{int(round(math.log10(v))):+d}"
        if self.fmt.endswith("%"):
            return f"{v * 100:.1f}%"
        return f"{v:.4g}"


def _nice_step(raw: float) -> float:
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _segments(xs: Sequence[float | None], ys: Sequence[float | None], step: bool) -> list[str]:
    """SVG path data, one subpath per run of drawable points (a ``None`` breaks the line)."""
    paths: list[list[tuple[float, float]]] = []
    cur: list[tuple[float, float]] = []
    for x, y in zip(xs, ys):
        if x is None or y is None:
            if len(cur) > 1:
                paths.append(cur)
            cur = []
            continue
        if step and cur:
            cur.append((x, cur[-1][1]))
        cur.append((x, y))
    if len(cur) > 1:
        paths.append(cur)
    return ["M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in p) for p in paths]


def _marker(x: float, y: float, marker: dict[str, Any], color: str) -> str:
    r = float(marker.get("size", 6)) / 2
    symbol = marker.get("symbol", "circle")
    if symbol == "x":
        return (f'<path d="M{x - r:.1f},{y - r:.1f} L{x + r:.1f},{y + r:.1f} M{x - r:.1f},{y + r:.1f} '
                f'L{x + r:.1f},{y - r:.1f}" stroke="{_esc(color)}" stroke-width="2"/>')
    fill = "none" if symbol.endswith("open") else _esc(color)
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{fill}" stroke="{_esc(color)}"/>'


def _trace_svg(i: int, t: dict[str, Any], ax: _Axis, ay: _Axis, fig_id: str) -> str:
    color = (t.get("line") or {}).get("color") or (t.get("marker") or {}).get("color") or "#444"
    mode = t.get("mode", "lines+markers")
    xs = [ax.px(x) for x in t.get("x", [])]
    ys = [ay.px(y) for y in t.get("y", [])]
    parts = []
    if "lines" in mode:
        line = t.get("line") or {}
        dash = _DASH.get(line.get("dash", "solid"), "")
        for d in _segments(xs, ys, line.get("shape") == "hv"):
            parts.append(f'<path d="{d}" fill="none" stroke="{_esc(color)}" stroke-width="{line.get("width", 2)}"'
                         + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
    if "markers" in mode and (mode == "markers" or len(xs) <= MAX_MARKERS):
        marker = t.get("marker") or {}
        parts += [_marker(x, y, marker, marker.get("color", color)) for x, y in zip(xs, ys)
                  if x is not None and y is not None]
    hidden = ' style="display:none"' if t.get("visible") == "legendonly" else ""
    return f'<g class="trace" data-trace="{_esc(fig_id)}-{i}"{hidden}>{"".join(parts)}</g>'


def _hover_columns(data: list[dict[str, Any]], ax: _Axis, top: float, bottom: float, lines: int | None) -> str:
    """One transparent band per distinct x carrying that column's hover texts (their first ``lines`` lines)."""
    texts: dict[float, list[str]] = {}
    for t in data:
        for x, text in zip(t.get("x", []), t.get("text") or []):
            plain = "\n".join(hover_plain(text).split("\n")[:lines]) if text else ""
            if x is not None and plain and plain not in texts.setdefault(x, []):
                texts[x].append(plain)
    if not texts:
        return ""
    xs = sorted(texts)
    gap = min((b - a for a, b in zip(xs, xs[1:])), default=1.0)
    half = max(1.0, abs((ax.px(xs[0] + gap) or 0) - (ax.px(xs[0]) or 0)) / 2)
    bands = [f'<rect x="{(ax.px(x) or 0) - half:.1f}" y="{top:.1f}" width="{2 * half:.1f}" '
             f'height="{bottom - top:.1f}"><title>{_esc(chr(10).join(texts[x]))}</title></rect>' for x in xs]
    return f'<g class="hover" fill="transparent">{"".join(bands)}</g>'


def _axis_svg(axis: _Axis, vertical: bool, at: float, title: str, far: float, right: bool = False) -> str:
    out = []
    for v, label in axis.ticks():
        p = axis.px(v)
        if p is None:
            continue
        if vertical:
            tx = at + (8 if right else -8)
            anchor = "start" if right else "end"
            out.append(f'<line x1="{at:.1f}" x2="{far:.1f}" y1="{p:.1f}" y2="{p:.1f}" class="grid"/>' if not right
                       else "")
            out.append(f'<text x="{tx:.1f}" y="{p + 4:.1f}" text-anchor="{anchor}">{_esc(label)}</text>')
        else:
            out.append(f'<line x1="{p:.1f}" x2="{p:.1f}" y1="{at:.1f}" y2="{far:.1f}" class="grid"/>')
            out.append(f'<text x="{p:.1f}" y="{at + 16:.1f}" text-anchor="middle">{_esc(label)}</text>')
    if vertical:
        mid = (axis.p0 + axis.p1) / 2
        tx = at + (62 if right else -62)
        out.append(f'<text class="axis-title" transform="translate({tx:.1f},{mid:.1f}) rotate(-90)" '
                   f'text-anchor="middle">{_esc(title)}</text>')
    else:
        out.append(f'<text class="axis-title" x="{(axis.p0 + axis.p1) / 2:.1f}" y="{at + 36:.1f}" '
                   f'text-anchor="middle">{_esc(title)}</text>')
    return "".join(out)


def _legend(data: list[dict[str, Any]], fig_id: str, y0: float) -> tuple[str, float]:
    items, x, y = [], 20.0, y0
    for i, t in enumerate(data):
        name = str(t.get("name", f"trace {i}"))
        w = 40 + 7 * len(name)
        if x + w > WIDTH - 20:
            x, y = 20.0, y + 20
        color = (t.get("line") or {}).get("color") or (t.get("marker") or {}).get("color") or "#444"
        off = " off" if t.get("visible") == "legendonly" else ""
        items.append(f'<g class="legend-item{off}" data-trace="{_esc(fig_id)}-{i}" transform="translate({x:.0f},'
                     f'{y:.0f})"><line x1="0" x2="24" y1="-4" y2="-4" stroke="{_esc(color)}" stroke-width="3"/>'
                     f'<text x="30" y="0">{_esc(name)}</text></g>')
        x += w
    return "".join(items), y + 14


def figure_svg(fig: dict[str, Any], tooltip_lines: int | None = None) -> str:
    """One figure spec as an ``<svg>`` element (str); tooltips keep their first ``tooltip_lines`` lines (all)."""
    layout, data, fig_id = fig.get("layout", {}), fig.get("data", []), str(fig.get("id", "plot"))
    height = float(layout.get("height", 420))
    has_y2 = any(t.get("yaxis") == "y2" for t in data)
    left, right, top, bottom = 90.0, (90.0 if has_y2 else 30.0), 46.0, height - 70.0
    shown = [t for t in data if t.get("visible") != "legendonly"]
    ax = _Axis(layout.get("xaxis", {}), (x for t in data for x in t.get("x", [])), left, WIDTH - right)
    ays = {name: _Axis(layout.get("yaxis" if name == "y" else "yaxis2", {}),
                       (y for t in shown if t.get("yaxis", "y") == name for y in t.get("y", [])), bottom, top)
           for name in (("y", "y2") if has_y2 else ("y",))}
    title = lambda spec: ((spec or {}).get("title") or {}).get("text", "")  # noqa: E731
    body = [f'<text class="fig-title" x="{WIDTH / 2:.0f}" y="24" text-anchor="middle">'
            f'{_esc(title(layout))}</text>',
            _axis_svg(ax, False, bottom, title(layout.get("xaxis")), top),
            _axis_svg(ays["y"], True, left, title(layout.get("yaxis")), WIDTH - right)]
    if has_y2:
        body.append(_axis_svg(ays["y2"], True, WIDTH - right, title(layout.get("yaxis2")), left, right=True))
    body.append(f'<rect class="frame" x="{left}" y="{top}" width="{WIDTH - right - left}" height="{bottom - top}"/>')
    body += [_trace_svg(i, t, ax, ays[t.get("yaxis", "y") if has_y2 else "y"], fig_id) for i, t in enumerate(data)]
    body.append(_hover_columns(data, ax, top, bottom, tooltip_lines))
    legend, end = _legend(data, fig_id, bottom + 58)
    body.append(legend)
    return (f'<svg class="figure" id="{_esc(fig_id)}-svg" viewBox="0 0 {WIDTH} {end + 6:.0f}" role="img" '
            f'aria-label="{_esc(title(layout))}">{"".join(body)}</svg>')
