"""Zeros an op flushes that a pole turns into inf, and an eps literal that is 0 in the dtype.

* ``log(softmax(z))`` in fp16: softmax returns 0 for probabilities below 6e-8, log(0) = -inf. The root cause is
  the softmax's underflow (newcomer review §6B), not an "overflow" of log; ``log_softmax`` is the healthy twin.
* ``y / sqrt(mean(y*y) + 1e-10)`` in fp16 on rows that are zero (padding): 1e-10 is 0 in fp16, so 0/0. The
  root cause is the literal (constant-out-of-range at the add); the healthy twin uses eps = 1e-5.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import ampdoctor


class Scorer(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 10)
        self.fused = fused

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.proj(h)
        return torch.log_softmax(z, -1) if self.fused else torch.log(torch.softmax(z, -1))


class Classifier(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.scorer = Scorer(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer(torch.relu(self.fc(x)))


def _classify(fused: bool) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Classifier(fused)
    with torch.no_grad():
        model.scorer.proj.weight.mul_(40.0)  # a confident classifier: the smallest probabilities are ~1e-10
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return ampdoctor.diagnose(model, x, precision="fp16", loss_fn=lambda o, b: F.nll_loss(o.float(), y),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_log_of_softmax_is_a_softmax_underflow() -> None:
    report = _classify(fused=False)
    root = report.findings[0]
    assert (root.code, root.severity, root.module, root.op, root.phase) == (
        "underflow", "error", "scorer", "aten._softmax.default", "forward")
    assert root.evidence["pole_op"] == "aten.log.default" and root.evidence["n_flushed"] > 0
    assert "overflow" not in report.codes()
    assert any("log_softmax" in f.snippet for f in root.fixes)


def test_log_softmax_twin_is_clean() -> None:
    report = _classify(fused=True)
    assert report.ok and not report.findings, report.findings


class PaddedRMS(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) * (torch.arange(x.shape[1]) % 4 != 0).to(x.dtype).unsqueeze(-1)  # padded rows are 0
        return y / torch.sqrt((y * y).mean(-1, keepdim=True) + self.eps)


class Net(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.block = PaddedRMS(eps)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


def _normalise(eps: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Net(eps)
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(3))
    return ampdoctor.diagnose(model, x, precision="fp16", loss_fn=lambda o, b: o.float().pow(2).mean(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_eps_that_is_zero_in_fp16_is_constant_out_of_range() -> None:
    report = _normalise(1e-10)
    root = report.findings[0]
    assert (root.code, root.severity, root.module, root.op, root.phase) == (
        "constant-out-of-range", "error", "block", "aten.add.Tensor", "forward")
    assert root.evidence["constant"] == 1e-10 and root.evidence["constant_in_dtype"] == 0.0
    assert root.evidence["consequence"]["op"] == "aten.div.Tensor"
    assert "torch.finfo" in root.fixes[0].snippet


def test_eps_the_dtype_holds_is_clean() -> None:
    report = _normalise(1e-5)
    assert report.ok, report.findings
    assert "constant-out-of-range" not in report.codes()
