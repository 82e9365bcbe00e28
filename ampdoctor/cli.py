"""The ``ampdoctor`` command line. Exit codes: 0 ok, 1 findings of severity error, 2 usage or input error."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

try:
    import click
except ImportError as e:  # pragma: no cover - the CLI extra is missing
    raise ImportError("the ampdoctor command line needs click and rich: pip install 'ampdoctor[cli]'") from e

import ampdoctor
from ampdoctor._cli_checks import did_you_mean, fail, need, output_path, scenario_path, user_code
from ampdoctor.errors import AmpDoctorError
from ampdoctor.precision import MAX_STEPS

PRECISION_CHOICES = ["fp16", "bf16", "fp16-amp", "bf16-amp", "fp8", "fp8-e4m3", "fp8-e5m2", "as-given"]


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False, stderr=stderr)


def _print(console: Any, text: str) -> None:
    """Print text that holds user-controlled names literally (never parsed as rich markup)."""
    console.print(text, markup=False, highlight=False, emoji=False)


def _outputs(json_out: str | None = None, html_out: str | None = None) -> None:
    """Check the report destinations and the extras they need before anything runs."""
    output_path(json_out, "--json", dash=True)
    output_path(html_out, "--html")
    if html_out:
        need("--html")


def _emit(report: ampdoctor.Report, json_out: str | None, html_out: str | None, quiet: bool = False) -> None:
    """Terminal report (on stderr when ``--json -`` takes stdout), JSON and HTML."""
    from ampdoctor.report import render_json, render_terminal, write_json

    if not quiet:
        render_terminal(report, console=_console(stderr=json_out == "-"))
    if json_out == "-":
        click.echo(render_json(report), nl=False)
    elif json_out:
        write_json(report, json_out)
    if html_out:
        from ampdoctor.report import write_html

        write_html(report, html_out)


class _phase_progress:
    """A rich progress bar over the diagnosis phases, drawn on stderr only when it is a terminal.

    ``headroom=True`` adds the headroom run (``check``); ``only_headroom=True`` is the ``headroom`` command's one
    fp32 traced run. The returned callable takes a phase name (``diagnose(progress=...)``'s protocol)."""

    LABELS = {"headroom": "fp32 headroom run", "reference": "fp32 reference run", "target": "target-precision run",
              "analysis": "analysis"}

    def __init__(self, *, headroom: bool = False, only_headroom: bool = False) -> None:
        run = ("reference", "target", "analysis")
        self.phases = ("headroom",) if only_headroom else (("headroom",) if headroom else ()) + run
        self.phases += ("done",)

    def __enter__(self) -> Any:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                            console=console, transient=True, disable=not console.is_terminal)
        self.bar.__enter__()
        self.task = self.bar.add_task(self.LABELS[self.phases[0]], total=len(self.phases) - 1)

        def update(phase: str) -> None:
            if phase in self.phases:
                self.bar.update(self.task, completed=self.phases.index(phase),
                                description=self.LABELS.get(phase, phase))

        return update

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)


_fail = fail
JSON_HELP = "write the JSON report to this file ('-': stdout, the terminal report then goes to stderr)"
HTML_HELP = "write the offline HTML report to this file (needs the html extra: jinja2, plotly)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ampdoctor.__version__, "--version", prog_name="ampdoctor")
@click.option("-v", "--verbose", is_flag=True, help="log progress to stderr")
def main(verbose: bool) -> None:
    """Find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy."""
    need("the terminal report")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default=None,
              help="target precision (default: the scenario's own, fp16 with --hf; 'as-given' runs the step as "
                   "written)")
@click.option("--steps", type=click.IntRange(min=1, max=MAX_STEPS), default=None,
              help=f"number of steps, at most {MAX_STEPS} (default: the scenario's)")
