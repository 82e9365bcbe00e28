"""Emulated Transformer-Engine-style fp8 linears: scaling recipes, statistics, and the failures they explain."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from ampdoctor.precision.fp8 import Fp8Recipe, Fp8TensorStats, fp8_autocast

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def quantize(x, scale, dtype, fmax):
    """The recipe's quantise-dequantise, written out independently of the library."""
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


# --- facts about torch's fp8 casts the emulation relies on -----------------------------------------------------------

def test_fp8_format_facts_on_this_torch():
    assert torch.finfo(E4M3).max == E4M3_MAX and torch.finfo(E5M2).max == E5M2_MAX
    # smallest subnormals: e4m3 2**-9, e5m2 2**-16; half of them rounds (to even) to 0
    assert torch.tensor([2.0 ** -9, 2.0 ** -10]).to(E4M3).float().tolist() == [2.0 ** -9, 0.0]
    assert torch.tensor([2.0 ** -16, 2.0 ** -17]).to(E5M2).float().tolist() == [2.0 ** -16, 0.0]
    # casting to e4m3fn saturates (even inf), NaN stays NaN; casting to e5m2 overflows to inf like IEEE formats
    e4 = torch.tensor([500.0, 1e6, math.inf, math.nan]).to(E4M3).float()
    assert e4[:3].tolist() == [448.0, 448.0, 448.0] and math.isnan(e4[3])
    assert torch.tensor([1e6, 61440.0, 61439.0]).to(E5M2).float().tolist() == [math.inf, math.inf, 57344.0]


# --- (a) outlier beyond the delayed (stale) scale saturates at 448 ---------------------------------------------------

def test_outlier_beyond_the_delayed_scale_saturates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    x0 = torch.randn(4, 8)
    x1 = x0.clone()
    x1[0, 0] = 100.0                                    # one outlier activation in the second step
    with fp8_autocast(model, Fp8Recipe(scaling="delayed", amax_history_len=4)) as fp8:
        model(x0)
        out1 = model(x1)
    first, second = fp8.stats().select(module="0", role="input")
    amax0 = float(x0.abs().max())
    assert (first.step, first.amax, first.amax_history, first.saturated) == (0, amax0, amax0, 0)
    assert second.step == 1 and second.amax == 100.0
    assert second.amax_history == amax0 < second.amax   # the scale still comes from step 0's amax
    assert second.scale == pytest.approx(E4M3_MAX / amax0, rel=1e-6)
    assert second.saturated == 1 and second.saturated_fraction == 1 / 32
    # the outlier came out of the GEMM as if it were amax0: row 0 is wrong by ~ (100 - amax0) * |w|
    ref = model(x1)
    assert (out1[0] - ref[0]).abs().max() > 10 * (out1[1:] - ref[1:]).abs().max()

    with fp8_autocast(model, Fp8Recipe(scaling="dynamic")) as fp8_dyn:
        model(x0)
        model(x1)
    assert [t.saturated for t in fp8_dyn.stats().select(role="input")] == [0, 0]


# --- (b) tiny gradients underflow e4m3 but not e5m2 ------------------------------------------------------------------

