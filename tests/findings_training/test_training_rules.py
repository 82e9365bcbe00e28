"""Training-setup codes on real failing models: low-precision-params, loss-scale-collapse, loss-scaling-misuse,
fp8-scale (hand-written fp8 and the fp8 emulation). Each with a healthy control."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampdoctor


def mse(out, batch):  # noqa: ANN001, ANN201
    return out.float().pow(2).mean()


# -- low-precision-params ----------------------------------------------------------------------------------------
def _norm_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(proj=nn.Linear(32, 32), norm=nn.LayerNorm(32))).to(dtype)


def test_bf16_weights_lose_adamw_updates() -> None:
    model = _norm_model(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda o, b: (o.float() - 0.5).pow(2).mean(), optimizer=opt)
    f = report.findings[0]
    assert (f.code, f.module, f.phase, f.severity) == ("low-precision-params", "norm", "optimizer", "error")
    # LayerNorm weights are exactly 1.0: bf16 ulp there is 2**-7, AdamW's first update is ~lr = 1e-3 < 2**-8
    assert f.evidence["fraction_lost"] == 1.0 and f.evidence["ulp_at_1"] == 2.0 ** -7
    assert f.evidence["fraction_lost_fp32"] == 0.0
    assert any(fx.id == "fp32_master" for fx in f.fixes)


def test_fp16_adam_eps_rounds_to_zero() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(8, 1))).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    report = ampdoctor.diagnose(model, torch.randn(4, 8).half(), loss_fn=lambda o, b: (o.float() ** 2).mean() * 1e-3,
                                optimizer=opt, steps=2)
    f = report.findings[0]
    assert (f.code, f.module, f.phase) == ("low-precision-params", "proj", "optimizer")
    assert f.evidence["eps"] == 1e-8 and f.evidence["eps_in_dtype"] == 0.0
    assert "eps=1e-4" in f.fixes[1].snippet


def test_fp32_master_weights_are_healthy() -> None:
    model = _norm_model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = ampdoctor.diagnose(model, torch.randn(16, 32), precision="bf16-amp",
                                loss_fn=lambda o, b: (o.float() - 0.5).pow(2).mean(), optimizer=opt)
    assert report.ok, report.codes()
    assert "low-precision-params" not in report.codes()


# -- loss-scale-collapse -------------------------------------------------------------------------------------------
class PowMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.act = nn.Tanh()  # a bounded forward; the explicit cube below overflows only in backward
        self.down = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(self.act(h * 0.001 + 0.0001 * h.pow(3)))


def _collapse_setup() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = PowMLP()
    with torch.no_grad():
        model.up.weight.mul_(200.0)  # pre-activations ~300: 3x^2 of the cube's backward exceeds 65504
    return model, torch.randn(8, 8)


def test_cuda_policy_runs_the_cube_in_fp32_and_stays_healthy() -> None:
    model, x = _collapse_setup()
    report = ampdoctor.diagnose(model, x, precision="fp16-amp", loss_fn=mse,
                                optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                scaler=torch.amp.GradScaler("cpu"), steps=3)
    assert report.ok, report.codes()
    assert report.summary["scales"] == [65536.0] * 3


def test_loss_scale_collapse_names_the_op_making_nonfinite_grads() -> None:
    model, x = _collapse_setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    # native CPU autocast keeps pow in fp16 (CUDA's policy would run it in fp32 and the step would be healthy)
    report = ampdoctor.diagnose(model, x, precision="fp16-amp", loss_fn=mse, optimizer=opt, scaler=scaler, steps=5,
                                policy="native")
    codes = report.codes()
    assert "loss-scale-collapse" in codes
    f = next(f for f in report.findings if f.code == "loss-scale-collapse")
    assert f.phase == "backward" and f.module == ""  # the cube is inline math of the root module
    assert f.evidence["autograd_node"] == "PowBackward0"
    scales = f.evidence["scales"]
    assert scales == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13, 2.0 ** 12, 2.0 ** 11]  # halved on every skipped step
    assert f.evidence["skipped_steps"] == 5        # all five, step 0 included (the scale started at 2**16)
    assert report.findings[0].code in ("overflow", "loss-scale-collapse")
    assert report.findings[0].phase == "backward"


def test_stable_scaler_is_healthy() -> None:
    torch.manual_seed(0)
    model = PowMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    report = ampdoctor.diagnose(model, torch.randn(8, 8), precision="fp16-amp", loss_fn=mse, optimizer=opt,
                                scaler=torch.amp.GradScaler("cpu"), steps=4)
    assert report.ok, report.codes()
    assert report.summary["scales"] == [65536.0] * 4


def _high_lr_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(16, 64), act=nn.GELU(), fc2=nn.Linear(64, 64), act2=nn.GELU(),
                                     head=nn.Linear(64, 1)))


def _high_lr_loss(out, batch):  # noqa: ANN001, ANN201
    return 16.0 * (out.float() - 1.0).pow(2).mean()  # gradients ~16x a plain MSE's: GradScaler backs off 6 times


def test_scaler_backing_off_from_65536_under_a_high_lr_is_no_collapse() -> None:
    """AdamW at lr 0.05 (weights |max| 0.25 -> 0.55 in 8 steps, finite): the scaled gradients overflow fp16 at
    65536 .. 2048, GradScaler skips 6 steps and settles at 1024, then the loss follows fp32's. Every skip's inf is a
    backward value that fits fp16 unscaled: normal back-off, not a collapse (it was reported as one at step 0)."""
    torch.manual_seed(1)
    x = torch.randn(32, 16)
    model = _high_lr_mlp()
    report = ampdoctor.diagnose(model, x, precision="fp16-amp", loss_fn=_high_lr_loss,
                                optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                scaler=torch.amp.GradScaler("cpu"), steps=8)
    assert "loss-scale-collapse" not in report.codes() and report.ok, report.codes()
    # the truth: a plain fp16-autocast loop with the same GradScaler skips the same steps, then trains
    m = _high_lr_mlp()
    opt, scaler, truth, losses = torch.optim.AdamW(m.parameters(), lr=0.05), torch.amp.GradScaler("cpu"), [], []
    for _ in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _high_lr_loss(m(x), x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        truth.append(scaler.get_scale())
        losses.append(loss.item())
    assert report.summary["scales"] == truth == [2.0 ** k for k in (15, 14, 13, 12, 11, 10, 10, 10)]
    assert losses[7] < losses[0] / 2  # it trains once calibrated
    ref = report.summary["loss_reference"]
    assert ref[-1] < ref[0] / 4  # and the fp32 reference goes down
    backoff = [f for f in report.findings if f.code == "overflow"]
    # calibration from 65536 (steps 0-5 all skipped): GradScaler's normal behaviour, info
    assert backoff and all(f.severity == "info" and f.phase == "backward" and f.evidence["unscaled_absmax"] < 65504
                           for f in backoff)


def test_collapse_after_backing_off_names_the_unscalable_op() -> None:
    """The cube's gradient (unscaled 3x^2 ~ 2.7e5) overflows at every scale: the skips are a collapse, and the
    evidence keeps them apart from back-off (none here: no skip the scale explains)."""
    model, x = _collapse_setup()
    report = ampdoctor.diagnose(model, x, precision="fp16-amp", loss_fn=mse,
                                optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                scaler=torch.amp.GradScaler("cpu"), steps=4, policy="native")
    f = next(f for f in report.findings if f.code == "loss-scale-collapse")
    assert f.evidence["collapse_steps"] == [0, 1, 2, 3] and f.evidence["backoff_steps"] == []
    assert f.evidence["autograd_node"] == "PowBackward0" and f.severity == "error" and f.step == 0


def test_exploding_weights_collapse_is_named_at_the_forward_overflow_not_the_back_off() -> None:
    """AdamW at lr 5 (fp32 too explodes: |w| 6.7 -> 365 in one update, loss 1.25 -> 5.8e9): GradScaler backs off at
    steps 0-1 (the scaled gradients of the initial weights, fitting unscaled), applies step 2, and from step 3 the
    fp16 forward of the grown weights overflows at every scale. The skips of steps 1.. are judged against the
    reference's step with the target's weights (after j skips the target's step s repeats the reference's s - j):
    the aligned reference step 1 already has exploded weights the target never had."""
    torch.manual_seed(1)
    x = torch.randn(32, 16)
    model = _high_lr_mlp()
    report = ampdoctor.diagnose(model, x, precision="fp16-amp", loss_fn=lambda o, b: (o.float() - 1.0).pow(2).mean(),
                                optimizer=torch.optim.AdamW(model.parameters(), lr=5.0),
                                scaler=torch.amp.GradScaler("cpu"), steps=6)
    assert report.summary["scales"] == [2.0 ** k for k in (15, 14, 14, 13, 12, 11)]
    f = next(f for f in report.findings if f.code == "loss-scale-collapse")
    assert f.evidence["backoff_steps"] == [0, 1] and f.evidence["collapse_steps"] == [3, 4, 5]
    assert (f.module, f.op, f.phase, f.step) == ("head", "aten.addmm.default", "forward", 3)
    # the truth: one fp32 AdamW update at lr 5 makes head's output exceed fp16's max, at any loss scale
    m = _high_lr_mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=5.0)
    (m(x) - 1.0).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        assert m(x).abs().max() > 65504
    # the step-1 overflow (scaled gradients of the unchanged initial weights) is back-off, no error
    assert not any(g.code == "overflow" and g.step == 1 and g.severity == "error" for g in report.findings)


# -- loss-scaling-misuse ----------------------------------------------------------------------------------------------
def _diagnose_clipping(clip_before_unscale: bool) -> ampdoctor.Report:
    """A GradScaler step that clips gradients to norm 1, before (wrong) or after (right) ``scaler.unscale_``."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(8, 8), head=nn.Linear(8, 1)))

    def train_step(m, batch, optimizer, scaler):  # noqa: ANN001, ANN202
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse(m(batch), batch)
        scaler.scale(loss).backward()
        if clip_before_unscale:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # wrong: the grads are still scaled
        scaler.unscale_(optimizer)
        if not clip_before_unscale:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return loss

    return ampdoctor.diagnose(model, torch.randn(4, 8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              scaler=torch.amp.GradScaler("cpu"), train_step=train_step)


def test_clipping_before_unscale_is_flagged() -> None:
    report = _diagnose_clipping(clip_before_unscale=True)
    f = next(f for f in report.findings if f.code == "loss-scaling-misuse")
    assert f.phase == "optimizer" and f.severity == "warning"
    assert "scaler.unscale_(optimizer)\ntorch.nn.utils.clip_grad_norm_" in f.fixes[0].snippet
    assert f.evidence["grad_norm_seen"] > 1000  # a norm of grads multiplied by 65536


def test_gradscaler_with_fp16_parameters_is_misuse() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(8, 1)))
    report = ampdoctor.diagnose(model, torch.randn(4, 8), precision="fp16", loss_fn=mse,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                scaler=torch.amp.GradScaler("cpu"))
    f = report.findings[0]
    assert (f.code, f.phase, f.module) == ("loss-scaling-misuse", "optimizer", "fc")
    assert "unscale FP16 gradients" in f.evidence["message"]


