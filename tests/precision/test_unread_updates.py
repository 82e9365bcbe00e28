"""The reference leaves out the one update nothing reads (``unread_updates``): its last optimizer step when the target
skipped its own (a GradScaler that found an inf/NaN gradient). The report is the same as with the update run, the
reference allocates no optimizer state for it, and every other case runs the update."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.precision import make_spec, run, saved_rng, unread_updates


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _spec(*, init_scale: float, steps: int = 1) -> Any:
    """fp16-amp with AdamW and a GradScaler. fc2's weights scaled up so that the gradients times ``init_scale``
    2**24 pass float16's 65504 (the scaler skips the step), while 2**4 keeps them finite (the step runs)."""
    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():
        model.fc2.weight.mul_(30.0)
    x, y = torch.randn(32, 16) * 4, torch.randint(0, 4, (32,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return make_spec(model, (x,), precision="fp16-amp", optimizer=opt, scaler=sc, steps=steps,
                     loss_fn=lambda out, batch: F.cross_entropy(out, y))


def _findings(report: Any) -> list[Any]:
    return [(f.code, f.severity, f.module, f.op, f.phase, f.step, repr(f.evidence)) for f in report.findings]


def _diagnose(spec: Any) -> Any:
    return ampdoctor.diagnose(spec.model, spec.batch, precision=spec.precision, optimizer=spec.optimizer,
                              scaler=spec.scaler, loss_fn=spec.loss_fn, steps=spec.steps)


def test_skipped_target_update_is_not_run_in_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(init_scale=2.0 ** 24)
    with saved_rng():
        target = run(spec, reference=False)
    assert target.updated_steps == [] and target.scales == [2.0 ** 23]  # the scaler skipped the step
    assert unread_updates(spec, target) == frozenset({0})
    with saved_rng():
        ref = run(spec, reference=True, no_update=frozenset({0}), keep_models=True)
    assert ref.updates_not_run == [0] and ref.updated_steps == []
    assert len(ref.models[1].state) == 0  # no AdamW state allocated for an update nobody reads
    ref.models = None
    lean = _diagnose(spec)
    assert lean.summary["reference_updates_not_run"] == [0]
    monkeypatch.setattr(sys.modules["ampdoctor.diagnose"], "unread_updates", lambda spec, target: frozenset())
    whole = _diagnose(spec)
    assert "reference_updates_not_run" not in whole.summary
    assert _findings(lean) == _findings(whole)  # nothing read the left-out update
    assert lean.summary["loss_reference"] == whole.summary["loss_reference"]
    assert lean.summary["loss_target"] == whole.summary["loss_target"]


def test_an_fp32_master_weight_update_is_not_run_in_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scaler kept the step: the target's AdamW ran in float32 on float32 master weights, wrote no 16-bit state,
    and stayed finite -- nothing compares the reference's update with it."""
    spec = _spec(init_scale=2.0 ** 4)
    with saved_rng():
        target = run(spec, reference=False)
    assert target.updated_steps == [0]  # the scaler kept the step
    assert unread_updates(spec, target) == frozenset({0})
    lean = _diagnose(spec)
    monkeypatch.setattr(sys.modules["ampdoctor.diagnose"], "unread_updates", lambda spec, target: frozenset())
    assert lean.summary["reference_updates_not_run"] == [0] and _findings(lean) == _findings(_diagnose(spec))


class _RootScale(_Net):
    """A parameter of the root module itself (a learnable temperature): its update is a module-less write, which
    ``loss-scaling-misuse`` compares with the reference's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_updates_something_reads_are_run_in_the_reference() -> None:
    base = _spec(init_scale=2.0 ** 4)
    torch.manual_seed(0)
    root = _RootScale()
    cases = {  # each: the target entered its optimizer step and left something the update rules compare
        "16-bit weights": replace(base, precision="bf16"),
        "root-module state": make_spec(root, base.batch, precision="bf16-amp",
                                       optimizer=torch.optim.AdamW(root.parameters(), lr=1e-3), loss_fn=base.loss_fn),
    }
    for name, spec in cases.items():
        with saved_rng():
            target = run(spec, reference=False)
        assert target.updated_steps == [0], name
        assert unread_updates(spec, target) == frozenset(), name
    bad = replace(base, optimizer=torch.optim.AdamW(base.model.parameters(), lr=1e39))
    with saved_rng():
        target = run(bad, reference=False)  # lr 1e39: the update itself overflows float32
    assert target.updated_steps == [0] and unread_updates(bad, target) == frozenset()


def test_only_the_last_step_and_only_the_own_loop() -> None:
    spec = _spec(init_scale=2.0 ** 40, steps=3)  # still overflowing after two halvings: every step skipped
    with saved_rng():
        target = run(spec, reference=False)
    assert target.updated_steps == [] and len(target.losses) == 3
    assert unread_updates(spec, target) == frozenset({2})  # earlier updates feed the next step's reference
    report = _diagnose(spec)
    assert report.summary["reference_updates_not_run"] == [2]

    def train_step(model: nn.Module, batch: Any, optimizer: Any, scaler: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = spec.loss_fn(model(*batch), batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    custom = replace(spec, train_step=train_step)
    with saved_rng():
        t2 = run(custom, reference=False)
    assert t2.updated_steps == [] and unread_updates(custom, t2) == frozenset()  # a user's step runs whole
