"""The same magnitudes as the hand-written field cases (``hand-groupnorm-fp16``, ``hand-weight-norm-fp16``) through
torch's own kernels, which keep their statistics in float32 (``native_group_norm``'s mean/rstd,
``_weight_norm_interface``'s norms): the fp16 result really is accurate (checked here against fp32), so
ampdoctor must not report an error -- the mechanism is the squared sum in fp16, not GroupNorm or weight norm."""

from __future__ import annotations

import copy
from typing import Any

import torch
from _field_cases import NormedProjNet, conv_norm_decoder
from torch import nn

import ampdoctor


def _native_groupnorm() -> dict[str, Any]:
    return conv_norm_decoder(True, nn.GroupNorm(8, 32, eps=1e-6))


def _native_weight_norm() -> dict[str, Any]:
    torch.manual_seed(0)
    m = NormedProjNet(nn.utils.parametrizations.weight_norm(nn.Linear(64, 64)))
    with torch.no_grad():  # row norms of v ~9e4 > 65504, as in hand-weight-norm-fp16
        m.proj.parametrizations.weight.original1.mul_(1.5e5)
    return {"model": m, "batch": torch.randn(4, 16), "precision": "fp16",
            "loss_fn": lambda out, batch: out.float().pow(2).mean()}


def _fp16_error(spec: dict[str, Any]) -> float:
    ref = spec["model"](spec["batch"]).detach()
    low = copy.deepcopy(spec["model"]).half()(spec["batch"].half()).float().detach()
    return float((low - ref).norm() / ref.norm())


def test_native_kernels_are_accurate_in_fp16() -> None:
    for build in (_native_groupnorm, _native_weight_norm):
        assert _fp16_error(build()) < 1e-2, build.__name__


def test_no_error_on_native_kernels() -> None:
    for build in (_native_groupnorm, _native_weight_norm):
        report = ampdoctor.diagnose(**build())
        errors = [(f.code, f.module, f.op) for f in report.findings if f.severity == "error"]
        assert not errors, (build.__name__, errors)
        assert report.summary["ops_traced"] > 0 and not report.summary["forward_only"]


def test_hand_written_twins_do_fail_in_fp16() -> None:
    """The hand-written forms at the same magnitudes are wrong in fp16 (why they are field cases)."""
    from _field_cases import CASES
    for name in ("hand-groupnorm-fp16", "hand-weight-norm-fp16"):
        spec = CASES[name].build(True)
        err = _fp16_error(spec)
        assert not err < 0.5, (name, err)  # NaN or far off
