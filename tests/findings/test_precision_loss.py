"""``precision-loss``: finite results that deviate from fp32 beyond what rounding to the dtype explains.

Catastrophic cancellation is the real-world mechanism: subtracting two nearly equal numbers keeps only the
digits the operands' rounding did not destroy. bf16 keeps 8 significant bits (u = 2**-8): activations with a
common offset of ~100 are rounded to multiples of 0.5, so ``x - mean(x)`` of a signal of size 0.1 is noise, and
``E[x**2] - E[x]**2`` (values ~400, spacing 2) can come out negative, so its ``sqrt`` is NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor

BF16_U = 2.0**-8


class Center(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class NaiveNorm(nn.Module):
    """Normalization with the one-pass variance E[x^2] - E[x]^2 (cancels when |mean| >> std)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-6)


class Net(nn.Module):
    """proj (bias = a large common offset) -> mid -> head."""

    def __init__(self, mid: nn.Module, offset: float) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 64)
        self.mid = mid
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.proj.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.proj(x)))


def loss_fn(out, batch):  # noqa: ANN001, ANN201
    return out.float().pow(2).mean()


def inputs() -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1))


def test_centering_offset_activations_in_bf16_is_catastrophic_cancellation():
    torch.manual_seed(0)
    model = Net(Center(), offset=100.0)
    report = ampdoctor.diagnose(model, inputs(), precision="bf16", loss_fn=loss_fn)
    f = next(f for f in report.findings if f.code == "precision-loss")
    assert (f.severity, f.module, f.op, f.phase) == ("warning", "mid", "aten.sub.Tensor", "forward")
    ev = f.evidence
    # tolerance = min(16 * sqrt(K) * u, 0.1) with K = 1 for an element-wise op and u = 2**-8
    assert ev["reduction_length"] == 1 and ev["unit_roundoff"] == BF16_U
    assert ev["tolerance"] == pytest.approx(16 * BF16_U)
    assert ev["own_error"] > ev["tolerance"] and ev["own_error"] == pytest.approx(
        ev["relative_error"] - ev["inherited_error"])
    assert ev["inherited_error"] < 0.01  # the offset activations themselves are accurate to ~u
    # ground truth: operands ~100, centred values ~2: log2(100 / 2) ~ 5.6 leading bits cancel
    with torch.no_grad():
        h = model.proj(inputs())
        centred = h - h.mean(-1, keepdim=True)
    assert ev["ref_absmax"] == pytest.approx(centred.abs().max().item(), rel=1e-4)
    assert ev["digits_cancelled"] == pytest.approx(math.log2(ev["operand_absmax"] / ev["ref_absmax"]))
    assert ev["digits_cancelled"] > 5
    assert "Catastrophic cancellation" in f.explanation
    assert any("offset" in x.title for x in f.fixes) and any(x.id == "keep_fp32" for x in f.fixes)


def test_one_pass_variance_in_bf16_goes_negative_and_sqrt_makes_nan():
    torch.manual_seed(0)
    model = Net(NaiveNorm(), offset=20.0)
    # ground truth: the bf16 one-pass variance of some row is negative (fp32: all positive)
    with torch.no_grad():
        h = model.proj(inputs())
        hb = h.bfloat16()
        var_bf16 = (hb * hb).mean(-1) - hb.mean(-1) ** 2
        var_fp32 = (h * h).mean(-1) - h.mean(-1) ** 2
    assert (var_bf16 + 1e-6 < 0).any() and (var_fp32 > 0).all()
    report = ampdoctor.diagnose(model, inputs(), precision="bf16", loss_fn=loss_fn)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "precision-loss", "error", "mid", "aten.sub.Tensor", "forward")
    assert f.evidence["nan_op"]["op"] == "aten.sqrt.default"
    assert f.evidence["n_nan"] >= 1
    assert f.evidence["ref_result_absmax"] == pytest.approx(var_fp32.abs().max().item(), rel=1e-3)
    assert f.evidence["operand_absmax"] > 300  # E[x^2] ~ 400: bf16 spacing 2 there, the variance is ~0.5
    assert "var(" in f.fixes[0].snippet and "float" in f.fixes[0].snippet
    assert "overflow" not in report.codes()


@pytest.mark.parametrize("mid,precision", [(Center(), "bf16"), (NaiveNorm(), "bf16"), (NaiveNorm(), "fp16-amp")])
def test_no_precision_loss_without_an_offset(mid, precision):
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Net(mid, offset=0.0), inputs(), precision=precision, loss_fn=loss_fn)
    assert "precision-loss" not in report.codes(), [(f.code, f.module, f.op, f.title) for f in report.findings]
    assert report.ok
