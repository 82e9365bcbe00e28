"""The command line on bad input (the reliability audit's Appendix B, CLI rows) and its user-facing contract.

Every row exits 0, 1 or 2 with a message and never a raw traceback: 2 with ``ampdoctor: error: ...`` for input the
CLI cannot use (checked before anything runs where it can be: output paths, optional extras), and user-controlled
text (module names) is printed literally, never parsed as rich markup.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ampdoctor
from ampdoctor.cli import main

HEAD = "import torch\nfrom torch import nn\n\n"

HEALTHY = HEAD + """
def make():
    g = torch.Generator().manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)),
            "batch": torch.randn(3, 4, generator=g), "loss_fn": lambda o, b: o.float().pow(2).mean(),
            "precision": "fp16"}
"""

#: a layer named ``name`` whose fp16 forward overflows (weights scaled to 1e5)
HOSTILE = HEAD + """
NAME = {name!r}

def make():
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential()
    m.add_module(NAME, nn.Linear(4, 4))
    m.add_module("head", nn.Linear(4, 1))
    with torch.no_grad():
        getattr(m, NAME).weight.mul_(1e5)
    return {{"model": m, "batch": torch.randn(3, 4, generator=g), "loss_fn": lambda o, b: o.float().mean(),
             "precision": "fp16"}}
"""

#: sum pooling: |sum| exceeds 65504 but CUDA autocast runs aten.sum in float32, so fp16-amp is safe
SUM_POOL = HEAD + """
class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).sum(dim=1, keepdim=True)

def make():
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential()
    m.add_module("pool", Pool())
    with torch.no_grad():
        m.pool.proj.weight.fill_(0.0); m.pool.proj.bias.fill_(30000.0)
    return {"model": m, "batch": torch.randn(3, 4, generator=g), "loss_fn": lambda o, b: (o.float() / 1e5).mean(),
            "precision": "fp16-amp"}
"""

EXIT_IMPORT = "import sys\n" + HEALTHY + "\nsys.exit(0)\n"
EXIT_MAKE = "import sys\n" + HEAD + "def make():\n    sys.exit(7)\n"
PLAIN_SCRIPT = HEAD + "model = nn.Linear(4, 2)\nopen(__file__ + '.ran', 'w').close()\n"


def run(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, everything printed) of one in-process CLI call."""
    res = CliRunner().invoke(main, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"raw exception from {args}: {res.exception!r}\n{res.output}") from res.exception
    return res.exit_code, res.stdout, res.output


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    texts = {"healthy.py": HEALTHY, "closing.py": HOSTILE.format(name="[/]"), "bold.py": HOSTILE.format(name="[bold]x"),
             "link.py": HOSTILE.format(name="[link=https://evil/x]click[/link]"), "pool.py": SUM_POOL,
             "exit0.py": EXIT_IMPORT, "exit7.py": EXIT_MAKE, "train.py": PLAIN_SCRIPT, "notes.txt": "hello\n",
             "empty.json": "", "text.json": "just text", "bad.json": "{", "schema.json": '{"schema": "nope"}',
             "list.json": "[1, 2]"}
    out = {}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
        out[name] = str(tmp_path / name)
    (tmp_path / "adir").mkdir()
    out["adir"] = str(tmp_path / "adir")
    out["missing"] = str(tmp_path / "nope.py")
    return out


# ------------------------------------------------------------------------------------------- the audit's rows
def test_missing_file_is_exit_2_for_every_command(files: dict[str, str]) -> None:
    for cmd in ("diagnose", "fix", "headroom", "check"):
        code, _, out = run(cmd, files["missing"])
        assert code == 2 and "scenario file not found" in out and "defines make()" in out, (cmd, out)
    code, _, out = run("replay", str(Path(files["adir"]) / "nope.pt"))
    assert code == 2 and "reproducer" in out, out


def test_directory_or_text_file_as_file(files: dict[str, str]) -> None:
    for cmd in ("diagnose", "fix", "headroom", "check", "replay"):
        code, _, out = run(cmd, files["adir"])
        assert code == 2 and "is a directory" in out, (cmd, out)
    for cmd in ("diagnose", "headroom"):
        code, _, out = run(cmd, files["notes.txt"])
        assert code == 2 and "a scenario is a .py file" in out, (cmd, out)
    code, _, out = run("replay", files["notes.txt"])
    assert code == 2 and "ampdoctor: error:" in out, out


