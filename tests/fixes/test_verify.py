"""Verification: tolerances, comparisons, and verify()/diagnose_and_fix() on small real failures and healthy runs."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampdoctor.findings import FixProposal, Report
from ampdoctor.fixes import TOLERANCES, Verification, diagnose_and_fix, fix, verify
from ampdoctor.fixes._tolerance import FACTOR, compute_dtype, curve_err, grad_errors, output_err, rel_err
from ampdoctor.precision import make_spec
from ampdoctor.report.fix_table import before_after_table

K = 20


# ---------------------------------------------------------------------------------------------------------------
# tolerances and comparisons


def test_tolerance_floors_are_multiples_of_the_unit_roundoff() -> None:
    fp16, bf16 = TOLERANCES["float16"], TOLERANCES["bfloat16"]
    assert fp16.u == 2.0 ** -11 and bf16.u == 2.0 ** -8
    t = fp16.scaled({"loss": None, "curve": 1e-2, "grad": float("inf"), "output": 1e-6})
    assert t["loss"] == 8 * 2.0 ** -11                 # no noise measured: the floor
    assert t["curve"] == FACTOR * 1e-2                 # noise above the floor: FACTOR x noise
    assert t["grad"] == 16 * 2.0 ** -11                # a non-finite noise is ignored
    assert t["output"] == 8 * 2.0 ** -11
    assert t["lost"] == 0.01


def test_relative_errors() -> None:
    assert rel_err(1.5, 1.0) == 0.5
    assert rel_err(float("nan"), 1.0) == math.inf
    assert rel_err(1.0, float("nan")) is None
    assert curve_err([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert curve_err([1.0], [1.0, 2.0]) == math.inf      # the run stopped early
    g_ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 1.0]), "frozen": None}
    err, lost = grad_errors({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 0.0])}, g_ref)
    assert err == pytest.approx(math.sqrt(2 / 27)) and lost == pytest.approx(2 / 4)
    assert output_err([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 2.0])]) == 0.0
    assert output_err([torch.tensor([1.0])], [torch.tensor([1.0, 2.0])]) == math.inf


def test_compute_dtype_from_precision_or_traced_layers() -> None:
    assert compute_dtype("fp16-amp", None) == "float16"
    assert compute_dtype("bf16", None) == "bfloat16"
    rep = Report(layers=({"dtype": "float32"}, {"dtype": "float16"}))
    assert compute_dtype(None, rep) == "float16"
    mixed = Report(layers=({"dtype": "float16"}, {"dtype": "bfloat16"}))
    assert compute_dtype(None, mixed) == "bfloat16"     # the coarsest format in use sets the tolerance
    assert compute_dtype(None, Report()) == "float32"


# ---------------------------------------------------------------------------------------------------------------
# tiny models


class Classifier(nn.Module):
    """encoder -> pooler (dense + tanh) -> head, like BERT's sequence classifier."""

    def __init__(self, pooler_bias: float = 0.0) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 16)
        self.pool = nn.Linear(16, 16)
        self.act = nn.Tanh()
        self.head = nn.Linear(16, 3)
        with torch.no_grad():
            self.pool.weight.mul_(0.1)
            sign = torch.sign(torch.randn(16, generator=torch.Generator().manual_seed(7)))
            self.pool.bias.copy_(pooler_bias * sign)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.pool(torch.relu(self.enc(x)))))


def classifier_spec(pooler_bias: float) -> object:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Classifier(pooler_bias)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 3, (32,), generator=g)
    return make_spec(model, x, precision="fp16-amp", loss_fn=lambda out, b: F.cross_entropy(out.float(), y),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), scaler=torch.amp.GradScaler("cpu"))


def _checks_pass(v: Verification) -> None:
    assert v.verified, v.reason
    assert v.steps == K and v.steps_finite == K
    assert v.max_rel_err_first_step <= v.tolerance["loss"]
    assert v.max_rel_err_curve <= v.tolerance["curve"]
    assert v.grad_rel_err <= v.tolerance["grad"]
    assert v.grad_lost_fraction <= v.tolerance["lost"]


def test_a_fix_applied_to_a_healthy_run_verifies(digest: Callable[..., dict]) -> None:
    spec = classifier_spec(pooler_bias=0.0)
    before = digest(spec.model, spec.optimizer, spec.scaler)
    for proposal in (FixProposal("fp32 pooler", id="keep_fp32", params={"modules": ["pool", "act"]}),
                     FixProposal("bf16", id="switch_precision", params={"precision": "bf16-amp"})):
        v = verify(proposal, spec, steps=K)
        _checks_pass(v)
        assert v.steps_finite_broken == K and v.grad_lost_fraction_broken == 0.0   # healthy before as well
    assert digest(spec.model, spec.optimizer, spec.scaler) == before      # model, optimizer, scaler, RNG, modes


