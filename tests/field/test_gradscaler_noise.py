"""GradScaler's scale is not a precision loss: the fp32 reference runs at scale 1, so every scaled gradient carries
a relative "error" of S - 1 = 65535. An op's own error is the factor it adds to that, ``(1 + e) / (1 + e_in) - 1``,
not the difference ``e - e_in`` (65536 times fp16's rounding noise, which flagged healthy backward matmuls).

Found on the healthy twin of the EfficientViT case (mit-han-lab/efficientvit#110) and shown on two more families.
"""

from __future__ import annotations

import pytest
import torch
from _field_cases import CASES

import ampdoctor
from ampdoctor.findings._analysis import added_error as own_error


@pytest.mark.parametrize("name", ["efficientvit-linear-attention", "mamba-softplus-exp", "var-layernorm-fp16"])
def test_healthy_fp16_amp_with_grad_scaler_has_no_backward_precision_loss(name: str) -> None:
    spec = CASES[name].build(False)
    spec.update(precision="fp16-amp", scaler=torch.amp.GradScaler("cpu"))
    spec.setdefault("loss_fn", lambda out, batch: out.float().pow(2).mean())
    report = ampdoctor.diagnose(**spec)
    scaled = [f for f in report.findings if f.code == "precision-loss" and f.phase == "backward"]
    assert not scaled, [(f.module, f.op, f.evidence.get("inherited_error")) for f in scaled]


def test_own_error_is_the_factor_an_op_adds() -> None:
    s = 65536.0
    # a gradient scaled by S with rounding noise 1e-4 in, 3e-4 out: the op adds ~2e-4, not 65536 * 2e-4 = 13
    assert own_error(s * (1 + 3e-4) - 1, s * (1 + 1e-4) - 1) == pytest.approx(2e-4, rel=1e-3)
    assert own_error(0.80, 0.002) == pytest.approx(0.796, rel=1e-3)  # small inherited errors: about the difference
    assert own_error(0.031, 0.03) < 0.001
