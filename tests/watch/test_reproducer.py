"""Reproducers: what a watch writes at an anomaly, how it loads (weights_only), and replaying it."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.watch import ReproducerError, load_reproducer, replay, watch

from .test_watch import collapse_run


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x))).pow(2).mean()


def run_until_nonfinite(tmp_path, bad_step: int = 3, steps: int = 5, **opts):
    """AdamW loop whose batch at ``bad_step`` holds an inf; returns the watch and what the loop saw there."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    seen = {}
    with watch(m, opt, reproducer_dir=tmp_path, **opts) as w:
        for i in range(steps):
            x = torch.randn(8, 16, generator=g)
            if i == bad_step:
                x[0, 0] = float("inf")
                seen = {"x": x.clone(), "rng": torch.get_rng_state(),
                        "state": {k: v.clone() for k, v in m.state_dict().items()}}
            opt.zero_grad()
            m(x).backward()
            opt.step()
    return w, seen


def test_reproducer_holds_the_pre_step_state(tmp_path) -> None:
    w, seen = run_until_nonfinite(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["step000003-nonfinite-grads.pt"]     # no temporary file left behind
    path = tmp_path / "step000003-nonfinite-grads.pt"
    raw = torch.load(path, weights_only=True)                                    # plain tensors and values only
    assert raw["format"] == "ampdoctor-reproducer" and raw["version"] == 1
    assert (raw["step"], raw["anomaly"]) == (3, "nonfinite-grads")
    assert raw["model_state"].keys() == seen["state"].keys()
    assert all(torch.equal(raw["model_state"][k], v) for k, v in seen["state"].items())
    assert torch.equal(raw["batch"], seen["x"])
    assert torch.equal(raw["rng"]["cpu"], seen["rng"])
    assert torch.isnan(raw["grads"]["body.weight"]).any()
    assert raw["optimizer_class"] == "torch.optim.adamw.AdamW"
    assert raw["optimizer_params"] == [["body.weight", "body.bias", "head.weight", "head.bias"]]
    assert [float(s["step"]) for s in raw["optimizer_state"]["state"].values()] == [3.0] * 4
    assert raw["scaler_state"] is None
    assert raw["precision"]["name"] is None and raw["precision"]["param_dtype"] == "float32"
    assert w.report().summary["reproducers"] == [str(path)]
    assert load_reproducer(path)["step"] == 3


def test_skipped_step_reproducer_keeps_the_scale_the_step_used(tmp_path) -> None:
    w, m, w0, (x, y) = collapse_run(5, reproducer_dir=tmp_path)
    rep = load_reproducer(tmp_path / "step000002-loss-scale-collapse.pt")
    assert rep["scaler_state"]["scale"] == 2.0 ** 14                # 65536 halved twice before step 2
    assert rep["scaler_device"] == "cpu"
    assert rep["precision"]["name"] == "fp16-amp" and rep["precision"]["autocast_dtype"] == "float16"
    assert all(torch.equal(rep["model_state"][k], v) for k, v in w0.items())   # no step was ever applied
    assert torch.equal(rep["batch"], x)                                    # the forward was model(x)


def test_broken_files_raise_a_clear_error(tmp_path) -> None:
    run_until_nonfinite(tmp_path)
    good = tmp_path / "step000003-nonfinite-grads.pt"
    data = good.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReproducerError, match="truncated, corrupted") as ei:
        load_reproducer(cut)
    assert "reproducer_dir" in str(ei.value)
    assert isinstance(ei.value, ampdoctor.AmpDoctorError)

    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as fh:
        pickle.dump({"format": "ampdoctor-reproducer", "obj": ReproducerError("x")}, fh, protocol=2)
    with pytest.raises(ReproducerError, match="not a readable ampdoctor reproducer"):
        load_reproducer(evil)

    other = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, other)
    with pytest.raises(ReproducerError, match="not an ampdoctor reproducer"):
        load_reproducer(other)
    with pytest.raises(ReproducerError, match="no reproducer at"):
        load_reproducer(tmp_path / "missing.pt")


def test_replay_needs_the_architecture(tmp_path) -> None:
    run_until_nonfinite(tmp_path)
    with pytest.raises(ReproducerError, match="model_factory"):
        replay(tmp_path / "step000003-nonfinite-grads.pt")
    with pytest.raises(ReproducerError, match="does not match"):
        replay(tmp_path / "step000003-nonfinite-grads.pt", model_factory=lambda: nn.Linear(3, 3))


def test_replay_from_file_runs_the_step_under_diagnosis(tmp_path) -> None:
    run_until_nonfinite(tmp_path)
    rng = torch.get_rng_state()
    r = replay(tmp_path / "step000003-nonfinite-grads.pt", model_factory=Net)
    assert torch.equal(torch.get_rng_state(), rng)                        # replay restores the caller's RNG
    assert r.codes()[0] == "nonfinite-input"                              # the inf came with the batch
    assert r.summary["replay"]["step"] == 3 and r.summary["replay"]["optimizer"] is True
    assert r.source.endswith("step000003-nonfinite-grads.pt")


def test_replay_from_a_scenario_source(tmp_path) -> None:
    scenario = tmp_path / "scn.py"
    scenario.write_text(
        "import torch, torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.body = nn.Linear(16, 32); self.head = nn.Linear(32, 1)\n"
        "    def forward(self, x):\n"
        "        return self.head(torch.relu(self.body(x))).pow(2).mean()\n"
        "def make():\n"
        "    return {'model': Net(), 'batch': torch.randn(8, 16)}\n")
    run_until_nonfinite(tmp_path, source=str(scenario))
    with pytest.raises(ReproducerError, match="--trust-source"):
        replay(tmp_path / "step000003-nonfinite-grads.pt")       # the recorded file is data: never imported
    r = replay(tmp_path / "step000003-nonfinite-grads.pt", trust_source=True)
    assert "nonfinite-input" in r.codes()


def test_a_crafted_reproducer_executes_nothing(tmp_path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\ndef make():\n    return {{}}\n")
    run_until_nonfinite(tmp_path, source=str(evil))
    path = tmp_path / "step000003-nonfinite-grads.pt"
    with pytest.raises(ReproducerError, match="--factory module:callable"):
        replay(path)
    from click.testing import CliRunner

    from ampdoctor.cli import main

    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 2 and "--trust-source" in res.output
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04trunc", b"not a torch file at all"])
def test_empty_truncated_or_malformed_reproducers_are_clear_errors(tmp_path, content) -> None:
    p = tmp_path / "bad.pt"
    p.write_bytes(content)
    with pytest.raises(ReproducerError, match="not a readable ampdoctor reproducer"):
        load_reproducer(p)


def test_in_process_replay_leads_the_report(tmp_path) -> None:
    w, _ = run_until_nonfinite(tmp_path, on_anomaly="replay")
    r = w.report()
    assert "replay_error" not in r.summary
    assert r.codes()[0] == "nonfinite-input"                  # the replay's ranking leads ...
    assert "overflow" not in r.codes()                         # ... and explains the watch's generic finding
    assert r.summary["replay"]["source"].endswith("step000003-nonfinite-grads.pt")