def test_headroom_without_argument_and_hf_on_a_plain_folder(files: dict[str, str]) -> None:
    code, _, out = run("headroom")
    assert code == 2 and "give either a scenario FILE or --hf DIR" in out
    code, _, out = run("headroom", "--hf", files["adir"])
    assert code == 2 and "config.json" in out, out


@pytest.mark.parametrize("name", ["missing.json", "empty.json", "bad.json", "schema.json", "text.json", "list.json"])
def test_report_on_files_that_are_not_reports(files: dict[str, str], name: str, tmp_path: Path) -> None:
    path = files.get(name, str(tmp_path / name))
    code, _, out = run("report", path)
    assert code == 2 and "ampdoctor: error:" in out, out


def test_option_errors(files: dict[str, str]) -> None:
    code, _, out = run("diagnose", files["healthy.py"], "--steps", "0")
    assert code == 2 and "--steps" in out
    code, _, out = run("diagnose", files["healthy.py"], "--steps", "100000")
    assert code == 2 and "1000" in out
    code, _, out = run("diagnose", files["healthy.py"], "--precision", "FP16")
    assert code == 2 and "fp16" in out
    code, _, out = run("fix", files["healthy.py"], "--apply", "keep_fp23")
    assert code == 2 and "did you mean 'keep_fp32'" in out, out
    code, _, out = run("run")
    assert code == 2 and "Missing argument" in out
    code, _, out = run("diagnose", files["healthy.py"], "--json", files["adir"])
    assert code == 2 and "is a directory" in out, out


def test_explain_unknown_code_suggests_one() -> None:
    code, _, out = run("explain", "overflw")
    assert code == 2 and "did you mean 'overflow'" in out
    code, _, out = run("explain", "Overflow")  # case and underscores are forgiven
    assert code == 0 and "overflow" in out


def test_outputs_are_checked_before_the_run(files: dict[str, str], tmp_path: Path) -> None:
    marker = Path(files["train.py"] + ".ran")
    for opt in ("--html", "--json"):
        code, _, out = run("diagnose", files["healthy.py"], opt, str(tmp_path / "no_dir" / "x.out"))
        assert code == 2 and "does not exist" in out and opt in out, out
        assert "fp32 reference" not in out
    assert not marker.exists()


def test_html_without_its_extra_fails_before_the_run(files: dict[str, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a))
    code, _, out = run("diagnose", files["healthy.py"], "--html", str(tmp_path / "r.html"))
    assert code == 2 and "pip install 'ampdoctor[html]'" in out and "plotly" in out, out
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("name", ["[/]", "[bold]x", "[link=https://evil/x]click[/link]"])
def test_markup_in_module_names_is_printed_literally(tmp_path: Path, name: str) -> None:
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE.format(name=name))
    for args in (("diagnose",), ("headroom",), ("check", "--precision", "fp16"), ("fix", "--steps", "1")):
        code, _, out = run(args[0], str(path), *args[1:])
        assert code in (0, 1), (args, out)
        assert name in out.replace("\n", ""), (args, name, out)


def test_check_headroom_diagnose_fail_on_a_scenario_that_exits(files: dict[str, str]) -> None:
    for cmd in ("diagnose", "check", "headroom"):
        code, _, out = run(cmd, files["exit0.py"])
        assert code == 2 and "called sys.exit(0) while importing" in out and "__main__" in out, (cmd, out)
        code, _, out = run(cmd, files["exit7.py"])
        assert code == 2 and "called sys.exit(7) in make()" in out, (cmd, out)


def test_check_fails_on_a_scenario_that_raises_or_gives_no_result(tmp_path: Path) -> None:
    raises = tmp_path / "raises.py"
    raises.write_text(HEAD + "def make():\n    raise RuntimeError('no GPU here')\n")
    nothing = tmp_path / "nothing.py"
    nothing.write_text(HEAD + "def make():\n    return None\n")
    for path, says in ((raises, "no GPU here"), (nothing, "must return a dict")):
        code, _, out = run("check", str(path))
        assert code == 2 and says in out, out


def test_a_plain_training_script_is_not_run_and_run_is_suggested(files: dict[str, str]) -> None:
    code, _, out = run("diagnose", files["train.py"])
    assert code == 2 and f"ampdoctor run -- python {files['train.py']}" in out.replace("\n", "")
    assert not Path(files["train.py"] + ".ran").exists()  # the script's top level never ran


