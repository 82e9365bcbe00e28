"""A step that STARTS from inf/NaN weights is replayed from the update that wrote them (the step before).

The mechanism (openai/CLIP#40): pure-fp16 weights trained by Adam(eps=1e-8), whose eps is 0 in fp16; where a
gradient's square underflows, the first update divides 0 by 0 and writes NaN into the weights. The watch sees the
NaN only at the next step; its replay must run the update that made it, not the step that found it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.watch._rules import NONFINITE_CODES


class _HalfNet(nn.Module):
    """Two fp16 Linear layers returning their loss (so a replay runs forward, backward and the update)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))).float().pow(2).mean()


def _model(eps: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = _HalfNet().half()
    with torch.no_grad():
        m.up.weight.mul_(1e-3)   # a small first layer, as in a pretrained encoder: tiny gradients, grad**2 -> 0
    return m, torch.optim.Adam(m.parameters(), lr=1e-3, eps=eps)


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int = 4, bad: int | None = None,
           **kw: object) -> ampdoctor.watch.Watch:
    g = torch.Generator().manual_seed(1)
    with ampdoctor.watch(m, opt, **kw) as w:  # type: ignore[arg-type]
        for i in range(steps):
            x = torch.randn(5, 8, generator=g).half()
            if i == bad:
                x[0, 0] = math.inf
            opt.zero_grad()
            loss = m(x)
            loss.backward()
            opt.step()
    return w


def test_nan_weights_from_adam_eps_replay_the_update_that_wrote_them(tmp_path) -> None:
    m, opt = _model(1e-8)
    w = _train(m, opt, reproducer_dir=tmp_path)
    rep = w.report()
    moved = rep.summary["replay_moved"]
    assert moved["from_step"] == 1 and moved["to_step"] == 0 and "up.weight" in moved["nonfinite"]
    assert rep.summary["replay"]["summary"]["replay"]["step"] == 0
    first = rep.findings[0]
    assert (first.code, first.module, first.op, first.phase) == (
        "low-precision-params", "up", "aten.addcdiv_.default", "optimizer")
    assert "eps=1e-08 is 0 in float16" in first.title
    codes = {f.code for f in rep.findings if f.phase == "optimizer" and f.op}
    assert "constant-out-of-range" in codes     # the literal eps itself, at its add_
    assert not any(f.code == "nonfinite-input" for f in rep.findings)
    # the reproducer written holds that earlier update: replaying the file names the same op
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files and files[0].startswith("step000000-"), files
    fresh = ampdoctor.replay(tmp_path / files[0], model_factory=lambda: _HalfNet().half())
    assert (fresh.findings[0].code, fresh.findings[0].op) == ("low-precision-params", "aten.addcdiv_.default")


def test_healthy_eps_twin_stays_clean() -> None:
    m, opt = _model(1e-4)      # representable in fp16: the same model and data train finitely
    rep = _train(m, opt).report()
    assert "replay_moved" not in rep.summary and "replay" not in rep.summary
    assert not [f for f in rep.findings if f.code in NONFINITE_CODES or f.severity == "error"]
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_nan_made_in_the_forward_still_replays_its_own_step() -> None:
    m, opt = _model(1e-4)
    rep = _train(m, opt, bad=2).report()      # an inf input at step 2: the weights are finite on entry
    assert "replay_moved" not in rep.summary
    assert rep.summary["replay"]["summary"]["replay"]["step"] == 2
    first = rep.findings[0]
    assert (first.code, first.phase) == ("nonfinite-input", "forward")
    assert not any(f.phase == "optimizer" and f.op for f in rep.findings)


def test_beyond_the_kept_window_the_report_says_why_it_replays_the_later_step() -> None:
    m, opt = _model(1e-8)
    rep = _train(m, opt, coverage_steps=0).report()   # no pre-step copies kept at all
    moved = rep.summary["replay_moved"]
    assert moved["to_step"] is None and moved["from_step"] == 1
    assert "coverage_steps above 1" in moved["note"]
    assert rep.summary["replay"]["summary"]["replay"]["step"] == 1


