import io
import json
import math
import re
import sys

import pytest

from ampdoctor import Finding, Report
from ampdoctor.report import _format as F
from ampdoctor.report import render_json, render_terminal, terminal_text

from .conftest import T5_WO, check_snapshot

pytest.importorskip("rich")

_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _color_codes(text: str) -> set[int]:
    """SGR parameters that select a colour (30-38, 40-48, 90-107), from every escape sequence in ``text``."""
    codes = set()
    for params in _SGR.findall(text):
        for p in params.split(";"):
            if p and (30 <= int(p) <= 48 or 90 <= int(p) <= 107):
                codes.add(int(p))
    return codes


def _rstrip_lines(text: str) -> str:
    return "".join(line.rstrip(" ") + "\n" for line in text.splitlines())


def test_snapshot_plain_width_100(any_report):
    name, report = any_report
    text = terminal_text(report, width=100)
    assert "\x1b[" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    check_snapshot(f"{name}.txt", text)


def test_t5_summary_names_verdict_cause_and_evidence(t5):
    text = terminal_text(t5, width=100)
    assert "Verdict           FAIL  (1 error, 1 warning)" in text
    assert f"Root cause        overflow in {T5_WO} (aten.mm.default," in text
    assert "precision fp16-amp" in text
    # evidence numbers in the house format
    evidence = text.split("Evidence for the root cause (overflow)")[1].split("Lineage")[0]
    assert re.search(r"ref_absmax\s+1\.05e\+05", evidence)
    assert re.search(r"fp16_max\s+65504", evidence)
    assert re.search(r"ratio\s+1\.6\b", evidence)
    assert re.search(r"target_absmax\s+inf", evidence)


def test_t5_lineage_runs_from_origin_to_loss(t5):
    text = terminal_text(t5, width=100)
    lineage = text.split("Lineage: origin -> first NaN -> loss")[1].split("#1 ERROR")[0]
    lines = [line.strip() for line in lineage.splitlines() if line.strip()]
    assert lines[0] == f"origin aten.mm.default in {T5_WO} (forward)"
    assert lines[4] == "-> aten.mul.Tensor in encoder.block.1.layer.0.layer_norm (forward)"
    assert lines[5] == "inf * rsqrt(inf) = NaN (first NaN)"
    assert lines[6] == "-> end aten.nll_loss_forward.default (forward)"


def test_fix_statuses(t5):
    text = terminal_text(t5, width=100)
    assert text.count("[verified ✓]") == 2
    assert "[failed ✗]   Lower GradScaler init_scale" in text
    assert "[untried]    Clamp the feed-forward output" in text
    assert "loss_fp32=3.472, loss_fixed=nan, max_rel_err=nan, steps_finite=0" in text


def test_headroom_margin_is_log2_of_format_max_over_absmax(t5, watch):
    rows = F.layer_rows(t5)
    first = F.least_headroom(rows)[0]
    assert (first.module, first.phase) == (T5_WO, "forward")
    assert first.margin_bits == pytest.approx(math.log2(65504 / 1.05e5), abs=1e-12)  # -0.68 bits: overflows
    watch_rows = F.least_headroom(F.layer_rows(watch))
    assert [(r.module, r.phase) for r in watch_rows[:2]] == [("mlp.act", "forward"), ("mlp.act", "backward")]
    assert watch_rows[0].margin_bits == pytest.approx(math.log2(65504 / 9.57e6), abs=1e-12)
    table = terminal_text(t5, width=100).split("Layer headroom (12 of 20 entries, least margin first)")[1]
    assert re.search(r"11 encoder\.block\.0\.layer\.1\.DenseReluDense\.wo +mm +fwd +fp16 +1\.05e\+05 +inf +-0\.7 +0%",
                     table)
    # bf16 against its own max 3.39e38: log2(3.3895e38 / 4.71) = 125.8 bits
    assert "+125.8" in terminal_text(Report(layers=({"module": "0", "dtype": "torch.bfloat16", "ref_absmax": 4.71},)))


