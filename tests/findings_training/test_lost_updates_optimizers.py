"""Lost weight updates are found from the write log whatever the optimizer's implementation: a loop over
parameters, ``foreach`` kernels over lists, or one ``fused`` kernel (the per-parameter before/after snapshot
that used to back this up is gone).

A bf16 MLP with weights near 4 (spacing there 2**-5): steps of lr=1e-4 are far below half a spacing and round
away; the Adam twin with lr=0.1 (a step of ~lr whatever the gradient) moves every weight and stays clean.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

OPTIMIZERS = {
    "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr),
    "adamw-loop": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, foreach=False),
    "adam-foreach": lambda ps, lr: torch.optim.Adam(ps, lr=lr, foreach=True),
    "adam-fused": lambda ps, lr: torch.optim.Adam(ps, lr=lr, fused=True),
}
WRITE_OP = {"sgd": "aten.add_.Tensor", "adamw-loop": "aten.addcdiv_.default",
            "adam-foreach": "aten._foreach_addcdiv_.ScalarList", "adam-fused": "aten._fused_adam_.default"}


def _diagnose(kind: str, lr: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.sign(p) * 4)  # |w| ~ 4: bf16 spacing 2**-5
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    opt = OPTIMIZERS[kind](model.parameters(), lr)
    return ampdoctor.diagnose(model, x, precision="bf16", optimizer=opt, steps=2,
                              loss_fn=lambda out, _: (out.float() - y).pow(2).mean())


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_lost_updates_are_found_for_every_optimizer_implementation(kind: str) -> None:
    report = _diagnose(kind, 1e-4)
    lost = [f for f in report.findings if f.code == "low-precision-params"]
    assert {f.module for f in lost} == {"0", "2"}, [(f.code, f.module, f.op) for f in report.findings]
    for f in lost:
        assert (f.op, f.phase, f.severity) == (WRITE_OP[kind], "optimizer", "error")
        assert f.evidence["fraction_lost"] == 1.0 and f.evidence["dtype"] == "bfloat16"


@pytest.mark.parametrize("kind", ["adam-foreach", "adam-fused"])
def test_updates_larger_than_the_spacing_are_clean(kind: str) -> None:
    report = _diagnose(kind, 0.1)
    assert "low-precision-params" not in report.codes(), [(f.code, f.module, f.op) for f in report.findings]
