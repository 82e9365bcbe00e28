"""``constant-out-of-range`` (no-op literal) needs statistics that can show a no-op: never on an inf input.

A hand-written softplus ``log(1 + exp(h))`` in fp16 with pre-activations ~14 (the Mamba field case): ``exp``
overflows to inf everywhere, ``1 + inf`` is inf, and the finite-only statistics of input and output are both
empty (|max| 0). Identical statistics there are the inf's doing, not the literal rounding away.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


class Softplus(nn.Module):
    def __init__(self, bias: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(0.1)
            self.proj.bias.fill_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(1 + torch.exp(self.proj(x)))


class Net(nn.Module):
    def __init__(self, bias: float) -> None:
        super().__init__()
        self.act = Softplus(bias)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(x))


def _report(bias: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return ampdoctor.diagnose(Net(bias), x, precision="fp16", loss_fn=lambda o, b: o.float().pow(2).mean())


def test_one_plus_inf_is_not_a_rounded_away_literal() -> None:
    report = _report(14.0)  # exp(14) = 1.2e6 > 65504: inf in every element
    codes = [(f.code, f.module, f.op) for f in report.findings]
    assert ("overflow", "act", "aten.exp.default") in codes  # the real cause is still named
    assert not [f for f in report.findings if f.code == "constant-out-of-range"], codes


def test_healthy_softplus_has_no_literal_finding() -> None:
    report = _report(2.0)
    assert not [f for f in report.findings if f.code == "constant-out-of-range"]
    assert not [f for f in report.findings if f.severity == "error"]
