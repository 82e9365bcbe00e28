"""Zeros an op flushes that a pole turns into inf, and an eps literal that is 0 in the dtype.

* ``log(softmax(z))`` in fp16: softmax returns 0 for probabilities below 6e-8, log(0) = -inf. The root cause is
  the softmax's underflow (newcomer review §6B), not an "overflow" of log; ``log_softmax`` is the healthy twin.
* ``y / sqrt(mean(y*y) + 1e-10)`` in fp16 on rows that are zero (padding): 1e-10 is 0 in fp16, so 0/0. The
  root cause is the literal (constant-out-of-range at the add); the healthy twin uses eps = 1e-5.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

import ampdoctor
from tests._models import RMSNet, confident_classifier


def _classify(fused: bool) -> ampdoctor.Report:
    model, x, y = confident_classifier(fused)  # the smallest probabilities are ~1e-10
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


def _normalise(eps: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = RMSNet(eps)
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


class CentredSquares(torch.nn.Module):
    """A hand-written variance of a wide residual stream (a sensor-fusion feature, channels ~ +-400): ``x - mean``
    rounds to exactly 0 in fp16 for the channel at the mean, and ``(x - mean) ** 2`` overflows for the far ones."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 64)
        with torch.no_grad():
            self.proj.weight.mul_(400.0)
            self.proj.weight[0] = self.proj.weight[1:].mean(0)  # channel 0 sits at the channels' mean
            self.proj.bias[0] = self.proj.bias[1:].mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        d = h - h.mean(-1, keepdim=True)
        return d / (d.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()


def test_a_square_is_no_pole_its_inf_is_the_overflow() -> None:
    torch.manual_seed(0)
    m = CentredSquares()
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        h = m.proj(x)
        d32, d16 = h - h.mean(-1, keepdim=True), h.half() - h.half().mean(-1, keepdim=True)
    assert ((d16 == 0) & (d32 != 0)).any() and (d32.abs().max() > 256)  # a cancelled 0 and squares beyond 65504
    report = ampdoctor.diagnose(m, x, precision="fp16", loss_fn=lambda o, b: o.float().pow(2).mean())
    root = report.findings[0]
    assert (root.code, root.op, root.severity) == ("overflow", "aten.pow.Tensor_Scalar", "error"), report.findings
    assert not any(f.code == "underflow" and "pole_op" in f.evidence for f in report.findings)  # 0 ** 2 = 0
