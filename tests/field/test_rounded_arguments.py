"""Values rounded into a low precision whose *absolute* error a later sin/cos or softmax reads (``findings/
_absolute_args``): decided by the argument's sampled error, not by names -- the modules here are called ``a``,
``b``, ``c``. The field cases ``wan-dit-timestep-bf16``, ``flux-pipeline-timestep-bf16`` (sin/cos),
``bloom-alibi-bf16`` and ``t5x-logit-drift-bf16`` (softmax) are the reported failures; their numbers are checked
here against an independent fp32/bf16 computation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _field_cases import CASES
from torch import nn

import ampdoctor
from ampdoctor.findings import _absolute_args as A
from ampdoctor.findings._absolute_args import LOGIT_LOST, PHASE_LOST
from ampdoctor.precision import triage


class Encoded(nn.Module):
    """A float value from a plain table, cast to the weights' dtype, then ``sin``/``cos`` at frequencies up to 1."""

    def __init__(self, top: float) -> None:
        super().__init__()
        self.table = torch.linspace(top, 0.0, 101)[:-1] + 0.37  # not integers: the integer check does not apply
        self.a = nn.Linear(32, 8)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        v = self.table[i].to(self.a.weight.dtype)
        ang = v.double()[:, None] * torch.pow(100.0, -torch.arange(16, dtype=torch.float64) / 16)
        return self.a(torch.cat([ang.sin(), ang.cos()], -1).to(self.a.weight.dtype))


def _run(model: nn.Module, batch: Any, precision: str = "bf16") -> ampdoctor.Report:
    return ampdoctor.diagnose(model, batch, precision=precision, loss_fn=lambda out, b: out.float().pow(2).mean())


def _lost(report: ampdoctor.Report) -> list[ampdoctor.Finding]:
    return [f for f in report.findings if f.evidence.get("mechanism") in ("phase-lost", "logit-differences-lost")]


def test_a_large_value_rounded_before_a_sinusoid_is_an_error_at_the_cast() -> None:
    idx = torch.arange(0, 100, 7)
    f = _lost(_run(Encoded(top=900.0), idx))
    assert f and (f[0].severity, f[0].module, f[0].op, f[0].phase) == ("error", "", "aten._to_copy.default", "forward")
    t = Encoded(900.0).table[idx]
    assert (t - t.bfloat16().float()).abs().max() >= PHASE_LOST  # the rounding itself moves the phase at f = 1
    assert f[0].evidence["argument_abs_error"] <= (t - t.bfloat16().float()).abs().max().item() + 1e-6


def test_the_same_value_at_a_magnitude_that_fits_stays_clean() -> None:
    r = _run(Encoded(top=40.0), torch.arange(0, 100, 7))  # |t| * u < 0.2 rad
    assert not _lost(r) and not [f for f in r.findings if f.severity == "error"]


class Offset(nn.Module):
    """Scores on a common offset, then a softmax in the activations' dtype (names neutral)."""

    def __init__(self, offset: float, sentinel: bool = False) -> None:
        super().__init__()
        self.b = nn.Linear(16, 64)
        self.c = nn.Linear(16, 16)
        self.sentinel = sentinel
        with torch.no_grad():
            self.b.bias.add_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.b(x)
        if self.sentinel:  # an additive mask (-10000 on half the keys): its rounding is moot, those keys get 0
            s = s + torch.cat([torch.zeros(32), torch.full((32,), -10000.0)]).to(s.dtype)
        return self.c(s.softmax(-1) @ torch.eye(64, 16, dtype=s.dtype))


@pytest.mark.parametrize("offset,bad", [(150.0, True), (0.0, False)])
def test_a_common_offset_before_a_softmax_blames_the_rounding_op(offset: float, bad: bool) -> None:
    r = _run(Offset(offset), torch.randn(32, 16, generator=torch.Generator().manual_seed(3)))
    f = _lost(r)
    if bad:
        assert f and (f[0].severity, f[0].module, f[0].op) == ("error", "b", "aten.addmm.default")
        assert f[0].evidence["argument_abs_error"] >= LOGIT_LOST
    else:
        assert not f


def test_a_mask_sentinel_is_not_a_lost_logit() -> None:
    r = _run(Offset(0.0, sentinel=True), torch.randn(32, 16, generator=torch.Generator().manual_seed(3)), "fp16")
    assert not _lost(r)  # -10000 in fp16 is off by up to 4, but softmax gives those keys 0 either way


def _case(name: str) -> tuple[dict[str, Any], ampdoctor.Finding]:
    spec = CASES[name].build(True)
    return spec, ampdoctor.diagnose(**spec).findings[0]


