"""``diagnose(..., fp8_recipe=...)``: the user's own fp8 recipe is the one diagnosed.

The model's input scale moves between steps (1, 0.4, 1, 0.4, 0.4, 1: a gain schedule kept in a buffer, as a
warm-up or a data mix would move activations). Under delayed scaling the scale of step k comes from the max amax of
the previous ``amax_history_len`` steps, so the step that clips depends on the history length:

* history 1: step 2 uses step 1's amax (0.4x): the input is 2.5x over the scale and clips, first at step 2;
* history 2: step 2 sees step 0's amax and is fine; step 5 sees only steps 3-4 (0.4x) and clips;
* history 16: every step sees step 0's amax: clean;
* history 1 with margin=2: the scale keeps 4x headroom, more than the 2.5x jump: clean.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.errors import AmpDoctorError
from ampdoctor.precision import Fp8Recipe, ScenarioError

GAINS = (1.0, 0.4, 1.0, 0.4, 0.4, 1.0)


class Scheduled(nn.Module):
    """``x * gain[step]`` into a linear layer; the step counter is a buffer (each run's copy starts at 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("gain", torch.tensor(GAINS))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gain[self.step.clamp(max=len(GAINS) - 1)]
        self.step += 1
        return self.head(torch.relu(self.proj(x * g)))


def _diagnose(recipe: Fp8Recipe | None) -> ampdoctor.Report:
    model = Scheduled()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 3.0
    return ampdoctor.diagnose(model, x, precision="fp8", steps=len(GAINS),
                              optimizer=torch.optim.SGD(model.parameters(), lr=1e-6),
                              loss_fn=lambda out, b: out.float().mean(), fp8_recipe=recipe)


def _clipping(report: ampdoctor.Report) -> list[ampdoctor.Finding]:
    return [f for f in report.findings if f.code == "fp8-scale" and f.module == "proj"
            and f.evidence.get("role") == "input" and f.severity == "warning"]


@pytest.mark.parametrize(("history", "step"), [(1, 2), (2, 5)])
def test_the_users_history_length_decides_the_step_that_clips(history, step):
    found = _clipping(_diagnose(Fp8Recipe(scaling="delayed", amax_history_len=history)))
    assert len(found) == 1
    f = found[0]
    assert (f.op, f.phase, f.step) == ("aten.linear.default", "forward", step)
    first = f.evidence["first_saturated"]
    assert first["step"] == step
    assert first["amax"] / first["amax_history"] == pytest.approx(1 / 0.4, rel=1e-5)  # the 2.5x jump
    assert "history" in f.explanation or "older amax" in f.explanation


def test_a_long_history_and_a_margin_are_clean():
    assert _clipping(_diagnose(Fp8Recipe(scaling="delayed", amax_history_len=16))) == []
    assert _clipping(_diagnose(Fp8Recipe(scaling="delayed", amax_history_len=1, margin=2))) == []
    assert _clipping(_diagnose(Fp8Recipe(scaling="dynamic"))) == []


def test_the_default_recipe_is_todays():
    default, explicit = _diagnose(None), _diagnose(Fp8Recipe())
    assert _clipping(default) == []         # Fp8Recipe(): history 1024, sees step 0's amax
    assert [(f.code, f.module, f.title) for f in default.findings] == \
        [(f.code, f.module, f.title) for f in explicit.findings]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"precision": "fp8", "fp8_recipe": {"margin": 2}}, "must be an ampdoctor.precision.Fp8Recipe, got dict"),
    ({"precision": "bf16-amp", "fp8_recipe": Fp8Recipe()}, "pass precision='fp8'"),
    ({"precision": None, "fp8_recipe": Fp8Recipe(format="e4m3")}, "pass precision='fp8-e4m3'"),
    ({"precision": "fp8-e5m2", "fp8_recipe": Fp8Recipe()}, "format 'hybrid' but precision 'fp8-e5m2'"),
])
def test_a_wrong_recipe_is_refused_before_anything_runs(kwargs, words):
    model = Scheduled()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ScenarioError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        ampdoctor.diagnose(model, torch.randn(4, 32), **kwargs)
    assert isinstance(e.value, AmpDoctorError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert int(model.step) == 0             # nothing ran


def test_a_scenario_may_return_its_recipe(tmp_path):
    path = tmp_path / "scn.py"
    path.write_text(
        "import torch\nfrom ampdoctor.precision import Fp8Recipe\n"
        f"from {__name__} import Scheduled, GAINS\n"
        "def make():\n"
        "    m = Scheduled()\n"
        "    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 3.0\n"
        "    return {'model': m, 'batch': x, 'precision': 'fp8', 'steps': len(GAINS),\n"
        "            'loss_fn': lambda out, b: out.float().mean(),\n"
        "            'fp8_recipe': Fp8Recipe(amax_history_len=1)}\n")
    found = _clipping(ampdoctor.diagnose_file(str(path)))
    assert [f.step for f in found] == [2]


# --- the recipe fix: the finding's margin / dynamic proposals change the recipe and are verified ----------------

def _spec(recipe: Fp8Recipe):
    from ampdoctor.precision import make_spec

    model = Scheduled()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 3.0
    return make_spec(model, x, precision="fp8", steps=len(GAINS),
                     optimizer=torch.optim.SGD(model.parameters(), lr=1e-6),
                     loss_fn=lambda out, b: out.float().mean(), fp8_recipe=recipe)


def test_the_clipping_finding_proposes_the_margin_that_covers_the_jump_and_it_verifies():
    from ampdoctor.diagnose import diagnose_spec
    from ampdoctor.fixes import verify

    spec = _spec(Fp8Recipe(amax_history_len=1))
    report = diagnose_spec(spec)
    (f,) = _clipping(report)
    recipe_fixes = [p for p in f.fixes if p.id == "fp8_recipe"]
    base = {"format": "hybrid", "scaling": "delayed", "amax_history_len": 1, "margin": 0, "amax_floor": 1e-12}
    # 2.5x over the scale -> ceil(log2 2.5) = 2 bits; and current scaling, the other fields kept
    assert [p.params for p in recipe_fixes] == [{**base, "margin": 2}, {**base, "scaling": "dynamic"}]
    v = verify(recipe_fixes[0], spec, report=report)
    assert v.verified, v.reason
    d = v.to_dict()
    assert d["report_ok"] and "fp8-scale@proj" not in d["remaining"]
    assert d["max_rel_err_curve"] < d["max_rel_err_curve_broken"]


def test_the_recipe_fix_refuses_a_non_fp8_run_and_bad_fields():
    from ampdoctor.fixes import FixContext, build_plan

    plan = build_plan("fp8_recipe", {"margin": 2}, FixContext("fp8-e4m3"))
    assert plan.spec_changes == {"fp8_recipe": Fp8Recipe(format="e4m3", margin=2)}
    assert "DelayedScaling(fp8_format=Format.E4M3" in plan.snippet and "margin=2" in plan.snippet
    with pytest.raises(ValueError, match="recipe of an fp8 run; the diagnosed precision is 'bf16-amp'"):
        build_plan("fp8_recipe", {"margin": 2}, FixContext("bf16-amp"))
    with pytest.raises(ValueError, match="margin must be an int >= 0"):
        build_plan("fp8_recipe", {"margin": -1}, FixContext("fp8"))
    with pytest.raises(ValueError, match="does not match precision 'fp8'"):
        build_plan("fp8_recipe", {"format": "e5m2"}, FixContext("fp8"))


# --- the CLI: ``ampdoctor diagnose FILE --precision fp8 --fp8-recipe ...`` ----------------------------------------

def _scenario(tmp_path, marker: str) -> str:
    """A scenario in fp8 with no recipe of its own; its make() leaves ``marker`` behind (so a test can tell that a
    bad flag stopped the command before anything ran)."""
    path = tmp_path / "sched.py"
    path.write_text(
        "import pathlib, torch\n"
        f"from {__name__} import Scheduled, GAINS\n"
        "def make():\n"
        f"    pathlib.Path({marker!r}).write_text('ran')\n"
        "    m = Scheduled()\n"
        "    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 3.0\n"
        "    return {'model': m, 'batch': x, 'precision': 'fp8', 'steps': len(GAINS),\n"
        "            'loss_fn': lambda out, b: out.float().mean()}\n")
    return str(path)


def _cli(args: list[str]):
    from click.testing import CliRunner

    from ampdoctor.cli import main

    return CliRunner().invoke(main, ["diagnose", *args])


@pytest.mark.parametrize(("flag", "steps"), [("delayed,amax_history_len=1", [2]), ("amax_history_len=2", [5]),
                                             ("amax_history_len=16", []), ("amax_history_len=1,margin=2", []),
                                             ("dynamic", [])])
def test_the_cli_flag_is_the_recipe_diagnosed(tmp_path, flag, steps):
    import json

    out = tmp_path / "r.json"
    res = _cli([_scenario(tmp_path, str(tmp_path / "ran")), "--precision", "fp8", "--fp8-recipe", flag,
                "--json", str(out)])
    assert res.exit_code == 0, res.output                   # fp8-scale warnings: the run is still ok
    data = json.loads(out.read_text())
    clipping = [f["step"] for f in data["findings"] if f["code"] == "fp8-scale" and f["module"] == "proj"
                and f["evidence"].get("role") == "input" and f["severity"] == "warning"]
    assert clipping == steps


@pytest.mark.parametrize(("args", "says"), [
    (["--precision", "fp8", "--fp8-recipe", "margin=two"], "margin must be an int, got 'two'"),
    (["--precision", "fp8", "--fp8-recipe", "history=4"], "unknown fp8 recipe field 'history'"),
    (["--precision", "fp8", "--fp8-recipe", "scaling=late"], "invalid scaling 'late'"),
    (["--precision", "fp8", "--fp8-recipe", "amax_history_len=0"], "amax_history_len must be an int >= 1"),
    (["--precision", "fp8", "--fp8-recipe", "late"], "neither field=value nor a scaling"),
    (["--precision", "fp8", "--fp8-recipe", ""], "empty fp8 recipe"),
    (["--precision", "fp8-e4m3", "--fp8-recipe", "format=e5m2"], "pass --precision fp8-e5m2"),
    (["--precision", "fp16", "--fp8-recipe", "dynamic"], "--fp8-recipe applies to an fp8 run"),
])
def test_a_bad_cli_recipe_is_a_clear_error_before_anything_runs(tmp_path, args, says):
    marker = tmp_path / "ran"
    res = _cli([_scenario(tmp_path, str(marker)), *args])
    assert res.exit_code == 2 and says in res.output, res.output
    assert not marker.exists()                               # make() never ran


def test_a_cli_recipe_without_precision_takes_the_scenarios(tmp_path):
    res = _cli([_scenario(tmp_path, str(tmp_path / "ran")), "--fp8-recipe", "amax_history_len=1"])
    assert res.exit_code == 0 and "fp8-scale" in res.output, res.output
