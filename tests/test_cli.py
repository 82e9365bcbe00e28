"""The command line: exit codes 0 ok / 1 error findings / 2 usage or input error, and what it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.scenarios import load_scenario

HEALTHY = """
import torch
from torch import nn

def make():
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), "batch": torch.randn(4, 8),
            "loss_fn": lambda o, b: o.pow(2).mean(), "precision": "fp16"}
"""

OVERFLOW = """
import torch
from torch import nn

EXPECT = {"codes": ["overflow"], "module": "0", "phase": "forward"}

def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        m[0].weight.mul_(1e5)
    return {"model": m, "batch": torch.randn(4, 8), "loss_fn": lambda o, b: o.float().mean(), "precision": "fp16"}
"""


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, text in (("healthy.py", HEALTHY), ("overflow.py", OVERFLOW)):
        p = tmp_path / name
        p.write_text(text)
        out[name] = str(p)
    return out


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args), env={"NO_COLOR": "1", "COLUMNS": "100"})
    return res.exit_code, res.output


def test_version() -> None:
    code, out = run("--version")
    assert code == 0 and ampdoctor.__version__ in out


def test_diagnose_exit_codes_and_json(files: dict[str, str], tmp_path: Path) -> None:
    code, out = run("diagnose", files["healthy.py"])
    assert code == 0, out
    js = tmp_path / "r.json"
    code, out = run("diagnose", files["overflow.py"], "--json", str(js))
    assert code == 1
    assert "overflow" in out and "aten.addmm.default" in out
    data = json.loads(js.read_text())
    assert data["ok"] is False and data["findings"][0]["code"] == "overflow" and data["findings"][0]["module"] == "0"
    assert data["findings"][0]["evidence"]["format_max"] == 65504.0


def test_diagnose_precision_override(files: dict[str, str]) -> None:
    code, _ = run("diagnose", files["overflow.py"], "--precision", "bf16")
    assert code == 0  # 1e5 fits bf16


def test_usage_and_input_errors_exit_2(files: dict[str, str], tmp_path: Path) -> None:
    code, out = run("diagnose", str(tmp_path / "missing.py"))
    assert code == 2 and "pass the path of a .py file that defines make()" in out
    code, out = run("diagnose", files["healthy.py"], "--precision", "fp12")
    assert code == 2 and "fp12" in out
    code, out = run("explain", "no-such-code")
    assert code == 2 and "unknown code" in out


def test_explain_prints_the_code_documentation() -> None:
    code, out = run("explain", "masked-row-nan")
    assert code == 0 and "-inf - (-inf)" in out


def test_report_renders_saved_json(files: dict[str, str], tmp_path: Path) -> None:
    js, html = tmp_path / "r.json", tmp_path / "r.html"
    run("diagnose", files["overflow.py"], "--json", str(js))
    code, out = run("report", str(js), "--html", str(html))
    assert code == 1 and "overflow" in out
    assert "<html" in html.read_text()[:500].lower()


def test_headroom_and_check(files: dict[str, str]) -> None:
    code, out = run("headroom", files["overflow.py"])
    assert code == 0 and "predicted to overflow in fp16: 0" in out
    code, out = run("check", files["overflow.py"], "--precision", "fp16")
    assert code == 1 and "UNSAFE" in out
    code, out = run("check", files["healthy.py"], "--precision", "fp16")
    assert code == 0 and "SAFE" in out


def test_demo_prints_both_diagnoses_in_80_columns() -> None:
    res = CliRunner().invoke(main, ["demo", "--steps", "5"], env={"NO_COLOR": "1", "COLUMNS": "80"})
    code, out = res.exit_code, res.output
    assert code == 0, out
    lines = out.splitlines()
    assert len(lines) <= 120, len(lines)  # a demo worth reading (it printed 550 lines)
    assert max(len(x.rstrip()) for x in lines) <= 80
    t5 = load_scenario("t5_fp16_amp_ff_overflow").EXPECT
    assert t5["module"] in out.replace("\n", "").replace(" ", "") or "DenseReluDense.wo" in out
    assert "unused-parameters" in out and "pooler.dense" in out
    # each motivating case ends with one "what to do" block: the fix verified against fp32, and its code
    assert out.count("what to do:") == 2
    assert out.count("verified over 5 training steps against fp32") == 2
    # the community fix (wo in fp32) verifies now that the tolerance is calibrated (docs/fixes.md)
    assert "run `encoder.block.0.layer.1.DenseReluDense.wo` in float32" in out.replace("\n", " ")
    assert "requires_grad_(False)" in out
    assert "tolerance={" not in out and "curve_fp32" not in out  # no raw verification dumps


def test_demo_verbose_adds_the_full_reports() -> None:
    code, out = run("demo", "--steps", "2", "--verbose")
    assert code == 0, out
    assert "65504" in out and "keep_fp32" in out and "exclude_unused" in out