@click.option("--policy", type=click.Choice(["cuda", "native"]), default="cuda", show_default=True,
              help="autocast op policy for *-amp: CUDA's (emulated off-GPU) or the device's own")
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
def diagnose(file: str | None, precision: str | None, steps: int | None, policy: str, json_out: str | None,
             html_out: str | None, hf: str | None, text: str | None, input_ids: str | None, task: str,
             max_new_tokens: int | None, seq_len: int | None, compiled: bool) -> None:
    """Diagnose the scenario FILE (a .py file defining make(), or a built-in scenario name), or a checkpoint's
    inference with --hf DIR."""
    _outputs(json_out, html_out)
    if hf is not None or file is None:
        if (file is None) == (hf is None):
            _fail("give either a scenario FILE or --hf DIR (a Hugging Face model directory)")
        if steps is not None:
            _fail("--steps applies to scenario files; with --hf use --max-new-tokens N for a generation")
        _diagnose_hf(str(hf), precision or "fp16", policy, json_out, html_out, text=text, input_ids=input_ids,
                     task=task, max_new_tokens=max_new_tokens, seq_len=seq_len, compiled=compiled)
        return
    given = [n for n, v in (("--text", text), ("--input-ids", input_ids), ("--max-new-tokens", max_new_tokens),
                            ("--seq-len", seq_len)) if v is not None] + (["--compiled"] if compiled else [])
    if given or task != "auto":
        _fail(f"{', '.join(given) or '--task'} need(s) --hf DIR; a scenario FILE defines its own batch in make()")
    file = scenario_path(file)
    overrides: dict[str, Any] = {"policy": policy}
    if precision is not None:
        overrides["precision"] = None if precision == "as-given" else precision
    if steps is not None:
        overrides["steps"] = steps
    with user_code(), _phase_progress() as progress:
        report = ampdoctor.diagnose_file(file, progress=progress, **overrides)
    _emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)


def _diagnose_hf(path: str, precision: str, policy: str, json_out: str | None, html_out: str | None,
                 **kw: Any) -> None:
    from ampdoctor.integrations.hf_checkpoint import diagnose_hf

    if precision == "as-given":
        _fail("--precision as-given has no meaning with --hf (the checkpoint is loaded in float32); pass fp16, "
              "bf16, fp16-amp, bf16-amp or an fp8 format")
    with user_code("the checkpoint"), _phase_progress() as progress:
        report = diagnose_hf(path, precision=precision, policy=policy, progress=progress, **kw)
    _emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)


@main.command()
@click.option("--json", "json_dir", type=click.Path(file_okay=False), default=None,
              help="also write each report as JSON into this folder")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="training steps of each fix verification")
@click.option("--verbose", is_flag=True, default=False,
              help="also print each full report and the table of every fix tried")
def demo(json_dir: str | None, steps: int, verbose: bool) -> None:
    """Diagnose the built-in scenarios (T5 fp16-amp FF overflow, BERT's unused pooler) and verify a fix.

    Each case prints its summary and one "what to do" block (the verified fix, its numbers in one line, the code);
    ``--verbose`` adds the full report and the table of every fix tried (also in ``--json``).
    """
    from ampdoctor.fixes import diagnose_and_fix
    from ampdoctor.report import render_terminal, write_json
    from ampdoctor.report.terminal import renderables
    from ampdoctor.scenarios import DEMO, load_scenario

    console = _console()
    for name in DEMO:
        module = load_scenario(name)
        title = (module.__doc__ or name).strip().splitlines()[0]
        console.rule(f"[bold]{name}[/bold]: {title}")
        status = console.status(f"diagnosing {name} and verifying fixes ({steps} steps)") if console.is_terminal \
            else contextlib.nullcontext()
        with status:
            report = diagnose_and_fix(str(module.__file__), steps=steps, until_verified=True)
        if verbose:
            render_terminal(report, console=console)
            console.print(_fix_table(report, steps))
        else:
            console.print(renderables(report)[0])
        _what_to_do(console, report, steps)
        if json_dir:
            os.makedirs(json_dir, exist_ok=True)
            write_json(report, os.path.join(json_dir, f"{name}.json"))


