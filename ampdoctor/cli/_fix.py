"""``ampdoctor fix`` (diagnose, verify the proposed fixes against fp32, apply one, ``--save`` it, or search the
minimal keep-in-fp32 set with ``--fp32-policy``) and ``ampdoctor demo`` (the built-in scenarios, each with its
verified fix)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import click

from ampdoctor.cli._app import POLICY_HELP, main
from ampdoctor.cli._checks import did_you_mean, fail, output_path, scenario_path, user_code
from ampdoctor.cli._output import check_outputs, emit, make_console, names, print_literal
from ampdoctor.errors import AmpDoctorError
from ampdoctor.precision import MAX_STEPS


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

    console = make_console()
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
              help=POLICY_HELP)
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
        fail(f"invalid --apply {which!r}{did_you_mean(which, FIXES)}: expected 'best' or one of "
              f"{', '.join(sorted(FIXES))}")
    check_outputs(json_out)
    output_path(save_path, "--save")
    file = scenario_path(file)
    with user_code():
        report = diagnose_and_fix(file, steps=steps, policy=policy, until_verified=which == "best")
    console = make_console(stderr=json_out == "-")
    console.print(_fix_table(report, steps))
    if json_out:
        emit(report, json_out, None, quiet=True)
    try:
        with user_code(), saved_rng():
            model = load_scenario_module(file).make()["model"]  # a fresh model: make() builds new objects
        result = apply_fix(model, report, which=which)
    except (AmpDoctorError, ValueError) as e:
        print_literal(console, f"no fix applied: {e}")
        sys.exit(1)
    for line in result.applied:
        print_literal(console, f"applied: {line}")
    if result.snippet:
        console.print("the fix as code (paste into your model or training script):")
        console.print(Syntax(result.snippet, "python"))
    for change in result.training_changes:
        if isinstance(change, str) and change != result.snippet:
            console.print("change in your training loop:")
            console.print(Syntax(change, "python"))
    if save_path:
        print_literal(console, save_fix(model, result, save_path))
    sys.exit(0 if result.proposal.verified else 1)


def _weights_changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    import torch

    if before.keys() != after.keys():
        return True
    return any(b.dtype != a.dtype or b.shape != a.shape or not torch.equal(b, a.to(b.device))
               for b, a in ((before[k], after[k]) for k in before) if isinstance(b, torch.Tensor))


def save_fix(model: Any, result: Any, path: str) -> str:
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
            fail(str(e))
    console = make_console()
    cost = "unknown" if result.fp32_flop_fraction is None else f"{result.fp32_flop_fraction:.1%}"
    verdict = "verifies" if result.verified else "does NOT verify (even the whole implicated set)"
    print_literal(console, f"minimal keep-in-fp32 set ({len(result.tried)} sets tried): "
                           f"{names(list(result.modules))}; {verdict}; cost: {cost} of the step's FLOPs move to "
                           "float32")
    if not result.verified:
        print_literal(console, f"why: {result.verification.get('reason', '')}")
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

