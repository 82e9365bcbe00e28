"""``saturation``: bounded activations that round to their bound in low precision, zeroing the gradient below.

The failing model is a BERT-style classifier head: a pooler ``Linear`` whose bias drifted to ±6 followed by
``tanh``. In fp16 every |x| >= 0.5 * ln(2**13 - 1) = 4.5055 rounds to exactly ±1 (fp16 holds nothing between
1 - 2**-11 and 1), so ``1 - y**2 = 0`` and the layers below get exactly-zero gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.findings._common import spacing_below_one
from ampdoctor.findings._saturation import saturation_threshold

FP16_TANH_THRESHOLD = 0.5 * math.log(2**13 - 1)  # tanh(x) >= 1 - 2**-12 rounds to 1 in fp16


class Classifier(nn.Module):
    """body -> gelu -> pooler -> tanh -> head: the pooler's bias sets how far tanh is driven."""

    def __init__(self, pooler_bias: float) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.pooler = nn.Linear(32, 32)
        self.act = nn.Tanh()
        self.head = nn.Linear(32, 3)
        with torch.no_grad():
            sign = torch.sign(torch.randn(32, generator=torch.Generator().manual_seed(7)))
            self.pooler.bias.copy_(pooler_bias * sign)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.pooler(nn.functional.gelu(self.body(x)))))


def ce_loss(out, batch):  # noqa: ANN001, ANN201 - scenario contract loss_fn(output, batch)
    return nn.functional.cross_entropy(out.float(), batch[1])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)


def _diagnose(model: nn.Module) -> ampdoctor.Report:
    x, y = batch()
    return ampdoctor.diagnose(model, (x, y), precision="fp16-amp", loss_fn=ce_loss,
                              train_step=None, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              scaler=torch.amp.GradScaler("cpu"))


class _Args(nn.Module):
    """Adapter: the batch is (x, y); the model reads x only."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_threshold_and_spacing_match_fp16_rounding():
    thr = saturation_threshold("tanh", torch.float16)
    assert thr == pytest.approx(FP16_TANH_THRESHOLD)
    assert spacing_below_one(torch.float16) == 2.0**-11
    assert spacing_below_one(torch.bfloat16) == 2.0**-8
    below, above = torch.tensor([4.49], dtype=torch.float16), torch.tensor([4.52], dtype=torch.float16)
    assert torch.tanh(below).item() < 1.0 and torch.tanh(above).item() == 1.0
    assert saturation_threshold("tanh", torch.bfloat16) == pytest.approx(0.5 * math.log(2**10 - 1))
    assert saturation_threshold("sigmoid", torch.float16) == pytest.approx(math.log(2**12 - 1))


def test_pooler_tanh_saturation_zeroes_the_gradients_below():
    torch.manual_seed(0)
    model = _Args(Classifier(pooler_bias=6.0))
    report = _diagnose(model)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "saturation", "error", "inner.act", "aten.tanh.default", "forward")
    # ground truth from the same weights: the fp16 pre-activations and how many of them round to +-1
    x, _ = batch()
    inner = model.inner
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        pre = inner.pooler(nn.functional.gelu(inner.body(x)))
    expected = (torch.tanh(pre).abs() == 1).float().mean().item()
    assert expected == 1.0
    assert f.evidence["fraction_at_limit"] == expected
    assert f.evidence["ref_fraction_at_limit"] == 0.0
    assert f.evidence["spacing_below_1"] == 2.0**-11
    assert f.evidence["saturation_threshold"] == pytest.approx(FP16_TANH_THRESHOLD)
    assert f.evidence["input_absmax"] == pytest.approx(pre.abs().max().item(), rel=1e-3)
    assert f.evidence["input_absmax"] > FP16_TANH_THRESHOLD
    assert f.evidence["grad_zero_fraction"] == 1.0 and f.evidence["ref_grad_zero_fraction"] == 0.0
    # body and pooler (weight + bias) feed the tanh: all four gradients are exactly zero in fp16
    assert sorted(f.evidence["dead_parameters"]) == [
        "inner.body.bias", "inner.body.weight", "inner.pooler.bias", "inner.pooler.weight"]
    assert f.evidence["upstream_grad_zero_fraction"] == 1.0
    assert f.evidence["ref_upstream_grad_zero_fraction"] < 0.01
    assert "loss scaling cannot bring a 0 back" in f.explanation
    keep = [x for x in f.fixes if x.id == "keep_fp32"]
    assert keep and keep[0].params["modules"] == ["inner.pooler", "inner.act"]
    assert "float32" in keep[0].title
    assert any("bfloat16 does not help" in x.title for x in f.fixes)
    assert not report.ok


def test_moderate_pooler_does_not_saturate():
    torch.manual_seed(0)
    report = _diagnose(_Args(Classifier(pooler_bias=0.5)))
    assert "saturation" not in report.codes(), report.codes()
    assert report.ok


class NewGelu(nn.Module):
    """GPT-2's tanh GELU written out: its tanh saturates for large |x|, but the gradient also flows through x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.act = NewGelu()
        self.out = nn.Linear(64, 3)
        with torch.no_grad():
            self.fc.weight.mul_(8.0)  # pre-activations up to ~10: some tanh outputs round to 1 in fp16

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


def test_gelu_tanh_saturation_with_a_live_gradient_path_is_not_reported():
    torch.manual_seed(0)
    model = Mlp()
    x, _ = batch()
    with torch.no_grad():
        h = model.fc(x).half()
        arg = math.sqrt(2.0 / math.pi) * (h + 0.044715 * h.pow(3))
        frac = (torch.tanh(arg).abs() == 1).float().mean().item()
    assert 0.05 < frac < 0.5  # the fp16 tanh does saturate for some entries ...
    report = _diagnose(model)
    assert "saturation" not in report.codes(), report.codes()  # ... but x * (1 + 1) still carries the gradient