def _what_to_do(console: Any, report: Any, steps: int) -> None:
    """The verified fix of a report in a few lines: what, its numbers in one line, the code."""
    from rich.syntax import Syntax

    from ampdoctor.fixes import NoFixError, best_fix

    try:
        proposal, _ = best_fix(report)
    except NoFixError:
        console.print("[bold]what to do:[/bold] no fix could be verified; see `ampdoctor fix FILE --fp32-policy`")
        return
    v = proposal.verification or {}
    if not proposal.verified:
        console.print(f"[bold]what to do:[/bold] no fix verified ({v.get('reason', 'not tried')})")
        return

    def num(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    tol = v.get("tolerance", {})
    console.print(f"[bold]what to do:[/bold] {proposal.title}")
    console.print(f"  verified over {v.get('steps', steps)} training steps against fp32: loss "
                  f"{num(v.get('loss_fp32'))} fp32 / {num(v.get('loss_broken'))} before / "
                  f"{num(v.get('loss_fixed'))} after; curve error {num(v.get('max_rel_err_curve'))} <= "
                  f"{num(tol.get('curve'))}; steps finite {v.get('steps_finite_broken')} -> {v.get('steps_finite')}")
    code = proposal.snippet or ""
    if code:
        console.print(Syntax(code, "python", word_wrap=True))


@main.command("fix")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--apply", "which", default="best", show_default=True,
              help="the fix to apply: 'best' (the first verified one) or a fix id (keep_fp32, switch_precision, ...)")
@click.option("--steps", type=click.IntRange(min=1, max=MAX_STEPS), default=20, show_default=True,
              help="training steps of each verification run")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), default=None,
              help="write the fix to this path: the fixed model's state_dict when the fix changed weights, "
                   "else the code to apply (the message says which)")
@click.option("--fp32-policy", "fp32_policy", is_flag=True, default=False,
              help="search the smallest set of implicated modules to keep in float32 so the run verifies, and "
                   "print it as a _keep_in_fp32_modules list and an autocast-disable snippet")
@click.option("--policy", type=click.Choice(["cuda", "native"]), default="cuda", show_default=True,
              help="autocast op policy for *-amp: CUDA's (emulated off-GPU) or the device's own")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="write the report with every verified fix as JSON ('-': stdout)")
def fix_cmd(file: str, which: str, steps: int, save_path: str | None, fp32_policy: bool, policy: str,
            json_out: str | None) -> None:
    """Diagnose FILE, verify the proposed fixes against fp32 and apply one (exit 0: a verified fix was applied)."""
    from rich.syntax import Syntax

    from ampdoctor.fixes import FIXES, diagnose_and_fix
    from ampdoctor.fixes import fix as apply_fix
    from ampdoctor.precision import load_scenario_module, saved_rng

    if fp32_policy:
        _fp32_policy(scenario_path(file), steps, policy)
    if which != "best" and which not in FIXES:
        _fail(f"invalid --apply {which!r}{did_you_mean(which, FIXES)}: expected 'best' or one of "
              f"{', '.join(sorted(FIXES))}")
    _outputs(json_out)
    output_path(save_path, "--save")
    file = scenario_path(file)
    with user_code():
        report = diagnose_and_fix(file, steps=steps, policy=policy, until_verified=which == "best")
    console = _console(stderr=json_out == "-")
    console.print(_fix_table(report, steps))
    if json_out:
        _emit(report, json_out, None, quiet=True)
    try:
        with user_code(), saved_rng():
            model = load_scenario_module(file).make()["model"]  # a fresh model: make() builds new objects
        result = apply_fix(model, report, which=which)
    except (AmpDoctorError, ValueError) as e:
        _print(console, f"no fix applied: {e}")
        sys.exit(1)
    for line in result.applied:
        _print(console, f"applied: {line}")
    if result.snippet:
        console.print("the fix as code (paste into your model or training script):")
        console.print(Syntax(result.snippet, "python"))
    for change in result.training_changes:
        if isinstance(change, str) and change != result.snippet:
            console.print("change in your training loop:")
            console.print(Syntax(change, "python"))
    if save_path:
        _print(console, _save_fix(model, result, save_path))
    sys.exit(0 if result.proposal.verified else 1)


