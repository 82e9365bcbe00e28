"""``ampdoctor run`` (a training script, unchanged, under the watch) and ``ampdoctor replay`` (a watch reproducer
under the full trace)."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ampdoctor.cli._app import HTML_HELP, JSON_HELP, main
from ampdoctor.cli._checks import fail, user_code
from ampdoctor.cli._output import check_outputs, emit


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--on-anomaly", type=click.Choice(["warn", "raise", "skip", "replay"]), default="warn",
              show_default=True, help="what the watch does when a step goes wrong")
@click.option("--reproducer-dir", type=click.Path(file_okay=False), default=None,
              help="write a reproducer of the anomalous step here (ampdoctor replay reads it)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None, help=JSON_HELP)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
def run(on_anomaly: str, reproducer_dir: str | None, json_out: str | None, argv: tuple[str, ...]) -> None:
    """Run a training script unchanged with a watch on every optimizer it creates:
    ampdoctor run -- python train.py ARGS

    Exit code: the script's own when it exited non-zero, 1 when it crashed or a finding is an error, 2 when the
    script cannot be started."""
    from ampdoctor.integrations.run import run_script

    check_outputs(json_out)
    with user_code("the script"):
        try:
            report = run_script(list(argv), on_anomaly=on_anomaly, reproducer_dir=reproducer_dir)
        except ValueError as e:  # the script cannot be started (missing file or module)
            fail(str(e))
    emit(report, json_out, None)
    for key in ("scaler_note", "replay_note"):     # what the watch could not see: after the report, not lost in it
        if report.summary.get(key):
            click.echo(f"ampdoctor: {report.summary[key]}", err=True)
    ended = report.summary.get("script", {})
    status = ended.get("status")
    if status == "exit":
        code = ended.get("code")
        click.echo(f"ampdoctor: the script did not finish: it exited with {code!r}", err=True)
        sys.exit(code if isinstance(code, int) and 0 < code < 256 else 1)
    if status == "error":
        click.echo(f"ampdoctor: the script did not finish: it raised {ended.get('exception')}: "
                   f"{ended.get('message', '')}", err=True)
        sys.exit(1)
    if status == "anomaly":
        click.echo(f"ampdoctor: the script was stopped at step {ended.get('step')} ({ended.get('kind')})", err=True)
        sys.exit(1)
    sys.exit(0 if report.ok else 1)


def _factory(spec: str) -> Any:
    """``module:callable`` -> the callable (the module is imported: the user named it explicitly)."""
    import importlib

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        fail(f"--factory {spec!r}: expected module:callable, e.g. --factory mypkg.models:build_model")
    sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        fail(f"--factory {spec!r}: {type(e).__name__}: {e}")
    finally:
        sys.path.remove(os.getcwd())
    if not callable(obj):
        fail(f"--factory {spec!r} is not callable")
    return obj


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--factory", default=None, metavar="MODULE:CALLABLE",
              help="build the model's architecture with this callable (weights come from FILE)")
@click.option("--trust-source", is_flag=True, default=False,
              help="import the scenario/script file named in FILE (runs its code; only for files you trust)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None, help=JSON_HELP)
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, help=HTML_HELP)
def replay(file: str, factory: str | None, trust_source: bool, json_out: str | None, html_out: str | None) -> None:
    """Replay a watch reproducer FILE under the full trace. The model is rebuilt from the recorded Hugging Face
    config, from --factory, or (with --trust-source only) from the scenario file it names."""
    from ampdoctor.watch import replay as replay_fn

    check_outputs(json_out, html_out)
    model_factory = _factory(factory) if factory is not None else None
    with user_code("the replay"):
        report = replay_fn(file, model_factory=model_factory, trust_source=trust_source)
    emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)

