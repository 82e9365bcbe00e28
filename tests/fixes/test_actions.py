"""Fix actions on tiny modules: each transform changes exactly what it says, with numbers known from the formats."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack

from ampdoctor.findings import Finding, FixProposal, Report
from ampdoctor.fixes import FIXES, FixContext, NoFixError, best_fix, build_plan, fix, register_fix
from ampdoctor.fixes._scope import (
    FP16_CLAMP,
    ClampHook,
    ClampOutputs,
    ExcludeParameters,
    Fp32Master,
    KeepFp32,
    ScopedMode,
    map_tensors,
    op_names,
    scopes_of,
)

FP16_MAX = 65504.0
FP16_MIN = -65504.0


# ---------------------------------------------------------------------------------------------------------------
# models


class SumSquares(nn.Module):
    """||x|| per row: x*x overflows fp16 for |x| > 256 while the result (here 600) fits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * x).sum(-1, keepdim=True).sqrt()


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.norm = SumSquares()
        self.head = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))
            self.head.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.lin(x)))


class NaiveRMSNorm(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Masked(nn.Module):
    """Attention-score masking as written for fp32: a -1e9 fill, or a -inf fill, then softmax."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fill = fill

    def forward(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~allowed, self.fill).softmax(-1)


class Additive(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (scores + (1.0 - mask.to(scores.dtype)) * -1e9).softmax(-1)


class Wrap(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args)


# ---------------------------------------------------------------------------------------------------------------
# registry


def test_every_fix_action_is_registered_once() -> None:
    expected = {"keep_fp32", "switch_precision", "clamp", "safe_mask", "upcast_op", "exclude_unused", "loss_scaling",
                "fp32_master", "fp8_amax_floor", "grad_scaler", "keep_fp32_buffers"}
    assert expected <= set(FIXES)
    with pytest.raises(ValueError, match="already registered"):
        register_fix("keep_fp32", summary="again")(lambda params, ctx: None)
    assert FIXES["keep_fp32"].build.__name__ == "keep_fp32"


def test_build_plan_validates_id_and_params() -> None:
    with pytest.raises(ValueError, match="registered fixes: .*keep_fp32"):
        build_plan("make_it_work", {}, FixContext())
    with pytest.raises(ValueError, match=r"accepts \['modules', 'module', 'outputs'\]"):
        build_plan("keep_fp32", {"modules": ["a"], "layers": ["a"]}, FixContext())
    with pytest.raises(ValueError, match="needs params\\['modules'\\]"):
        build_plan("keep_fp32", {}, FixContext())
    with pytest.raises(ValueError, match="'bf16', 'bf16-amp', 'fp16-amp', 'fp16'"):
        build_plan("switch_precision", {"precision": "fp4"}, FixContext())
    with pytest.raises(ValueError, match="upcast_op cannot run 'matmul'"):
        build_plan("upcast_op", {"modules": ["a"], "ops": ["matmul"]}, FixContext())
    # the finding's module is the default scope
    assert build_plan("keep_fp32", {}, FixContext(module="enc.wo")).params == {"modules": ["enc.wo"]}


def test_op_names_accepts_families_functions_and_aten_overloads() -> None:
    assert op_names(["tanh"]) == {"tanh": "input"}
    assert op_names(["aten.pow.Tensor_Scalar"]) == {"pow": "fp32"}
    assert op_names(["softmax"])["_softmax"] == "input"


# ---------------------------------------------------------------------------------------------------------------
# keep_fp32


def test_keep_fp32_after_whole_model_cast_keeps_weights_fp32_and_hands_back_fp16() -> None:
    x = torch.full((1, 4), 300.0)
    model = NormNet().half()
    with torch.no_grad():
        broken = model(x.half())
    assert math.isinf(broken.item())                     # 300**2 = 90000 > 65504
    KeepFp32(("norm", "lin"))(model)
    assert model.lin.weight.dtype == torch.float32 and model.head.weight.dtype == torch.float16
    with torch.no_grad():
        y = model(x.half())
    assert y.dtype == torch.float16
    assert y.item() == 600.0                             # sqrt(4 * 300**2), exact in fp16


def test_keep_fp32_of_the_models_output_module_can_leave_its_output_float32() -> None:
    """``outputs='float32'``: logits ~150 (bf16 spacing 1) keep their fractional differences; the default casts back."""
    torch.manual_seed(0)
    head = nn.Linear(8, 16)
    with torch.no_grad():
        head.bias.fill_(150.0)
    x = torch.randn(2, 8).bfloat16()
    low = copy.deepcopy(head).bfloat16()
    exact = nn.functional.linear(x.float(), low.weight.float(), low.bias.float())  # the bf16 values, fp32 math
    for outputs, dtype in (("float32", torch.float32), ("model dtype", torch.bfloat16)):
        model = copy.deepcopy(head).bfloat16()
        plan = build_plan("keep_fp32", {"modules": [""], "outputs": outputs}, FixContext(precision="bf16"))
        for transform in plan.transforms:
            transform(model)
        with torch.no_grad():
            y = model(x)
        assert y.dtype == dtype
        err = (y.float() - exact).abs().max().item()
        assert (err < 1e-4) if dtype == torch.float32 else (err > 0.05)      # bf16 rounds 150.x to a whole number
    with pytest.raises(ValueError, match="params\\['outputs'\\] must be"):
        build_plan("keep_fp32", {"modules": ["a"], "outputs": "fp16"}, FixContext(precision="bf16"))


def test_keep_fp32_under_autocast_returns_fp32_and_autocast_resumes_after() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e-3

    big = nn.Linear(2, 1, bias=False)
    nxt = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        big.weight.fill_(1000.0)
        nxt.weight.fill_(2.0)
    model = nn.Sequential(big, Scale(), nxt)
    x = torch.full((1, 2), 50.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert math.isinf(model[0](x).item())             # 100000 in an fp16 matmul
    KeepFp32(("0",))(model)
    seen = {}
    model[0].register_forward_hook(lambda m, a, o: seen.update(dtype=o.dtype, value=o.item()))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        y = model(x)
        assert torch.is_autocast_enabled("cpu")
    assert seen == {"dtype": torch.float32, "value": 100000.0}
    assert y.dtype == torch.float16 and y.item() == 200.0  # the next Linear is autocast again


def test_scope_leaves_autocast_and_modes_as_found_when_the_forward_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = Wrap(Boom())
    KeepFp32(("inner",))(model)
    ScopedMode(("inner",), "safe_mask")(model)
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(2))
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    assert _get_current_function_mode_stack() == []


def test_keep_fp32_moves_optimizer_state_to_fp32() -> None:
    model = nn.Sequential(nn.Linear(2, 2)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    model(torch.ones(1, 2, dtype=torch.float16)).sum().backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float16
    KeepFp32(("0",))(model, opt)
    assert {v.dtype for st in opt.state.values() for v in st.values() if v.dim() > 0} == {torch.float32}


# ---------------------------------------------------------------------------------------------------------------
# upcast_op


def test_upcast_tanh_keeps_the_gradient_that_fp16_tanh_rounds_to_zero() -> None:
    model = Wrap(nn.Tanh())
    x = torch.tensor([5.0], dtype=torch.float16, requires_grad=True)
    model(x).sum().backward()
    assert model(x).item() == 1.0 and x.grad.item() == 0.0   # fp16 tanh(5) is exactly 1: gradient 1 - 1 = 0
    ScopedMode(("inner",), "upcast", tuple(op_names(["tanh"]).items()))(model)
    x.grad = None
    y = model(x)
    y.sum().backward()
    t = torch.tanh(torch.tensor(5.0))
    assert y.dtype == torch.float16 and y.item() == 1.0
    assert x.grad.item() == (1 - t * t).half().item() > 0      # fp32's 1 - tanh(5)**2 = 1.8e-4


def test_upcast_norm_statistics_fix_the_zeroed_token() -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    x[1] *= 300.0
    ref = NaiveRMSNorm()(x)
    model = Wrap(NaiveRMSNorm()).half()
    with torch.no_grad():
        assert model(x.half())[1].abs().max().item() == 0.0      # rsqrt(inf) = 0
    build_plan("upcast_op", {"modules": ["inner"], "ops": ["norm"]}, FixContext(precision="fp16")).transforms[0](model)
    with torch.no_grad():
        y = model(x.half())
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref, rtol=2.0 ** -10, atol=0.0)


# ---------------------------------------------------------------------------------------------------------------
# safe_mask


def test_safe_mask_rewrites_an_out_of_range_fill_to_the_dtypes_min() -> None:
    scores = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).half()
    allowed = torch.tensor([[True, True, False, False], [True, True, True, True]])
    model = Wrap(Masked(-1e9))
    with pytest.raises(RuntimeError, match="without overflow"):
        model(scores, allowed)
    ScopedMode(("inner",), "safe_mask")(model)
    y = model(scores, allowed)
    expected = torch.softmax(scores.float().masked_fill(~allowed, FP16_MIN), -1)
    torch.testing.assert_close(y.float(), expected, rtol=2.0 ** -10, atol=2.0 ** -14)
    assert y[0, 2:].tolist() == [0.0, 0.0]
    # outside the scoped module nothing changes
    with pytest.raises(RuntimeError, match="without overflow"):
        scores.masked_fill(~allowed, -1e9)


def test_safe_mask_makes_a_minus_inf_fill_finite_for_fully_masked_rows() -> None:
    scores = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    allowed = torch.tensor([[False, False, False], [True, False, True]])

    class NegInf(nn.Module):
        def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            return s.masked_fill(~a, float("-inf"))

    model = Wrap(NegInf())
    plain = model(scores, allowed).softmax(-1)
    assert torch.isnan(plain[0]).all()
    masked = Wrap(Masked(float("-inf")))
    ScopedMode(("inner",), "safe_mask")(masked)
    y = masked(scores, allowed)
    # -inf became finfo(float32).min: the fully masked row is uniform instead of NaN, the other row unchanged
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[1], plain[1])
    y.sum().backward()
    assert torch.isfinite(scores.grad).all()


def test_safe_mask_zeroes_softmax_rows_that_are_all_minus_inf() -> None:
    class SoftmaxOnly(nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return torch.softmax(s, dim=-1)

    model = Wrap(SoftmaxOnly())
    ScopedMode(("inner",), "safe_mask")(model)
    s = torch.tensor([[float("-inf")] * 3, [0.0, float("-inf"), 0.0]], requires_grad=True)
    y = model(s)
    assert y.tolist() == [[0.0, 0.0, 0.0], [0.5, 0.0, 0.5]]
    y.sum().backward()
    assert torch.isfinite(s.grad).all()


def test_safe_mask_fixes_an_additive_mask_constant_in_fp16() -> None:
    scores = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).half()
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    model = Wrap(Additive())
    assert torch.isnan(model(scores, mask)[1]).all()                # -1e9 * 1.0 = -inf in fp16
    ScopedMode(("inner",), "safe_mask")(model)
    y = model(scores, mask)
    assert torch.isfinite(y).all()
    ref = torch.softmax(scores.float() + (1.0 - mask.float()) * -1e9, -1)  # what fp32 computes
    torch.testing.assert_close(y.float(), ref, rtol=2.0 ** -10, atol=2.0 ** -14)


# ---------------------------------------------------------------------------------------------------------------
# clamp, exclude_unused, fp32_master, loss_scaling, fp8_amax_floor, keep_fp32_buffers


def test_clamp_saturates_at_fp16_max_minus_1000_and_counts() -> None:
    class Const(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.tensor([1e5, -1e5, 3.0])

    model = Wrap(Const())
    ClampOutputs(("inner",))(model)
    y = model(torch.ones(3))
    assert FP16_CLAMP == 64504.0
    assert y.tolist() == [64504.0, -64504.0, 3.0]
    model(torch.ones(3))
    assert [h.clamped for h in scopes_of(model, ClampHook)] == [4]


def test_exclude_unused_leaves_parameters_out_of_the_optimizer() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 2), "pooler": nn.Linear(2, 2)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ExcludeParameters(("pooler.weight", "pooler.bias"))(model, opt)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(model["used"].weight), id(model["used"].bias)}
    assert not model["pooler"].weight.requires_grad and model["used"].weight.requires_grad
    with pytest.raises(ValueError, match="no parameter"):
        ExcludeParameters(("pooler.gamma",))(model, opt)


def test_fp32_master_and_loss_scaling_plans_follow_the_parameter_dtype() -> None:
    fp16_ctx = FixContext(precision=None, param_dtype="float16")
    plan = build_plan("fp32_master", {}, fp16_ctx)
    assert plan.spec_changes["precision"] == "fp16-amp"
    assert isinstance(plan.spec_changes["scaler"], torch.amp.GradScaler)
    assert build_plan("fp32_master", {}, FixContext(param_dtype="bfloat16")).spec_changes == {"precision": "bf16-amp"}
    ls = build_plan("loss_scaling", {"init_scale": 1024.0}, FixContext(precision="fp16"))
    assert ls.spec_changes["precision"] == "fp16-amp" and isinstance(ls.transforms[0], Fp32Master)
    assert ls.spec_changes["scaler"].get_scale() == 1024.0
    amp = build_plan("grad_scaler", {}, FixContext(precision="fp16-amp"))
    assert amp.id == "grad_scaler" and set(amp.spec_changes) == {"scaler"} and amp.transforms == ()
    with pytest.raises(ValueError, match="positive int growth_interval"):
        build_plan("loss_scaling", {"growth_interval": 0}, FixContext())


def test_fp8_amax_floor_turns_the_zero_scale_nan_into_zero() -> None:
    class Quant(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = x.abs().amax(-1, keepdim=True).float() / 448.0
            return (x / scale).to(torch.float8_e4m3fn).float() * scale

    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    model = Wrap(Quant())
    broken = model(x)
    assert torch.isnan(broken[0]).all()
    plan = build_plan("fp8_amax_floor", {"amax_floor": 1e-12}, FixContext(module="inner"))
    plan.transforms[0](model)
    y = model(x)
    assert y[0].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(y[1], broken[1])


def test_keep_fp32_buffers_restores_the_original_values_after_a_bf16_cast() -> None:
    class Rope(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)

    model = Wrap(Rope())
    original = model.inner.inv_freq.clone()
    plan = build_plan("keep_fp32_buffers", {"buffers": ["inner.inv_freq"]}, FixContext.of(model, "bf16"))
    cast = copy.deepcopy(model).to(torch.bfloat16)
    assert not torch.equal(cast.inner.inv_freq.float(), original)
    plan.transforms[0](cast)
    assert cast.inner.inv_freq.dtype == torch.float32 and torch.equal(cast.inner.inv_freq, original)


def test_map_tensors_keeps_container_types() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    out = map_tensors({"x": Pair(torch.ones(1), [torch.zeros(1), 3])}, lambda t: t + 1)
    assert isinstance(out["x"], Pair) and out["x"].a.item() == 2.0 and out["x"].b[0].item() == 1.0
    assert out["x"].b[1] == 3


# ---------------------------------------------------------------------------------------------------------------
# fix()


def _report(precision: str | None = "fp16", verified: bool | None = None) -> Report:
    keep = FixProposal("run norm in fp32", id="keep_fp32", params={"modules": ["norm"]}, verified=verified,
                       verification={"reason": "x"} if verified is False else {})
    bf16 = FixProposal("bf16", id="switch_precision", params={"precision": "bf16"})
    f = Finding("overflow", "error", "norm", "aten.mul.Tensor", "forward", "mul overflows", "x*x > 65504",
                fixes=(FixProposal("advice only"), keep, bf16))
    return Report((f,), precision)


def test_fix_returns_a_fixed_copy_and_never_touches_the_callers_model(digest: Callable[..., dict]) -> None:
    model = NormNet()
    before = digest(model)
    result = fix(model, _report())
    assert digest(model) == before
    assert result.model is not model
    assert result.proposal.id == "keep_fp32" and result.precision == "fp16"
    assert result.applied[0] == "cast the model to float16 (precision 'fp16')"
    assert result.model.lin.weight.dtype == torch.float16 and result.model.norm is not model.norm
    with torch.no_grad():
        y = result.model(torch.full((1, 4), 300.0).half())
    assert y.item() == 600.0
    assert "torch.autocast(device_type, enabled=False)" in result.snippet


def test_fix_inplace_changes_the_model_itself(digest: Callable[..., dict]) -> None:
    model = NormNet()
    before = digest(model)
    result = fix(model, _report(precision="fp16-amp"), which="keep_fp32", inplace=True)
    after = digest(model)
    assert result.model is model and {k for k in before if before[k] != after[k]} == {"hooks"}
    assert len(model.norm._forward_pre_hooks) == 1
    assert model.lin.weight.dtype == torch.float32   # amp: no cast


def test_fix_which_and_errors(digest: Callable[..., dict]) -> None:
    model = NormNet()
    other = nn.Sequential(nn.Linear(4, 4))
    before = digest(model)
    assert fix(model, _report(), which="switch_precision").training_changes == ["model = model.to(torch.bfloat16)"]
    with pytest.raises(NoFixError, match="proposes no 'clamp' fix; proposed: keep_fp32, switch_precision"):
        fix(model, _report(), which="clamp")
    with pytest.raises(ValueError, match="expected 'best' or one of"):
        fix(model, _report(), which="magic")
    with pytest.raises(TypeError, match="Report"):
        fix(model, {"findings": []})
    with pytest.raises(ValueError, match=r"module\(s\) \['norm'\] that the model does not have"):
        fix(other, _report())
    with pytest.raises(NoFixError, match="no findings"):
        fix(model, Report())
    assert digest(model) == before


def test_best_fix_prefers_verified_and_refuses_when_all_failed() -> None:
    rep = _report()
    f = rep.findings[0]
    verified_second = Report((Finding(**{**f.__dict__, "fixes": (
        FixProposal("a", id="keep_fp32", params={"modules": ["norm"]}, verified=False, verification={"reason": "r1"}),
        FixProposal("b", id="switch_precision", params={"precision": "bf16"}, verified=True))}),), "fp16")
    assert best_fix(verified_second)[0].id == "switch_precision"
    all_failed = Report((Finding(**{**f.__dict__, "fixes": (
        FixProposal("a", id="keep_fp32", params={"modules": ["norm"]}, verified=False, verification={"reason": "r1"}),
    )}),), "fp16")
    with pytest.raises(NoFixError, match="keep_fp32: r1"):
        best_fix(all_failed)