def _weights_changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    import torch

    if before.keys() != after.keys():
        return True
    return any(b.dtype != a.dtype or b.shape != a.shape or not torch.equal(b, a.to(b.device))
               for b, a in ((before[k], after[k]) for k in before) if isinstance(b, torch.Tensor))


def _save_fix(model: Any, result: Any, path: str) -> str:
    """``--save``: the state_dict only when the fix changed weights (dtypes or values), else the code to apply."""
    import torch

    after = result.model.state_dict()
    if _weights_changed(model.state_dict(), after):
        torch.save(after, path)
        return f"the fix changed the weights: the fixed model's state_dict is written to {path}"
    code = result.snippet or "\n\n".join(c for c in result.training_changes if isinstance(c, str))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# ampdoctor fix: {result.proposal.id}\n# {'; '.join(result.applied)}\n{code}\n")
    return (f"the fix changes no weights (it changes how modules run): its code is written to {path}; "
            "no state_dict was saved, it would equal your model's")


def _fp32_policy(file: str, steps: int, policy: str) -> None:
    from rich.syntax import Syntax

    from ampdoctor.fixes import minimal_fp32_policy

    with user_code():
        try:
            result = minimal_fp32_policy(file, steps=steps, policy=policy)
        except ValueError as e:
            _fail(str(e))
    console = _console()
    cost = "unknown" if result.fp32_flop_fraction is None else f"{result.fp32_flop_fraction:.1%}"
    verdict = "verifies" if result.verified else "does NOT verify (even the whole implicated set)"
    _print(console, f"minimal keep-in-fp32 set ({len(result.tried)} sets tried): {_names(list(result.modules))}; "
                    f"{verdict}; cost: {cost} of the step's FLOPs move to float32")
    if not result.verified:
        _print(console, f"why: {result.verification.get('reason', '')}")
    console.print(Syntax(result.snippet(), "python"))
    sys.exit(0 if result.verified else 1)


def _fix_table(report: Any, steps: int) -> Any:
    from rich.table import Table
    from rich.text import Text

    from ampdoctor.report.fix_table import before_after_table

    table = Table(title=f"fixes, verified over {steps} training steps against fp32", title_justify="left")
    for col in ("fix", "verified", "loss fp32", "loss broken", "loss fixed", "max rel err (step 1)",
                f"max rel err ({steps} steps)", "tolerance", "steps finite (broken -> fixed)"):
        table.add_column(col, overflow="fold")
    rows = before_after_table(report)
    for r in rows:
        verified = Text("yes", style="green") if r["verified"] else Text("no", style="red")
        table.add_row(Text(str(r["fix"])), verified, *(Text(str(r[k])) for k in (
            "loss_fp32", "loss_broken", "loss_fixed", "max_rel_err_first_step", "max_rel_err_curve", "tolerance")),
            Text(f"{r['steps_finite_broken']} -> {r['steps_finite']}"))
    return table


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
    info = CODE_INFO.get(code) or CODE_INFO.get(code.lower().replace("_", "-"))
    if info is None:
        _fail(f"unknown code {code!r}{did_you_mean(code, ampdoctor.CODES)}; expected one of "
              f"{', '.join(ampdoctor.CODES)}")
    console.print(Markdown(f"# `{info.code}` ({info.severity}, precedence {info.precedence})\n\n"
                           f"**{info.summary}**\n\n{info.doc}" + _remedies_markdown(info.code)))


