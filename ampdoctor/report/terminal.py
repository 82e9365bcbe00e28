"""Render a :class:`~ampdoctor.findings.Report` for a terminal with rich.

>>> from ampdoctor.report import render_terminal, terminal_text
>>> render_terminal(report)                       # doctest: +SKIP
>>> print(terminal_text(report, width=100))       # plain text, no colour   # doctest: +SKIP

rich is imported when a function is called (``pip install ampdoctor[cli]``). Model-supplied strings (module
names, ops, explanations) are rendered as plain :class:`rich.text.Text`, never parsed as rich markup.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from ampdoctor.findings import Finding, Link, Report
from ampdoctor.report import _format as F

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

#: How many layers the headroom table shows.
LAYER_ROWS = 12

_SHORT_DTYPE = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}
_SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "bold blue"}


def _rich() -> Any:
    try:
        import rich  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "the terminal report needs rich: pip install 'ampdoctor[cli]' (or pip install rich)"
        ) from e
    import rich.box
    import rich.console
    import rich.panel
    import rich.table
    import rich.text

    return rich


def render_terminal(report: Report, *, console: Console | None = None, width: int | None = None) -> None:
    """Print ``report`` to ``console`` (default: a new rich Console on stdout).

    A new console follows rich's rules: no colour when ``NO_COLOR`` is set or stdout is not a terminal.
    ``width`` fixes the line width of a new console (default: the terminal's).
    """
    rich = _rich()
    if console is None:
        console = rich.console.Console(width=width, highlight=False, emoji=False)
    for part in renderables(report):
        console.print(part)


def terminal_text(report: Report, width: int = 100, color: bool = False) -> str:
    """The terminal rendering as a string, ``width`` columns wide; ANSI colour codes only when ``color``."""
    rich = _rich()
    buf = io.StringIO()
    console = rich.console.Console(
        file=buf,
        width=width,
        color_system="standard" if color else None,
        force_terminal=color,
        no_color=not color,
        highlight=False,
        emoji=False,
        legacy_windows=False,
        force_jupyter=False,
        force_interactive=False,
        _environ={},
    )
    for part in renderables(report):
        console.print(part)
    return "".join(line.rstrip(" ") + "\n" for line in buf.getvalue().splitlines())


def renderables(report: Report) -> list[RenderableType]:
    """The report as a list of rich renderables: summary, evidence, lineage, findings, layer headroom."""
    rich = _rich()
    parts: list[Any] = [_summary_panel(rich, report)]
    root = report.root_cause
    if root is not None and root.evidence:
        parts.append(_evidence_table(rich, root))
    links = F.chain(report)
    if links:
        parts.append(_chain_table(rich, links))
    for i, finding in enumerate(report.findings, 1):
        parts.append(_finding_panel(rich, i, finding))
    rows = F.layer_rows(report)
    if rows:
        parts.append(_layer_table(rich, rows))
    return parts


def _summary_panel(rich: Any, report: Report) -> Any:
    counts = {sev: sum(f.severity == sev for f in report.findings) for sev in ("error", "warning", "info")}
    tally = ", ".join(f"{n} {sev}{'s' if n != 1 else ''}" for sev, n in counts.items() if n) or "no findings"
    grid = rich.table.Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")

    def row(label: str, *pieces: tuple[str, str]) -> None:
        value = rich.text.Text()
        for text, style in pieces:
            value.append(text, style=style)
        grid.add_row(label, value)

    row("Verdict", ("OK" if report.ok else "FAIL", "bold green" if report.ok else "bold red"), (f"  ({tally})", ""))
    facts = report.run
    run = [f"precision {facts.precision or 'as given (none)'}"]
    if facts.steps is not None:
        run.append(_plural(facts.steps, "step"))
    run += [f"{label} {v}" for v, label in ((facts.device, "device"), (facts.torch_version, "torch")) if v]
    if facts.elapsed_s is not None:
        run.append(f"{facts.elapsed_s:.1f} s")
    row("Run", (", ".join(run), ""))
    if facts.forward_only:  # say what did not run: an "OK" here judges the forward only
        row("Mode", ("forward only: no backward and no optimizer step ran (the step has no loss with a graph; pass "
                     "loss_fn=... to diagnose training)", "yellow"))
    if report.source:
        row("Source", (report.source, ""))

    root = report.root_cause
    if root is None:
        row("Root cause", ("none found", "green"))
    else:
        detail = ", ".join(x for x in (root.op, root.phase, f"step {root.step}") if x)
        row(
            "Root cause",
            (root.code, _SEVERITY_STYLE.get(root.severity, "")),
            (f" in {root.module or '<root>'} ({detail})", ""),
        )
    if facts.loss_target is not None or facts.loss_reference is not None:
        row("Loss (last step)", (F.loss_text(facts), ""))
    if facts.first_nonfinite is not None:
        row("First non-finite", (str(facts.first_nonfinite), ""))
    if facts.first_nan is not None:
        row("First NaN", (str(facts.first_nan), ""))
    if F.scale_text(facts):
        row("Loss scale", (F.scale_text(facts), ""))
    elif facts.skipped_steps is not None:
        row("Skipped steps", (str(facts.skipped_steps), ""))

    title = rich.text.Text("ampdoctor report", style="bold")
    return rich.panel.Panel(grid, title=title, title_align="left", border_style="green" if report.ok else "red")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _heading(rich: Any, text: str) -> Any:
    return rich.text.Text(text, style="bold underline")


def _evidence_table(rich: Any, root: Finding) -> Any:
    table = rich.table.Table(box=rich.box.SIMPLE_HEAD, show_edge=False)
    table.add_column("quantity", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in root.evidence.items():
        table.add_row(rich.text.Text(str(key)), rich.text.Text(F.fmt_num(value)))
    return rich.console.Group(_heading(rich, f"Evidence for the root cause ({root.code})"), table)


def _chain_table(rich: Any, links: list[Link]) -> Any:
    grid = rich.table.Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for i, link in enumerate(links):
        marker = "origin" if i == 0 else ("->" if i < len(links) - 1 else "-> end")
        text = rich.text.Text()
        text.append(link.op or "-", style="cyan")
        if link.module:
            text.append(" in ")
            text.append(link.module, style="bold")
        if link.phase:
            text.append(f" ({link.phase})")
        if link.what:
            text.append("\n")
            text.append(link.what, style="dim")
        grid.add_row(marker, text)
    return rich.console.Group(_heading(rich, "Lineage: origin -> first NaN -> loss"), grid)


def _finding_panel(rich: Any, index: int, finding: Finding) -> Any:
    head = rich.text.Text()
    head.append(finding.title or finding.code, style="bold")
    where = rich.text.Text()
    for label, value in (
        ("module", finding.module or "<root>"),
        ("op", finding.op or "-"),
        ("phase", finding.phase),
        ("step", str(finding.step)),
    ):
        where.append(f"{label} ", style="dim")
        where.append(value)
        where.append("   ")
    where.rstrip()
    body: list[Any] = [head, where]
    if finding.explanation:
        body.append(rich.text.Text(""))
        body.append(rich.text.Text(finding.explanation))
    if finding.fixes:
        body.append(rich.text.Text(""))
        body.append(rich.text.Text("Fixes", style="bold"))
    if finding.fixes:
        fixes = rich.table.Table.grid(padding=(0, 1))
        fixes.add_column(no_wrap=True)
        fixes.add_column(overflow="fold")
        for fix in finding.fixes:
            status = F.fix_status(fix)
            style = {"verified ✓": "green", "failed ✗": "red"}.get(status, "yellow")
            text = rich.text.Text(fix.title)
            if fix.verification:
                text.append("\n")
                text.append(F.fmt_num(dict(fix.verification)), style="dim")
            if fix.snippet:
                text.append("\n")
                text.append(fix.snippet, style="cyan")
            fixes.add_row(rich.text.Text(f"  [{status}]", style=style), text)
        body.append(fixes)
    title = rich.text.Text()
    title.append(f"#{index} ")
    title.append(finding.severity.upper(), style=_SEVERITY_STYLE.get(finding.severity, ""))
    title.append(f" {finding.code}")
    return rich.panel.Panel(
        rich.console.Group(*body),
        title=title,
        title_align="left",
        border_style={"error": "red", "warning": "yellow"}.get(finding.severity, "blue"),
    )


def _layer_table(rich: Any, rows: list[F.LayerRow]) -> Any:
    shown = F.least_headroom(rows, LAYER_ROWS)
    heading = f"Layer headroom ({len(shown)} of {len(rows)} entries, least margin first)"
    return rich.console.Group(_heading(rich, heading), _LayerTable(rich, shown))


class _LayerTable:
    """The headroom table; below :data:`_WIDE` columns the op and pass columns fold into the module cell."""

    _WIDE = 90

    def __init__(self, rich: Any, rows: list[F.LayerRow]) -> None:
        self._rich, self._rows = rich, rows

    def __rich_console__(self, console: Any, options: Any) -> Any:
        rich, wide = self._rich, options.max_width >= self._WIDE
        table = rich.table.Table(
            box=rich.box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=0,
        )
        table.add_column("#", justify="right", no_wrap=True)
        table.add_column("module" if wide else "module / aten op", overflow="fold")
        if wide:
            table.add_column("aten op", overflow="fold")
            table.add_column("pass", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        table.add_column("ref |max|", justify="right", no_wrap=True)
        table.add_column("tgt |max|", justify="right", no_wrap=True)
        table.add_column("margin", justify="right", no_wrap=True)
        table.add_column("flush", justify="right", no_wrap=True)
        for r in self._rows:
            bad = r.margin_bits is not None and r.margin_bits < 0
            phase = rich.text.Text({"forward": "fwd", "backward": "bwd"}.get(r.phase, r.phase or "-"))
            module = rich.text.Text(r.module or "<root>")
            if wide:
                where = [module, rich.text.Text(_short_op(r.op) or "-"), phase]
            else:
                module.append(f"\n{_short_op(r.op) or '-'} ({phase.plain})", style="dim")
                where = [module]
            table.add_row(
                str(r.depth),
                *where,
                rich.text.Text(_SHORT_DTYPE.get(r.dtype, r.dtype) or "-"),
                F.fmt_num(r.ref_absmax),
                rich.text.Text(F.fmt_num(r.target_absmax), style="red" if r.overflowed or r.target_nan else ""),
                rich.text.Text(F.fmt_margin(r.margin_bits), style="red" if bad else ""),
                F.fmt_percent(r.flush_fraction),
            )
        yield table
        yield rich.text.Text("margin = log2(format max / |max|) in bits; negative = past the format's max", style="dim")


def _short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``aten.pow.Tensor_Scalar`` -> ``pow.Tensor_Scalar`` (table column is aten op)."""
    if op.startswith("aten."):
        op = op[len("aten.") :]
    return op[: -len(".default")] if op.endswith(".default") else op
