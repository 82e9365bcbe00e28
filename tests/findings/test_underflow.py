"""``underflow``: values nonzero in fp32 that become exactly 0 below the format's smallest subnormal.

fp16's smallest subnormal is 2**-24 = 5.96e-8; anything below half of it rounds to 0. Three real mechanisms:
fp16 backward without loss scaling (a 1e-6 loss weight), Adam's ``grad**2`` in fp16 optimizer state (the update
then divides by zero), and a 0/0 NaN made from flushed activations.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

FP16_MIN_SUBNORMAL = 2.0**-24


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[0].weight.dtype))


def weighted_loss(weight: float):  # noqa: ANN201
    def loss_fn(out, batch):  # noqa: ANN001, ANN202
        return out.float().mean() * weight
    return loss_fn


def inputs() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def test_fp16_backward_without_loss_scaling_flushes_gradients():
    torch.manual_seed(0)
    model = Mlp()
    report = ampdoctor.diagnose(model, inputs(), precision="fp16", loss_fn=weighted_loss(1e-6))
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "underflow", "error", "net.4", "aten.mm.default", "backward")
    # theory: d loss / d out = 1e-6 / 16 per row, so the grad-input of net.4 is 6.25e-8 * W4 (fp32 reference)
    w4 = model.net[4].weight.detach()
    assert f.evidence["ref_absmax"] == pytest.approx(1e-6 / 16 * w4.abs().max().item(), rel=1e-5)
    assert f.evidence["ref_absmax"] < FP16_MIN_SUBNORMAL
    assert f.evidence["flushed_fraction"] == 1.0 and f.evidence["n_flushed"] == 16 * 32
    assert f.evidence["format_min_subnormal"] == FP16_MIN_SUBNORMAL
    # the incoming gradient 6.25e-8 was already rounded onto the floor: 2**-24, all 16 values subnormal
    sub = f.evidence["subnormal_input"]
    assert sub["n_subnormal"] == 16 and sub["absmax"] == FP16_MIN_SUBNORMAL
    assert sorted(f.evidence["dead_parameters"]) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert f.fixes[0].id == "grad_scaler" and "loss scaling" in f.fixes[0].title
    assert not report.ok


@pytest.mark.parametrize("precision,weight", [("fp16", 1.0), ("bf16", 1e-6)])
def test_no_underflow_when_the_values_fit(precision, weight):
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Mlp(), inputs(), precision=precision, loss_fn=weighted_loss(weight))
    assert "underflow" not in report.codes(), report.codes()


class Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


def test_adam_state_in_fp16_flushes_grad_squared_then_divides_by_zero():
    torch.manual_seed(0)
    model = Proj().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(model, x, loss_fn=lambda o, b: (o.float() ** 2).mean() * 1e-3, optimizer=opt)
    f = next(f for f in report.findings if f.code == "underflow")
    assert (f.severity, f.module, f.op, f.phase) == ("error", "proj", "aten.addcmul_.default", "optimizer")
    assert f.evidence["flushed_fraction"] == 1.0
    # (1 - beta2) * grad**2: every value below the fp16 floor in the fp32 reference
    assert f.evidence["ref_absmax"] < FP16_MIN_SUBNORMAL
    assert f.evidence["feeds_nonfinite"][0]["op"] == "aten.addcdiv_.default"
    assert 1e-8 in f.evidence["constants_below_floor"]  # eps = 1e-8 rounds to 0 in fp16
    assert any(x.id == "fp32_master" for x in f.fixes)
    assert report.findings.index(f) == 0 or report.findings[0].code == "low-precision-params"


class TinyDirections(nn.Module):
    """Unit directions of tiny vectors: v / ||v||. In fp16 v (~1e-9) flushes to 0 and 0 / 0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.lin(x) * 1e-9
        return self.head(v / v.norm(dim=-1, keepdim=True))


def test_nan_from_flushed_zeros_is_underflow():
    torch.manual_seed(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(TinyDirections(), x, precision="fp16", loss_fn=lambda o, b: o.float().mean())
    assert report.summary["loss_target"][0] != report.summary["loss_target"][0]  # NaN
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == ("underflow", "error", "", "aten.mul.Tensor", "forward")
    assert f.evidence["flushed_fraction"] == 1.0
    assert f.evidence["feeds_nonfinite"][0]["op"] == "aten.div.Tensor"
    assert "division by zero" in f.explanation
    assert "precision-loss" not in report.codes()
    # the forward NaN is not an overflow; only the backward's 1/||v||**2 (~1e8 even in fp32) may overflow too
    assert all(x.phase == "backward" for x in report.findings if x.code == "overflow")
