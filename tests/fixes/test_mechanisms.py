"""Mechanism-specific fixes on real failing tiny models: the rule that detects the mechanism proposes its remedy,
the automatic application (or the snippet's code written into the model's twin) removes the failure, verified by
the calibrated verification, and ``ampdoctor explain CODE`` lists the remedies of the code.

* log(softmax(z)) in fp16 -> ``log_softmax`` (rewritten by a torch-function mode)
* ``masked_fill(mask, -1e9)`` in fp16 -> ``finfo(dtype).min`` (``safe_mask`` clamps the literal to the range)
* an eps of 1e-10 (0 in fp16) -> ``finfo(dtype).tiny`` (``dtype_eps``)
* q @ k^T overflowing before ``/ sqrt(d)`` -> scale q first / SDPA (snippets; twin written that way), keep_fp32
* ``x.pow(2).mean()`` in fp16 -> the reduction in float32 (``upcast_op``)
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.findings import REMEDIES, FixProposal, Report, remedies_for
from ampdoctor.fixes import FIXES, fix, verify
from ampdoctor.precision import StepSpec
from tests._models import RMSNet, confident_classifier

STEPS = 3


def _spec(model: nn.Module, batch: Any, loss_fn: Any = None) -> StepSpec:
    # forward + backward, no optimizer: fp16 weights under SGD are a separate finding (low-precision-params)
    return StepSpec(model, batch, "fp16", loss_fn or (lambda o, b: o.float()))


def _diagnose(spec: StepSpec) -> Report:
    return ampdoctor.diagnose(spec.model, spec.batch, precision=spec.precision, loss_fn=spec.loss_fn,
                              optimizer=spec.optimizer)


def _proposal(report: Report, code: str, fix_id: str) -> FixProposal:
    f = next(f for f in report.findings if f.code == code)
    return next(p for p in f.fixes if p.id == fix_id)


# ---------------------------------------------------------------------------------------------------- log(softmax)
def _classifier_spec() -> StepSpec:
    model, x, y = confident_classifier()  # the smallest probabilities are ~1e-10, 0 in fp16
    return _spec(model, x, lambda o, b: F.nll_loss(o.float(), y))


def test_log_of_softmax_gets_log_softmax_and_it_verifies() -> None:
    spec = _classifier_spec()
    report = _diagnose(spec)
    root = report.findings[0]
    assert (root.code, root.module, root.op) == ("underflow", "scorer", "aten._softmax.default")
    p = _proposal(report, "underflow", "log_softmax")
    assert p.params == {"modules": ["scorer"]} and "torch.log_softmax" in p.snippet and "cross_entropy" in p.snippet
    v = verify(p, spec, steps=STEPS, report=report)
    assert v.verified, v.reason
    assert v.loss_broken is not None and not math.isfinite(v.loss_broken)
    assert v.loss_fixed is not None and math.isfinite(v.loss_fixed)


def test_log_softmax_mode_rewrites_only_log_of_a_softmax_output() -> None:
    spec = _classifier_spec()
    fixed = fix(spec.model, _diagnose(spec), which="log_softmax").model
    x = spec.batch.half()
    out = fixed.half()(x) if next(fixed.parameters()).dtype != torch.float16 else fixed(x)
    ref = torch.log_softmax(spec.model.float().scorer.proj(torch.relu(spec.model.fc(spec.batch))), -1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=5e-2)
    assert torch.isinf(spec.model.half()(x)).any()  # the caller's model is unchanged: still log(0) = -inf


# ---------------------------------------------------------------------------------------------------- mask literal
class MaskScore(nn.Module):
    def forward(self, s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return s.masked_fill(mask == 0, -1e9).softmax(-1)


class MaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mask = MaskScore()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.mask(self.fc(x), mask)).mean()


def test_mask_literal_out_of_range_gets_finfo_min_and_it_verifies() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    spec = _spec(MaskNet(), (x, torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0]] * 4)))
    report = _diagnose(spec)
    p = _proposal(report, "constant-out-of-range", "safe_mask")
    assert p.params == {"modules": ["mask"]} and "torch.finfo(x.dtype).min" in p.snippet
    v = verify(p, spec, steps=STEPS, report=report)
    assert v.verified, v.reason
    assert v.loss_fixed is not None and math.isfinite(v.loss_fixed)


# ---------------------------------------------------------------------------------------------------- eps
def test_eps_that_is_zero_in_fp16_gets_a_dtype_aware_eps_and_it_verifies() -> None:
    torch.manual_seed(0)
    spec = _spec(RMSNet(1e-10, mean=True), torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1)))
    report = _diagnose(spec)
    p = _proposal(report, "constant-out-of-range", "dtype_eps")
    assert p.params == {"modules": ["block"]} and "torch.finfo(x.dtype).tiny" in p.snippet
    v = verify(p, spec, steps=STEPS, report=report)
    assert v.verified, v.reason
    assert v.loss_broken is not None and not math.isfinite(v.loss_broken)
    assert v.loss_fixed is not None and math.isfinite(v.loss_fixed)


# ---------------------------------------------------------------------------------------------------- QK^T
class Attn(nn.Module):
    def __init__(self, pre_scale: bool, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.pre_scale = pre_scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(h), self.k(h), self.v(h)
        d = q.shape[-1]
        if self.pre_scale:  # the snippet: scale q by 1/sqrt(d) before the matmul
            s = (q * d ** -0.5) @ k.transpose(-2, -1)
        else:
            s = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        return s.softmax(-1) @ v


class AttnNet(nn.Module):
    def __init__(self, pre_scale: bool = False) -> None:
        super().__init__()
        self.attn = Attn(pre_scale)
        self.out = nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(h)).mean()


def _attn_spec(pre_scale: bool) -> StepSpec:
    torch.manual_seed(0)
    model = AttnNet(pre_scale)
    with torch.no_grad():
        model.attn.q.weight.mul_(60.0)  # q and k fit fp16 (|max| ~ 1e3); q . k reaches ~1e5 before the scale
        model.attn.k.weight.mul_(60.0)
    return _spec(model, torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1)) * 3)


def test_qk_overflow_gets_scale_before_matmul_and_sdpa_and_the_scaled_twin_is_clean() -> None:
    spec = _attn_spec(pre_scale=False)
    report = _diagnose(spec)
    root = report.findings[0]
    assert (root.code, root.module, root.op) == ("overflow", "attn", "aten.bmm.default")
    snippets = [p.snippet for p in root.fixes]
    assert any("q = q * q.shape[-1] ** -0.5" in s for s in snippets)
    assert any("F.scaled_dot_product_attention" in s for s in snippets)
    v = verify(_proposal(report, "overflow", "keep_fp32"), spec, steps=STEPS, report=report)
    assert v.verified, v.reason
    # the snippet's code, written into the twin: no finding, and the same outputs as the fp32 reference
    twin = _attn_spec(pre_scale=True)
    assert not _diagnose(twin).findings
    h = twin.batch
    ref = spec.model(h)
    torch.testing.assert_close(twin.model.half()(h.half()).float(), ref, rtol=2e-2, atol=2e-2)


def test_scale_before_matmul_is_not_proposed_for_a_matmul_that_feeds_no_softmax() -> None:
    class Big(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return (a @ a.transpose(-2, -1)).mean()

    report = _diagnose(_spec(Big(), torch.full((2, 4, 16), 80.0)))
    root = next(f for f in report.findings if f.code == "overflow")
    assert not any("scaled_dot_product_attention" in p.snippet for p in root.fixes)


# ---------------------------------------------------------------------------------------------------- reduction
class Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = Norm()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.fc(x))).mean()


def test_reduction_overflow_gets_an_fp32_reduction_and_it_verifies() -> None:
    torch.manual_seed(0)
    model = NormNet()
    with torch.no_grad():
        model.fc.weight.mul_(200.0)  # activations ~300: x**2 exceeds 65504, the normalised output fits
    spec = _spec(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
    report = _diagnose(spec)
    root = report.findings[0]
    assert (root.code, root.module, root.op) == ("overflow", "norm", "aten.pow.Tensor_Scalar")
    p = root.fixes[0]
    assert p.id == "upcast_op" and p.params == {"modules": ["norm"], "ops": ["pow"]}
    assert "x.float().pow(2).mean" in p.snippet
    v = verify(p, spec, steps=STEPS, report=report)
    assert v.verified, v.reason
    assert v.loss_fixed is not None and math.isfinite(v.loss_fixed)


# ---------------------------------------------------------------------------------------------------- registry, explain
def test_every_remedy_names_a_registered_code_and_fix() -> None:
    for r in REMEDIES.values():
        assert r.code in ampdoctor.CODES, r
        assert r.fix_id is None or r.fix_id in FIXES, r
        assert r.snippet.strip(), r


@pytest.mark.parametrize("code", ["underflow", "constant-out-of-range", "overflow", "low-precision-params",
                                  "loss-scaling-misuse", "must-stay-fp32", "fp8-scale"])
def test_explain_lists_the_fixes_registered_for_the_code(code: str) -> None:
    res = CliRunner().invoke(main, ["explain", code], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps lines
    assert "Fixes registered for this code" in text
    rems = remedies_for(code)
    assert rems
    for r in rems:
        assert r.id in text and r.snippet.splitlines()[0].split("#")[0].strip() in text
        if r.fix_id:
            assert f"ampdoctor fix --apply {r.fix_id}" in text


def test_the_modes_change_only_what_their_mechanism_names() -> None:
    from ampdoctor.fixes import MechanismMode

    class Ops(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            p = torch.softmax(x, -1)
            return torch.log(p), torch.log(p + 0.0), x + 1e-3, x + 1e-10, x.float() + 1e-10

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).half() * 4
    plain = Ops()(x)
    m = Ops()
    MechanismMode(("",), "log_softmax")(m)
    MechanismMode(("",), "dtype_eps")(m)
    logp, log_other, kept, eps, fp32 = m(x)
    torch.testing.assert_close(logp, torch.log_softmax(x, -1))     # log of a softmax output: rewritten
    assert torch.equal(log_other, torch.log(torch.softmax(x, -1) + 1e-10 * 0))  # another tensor: unchanged
    assert torch.equal(kept, plain[2])                              # 1e-3 fits fp16: unchanged
    assert torch.equal(eps, x + torch.finfo(torch.float16).tiny)    # 1e-10 is 0 in fp16: finfo.tiny
    assert torch.equal(fp32, plain[4])                              # fp32 holds 1e-10: unchanged
    with pytest.raises(ValueError, match="unknown mechanism mode"):
        MechanismMode(("",), "nope")(m)


def test_softmax_alone_in_fp32_does_not_fix_log_of_softmax_but_the_module_in_fp32_does() -> None:
    """What the docs say: the fp32 probabilities flush again when cast back to fp16 before the log; running the
    whole module (softmax and log) in fp32 works, like the log_softmax rewrite."""
    spec = _classifier_spec()
    report = _diagnose(spec)
    alone = FixProposal("softmax in fp32", "", id="upcast_op", params={"modules": ["scorer"], "ops": ["softmax"]})
    assert not verify(alone, spec, steps=STEPS).verified
    assert verify(_proposal(report, "underflow", "keep_fp32"), spec, steps=STEPS, report=report).verified