def test_saturated_tanh_keep_fp32_verifies_and_loss_scaling_cannot_help() -> None:
    spec = classifier_spec(pooler_bias=6.0)               # fp16 tanh(|x| >= 4.506) is exactly +-1
    keep = verify(FixProposal("fp32 pooler", id="keep_fp32", params={"modules": ["pool", "act"]}), spec, steps=K)
    _checks_pass(keep)
    # before: every encoder gradient element is exactly 0 (1 - y**2 = 0), so the encoder's share of the gradient
    # elements fp32 computes is lost
    n_enc = 16 * 16 + 16
    n_all = sum(p.numel() for p in spec.model.parameters())
    assert keep.grad_lost_fraction_broken >= n_enc / n_all - 0.01
    tanh = verify(FixProposal("fp32 tanh", id="upcast_op", params={"modules": ["act"], "ops": ["tanh"]}), spec,
                  steps=K)
    _checks_pass(tanh)
    scaling = verify(FixProposal("scale", id="loss_scaling", params={}), spec, steps=K)
    assert not scaling.verified
    assert scaling.grad_lost_fraction == keep.grad_lost_fraction_broken             # 0 * scale is still 0
    assert "of the gradient elements fp32 computes are exactly 0" in scaling.reason
    assert scaling.steps_finite == K                                                # nothing non-finite to see


def test_verify_by_id_on_a_builtin_scenario() -> None:
    bf16 = verify("switch_precision", "mlp_fp16_overflow", steps=K)
    assert bf16.verified, bf16.reason
    assert bf16.params == {"precision": "bf16-amp"} and bf16.dtype == "bfloat16"
    assert math.isnan(bf16.loss_broken) and bf16.steps_finite_broken == 0
    assert bf16.steps_finite == K and bf16.max_rel_err_first_step <= bf16.tolerance["loss"]
    keep = verify("keep_fp32", "mlp_fp16_overflow", steps=K)
    # the hidden layer's fp32 output (1.75e5) is handed back to the fp16 model: inf again
    assert not keep.verified and "overflow@hidden" in keep.reason
    assert keep.steps_finite == 0 and math.isnan(keep.loss_fixed)
    json.dumps(keep.to_dict())


def test_verify_rejects_what_it_cannot_apply() -> None:
    with pytest.raises(ValueError, match="no finding proposes fix 'clamp'; proposed fixes: keep_fp32"):
        verify("clamp", "mlp_fp16_overflow", steps=2)
    with pytest.raises(ValueError, match="advice without an automatic action"):
        verify(FixProposal("use bf16"), "mlp_fp16_overflow", steps=2)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        verify("keep_fp32", "mlp_fp16_overflow", steps=0)
    with pytest.raises(TypeError, match="StepSpec, a scenario file path"):
        verify("keep_fp32", 42)


def test_diagnose_and_fix_annotates_orders_and_verifies_each_fix_once() -> None:
    report = diagnose_and_fix("fully_masked_row", steps=K)
    fixed = [(f.code, [(p.id, p.verified) for p in f.fixes]) for f in report.findings if f.fixes]
    for code, fixes in fixed:
        flags = [v for _, v in fixes]
        assert flags == sorted(flags, key=lambda v: {True: 0, None: 1, False: 2}[v]), code
    safe = [p for f in report.findings for p in f.fixes if p.id == "safe_mask"]
    assert len(safe) >= 2 and all(p.verified for p in safe)
    assert len({json.dumps(p.verification, sort_keys=True) for p in safe}) == 1    # verified once, shared
    v = safe[0].verification
    assert v["params"] == {"modules": ["history_attention"]}
    assert v["loss_broken"] == "nan" and v["steps_finite_broken"] == 0 and v["steps_finite"] == K
    assert v["max_rel_err_first_step"] <= v["tolerance"]["loss"]
    assert v["reference"] == "fp32"            # the original fp32 step is finite: -1e9 fits float32
    rows = before_after_table(report)
    assert rows[0]["fix"] == "safe_mask ['history_attention']" and rows[0]["verified"] is True
    assert rows[0]["loss_broken"] == "nan" and rows[0]["steps_finite"] == f"{K}/{K}"
    assert len(rows) == 1                       # one row per distinct fix


def test_fix_applies_the_verified_fix_of_an_annotated_report() -> None:
    from ampdoctor.scenarios import load_scenario

    spec = load_scenario("fully_masked_row").make()
    report = diagnose_and_fix("fully_masked_row", steps=2, until_verified=True)
    result = fix(spec["model"], report)
    assert result.proposal.id == "safe_mask" and result.precision == "fp16"
    batch = spec["batch"]
    logits = result.model(**batch)
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()
    ref = spec["model"](**batch)
    torch.testing.assert_close(logits.float(), ref, rtol=2.0 ** -8, atol=2.0 ** -8)
