"""Adam on pure-fp16 parameters: the finding says whether an update is lost, blown up or non-finite, as the write
log and the fp32 reference show -- not "lost to rounding" for an update thousands of times too large.

Ground truth built here by hand: a two-layer MLP cast with ``.half()``, small gradients (1e-6..2e-4, a loss of
~2e-4), one Adam step with ``eps=1e-7`` (1.19e-7 in fp16). ``exp_avg_sq = 0.001 * g**2`` is below fp16's smallest
subnormal (6e-8) for every element of the first layer, so the denominator is eps alone and each update is
``lr * m_hat / eps`` -- hundreds to thousands of times the fp32 step of ~lr. With ``eps=1e-8`` (0 in fp16) the same
division is by 0: inf/NaN. Twin: the same model with fp32 master weights under fp16 autocast (updates of ~lr).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

LR = 1e-3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch() -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return (out.float() ** 2).mean() * 1e-3


def _one_step(dtype: torch.dtype, eps: float, foreach: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """One real Adam step in ``dtype``: the model and each parameter's applied |update| (float64)."""
    m = _model().to(dtype)
    opt = torch.optim.Adam(m.parameters(), lr=LR, eps=eps, foreach=foreach)
    before = {n: p.detach().double().clone() for n, p in m.named_parameters()}
    _loss(m(_batch().to(dtype)), None).backward()
    opt.step()
    sq = [opt.state[p]["exp_avg_sq"] for p in m.parameters()]
    if dtype == torch.float16:
        assert int(sq[0].count_nonzero()) == 0  # truth: grad**2 flushed for every element of the first layer
    return m, {n: (p.detach().double() - before[n]).abs() for n, p in m.named_parameters()}


@pytest.mark.parametrize("foreach", [False, True])
def test_blown_up_fp16_adam_update_is_named_as_too_large(foreach: bool) -> None:
    _, half = _one_step(torch.float16, 1e-7, foreach)
    _, full = _one_step(torch.float32, 1e-7, foreach)
    assert max(float(d.max()) for d in full.values()) <= 1.01 * LR  # fp32: a step of ~lr
    assert min(float(half[n].sum() / full[n].sum()) for n in half) > 100  # fp16: hundreds of times more
    m = _model().half()
    report = ampdoctor.diagnose(m, _batch().half(), precision=None, loss_fn=_loss, steps=2,
                                optimizer=torch.optim.Adam(m.parameters(), lr=LR, eps=1e-7, foreach=foreach))
    lpp = [f for f in report.findings if f.code == "low-precision-params"]
    assert {f.module for f in lpp} == {"0", "2"}, [(f.code, f.module, f.op, f.step) for f in report.findings]
    op = "aten._foreach_addcdiv_.ScalarList" if foreach else "aten.addcdiv_.default"
    for f in lpp:
        assert (f.op, f.phase, f.severity, f.step) == (op, "optimizer", "error", 0)
        assert f.evidence["update_is"] == "blown_up"
        assert "blown up" in f.title and "lost to rounding" not in f.title
        assert "not lost to rounding but blown up" in f.explanation and "m / eps" in f.explanation
        name = f.evidence["tensor"]
        truth = float(half[name].sum() / full[name].sum())
        assert f.evidence["applied_vs_fp32"] == pytest.approx(truth, rel=0.05)
        assert f.evidence["eps_in_dtype"] == pytest.approx(1.1920929e-07)
        assert "fp32_master" in {x.id for x in f.fixes}
    assert report.findings[0].code == "low-precision-params"


def test_fp16_adam_eps_zero_update_is_nonfinite_not_lost() -> None:
    m, half = _one_step(torch.float16, 1e-8, False)
    assert not all(bool(torch.isfinite(d).all()) for d in half.values())  # truth: m / 0
    m = _model().half()
    report = ampdoctor.diagnose(m, _batch().half(), precision=None, loss_fn=_loss, steps=2,
                                optimizer=torch.optim.Adam(m.parameters(), lr=LR, eps=1e-8, foreach=False))
    f = report.findings[0]
    assert (f.code, f.op, f.phase, f.severity) == ("low-precision-params", "aten.addcdiv_.default", "optimizer",
                                                   "error")
    assert f.evidence["update_is"] == "nonfinite" and "not lost to rounding but infinite" in f.explanation


def test_fp32_master_weights_twin_is_clean() -> None:
    m = _model()
    report = ampdoctor.diagnose(m, _batch(), precision="fp16-amp", loss_fn=_loss, steps=2,
                                optimizer=torch.optim.Adam(m.parameters(), lr=LR, eps=1e-7, foreach=False))
    assert "low-precision-params" not in report.codes(), [(f.code, f.module, f.op) for f in report.findings]
    assert not [f for f in report.findings if f.severity == "error"]