def _remedies_markdown(code: str) -> str:
    """The mechanism-specific fixes registered for ``code``: mechanism, remedy, automatic fix id, snippet."""
    from ampdoctor.findings import remedies_for
    from ampdoctor.fixes import FIXES

    rems = remedies_for(code)
    if not rems:
        return ""
    out = ["\n\n## Fixes registered for this code\n"]
    for r in rems:
        auto = (f"automatic: `ampdoctor fix --apply {r.fix_id}` ({FIXES[r.fix_id].summary})"
                if r.fix_id in FIXES else "a source change (no automatic application)")
        out.append(f"- **{r.id}** — {r.mechanism}: {r.title}; {auto}\n\n```python\n{r.snippet}\n```\n")
    return "\n".join(out)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None, help=HTML_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None, help=JSON_HELP)
def report(file: str, html_out: str | None, json_out: str | None) -> None:
    """Render a saved JSON report FILE (terminal, and --html / --json)."""
    from ampdoctor.report import load_report

    _outputs(json_out, html_out)
    try:
        rep = load_report(file)
    except (AmpDoctorError, ValueError, OSError) as e:
        _fail(str(e))
    _emit(rep, json_out, html_out)
    sys.exit(0 if rep.ok else 1)


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

    _outputs(json_out)
    with user_code("the script"):
        try:
            report = run_script(list(argv), on_anomaly=on_anomaly, reproducer_dir=reproducer_dir)
        except ValueError as e:  # the script cannot be started (missing file or module)
            _fail(str(e))
    _emit(report, json_out, None)
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
        _fail(f"--factory {spec!r}: expected module:callable, e.g. --factory mypkg.models:build_model")
    sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        _fail(f"--factory {spec!r}: {type(e).__name__}: {e}")
    finally:
        sys.path.remove(os.getcwd())
    if not callable(obj):
        _fail(f"--factory {spec!r} is not callable")
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

    _outputs(json_out, html_out)
    model_factory = _factory(factory) if factory is not None else None
    with user_code("the replay"):
        report = replay_fn(file, model_factory=model_factory, trust_source=trust_source)
    _emit(report, json_out, html_out)
    sys.exit(0 if report.ok else 1)


def _spec_for(file: str | None, hf: str | None) -> Any:
    from ampdoctor.precision import load_scenario_module, make_spec, saved_rng, spec_from_module

    if (file is None) == (hf is None):
        _fail("give either a scenario FILE or --hf DIR (a Hugging Face model directory)")
    if hf is not None:
        from ampdoctor.integrations.hf_checkpoint import load_checkpoint

        made = load_checkpoint(hf)
        return make_spec(made["model"], made["batch"], loss_fn=made["loss_fn"], source=hf)
    path = scenario_path(str(file))
    with saved_rng():
        return spec_from_module(load_scenario_module(path), source=path)


def _headroom_table(h: Any, fmt: str, autocast: str | None = None) -> Any:
    from rich.table import Table
    from rich.text import Text

    from ampdoctor.report._format import fmt_num

    judged = f"ops autocast runs in {fmt} under the {autocast} policy" if autocast else "every op"
    table = Table(title=f"headroom in {fmt} (fp32 run, {judged}; margin = log2(format max / |max|), flush = share of "
                        "nonzero values that round to 0)", title_justify="left")
    for col in ("module", "phase", "op", "|max|", "min nonzero", "margin bits", "flush"):
        table.add_column(col, overflow="fold")
    rows = sorted(h.rows, key=lambda r: (r.margin(fmt, autocast), -r.flush_fraction[fmt]))[:15]
    for r in rows:
        m = r.margin(fmt, autocast)
        style = "red" if m < 0 else ("yellow" if m < 2 or r.flush_fraction[fmt] > 0.5 else "")
        table.add_row(*(Text(c) for c in (r.module or "<root>", r.phase, r.op.replace("aten.", ""), fmt_num(r.absmax),
                                          fmt_num(r.min_nonzero), f"{m:+.1f}", f"{r.flush_fraction[fmt]:.0%}")),
                      style=style)
    return table


