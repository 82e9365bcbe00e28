"""A run whose fp32 reference diverges by itself (a learning rate too high) is told so -- ``reference-diverges``,
info, with both runs' losses per step -- and its precision errors past the divergence become warnings.

Ground truth built here: a GELU MLP (default init) regressing random targets with plain SGD. At lr 3 the fp32 loss
on the same batch goes 0.69, 3.27, 83.7, 1.1e13 (finite: no ``nonfinite-reference``); in pure fp16 the grown
weights make the last layer's forward exceed 65504 at step 3 -- an overflow that only the divergence reaches. The
twin, lr 0.5, trains (0.69 -> 0.38) and gets no note.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor


def _setup(lr: float) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
    return m, x, y, torch.optim.SGD(m.parameters(), lr=lr)


def _fp32_losses(lr: float, steps: int) -> list[float]:
    m, x, y, opt = _setup(lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (m(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _diagnose(lr: float, precision: str) -> ampdoctor.Report:
    m, x, y, opt = _setup(lr)
    return ampdoctor.diagnose(m, x, precision=precision, optimizer=opt, steps=4,
                              loss_fn=lambda o, _: (o.float() - y).pow(2).mean())


@pytest.mark.parametrize("precision", ["bf16-amp", "fp16"])
def test_fp32_reference_diverging_too_is_said_with_both_losses(precision: str) -> None:
    truth = _fp32_losses(3.0, 4)
    assert all(map(math.isfinite, truth)) and truth[2] > 10 * truth[0] > truth[1]  # diverges from step 2, finite
    report = _diagnose(3.0, precision)
    f = next(f for f in report.findings if f.code == "reference-diverges")
    assert (f.module, f.op, f.phase, f.severity, f.step) == ("", "", "optimizer", "info", 2)
    assert f.evidence["loss_reference"] == pytest.approx(truth, rel=1e-3)
    assert f.evidence["loss_target"] == report.summary["loss_target"] and f.evidence["lr"] == 3.0
    assert f.evidence["growth"] == pytest.approx(truth[3] / truth[0], rel=1e-3)
    assert "fp32 reference diverges as well" in f.explanation and "not a precision problem" in f.explanation
    if precision == "bf16-amp":
        assert report.ok and report.codes() == ["reference-diverges"]


def test_precision_errors_past_the_divergence_are_warnings_that_say_so() -> None:
    # the truth: fp32 activations of the last layer at step 3 exceed fp16's max (the weights grew in fp32 as well)
    m, x, y, opt = _setup(3.0)
    for _ in range(3):
        opt.zero_grad()
        (m(x) - y).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        assert m(x).abs().max() > 65504
    report = _diagnose(3.0, "fp16")
    over = next(f for f in report.findings if f.code == "overflow")
    assert (over.module, over.op, over.phase, over.step) == ("4", "aten.addmm.default", "forward", 3)
    assert over.severity == "warning" and over.evidence["reference_diverges"] == 2
    assert "fp32 reference diverges as well from step 2" in over.explanation
    assert not [f for f in report.findings if f.severity == "error"]


def test_a_run_that_trains_in_fp32_gets_no_note() -> None:
    truth = _fp32_losses(0.5, 4)
    assert truth[-1] < truth[0]
    for precision in ("bf16-amp", "fp16"):
        report = _diagnose(0.5, precision)
        assert "reference-diverges" not in report.codes(), report.codes()
        assert not any("reference_diverges" in f.evidence for f in report.findings)
