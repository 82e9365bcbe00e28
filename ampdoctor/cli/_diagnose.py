"""``ampdoctor diagnose`` (a scenario file or a Hugging Face checkpoint's inference) and ``ampdoctor report``
(render a saved JSON report)."""

from __future__ import annotations

import sys
from typing import Any

import click

import ampdoctor
from ampdoctor.cli._app import HTML_HELP, JSON_HELP, POLICY_HELP, PRECISION_CHOICES, main
from ampdoctor.cli._checks import fail, scenario_path, user_code
from ampdoctor.cli._output import PhaseProgress, check_outputs, emit
from ampdoctor.errors import AmpDoctorError
from ampdoctor.precision import MAX_STEPS


@main.command()
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default=None,
              help="target precision (default: the scenario's own, fp16 with --hf; 'as-given' runs the step as "
                   "written)")
@click.option("--steps", type=click.IntRange(min=1, max=MAX_STEPS), default=None,
              help=f"number of steps, at most {MAX_STEPS} (default: the scenario's)")
@click.option("--policy", type=click.Choice(["cuda", "native"]), default="cuda", show_default=True, help=POLICY_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None, help=JSON_HELP)
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, help=HTML_HELP)
@click.option("--hf", type=click.Path(file_okay=False), default=None,
              help="diagnose inference of a local Hugging Face model directory instead of a scenario FILE")
@click.option("--text", default=None, help="with --hf: the prompt, tokenized with the checkpoint's tokenizer")
@click.option("--input-ids", "input_ids", type=click.Path(dir_okay=False), default=None,
              help="with --hf: a file of token ids (JSON list, whitespace-separated ints or a .pt tensor)")
@click.option("--task", type=click.Choice(["auto", "causal-lm", "seq2seq", "embeddings", "classification"]),
              default="auto", show_default=True, help="with --hf: which head to load (auto: from config.json)")
@click.option("--max-new-tokens", "max_new_tokens", type=click.IntRange(min=1), default=None,
              help="with --hf: diagnose a greedy generation of N tokens (KV cache) instead of one forward")
@click.option("--seq-len", "seq_len", type=click.IntRange(min=1), default=None,
              help="with --hf: probe a context of L tokens (synthetic ids without --text); a per-position headroom "
                   "curve goes into the JSON summary")
@click.option("--compiled", is_flag=True, default=False,
              help="with --hf: also compare torch.compile's target outputs with the eager target's")
@click.option("--fp8-recipe", "fp8_recipe", default=None, metavar="RECIPE",
              help="the fp8 recipe of an fp8 precision: comma-separated field=value (scaling=delayed|dynamic, "
                   "amax_history_len=N, margin=M, amax_floor=F) or a bare 'delayed'/'dynamic'; the format follows "
                   "--precision (default: hybrid, delayed, history 1024, margin 0, floor 1e-12)")
def diagnose(file: str | None, precision: str | None, steps: int | None, policy: str, json_out: str | None,
             html_out: str | None, hf: str | None, text: str | None, input_ids: str | None, task: str,
             max_new_tokens: int | None, seq_len: int | None, compiled: bool, fp8_recipe: str | None) -> None:
    """Diagnose the scenario FILE (a .py file defining make(), or a built-in scenario name), or a checkpoint's
    inference with --hf DIR."""
    check_outputs(json_out, html_out)
    recipe = _fp8_recipe(fp8_recipe, precision, hf is not None) if fp8_recipe is not None else None
    if hf is not None or file is None:
        if (file is None) == (hf is None):
            fail("give either a scenario FILE or --hf DIR (a Hugging Face model directory)")
        if steps is not None:
            fail("--steps applies to scenario files; with --hf use --max-new-tokens N for a generation")
        _diagnose_hf(str(hf), precision or "fp16", policy, json_out, html_out, text=text, input_ids=input_ids,
                     task=task, max_new_tokens=max_new_tokens, seq_len=seq_len, compiled=compiled, fp8_recipe=recipe)
        return
    given = [n for n, v in (("--text", text), ("--input-ids", input_ids), ("--max-new-tokens", max_new_tokens),
                            ("--seq-len", seq_len)) if v is not None] + (["--compiled"] if compiled else [])
    if given or task != "auto":
        fail(f"{', '.join(given) or '--task'} need(s) --hf DIR; a scenario FILE defines its own batch in make()")
    file = scenario_path(file)
    overrides: dict[str, Any] = {"policy": policy}
    if precision is not None:
        overrides["precision"] = None if precision == "as-given" else precision
    if steps is not None:
        overrides["steps"] = steps
    if recipe is not None:
        overrides["fp8_recipe"] = recipe
    with user_code(), PhaseProgress() as progress:
        report = ampdoctor.diagnose_file(file, progress=progress, **overrides)
    emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)


def _fp8_recipe(text: str, precision: str | None, hf: bool) -> Any:
    """``--fp8-recipe`` as an :class:`~ampdoctor.precision.Fp8Recipe` in ``--precision``'s format (the scenario's
    own precision when none is given: the recipe's format must then match it); a clear error otherwise."""
    from ampdoctor.precision import FP8_FORMATS, Fp8Recipe

    if hf and precision is None:
        fail("--fp8-recipe with --hf needs an fp8 precision (--hf runs fp16 by default): pass --precision fp8, "
             "fp8-e4m3 or fp8-e5m2")

    if precision is not None and precision not in FP8_FORMATS:
        fail(f"--fp8-recipe applies to an fp8 run, but --precision is {precision}: pass --precision "
             f"{' / '.join(FP8_FORMATS)} with it, or drop --fp8-recipe")
    fmt = FP8_FORMATS.get(precision or "")
    try:
        recipe = Fp8Recipe.parse(text, format=fmt)
    except ValueError as e:
        fail(f"--fp8-recipe {text!r}: {e}")
    if fmt is not None and recipe.format != fmt:
        right = next(p for p, f in FP8_FORMATS.items() if f == recipe.format)
        fail(f"--fp8-recipe format={recipe.format} does not match --precision {precision} (which runs {fmt}): drop "
             f"format= (the precision decides it) or pass --precision {right}")
    return recipe


def _diagnose_hf(path: str, precision: str, policy: str, json_out: str | None, html_out: str | None,
                 **kw: Any) -> None:
    from ampdoctor.integrations.hf_checkpoint import diagnose_hf

    if precision == "as-given":
        fail("--precision as-given has no meaning with --hf (the checkpoint is loaded in float32); pass fp16, "
             "bf16, fp16-amp, bf16-amp or an fp8 format")
    with user_code("the checkpoint"), PhaseProgress() as progress:
        report = diagnose_hf(path, precision=precision, policy=policy, progress=progress, **kw)
    emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, help=HTML_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None, help=JSON_HELP)
def report(file: str, html_out: str | None, json_out: str | None) -> None:
    """Render a saved JSON report FILE (terminal, and --html / --json)."""
    from ampdoctor.report import load_report

    check_outputs(json_out, html_out)
    try:
        rep = load_report(file)
    except (AmpDoctorError, ValueError, OSError) as e:
        fail(str(e))
    emit(rep, json_out, html_out)
    sys.exit(0 if rep.ok else 1)
