"""What the commands share to show results: the rich console, literal printing, the report outputs (terminal,
``--json``, ``--html``) and the progress bar over the diagnosis phases."""

from __future__ import annotations

import os
from typing import Any

import click

import ampdoctor
from ampdoctor.cli._checks import need, output_path


def make_console(stderr: bool = False) -> Any:
    """A rich console (no colour under ``NO_COLOR``), on stderr when ``stderr``."""
    from rich.console import Console

    return Console(no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False, stderr=stderr)


def print_literal(con: Any, text: str) -> None:
    """Print text that holds user-controlled names literally (never parsed as rich markup)."""
    con.print(text, markup=False, highlight=False, emoji=False)


def names(modules: list[str]) -> str:
    """Module names for a message, the root as ``<root>``."""
    return ", ".join(m or "<root>" for m in modules) or "none"


def check_outputs(json_out: str | None = None, html_out: str | None = None) -> None:
    """Check the report destinations and the extras they need before anything runs."""
    output_path(json_out, "--json", dash=True)
    output_path(html_out, "--html")
    if html_out:
        need("--html")


def emit(report: ampdoctor.Report, json_out: str | None, html_out: str | None, quiet: bool = False) -> None:
    """Terminal report (on stderr when ``--json -`` takes stdout), JSON and HTML."""
    from ampdoctor.report import render_json, render_terminal, write_json

    if not quiet:
        render_terminal(report, console=make_console(stderr=json_out == "-"))
    if json_out == "-":
        click.echo(render_json(report), nl=False)
    elif json_out:
        write_json(report, json_out)
    if html_out:
        from ampdoctor.report import write_html

        write_html(report, html_out)


class PhaseProgress:
    """A rich progress bar over the diagnosis phases, drawn on stderr only when it is a terminal.

    ``headroom=True`` adds the headroom run and the quick target step (``check``; a quick check that needs no full
    diagnosis jumps from there to done); ``only_headroom=True`` is the ``headroom`` command's one
    fp32 traced run. The returned callable takes a phase name (``diagnose(progress=...)``'s protocol)."""

    LABELS = {"headroom": "fp32 headroom run", "guard": "quick target-precision step (cheap trace)",
              "reference": "fp32 reference run", "target": "target-precision run (full diagnosis)",
              "analysis": "analysis"}

    def __init__(self, *, headroom: bool = False, only_headroom: bool = False) -> None:
        run = ("reference", "target", "analysis")
        self.phases = ("headroom",) if only_headroom else (("headroom", "guard") if headroom else ()) + run
        self.phases += ("done",)

    def __enter__(self) -> Any:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        con = Console(stderr=True)
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                            console=con, transient=True, disable=not con.is_terminal)
        self.bar.__enter__()
        self.task = self.bar.add_task(self.LABELS[self.phases[0]], total=len(self.phases) - 1)

        def update(phase: str) -> None:
            if phase in self.phases:
                self.bar.update(self.task, completed=self.phases.index(phase),
                                description=self.LABELS.get(phase, phase))
                self.bar.refresh()  # drawn now: a phase shorter than the refresh period still shows

        return update

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)