def test_layer_table_lists_at_most_twelve_and_omits_without_layers(t5, bert):
    text = terminal_text(t5, width=100)
    assert "Layer headroom (12 of 20 entries" in text
    assert "encoder.block.0.layer.0.SelfAttention.v" not in text.split("Layer headroom")[1]  # 13th smallest margin
    no_layers = Report(findings=bert.findings, summary=bert.summary)
    assert "Layer headroom" not in terminal_text(no_layers, width=100)


def test_empty_report_renders():
    text = terminal_text(Report(), width=80)
    assert re.search(r"Verdict +OK  \(no findings\)", text)
    assert re.search(r"Root cause +none found", text)
    assert "Lineage" not in text and "Evidence" not in text


def test_json_round_trip_renders_identically(any_report):
    # after to_dict, inf/nan are strings: the renderer must read them as numbers
    _, report = any_report
    again = Report.from_dict(json.loads(render_json(report)))
    assert terminal_text(again, width=100) == terminal_text(report, width=100)


def test_model_strings_are_not_rich_markup(t5):
    hostile = Finding(code="overflow", severity="error", module="enc.[bold red]x[/bold red]", op="aten.mm.default",
                      phase="forward", title="[link=http://evil]click[/link]", explanation="[/] stray close tag")
    layers = ({"module": "[red]m[/red]", "op": "aten.[b]mm", "phase": "[bold]weird", "dtype": "float16",
               "ref_absmax": 1.0},)
    chain = [{"op": "[i]op", "module": "[u]mod", "phase": "forward", "what": "[/i] what"}]
    text = terminal_text(Report(findings=(hostile,), layers=layers, summary={"chain": chain}), width=100)
    for literal in ("[red]m[/red]", "[b]mm", "[bold]weird", "[i]op in [u]mod", "[/i] what"):
        assert literal in text
    assert "enc.[bold red]x[/bold red]" in text
    assert "[link=http://evil]click[/link]" in text
    assert "[/] stray close tag" in text


def test_color_output_and_no_color(t5, monkeypatch):
    colored = terminal_text(t5, width=100, color=True)
    assert _color_codes(colored)  # FAIL in red, ...
    assert _rstrip_lines(_SGR.sub("", colored)) == terminal_text(t5, width=100)

    monkeypatch.setenv("FORCE_COLOR", "1")
    buf = io.StringIO()
    from rich.console import Console

    render_terminal(t5, console=Console(file=buf, width=100))
    assert _color_codes(buf.getvalue())
    monkeypatch.setenv("NO_COLOR", "1")
    buf = io.StringIO()
    render_terminal(t5, console=Console(file=buf, width=100))
    assert not _color_codes(buf.getvalue())


def test_render_terminal_default_console_non_tty_is_plain(t5, capsys, monkeypatch):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    render_terminal(t5, width=100)
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert _rstrip_lines(out) == terminal_text(t5, width=100)


def test_missing_rich_names_the_extra(t5, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(ImportError, match=r"ampdoctor\[cli\]"):
        terminal_text(t5)


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.05e5, "1.05e+05"), (65504.0, "65504"), (65504, "65504"), (1.6, "1.6"), (2.0**-14, "6.1e-05"),
     (2.0**-24, "5.96e-08"), (3.3895313892515355e38, "3.39e+38"), ("inf", "inf"), (-math.inf, "-inf"),
     (math.nan, "nan"), (None, "-"), (0.0, "0"), (3.4721, "3.472"), (False, "no"), (44240.3, "44240"),
     (212.25, "212.2"), ({"a": 1.0, "b": [{"c": "inf"}]}, "a=1, b=[{c=inf}]")],
)
def test_fmt_num(value, text):
    assert F.fmt_num(value) == text


def test_layer_format_max_wins_over_dtype():
    layers = ({"module": "m", "dtype": "float16", "format_max": 448.0, "ref_absmax": 112.0},)
    assert F.layer_rows(Report(layers=layers))[0].margin_bits == pytest.approx(2.0)  # log2(448 / 112)