def _names(modules: list[str]) -> str:
    return ", ".join(m or "<root>" for m in modules) or "none"


@main.command()
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("--hf", type=click.Path(file_okay=False), default=None, help="a Hugging Face model directory instead")
@click.option("--format", "fmt", type=click.Choice(["fp16", "bf16", "e4m3", "e5m2"]), default="fp16",
              show_default=True, help="the number format to judge the range against")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="write the rows as JSON ('-': stdout)")
def headroom(file: str | None, hf: str | None, fmt: str, json_out: str | None) -> None:
    """Per-module range headroom from one fp32 forward+backward (no low-precision run needed)."""
    import json

    from ampdoctor.precision.headroom import headroom_spec

    _outputs(json_out)
    with user_code():
        spec = _spec_for(file, hf)
        with _phase_progress(only_headroom=True) as progress:
            progress("headroom")
            h = headroom_spec(spec)
    console = _console(stderr=json_out == "-")
    console.print(_headroom_table(h, fmt))
    for note in h.notes:
        _print(console, f"note: {note}")
    _print(console, f"predicted to overflow in {fmt}: {_names(h.predicted_failures(fmt))}")
    _print(console, f"suggested keep-in-fp32: {_names(h.keep_fp32(fmt))}")
    if json_out == "-":
        click.echo(json.dumps(h.to_dict(), indent=1, default=str))
    elif json_out:
        with open(json_out, "w") as f:
            json.dump(h.to_dict(), f, indent=1, default=str)


#: precision -> (headroom format, whether it autocasts); fp8 and as-given runs are judged by their run only
CHECK_FORMATS = {"fp16": ("fp16", False), "bf16": ("bf16", False), "fp16-amp": ("fp16", True),
                 "bf16-amp": ("bf16", True)}


@main.command()
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("--hf", type=click.Path(file_okay=False), default=None, help="a Hugging Face model directory instead")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default=None,
              help="the precision to gate (default: the scenario's own; 'as-given' runs the step as written)")
@click.option("--policy", type=click.Choice(["cuda", "native"]), default="cuda", show_default=True,
              help="autocast op policy for *-amp: CUDA's (emulated off-GPU) or the device's own")
def check(file: str | None, hf: str | None, precision: str | None, policy: str) -> None:
    """CI gate: exit 1 when the model is predicted unsafe in PRECISION or its run there fails, 2 when the
    scenario cannot be run (raises, exits, gives no result), else 0."""
    from dataclasses import replace

    from ampdoctor.diagnose import diagnose_spec
    from ampdoctor.precision.headroom import headroom_spec

    with user_code():
        spec = _spec_for(file, hf)
        if precision is not None:
            spec = replace(spec, precision=None if precision == "as-given" else precision)
        fmt, amp = CHECK_FORMATS.get(spec.precision or "", (None, False))
        with _phase_progress(headroom=fmt is not None) as progress:
            h = None
            if fmt is not None:
                progress("headroom")
                h = headroom_spec(spec)
            report = diagnose_spec(spec, policy=policy, progress=progress)
    name = spec.precision or "as-given"
    autocast = (("cuda" if policy == "cuda" else "cpu") if amp else None)
    bad = h.predicted_failures(fmt, autocast=autocast) if h is not None and fmt is not None else []
    console = _console()
    if h is None:
        _print(console, f"note: no range prediction for {name} (only fp16/bf16 and their autocasts); judging the run")
    if bad or not report.ok:
        root = report.findings[0] if report.findings else None
        run_txt = f"{root.code} at {root.module or '<root>'}" if root is not None else "ok"
        pred = f"predicted overflow in {_names(bad)}; " if h is not None else ""
        _print(console, f"UNSAFE in {name}: {pred}run: {run_txt}")
        sys.exit(1)
    _print(console, f"SAFE in {name}: " + ("every module keeps range headroom and " if h is not None else "")
           + f"the {name} run is ok")


if __name__ == "__main__":  # pragma: no cover
    main()
