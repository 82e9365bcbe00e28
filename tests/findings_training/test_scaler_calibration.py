"""GradScaler calibrating from 65536 in a healthy fp16-amp run is normal behaviour: its skipped steps' overflows are
``info``, not warnings; a back-off later in the run (the scale grew again past what the gradients allow) stays a
warning, and neither is an error.

Ground truth built here: the GELU MLP of test_training_rules under fp16-amp with AdamW(lr=0.05) and a loss 16x a
plain MSE's; a real autocast + GradScaler(growth_interval=1) loop skips steps 0-5 (65536 -> 1024: the scaled
gradients overflow, the unscaled ones fit), grows the scale after each good step and skips again at step 8.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

import ampdoctor


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(16, 64), act=nn.GELU(), fc2=nn.Linear(64, 64), act2=nn.GELU(),
                                     head=nn.Linear(64, 1)))


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return 16.0 * (out.float() - 1.0).pow(2).mean()


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(32, 16)


def test_calibration_skips_are_info_and_a_later_back_off_a_warning() -> None:
    x, m = _x(), _mlp()
    opt, scaler, truth = torch.optim.AdamW(m.parameters(), lr=0.05), torch.amp.GradScaler("cpu", growth_interval=1), []
    for _ in range(10):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(m(x), x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        truth.append(scaler.get_scale())
    assert truth == [2.0 ** k for k in (15, 14, 13, 12, 11, 10, 11, 12, 11, 12)]  # skips at 0-5 and at 8
    m = _mlp()
    report = ampdoctor.diagnose(m, x, precision="fp16-amp", loss_fn=_loss, steps=10,
                                optimizer=torch.optim.AdamW(m.parameters(), lr=0.05),
                                scaler=torch.amp.GradScaler("cpu", growth_interval=1))
    assert report.summary["scales"] == truth and report.ok
    over = [f for f in report.findings if f.code in ("overflow", "nan-from-inf")]
    assert over and all(f.phase == "backward" for f in over)
    calibrating = [f for f in over if f.step <= 5]
    later = [f for f in over if f.step == 8]
    assert calibrating and all(f.severity == "info" for f in calibrating), [(f.severity, f.step) for f in over]
    assert later and all(f.severity == "warning" and f.evidence["unscaled_absmax"] < 65504 for f in later)
    assert {f.step for f in over} <= {0, 1, 2, 3, 4, 5, 8}
    assert "loss-scale-collapse" not in report.codes()