@pytest.mark.parametrize("on_anomaly", ["raise", "skip"])
def test_moved_replay_keeps_the_users_decision(on_anomaly: str) -> None:
    m, opt = _model(1e-8)
    if on_anomaly == "raise":
        with pytest.raises(ampdoctor.AnomalyError) as err:
            _train(m, opt, on_anomaly=on_anomaly)
        assert err.value.step == 1
    else:
        w = _train(m, opt, on_anomaly=on_anomaly)
        assert w.report().summary["replay_moved"]["to_step"] == 0


def test_a_failing_state_check_never_stops_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    guard = sys.modules["ampdoctor.watch._guard"]

    def broken(*a: object) -> tuple[str, ...]:
        raise RuntimeError("boom")

    monkeypatch.setattr(guard, "nonfinite_state", broken)
    m, opt = _model(1e-8)
    rep = _train(m, opt).report()
    assert "replay_moved" not in rep.summary
    assert rep.summary["replay"]["summary"]["replay"]["step"] == 1   # the step's own replay, as before


LOOP = """
    import sys, torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).half()
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=float(sys.argv[1]))
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(5, 8, generator=g).half()
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()      # the loss in the loop: recorded, replayed with the update
        loss.backward()
        opt.step()
"""


@pytest.mark.parametrize("eps", ["1e-8", "1e-4"])
def test_ampdoctor_run_replays_the_update_that_wrote_the_nan(tmp_path, eps: str) -> None:
    import textwrap

    from ampdoctor.integrations.run import run_script

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOOP))
    rep = run_script(["python", str(script), eps])
    assert rep.summary["script"] == {"status": "completed"}
    if eps == "1e-4":
        assert "replay_moved" not in rep.summary and "replay" not in rep.summary
        assert not [f for f in rep.findings if f.code in NONFINITE_CODES]
        return
    assert rep.summary["replay_moved"]["to_step"] == 0
    assert "not_reproduced" not in rep.summary["replay"]
    first = rep.findings[0]
    assert (first.code, first.module, first.op, first.phase) == (
        "low-precision-params", "0", "aten.addcdiv_.default", "optimizer")


def test_healthy_fp16_run_keeps_one_read_per_step_and_frees_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-step copies cost no host read, are bitwise inert, and go once the first coverage_steps are over."""
    reads = [0]
    real = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> object:
        reads[0] += 1
        return real(self)

    m0, opt0 = _model(1e-4)
    m, opt = _model(1e-4)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with ampdoctor.watch(m, opt, coverage_steps=3) as w:
        tracker = w._tracker
        g = torch.Generator().manual_seed(1)
        held = []
        for _ in range(5):
            x = torch.randn(5, 8, generator=g).half()
            opt.zero_grad()
            m(x).backward()
            opt.step()
            held.append(tracker.prior is not None)
        steps_reads = reads[0]
    assert steps_reads == 5         # the one read of each step's pre-update check, nothing more
    assert held == [True, True, True, False, False]
    monkeypatch.undo()
    g = torch.Generator().manual_seed(1)
    for _ in range(5):       # the same training without the watch: bitwise the same weights
        x = torch.randn(5, 8, generator=g).half()
        opt0.zero_grad()
        m0(x).backward()
        opt0.step()
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m0.state_dict().values()))


def test_a_copy_that_would_not_fit_is_not_made_and_the_report_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setattr(sys.modules["ampdoctor.watch._prestate"], "fits", lambda tensors: False)
    m, opt = _model(1e-8)
    rep = _train(m, opt).report()
    moved = rep.summary["replay_moved"]
    assert moved["to_step"] is None and "free device memory" in moved["note"]
    assert rep.summary["replay"]["summary"]["replay"]["step"] == 1
