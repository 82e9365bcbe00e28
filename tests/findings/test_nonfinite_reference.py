"""nonfinite-reference: inf/NaN that the fp32 reference makes too is not a precision problem."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


class Standardize(nn.Module):
    """Per-sample standardization; without ``eps`` a constant row divides 0 by 0."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / (x.std(-1, keepdim=True) + self.eps)


class Net(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.norm = Standardize(eps)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g)
    x[2] = 3.0  # a constant sample (a sensor stuck at one value): std is exactly 0 in any dtype
    return x


def _diagnose(eps: float, precision: str | None) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Net(eps)
    return ampdoctor.diagnose(model, _batch(), precision=precision, loss_fn=lambda o, b: o.float().pow(2).mean(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("precision", ["fp16-amp", "bf16", None])
def test_zero_std_is_nonfinite_in_fp32_too(precision: str | None) -> None:
    report = _diagnose(0.0, precision)
    root = report.findings[0]
    assert (root.code, root.module, root.op, root.phase) == ("nonfinite-reference", "norm", "aten.div.Tensor",
                                                             "forward")
    assert root.severity == "error" and not report.ok
    assert root.evidence["n_nan"] > 0 and root.evidence["reference_dtype"] == "float32"
    assert "not a precision problem" in root.explanation
    assert "overflow" not in report.codes() and "nan-from-inf" not in report.codes()


@pytest.mark.parametrize("precision", ["fp16-amp", "bf16"])
def test_healthy_twin_with_eps_is_clean(precision: str) -> None:
    report = _diagnose(1e-3, precision)
    assert report.ok, report.findings
    assert "nonfinite-reference" not in report.codes()


def test_fp16_overflow_stays_overflow_when_fp32_is_finite() -> None:
    """The same model with a weight past fp16's range: fp32 is finite, so the cause is the precision."""
    torch.manual_seed(0)
    model = Net(1e-3)
    with torch.no_grad():
        model.fc1.weight.mul_(1.5e5)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 10
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=lambda o, b: o.float().pow(2).mean())
    assert report.findings[0].code == "overflow" and report.findings[0].module == "fc1"
    assert "nonfinite-reference" not in report.codes()


def test_zero_div_r10() -> None:
    """reliability.md R10: h / (h - h) makes inf in fp32 as well; not fp16 overflow."""

    class ZeroDiv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h / (h - h)

    torch.manual_seed(0)
    report = ampdoctor.diagnose(ZeroDiv(), torch.randn(3, 4), precision="fp16",
                                loss_fn=lambda o, b: o.float().mean())
    assert [(f.code, f.module, f.op) for f in report.findings][:1] == [("nonfinite-reference", "", "aten.div.Tensor")]
