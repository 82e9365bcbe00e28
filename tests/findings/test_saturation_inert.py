"""A saturation no backward reads is no cause: the error its input carried in is (``saturation`` -> ``info``).

The failing model centres activations that sit on a large common offset (a drifted bias of 256: bf16 spacing 2
there, so ``u - mean(u)`` keeps about one significant bit -- catastrophic cancellation, a ``precision-loss``), then
applies GPT-2's GELU-tanh. The tanh's argument then lies in [3.5, 9] (bf16 rounds tanh to exactly 1 from 3.466,
fp32 only from ~9.0), so it "saturates in bf16 where fp32 does not". In a forward-only run nothing reads the
tanh's derivative, and at the bound each value moves by at most 2**-9: the output differs from fp32 because the
tanh's input already does. The saturation must not rank above the cancellation; with a backward it stays a
warning (its derivative is then read). The healthy twin (no offset) stays clean.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor


class GeluTanh(nn.Module):
    """GPT-2's ``gelu_new``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x**3)))``."""

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * torch.pow(u, 3.0))))


class Center(nn.Module):
    """Subtract the row mean, then add a fixed shift (the activation's working point)."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u - u.mean(-1, keepdim=True) + self.shift


class Net(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(32, 64)
        self.center = Center(4.2 if offset else 0.0)
        self.act = GeluTanh()
        self.down = nn.Linear(64, 8)
        with torch.no_grad():
            self.up.weight.normal_(0, 0.03)
            self.up.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.center(self.up(x))))


def _x() -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(1))


def _sat(report: ampdoctor.Report) -> ampdoctor.Finding:
    return next(f for f in report.findings if f.code == "saturation")


def test_forward_only_saturation_ranks_below_the_carried_error() -> None:
    report = ampdoctor.diagnose(Net(256.0), (_x(),), precision="bf16")
    top = report.findings[0]
    assert (top.code, top.module, top.op, top.phase) == ("precision-loss", "center", "aten.sub.Tensor", "forward")
    sat = _sat(report)
    assert (sat.severity, sat.module, sat.op, sat.phase) == ("info", "act", "aten.tanh.default", "forward")
    assert sat.evidence["fraction_at_limit"] >= 0.5 and sat.evidence["ref_fraction_at_limit"] < 0.1
    assert "backward_op" not in sat.evidence
    assert sat.evidence["input_relative_error"] > 0.1  # the tanh's argument is already off (5.97 vs 7.20)
    assert "carried in from upstream" in sat.explanation and "No backward op reads it" in sat.explanation


def test_saturation_read_by_a_backward_stays_a_warning() -> None:
    model = Net(256.0)
    report = ampdoctor.diagnose(model, (_x(),), precision="bf16", loss_fn=lambda out, batch: out.float().sum())
    sat = _sat(report)
    assert (sat.severity, sat.module, sat.op, sat.phase) == ("warning", "act", "aten.tanh.default", "forward")
    assert sat.evidence["backward_op"] == "aten.tanh_backward.default"
    assert "No backward op reads it" not in sat.explanation


def test_healthy_twin_is_clean() -> None:
    report = ampdoctor.diagnose(Net(0.0), (_x(),), precision="bf16")
    assert not report.findings, [f.code for f in report.findings]