def test_wan_timestep_numbers() -> None:
    spec, f = _case("wan-dit-timestep-bf16")
    m, b = spec["model"], spec["batch"]
    t = m.timesteps[b["timestep_id"]]
    moved = (t - t.bfloat16().float()).abs()
    assert f.evidence["origin_abs_error"] <= moved.max().item() + 1e-6 and moved.max() > PHASE_LOST
    with torch.no_grad():  # the embedding at the highest frequency (1): cos(t) in fp64 vs cos(bf16(t))
        assert (torch.cos(t.double()) - torch.cos(t.bfloat16().double())).abs().max() > 0.5


def test_alibi_numbers() -> None:
    spec, f = _case("bloom-alibi-bf16")
    t = spec["batch"].shape[1]
    bias = 0.5 * torch.arange(t, dtype=torch.float32)  # the steepest head's slope (2**-1 for 8 heads)
    assert (bias - bias.bfloat16().float()).abs().max() == 0.5  # keys 0.5 apart share a bias above 128
    assert f.evidence["argument_abs_error"] >= LOGIT_LOST and f.evidence["origin_absmax"] > 128
    assert math.isclose(f.evidence["unit_roundoff"], 2 ** -8)


def test_alibi_fix_verifies() -> None:
    """The proposed ``keep_fp32`` of the module that casts the bias (float32 bias and scores) verifies: the error is
    gone from the fixed step and its gradients are off from fp32's 5x less than the broken run's (0.006 vs 0.066)."""
    from ampdoctor.fixes import diagnose_and_fix
    from ampdoctor.precision import make_spec

    report = diagnose_and_fix(make_spec(**CASES["bloom-alibi-bf16"].build(True)), until_verified=True)
    f = report.findings[0]
    assert (f.severity, f.code, f.module, f.op) == ("error", "precision-loss", "attn", "aten._to_copy.default")
    p = f.fixes[0]
    assert (p.id, p.params, p.verified) == ("keep_fp32", {"modules": ["attn"]}, True), p.verification
    v = p.verification
    assert "precision-loss@attn" in v["findings_before"] and not v["findings_after"]
    assert v["grad_rel_err"] * 5 < v["grad_rel_err_broken"]


def test_logit_drift_numbers() -> None:
    spec, f = _case("t5x-logit-drift-bf16")
    m, ids = spec["model"], spec["batch"]
    with torch.no_grad():
        ref = m(ids)
        low = m.to(torch.bfloat16)(ids).float()
    moved = (F.log_softmax(ref, -1) - F.log_softmax(low, -1)).abs().max()
    assert moved > LOGIT_LOST and f.evidence["function_error"] <= moved.item() + 1e-3


def test_check_triage_uses_the_rule_thresholds() -> None:
    """``check``'s quick pass escalates on the same thresholds (precision cannot import findings: equal by test)."""
    assert triage.ABS_ARG_LOST == {"periodic": A.PHASE_LOST, "softmax": A.LOGIT_LOST}
    assert (triage.ABS_ARG_SLACK, triage.ABS_ARG_SENTINEL, triage.ABS_ARG_DEPTH) == (A.ROUNDING_SLACK, A.SENTINEL,
                                                                                       A.DEPTH)


def test_logit_drift_fix_keeps_the_model_output_in_float32_and_verifies() -> None:
    """Drifted logits (~150, bf16 spacing 1) are the model's output: ``keep_fp32(lm_head)`` that casts its result
    back to bf16 redoes the very rounding the finding is about (loss 6.5884, bitwise the broken run's), so the
    proposal leaves the output in float32 (``outputs='float32'``) and verifies: loss 6.4962 against fp32's 6.4966."""
    from ampdoctor.fixes import diagnose_and_fix
    from ampdoctor.precision import make_spec

    report = diagnose_and_fix(make_spec(**CASES["t5x-logit-drift-bf16"].build(True)), until_verified=True)
    f = report.findings[0]
    assert (f.severity, f.code, f.module, f.op) == ("error", "precision-loss", "lm_head", "aten.addmm.default")
    p = next(x for x in f.fixes if x.id == "keep_fp32")
    assert p.params == {"modules": ["lm_head"], "outputs": "float32"} and p.verified, p.verification
    v = p.verification
    assert not v["findings_after"] and abs(v["loss_fixed"] - v["loss_fp32"]) < 1e-3 < v["loss_broken"] - v["loss_fp32"]


def test_a_module_inside_the_model_keeps_the_cast_back() -> None:
    """BLOOM's bias cast sits in an inner attention whose output feeds the next layer: no ``outputs`` parameter."""
    spec, f = _case("bloom-alibi-bf16")
    del spec
    p = next(x for x in f.fixes if x.id == "keep_fp32")
    assert p.params == {"modules": ["attn"]}