def test_unscale_then_clip_is_healthy() -> None:
    report = _diagnose_clipping(clip_before_unscale=False)
    assert "loss-scaling-misuse" not in report.codes() and report.ok


# -- fp8-scale --------------------------------------------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn


class Fp8Proj(nn.Module):
    """Hand-written per-row fp8 quantisation without an amax floor (scale = amax / 448)."""

    def __init__(self, zero: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 16) if zero else torch.randn(4, 16) * 0.1)

    @staticmethod
    def q(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).float() / 448.0
        return x + ((x.float() / scale).to(E4M3).float() * scale - x).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) @ self.q(self.weight).t()


@pytest.mark.parametrize("zero", [True, False])
def test_fp8_zero_amax_scale(zero: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(16, 16), out=Fp8Proj(zero)))
    report = ampdoctor.diagnose(model, torch.randn(3, 16), loss_fn=mse)
    if not zero:
        assert report.ok, report.codes()
        return
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("fp8-scale", "out", "aten.div.Tensor", "forward")
    assert f.evidence["zero_scale_entries"] == 4 and f.evidence["fp8_max"] == 448.0
    assert "clamp(min=1e-12)" in f.fixes[0].snippet


def test_emulated_fp8_reports_per_layer_saturation_and_underflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(16, 32), act=nn.ReLU(), b=nn.Linear(32, 4)))
    with torch.no_grad():
        model.b.weight.zero_()  # zero amax: floored, not NaN
    x = torch.randn(8, 16) * 1e-3
    x[0, 0] = 3000.0  # one outlier: e4m3 scale 448/3000 flushes the 1e-3 values (below 2**-10 after scaling)
    report = ampdoctor.diagnose(model, x, precision="fp8", loss_fn=mse)
    per = {(s["module"], s["role"]): s for s in report.summary["fp8"]}
    assert per[("a", "input")]["underflowed"] == 127 and per[("a", "input")]["nonzero"] == 128
    assert per[("a", "input")]["amax"] == 3000.0
    assert per[("b", "weight")]["amax"] == 0.0 and math.isfinite(per[("b", "weight")]["scale"])
    under = next(f for f in report.findings if f.module == "a" and f.evidence.get("role") == "input")
    assert under.code == "fp8-scale" and under.severity == "warning" and "99% of the nonzero values" in under.title
    zero = next(f for f in report.findings if f.module == "b" and f.evidence.get("role") == "weight")
    assert zero.severity == "info" and zero.evidence["zero_amax_tensors"] == 1
    assert math.isfinite(report.summary["loss_target"][0])


def test_emulated_fp8_healthy_model_has_no_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(16, 32), act=nn.ReLU(), b=nn.Linear(32, 4)))
    report = ampdoctor.diagnose(model, torch.randn(8, 16), precision="fp8", loss_fn=mse)
    assert report.ok
    assert not [f for f in report.findings if f.severity != "info"]
