"""run_script: an unmodified training script, watched through global optimizer/module hooks."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optimizer_mod

from ampdoctor.integrations.run import run_script

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)
            self.unused = nn.Linear(8, 8)

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    def main(steps, bad):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(steps):
            x = torch.randn(4, 8)
            if i == bad:
                x[0, 0] = float("inf")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return model

    if __name__ == "__main__":
        main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else -1)
""")


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return p


def test_unused_linear_in_an_unmodified_script(script) -> None:
    argv0, path0 = sys.argv[:], sys.path[:]
    hooks0 = (len(module_mod._global_forward_pre_hooks), len(optimizer_mod._global_optimizer_pre_hooks))
    r = run_script(["python", str(script), "5"])
    assert r.summary["script"] == {"status": "completed"}
    assert r.summary["steps"] == 5
    assert [(f.code, f.module, f.phase) for f in r.findings] == [("unused-parameters", "unused", "backward")]
    assert r.findings[0].evidence["parameters"] == ["unused.weight", "unused.bias"]
    assert r.source == str(script)
    assert (sys.argv, sys.path) == (argv0, path0)
    assert (len(module_mod._global_forward_pre_hooks), len(optimizer_mod._global_optimizer_pre_hooks)) == hooks0


def test_anomaly_stops_the_script_with_raise(script) -> None:
    r = run_script([str(script), "6", "3"], on_anomaly="raise")
    assert r.summary["script"]["status"] == "anomaly"
    assert (r.summary["script"]["kind"], r.summary["script"]["step"]) == ("nonfinite-grads", 3)
    assert r.summary["steps"] == 3                          # steps 0..2 completed, step 3 stopped before its update
    assert ("nonfinite-input", "forward") == (r.findings[0].code, r.findings[0].phase)   # located by the replay


def test_script_errors_are_reported_not_raised(tmp_path) -> None:
    p = tmp_path / "boom.py"
    p.write_text("import torch\nm = torch.nn.Linear(2, 2)\no = torch.optim.SGD(m.parameters(), lr=1)\n"
                 "m(torch.ones(2)).sum().backward(); o.step()\nraise ValueError('bad config')\n")
    r = run_script(["python", str(p)])
    assert r.summary["script"] == {"status": "error", "exception": "ValueError", "message": "bad config"}
    assert r.summary["steps"] == 1


def test_bad_command_lines() -> None:
    with pytest.raises(ValueError, match="script not found"):
        run_script(["python", "does_not_exist.py"])
    with pytest.raises(ValueError, match="needs a command"):
        run_script(["python"])
    assert torch.is_grad_enabled()


def test_optimizer_created_after_the_first_forward_is_attached_at_its_first_step(tmp_path) -> None:
    p = tmp_path / "late.py"
    p.write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        with torch.no_grad():
            model(torch.randn(2, 4))                     # a shape check before the optimizer exists
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
    """))
    r = run_script([str(p)])
    assert r.summary["steps"] == 4                  # the first step is seen: the watch's hooks run in that step
    assert len(r.summary["grad_norms"]) == 4 and r.findings == ()


def test_unused_sibling_of_the_forwarded_submodule_is_covered(tmp_path) -> None:
    """The script calls a submodule (``model["net"]``) while the optimizer also holds a sibling that never runs:
    the watch covers the smallest module holding all of the optimizer's parameters, so the sibling is seen."""
    p = tmp_path / "sibling.py"
    p.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.ModuleDict({"net": nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)),
                               "unused": nn.Linear(4, 4)})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad()
            model["net"](torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    """))
    report = run_script(["python", str(p)])
    f = report.findings[0]
    assert (f.code, f.module) == ("unused-parameters", "unused")
    assert f.evidence["parameters"] == ["unused.weight", "unused.bias"]
    assert report.precision is None and report.summary["precision_settings"]["param_dtype"] == "float32"


@pytest.mark.parametrize(("body", "code", "says"), [
    ("import sys\nsys.exit(3)\n", 3, "exited with 3"),
    ("raise ValueError('bad config')\n", 1, "raised ValueError: bad config"),
])
def test_cli_run_propagates_how_the_script_ended(tmp_path, body, code, says) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    p = tmp_path / "s.py"
    p.write_text("import torch\nm = torch.nn.Linear(2, 2)\no = torch.optim.SGD(m.parameters(), lr=1)\n"
                 "m(torch.ones(2)).sum().backward(); o.step()\n" + body)
    res = CliRunner().invoke(main, ["run", "--", "python", str(p)])
    assert res.exit_code == code and "did not finish" in res.output and says in res.output


def test_cli_run_of_a_missing_script_is_exit_2(tmp_path) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    res = CliRunner().invoke(main, ["run", "--", "python", str(tmp_path / "nope.py")])
    assert res.exit_code == 2 and "script not found" in res.output


def test_cli_run_of_a_chronic_scale_collapse_is_an_error_exit(tmp_path) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    p = tmp_path / "collapse.py"
    p.write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 1)
        o = torch.optim.SGD(m.parameters(), lr=0.01)
        sc = torch.amp.GradScaler("cpu")
        for i in range(24):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(8, 4)).float().pow(2).mean()
            if i % 3 != 2:
                loss = loss * float("inf")          # GradScaler skips two steps of every three
            sc.scale(loss).backward()
            sc.step(o)
            sc.update()
    """))
    res = CliRunner().invoke(main, ["run", "--json", str(tmp_path / "r.json"), "--", "python", str(p)])
    assert res.exit_code == 1, res.output
    import json

    rep = json.loads((tmp_path / "r.json").read_text())
    f = next(f for f in rep["findings"] if f["code"] == "loss-scale-collapse")
    assert f["severity"] == "error" and f["evidence"]["skipped_steps"] == 16


@pytest.mark.parametrize("bad", [0, 5])
def test_run_failure_at_step_0_and_5_replays_in_process_and_from_the_file(script, tmp_path, monkeypatch, bad) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main
    from ampdoctor.watch import load_reproducer

    repro = tmp_path / "repro"
    r = run_script([str(script), "7", str(bad)], reproducer_dir=str(repro))
    assert (r.findings[0].code, r.findings[0].phase) == ("nonfinite-input", "forward")    # located in process
    files = sorted(repro.iterdir())
    assert files and files[0].name == f"step{bad:06d}-nonfinite-grads.pt"
    rep = load_reproducer(files[0])
    assert rep["batch"] is not None and not torch.isfinite(rep["batch"]).all()   # step 0's inputs were recorded
    monkeypatch.chdir(script.parent)
    res = CliRunner().invoke(main, ["replay", str(files[0]), "--factory", f"{script.stem}:Net",
                                    "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    import json

    assert json.loads((tmp_path / "r.json").read_text())["findings"][0]["code"] == "nonfinite-input"


def test_owner_of_an_optimizer_is_the_called_module_when_a_wrapper_holds_the_same_parameters() -> None:
    """A wrapper (DDP, or any module around one child) holds exactly its child's parameters: the watch goes on the
    module the script calls, which the runner saw first (and on a DDP wrapper, so that the ranks agree), not on
    whichever of the two ``gc`` lists first."""
    from torch import nn

    from ampdoctor.integrations.run import _Runner

    for _ in range(3):
        inner = nn.Linear(4, 4)
        outer = nn.Sequential(inner)
        opt = torch.optim.SGD(inner.parameters(), lr=0.1)
        assert _Runner("", {})._owner(opt, outer) is outer
        assert _Runner("", {})._owner(opt, inner) is inner