def _two_steps(fmt):
    """Step 0 with a normal loss, step 1 with the loss x1e-6: grads ~1e-9 meet a scale made for grads ~1e-3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    grads = []
    with fp8_autocast(model, Fp8Recipe(format=fmt, scaling="delayed")) as fp8:
        for factor in (1.0, 1e-6):
            model.zero_grad()
            out = model(x)
            out.register_hook(grads.append)
            (factor * out.pow(2).mean()).backward()
    return model, fp8.stats().select(module="2", role="grad_output"), grads


def test_tiny_gradients_underflow_in_e4m3_and_survive_in_e5m2():
    model_e4, (g0_e4, g1_e4), grads = _two_steps("e4m3")
    model_hy, (g0_hy, g1_hy), _ = _two_steps("hybrid")
    assert g1_e4.format == "e4m3" and g1_hy.format == "e5m2"
    assert g1_e4.amax == pytest.approx(1e-6 * g0_e4.amax, rel=1e-5) and g1_e4.amax < 1e-7
    assert g1_e4.amax_history == g0_e4.amax > 1e-2       # the scale was made for step 0's gradients
    # the expected count, from the captured gradient and the stale scale
    g1 = grads[1]
    scale = E4M3_MAX / g0_e4.amax
    expected = int(((quantize(g1, scale, E4M3, E4M3_MAX) == 0) & (g1 != 0)).sum())
    assert g1_e4.underflowed == expected and g1_e4.nonzero == int((g1 != 0).sum())
    assert g1_e4.underflow_fraction == 1.0
    assert g1_hy.underflow_fraction < 0.1
    assert g0_e4.underflowed == 0 and g0_hy.underflowed == 0
    # all of layer 0's gradient is lost with e4m3 gradients; e5m2 keeps it
    assert torch.count_nonzero(model_e4[0].weight.grad) == 0
    assert torch.count_nonzero(model_hy[0].weight.grad) > 0


# --- (c) a zero-initialised weight (LoRA B) ---------------------------------------------------------------------------

class LoRALinear(nn.Module):
    def __init__(self, d=8, r=2):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.lora_A = nn.Linear(d, r, bias=False)
        self.lora_B = nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.lora_B.weight)               # LoRA's init: B = 0

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def _lora_step(recipe):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("proj", LoRALinear())
    with fp8_autocast(model, recipe) as fp8:
        out = model(torch.randn(4, 8))
        out.pow(2).mean().backward()
    (w,) = fp8.stats().select(module="proj.lora_B", role="weight")
    return model, out, w


def test_zero_weight_with_the_default_amax_floor_is_finite():
    model, out, w = _lora_step(Fp8Recipe())
    assert w.amax == 0.0 and w.nonzero == 0 and w.underflowed == 0
    assert w.scale == pytest.approx(E4M3_MAX / 1e-12)
    assert bool(torch.isfinite(out).all())
    assert bool(torch.isfinite(model.proj.lora_B.weight.grad).all())


def test_zero_weight_without_an_amax_floor_reports_an_infinite_scale_and_nan_output():
    model, out, w = _lora_step(Fp8Recipe(amax_floor=0.0))
    assert w.amax == 0.0 and w.scale == math.inf
    assert bool(torch.isnan(out).all())                  # 0 * inf = NaN in the dequantised weight
    assert bool(torch.isnan(model.proj.lora_A.weight.grad).all())


# --- (d) a healthy model: no saturation, error within what 3 mantissa bits allow -------------------------------------

def test_healthy_linear_has_no_saturation_and_error_within_the_e4m3_rounding_bound():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    x = torch.randn(8, 32, requires_grad=True)
    with fp8_autocast(model, Fp8Recipe(scaling="dynamic")) as fp8:
        out = model(x)
    stats = fp8.stats()
    assert all(t.saturated == 0 for t in stats.tensors)
    xs, ws = (t.scale for t in stats.tensors)
    w, b = model[0].weight.detach(), model[0].bias.detach()
    ref = F.linear(x.detach(), w, b)
    # round-to-nearest with 3 mantissa bits: relative error <= 2**-4 for normals, <= 2**-10 / scale absolute below
    u = 2.0 ** -4
    dx = u * x.detach().abs() + 2.0 ** -10 / xs
    dw = u * w.abs() + 2.0 ** -10 / ws
    bound = dx @ w.abs().t() + x.detach().abs() @ dw.t() + dx @ dw.t()
    err = (out.detach() - ref).abs()
    assert bool((err <= bound * (1 + 1e-5)).all())
    assert float((err / (x.detach().abs() @ w.abs().t())).max()) < 2 * u + u * u
    assert float(err.max()) > 0                          # it did quantise


def test_gradients_are_computed_from_the_dequantised_tensors():
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    x = torch.randn(5, 6, requires_grad=True)
    with fp8_autocast(lin, Fp8Recipe(scaling="dynamic")) as fp8:
        out = lin(x)
    g = torch.randn(5, 3)
    out.backward(g)
    xq_s, wq_s, gq_s = (t.scale for t in fp8.stats().tensors)
    xq = quantize(x.detach(), xq_s, E4M3, E4M3_MAX)
    wq = quantize(lin.weight.detach(), wq_s, E4M3, E4M3_MAX)
    gq = quantize(g, gq_s, E5M2, E5M2_MAX)
    assert torch.equal(out.detach(), xq @ wq.t() + lin.bias.detach())
    assert torch.equal(x.grad, gq @ wq)
    assert torch.equal(lin.weight.grad, gq.t() @ xq)
    assert torch.equal(lin.bias.grad, g.sum(0))          # bias gradient from the unquantised grad_output


# --- bookkeeping ------------------------------------------------------------------------------------------------------

class TwoCalls(nn.Module):
    """One module calling F.linear twice in its forward (like MultiheadAttention's in/out projections)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 4))
        self.w2 = nn.Parameter(torch.randn(4, 4) * 100)

    def forward(self, x):
        return F.linear(F.linear(x, self.w1), self.w2)


def test_records_are_attributed_to_the_innermost_module_and_numbered_per_call():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("block", nn.Sequential(nn.Linear(4, 4)))
    model.add_module("two", TwoCalls())
    with fp8_autocast(model, Fp8Recipe(format="e5m2", scaling="dynamic")) as fp8:
        model(torch.randn(3, 4)).sum().backward()
    stats = fp8.stats()
    forward = [(t.module, t.call, t.role, t.format, t.numel) for t in stats.tensors if t.role != "grad_output"]
    assert forward == [("block.0", 0, "input", "e5m2", 12), ("block.0", 0, "weight", "e5m2", 16),
                       ("two", 0, "input", "e5m2", 12), ("two", 0, "weight", "e5m2", 16),
                       ("two", 1, "input", "e5m2", 12), ("two", 1, "weight", "e5m2", 16)]
    assert list(stats.by_module()) == ["block.0", "two"]
    (w2,) = [t for t in stats.select(module="two", role="weight") if t.call == 1]
    assert w2.amax == float(model.two.w2.detach().abs().max())
    assert len(stats.select(role="grad_output")) == 3
    assert isinstance(w2, Fp8TensorStats)
    with pytest.raises(AttributeError):
        w2.amax = 0.0                                    # frozen


def test_hooks_and_mode_are_removed_on_exit_and_on_exception():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    depth = len(_get_current_function_mode_stack())

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    with fp8_autocast(model):
        assert hooks() == 6 and len(_get_current_function_mode_stack()) == depth + 1
        model(torch.randn(2, 4))
    assert hooks() == 0 and len(_get_current_function_mode_stack()) == depth
    with pytest.raises(RuntimeError, match="mat1 and mat2"), fp8_autocast(model):
        model(torch.randn(2, 5))
    assert hooks() == 0 and len(_get_current_function_mode_stack()) == depth
    out = model(torch.randn(2, 4))                      # plain fp32 again
    assert out.dtype == torch.float32


def test_recipe_and_arguments_are_validated_with_the_allowed_values():
    with pytest.raises(ValueError, match="'hybrid', 'e4m3', 'e5m2'"):
        Fp8Recipe(format="e3m4")
    with pytest.raises(ValueError, match="'dynamic', 'delayed'"):
        Fp8Recipe(scaling="just-in-time")
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1"):
        Fp8Recipe(amax_history_len=0)
    with pytest.raises(ValueError, match="margin must be an int >= 0"):
        Fp8Recipe(margin=-1)
    with pytest.raises(ValueError, match="e.g. 1e-12; 0 disables the floor"):
        Fp8Recipe(amax_floor=-1.0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fp8_autocast("model")
    with pytest.raises(TypeError, match="Fp8Recipe"):
        fp8_autocast(nn.Linear(2, 2), {"format": "hybrid"})
    assert Fp8Recipe().format_of("grad_output") == "e5m2" and Fp8Recipe().format_of("input") == "e4m3"


def test_margin_divides_the_scale_by_a_power_of_two():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    scales = []
    for margin in (0, 3):
        with fp8_autocast(lin, Fp8Recipe(scaling="dynamic", margin=margin)) as fp8:
            lin(x)
        scales.append(fp8.stats().tensors[0].scale)
    assert scales[0] == pytest.approx(8 * scales[1], rel=1e-7)


def test_reentering_the_same_block_continues_the_amax_history():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    fp8 = fp8_autocast(lin, Fp8Recipe(scaling="delayed"))
    for step in range(2):
        with fp8:
            lin(x * (step + 1))
    first, second = fp8.stats().select(role="input")
    assert (first.step, second.step) == (0, 1)
    assert second.amax == 2 * first.amax and second.amax_history == first.amax


def test_the_median_of_the_nonzero_values_is_the_lower_median_without_placeholders():
    from ampdoctor.precision.fp8 import _median_nonzero

    gen = torch.Generator().manual_seed(3)
    for n, zeros in [(1, 0), (2, 1), (5, 3), (6, 0), (100, 40), (0, 4), (0, 0)]:
        x = torch.randn(n + zeros, generator=gen)
        x[:zeros] = 0
        nz = x != 0
        want = float(x.abs()[nz].median()) if n else 0.0   # torch's median: the lower of the two middle values
        assert float(_median_nonzero(x, nz)) == want, (n, zeros)