# ------------------------------------------------------------------------------------------- the contract
def test_json_dash_writes_the_report_to_stdout(files: dict[str, str]) -> None:
    code, stdout, _ = run("diagnose", files["healthy.py"], "--json", "-")
    assert code == 0
    data = json.loads(stdout)  # stdout holds only the JSON; the terminal report went to stderr
    assert data["ok"] is True


def test_diagnose_accepts_built_in_scenario_names() -> None:
    code, _, out = run("diagnose", "mlp_fp16_overflow")
    assert code == 1 and "overflow" in out
    code, _, out = run("diagnose", "mlp_fp16_overflw")
    assert code == 2 and "did you mean 'mlp_fp16_overflow'" in out


def test_check_uses_the_scenarios_own_precision(files: dict[str, str]) -> None:
    code, _, out = run("check", files["healthy.py"])
    assert code == 0 and "SAFE in fp16" in out  # HEALTHY's make() says fp16
    code, _, out = run("check", files["pool.py"])
    assert "fp16-amp" in out


def test_check_fp16_amp_follows_the_autocast_policy(files: dict[str, str]) -> None:
    """|sum| > 65504 in fp32, but autocast runs aten.sum in float32: fp16-amp is safe, whole-model fp16 is not."""
    from ampdoctor.precision import load_scenario_module, spec_from_module
    from ampdoctor.precision.headroom import headroom_spec

    h = headroom_spec(spec_from_module(load_scenario_module(files["pool.py"])))
    assert "pool" in h.predicted_failures("fp16")
    assert h.predicted_failures("fp16", autocast="cuda") == []
    code, _, out = run("check", files["pool.py"], "--precision", "fp16-amp")
    assert code == 0 and "SAFE in fp16-amp" in out, out
    code, _, out = run("check", files["pool.py"], "--precision", "fp16")
    assert code == 1 and "UNSAFE in fp16" in out and "pool" in out, out


def test_root_module_is_printed_as_root(tmp_path: Path) -> None:
    path = tmp_path / "root.py"
    path.write_text(HEAD + "def make():\n    m = nn.Linear(4, 1)\n    with torch.no_grad():\n"
                    "        m.weight.fill_(1e5)\n"
                    "    return {'model': m, 'batch': torch.ones(3, 4), 'loss_fn': lambda o, b: o.float().mean(), "
                    "'precision': 'fp16'}\n")
    code, _, out = run("diagnose", str(path))
    assert code == 1 and "<root>" in out and "(model root)" not in out
    code, _, out = run("headroom", str(path))
    assert "<root>" in out


@pytest.mark.parametrize("cmd", ["diagnose", "fix", "headroom", "check", "report", "replay", "run", "demo"])
def test_help_describes_every_option(cmd: str) -> None:
    code, _, out = run(cmd, "--help")
    assert code == 0
    cmd_obj = main.commands[cmd]
    for p in cmd_obj.params:
        if getattr(p, "param_type_name", "") == "option" and not getattr(p, "hidden", False):
            assert p.help, f"{cmd} {p.opts} has no help text"
            if p.default not in (None, False) and not p.is_flag:
                assert p.show_default, f"{cmd} {p.opts} does not show its default {p.default!r}"


def test_version_and_no_traceback_on_unknown_command() -> None:
    code, _, out = run("--version")
    assert code == 0 and ampdoctor.__version__ in out
    code, _, out = run("diagnos")
    assert code == 2 and "No such command" in out


def test_a_forward_only_run_says_so(tmp_path: Path) -> None:
    """An optimizer but no loss: the diagnosis is of the forward only, and the report must not read as training."""
    path = tmp_path / "fwd.py"
    path.write_text(HEAD + "def make():\n    m = nn.Linear(4, 2)\n    return {'model': m, 'batch': torch.ones(3, 4), "
                    "'optimizer': torch.optim.SGD(m.parameters(), lr=0.1), 'precision': 'fp16'}\n")
    code, _, out = run("diagnose", str(path))
    assert code == 0 and "forward only: no backward and no optimizer step ran" in out.replace("\n", " ")


def test_one_message_per_error(files: dict[str, str]) -> None:
    """The CLI's own usage errors inside a run are not mistaken for a scenario's sys.exit."""
    code, _, out = run("check")
    assert code == 2 and out.count("ampdoctor: error:") == 1 and "sys.exit" not in out, out
