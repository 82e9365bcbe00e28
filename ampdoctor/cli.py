"""The ``ampdoctor`` command line. Exit codes: 0 ok, 1 findings of severity error, 2 usage or input error."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

try:
    import click
except ImportError as e:  # pragma: no cover - the CLI extra is missing
    raise ImportError("the ampdoctor command line needs click and rich: pip install 'ampdoctor[cli]'") from e

import ampdoctor
from ampdoctor import AmpDoctorError

PRECISION_CHOICES = ["fp16", "bf16", "fp16-amp", "bf16-amp", "fp8", "fp8-e4m3", "fp8-e5m2", "as-given"]


def _console() -> Any:
    from rich.console import Console

    return Console(no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False)


def _emit(report: ampdoctor.Report, json_out: str | None, html_out: str | None, quiet: bool = False) -> None:
    from ampdoctor.report import render_terminal, write_json

    if not quiet:
        render_terminal(report, console=_console())
    if json_out:
        write_json(report, json_out)
    if html_out:
        from ampdoctor.report import write_html

        write_html(report, html_out)


def _fail(msg: str) -> None:
    click.echo(f"ampdoctor: error: {msg}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ampdoctor.__version__, "--version", prog_name="ampdoctor")
@click.option("-v", "--verbose", is_flag=True, help="log progress to stderr")
def main(verbose: bool) -> None:
    """Find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default=None,
              help="target precision (default: the scenario's own; 'as-given' runs the step as written)")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="number of steps (default: the scenario's)")
@click.option("--policy", type=click.Choice(["cuda", "native"]), default="cuda",
              help="autocast op policy for *-amp: CUDA's (emulated off-GPU) or the device's own")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="write the JSON report")
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, help="write the HTML report")
def diagnose(file: str, precision: str | None, steps: int | None, policy: str, json_out: str | None,
             html_out: str | None) -> None:
    """Diagnose the scenario FILE (a .py file defining make())."""
    overrides: dict[str, Any] = {"policy": policy}
    if precision is not None:
        overrides["precision"] = None if precision == "as-given" else precision
    if steps is not None:
        overrides["steps"] = steps
    try:
        report = ampdoctor.diagnose_file(file, **overrides)
    except AmpDoctorError as e:
        _fail(str(e))
    _emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)


@main.command()
@click.option("--json", "json_dir", type=click.Path(file_okay=False), default=None,
              help="also write each report as JSON into this folder")
def demo(json_dir: str | None) -> None:
    """Diagnose the built-in scenarios: T5 fp16-amp FF overflow and BERT's unused pooler."""
    from ampdoctor.report import render_terminal, write_json
    from ampdoctor.scenarios import DEMO, load_scenario

    console = _console()
    for name in DEMO:
        module = load_scenario(name)
        title = (module.__doc__ or name).strip().splitlines()[0]
        console.rule(f"[bold]{name}[/bold]: {title}")
        report = ampdoctor.diagnose_file(str(module.__file__))
        render_terminal(report, console=console)
        if json_dir:
            os.makedirs(json_dir, exist_ok=True)
            write_json(report, os.path.join(json_dir, f"{name}.json"))


@main.command()
@click.argument("code", required=False)
def explain(code: str | None) -> None:
    """Print the documentation of a cause CODE (all codes without an argument)."""
    from rich.markdown import Markdown

    from ampdoctor.findings import CODE_INFO, codes_markdown

    console = _console()
    if code is None:
        console.print(Markdown(codes_markdown()))
        return
    info = CODE_INFO.get(code)
    if info is None:
        _fail(f"unknown code {code!r}; expected one of {', '.join(ampdoctor.CODES)}")
        return
    console.print(Markdown(f"# `{info.code}` ({info.severity}, precedence {info.precedence})\n\n"
                           f"**{info.summary}**\n\n{info.doc}"))


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, help="write the HTML report")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="write the JSON report")
def report(file: str, html_out: str | None, json_out: str | None) -> None:
    """Render a saved JSON report FILE (terminal, and --html / --json)."""
    from ampdoctor.report import load_report

    try:
        rep = load_report(file)
    except (AmpDoctorError, ValueError, OSError) as e:
        _fail(str(e))
    _emit(rep, json_out, html_out)
    sys.exit(0 if rep.ok else 1)


if __name__ == "__main__":  # pragma: no cover
    main()
