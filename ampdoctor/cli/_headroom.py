"""``ampdoctor headroom`` (per-module range headroom from one fp32 step) and ``ampdoctor check`` (the CI gate: the
headroom prediction and the run in the target precision)."""

from __future__ import annotations

import sys
from typing import Any

import click

from ampdoctor.cli._app import POLICY_HELP, PRECISION_CHOICES, main
from ampdoctor.cli._checks import fail, scenario_path, user_code
from ampdoctor.cli._output import PhaseProgress, check_outputs, make_console, names, print_literal


def _spec_for(file: str | None, hf: str | None) -> Any:
    from ampdoctor.precision import load_scenario_module, make_spec, saved_rng, spec_from_module

    if (file is None) == (hf is None):
        fail("give either a scenario FILE or --hf DIR (a Hugging Face model directory)")
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

    from ampdoctor.report import fmt_num

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

    check_outputs(json_out)
    with user_code():
        spec = _spec_for(file, hf)
        with PhaseProgress(only_headroom=True) as progress:
            progress("headroom")
            h = headroom_spec(spec)
    console = make_console(stderr=json_out == "-")
    console.print(_headroom_table(h, fmt))
    for note in h.notes:
        print_literal(console, f"note: {note}")
    print_literal(console, f"predicted to overflow in {fmt}: {names(h.predicted_failures(fmt))}")
    print_literal(console, f"suggested keep-in-fp32: {names(h.keep_fp32(fmt))}")
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
              help=POLICY_HELP)
@click.option("--full", is_flag=True, default=False,
              help="always run the full diagnosis (by default fp16-amp/bf16-amp runs it only where the fp32 range "
                   "pass or a cheaply traced target step shows something it could judge)")
def check(file: str | None, hf: str | None, precision: str | None, policy: str, full: bool) -> None:
    """CI gate: exit 1 when the model is predicted unsafe in PRECISION or its run there fails, 2 when the
    scenario cannot be run (raises, exits, gives no result), else 0."""
    from dataclasses import replace

    from ampdoctor.diagnose import diagnose_spec, headroom_and_check

    with user_code():
        spec = _spec_for(file, hf)
        if precision is not None:
            spec = replace(spec, precision=None if precision == "as-given" else precision)
        fmt, amp = CHECK_FORMATS.get(spec.precision or "", (None, False))
        with PhaseProgress(headroom=fmt is not None) as progress:
            h, res = None, None
            if fmt is not None:  # the fp32 run gives headroom, decides the full diagnosis and is its reference
                res = headroom_and_check(spec, policy=policy, progress=progress, full=full)
                h, report = res.headroom, res.report
            else:
                report = diagnose_spec(spec, policy=policy, progress=progress)
    name = spec.precision or "as-given"
    autocast = (("cuda" if policy == "cuda" else "cpu") if amp else None)
    bad = h.predicted_failures(fmt, autocast=autocast) if h is not None and fmt is not None else []
    console = make_console()
    if h is None:
        print_literal(console, f"note: no range prediction for {name} (only fp16/bf16 and their autocasts); "
                               "judging the run")
    if res is not None and res.triage.full:
        print_literal(console, "full diagnosis ran: " + "; ".join(res.triage.reasons))
    if bad or (report is not None and not report.ok):
        root = report.findings[0] if report is not None and report.findings else None
        run_txt = f"{root.code} at {root.module or '<root>'}" if root is not None else "ok"
        pred = f"predicted overflow in {names(bad)}; " if h is not None else ""
        print_literal(console, f"UNSAFE in {name}: {pred}run: {run_txt}")
        sys.exit(1)
    if report is None:
        print_literal(console, f"SAFE in {name}: every module keeps range headroom, no mechanism the full diagnosis "
                               f"judges applies, and a quick {name} step matches float32 (quick check; --full "
                               "diagnoses anyway)")
        return
    print_literal(console, f"SAFE in {name}: " + ("every module keeps range headroom and " if h is not None else "")
                  + f"the {name} run is ok")
