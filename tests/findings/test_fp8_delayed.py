"""fp8 delayed scaling with a stale amax history (issue 13 item 1, multi-step), in the forward and the backward.

The Transformer-Engine recipe: ``scale = fmax / max(amax_history) / 2**margin``, the history updated *after* the
cast, so step ``k`` casts with the amax of steps ``< k``. When the range grows between steps (here: a momentum SGD
update that makes the activations, or the gradients, grow), the stale scale saturates the cast at the step where
the growth outpaces the margin. The finding is ``fp8-scale`` at the quantizing module's cast, at that step, with
the amax the history held, the largest |x| the stale scale represents and the margin that fits. Recognised by
lineage (the scale tensor the cast reads was produced in an earlier step), never by buffer names: the twins keep
the very same buffers with a margin that fits (clean), or compute the scale from the current tensor (clean).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CAST = "aten._to_copy.default"


class DelayedScaling(nn.Module):
    """Quantize-dequantize with a per-tensor scale from an amax history of previous steps (updated after use)."""

    def __init__(self, dtype: torch.dtype = E4M3, margin: int = 0, history: int = 1) -> None:
        super().__init__()
        self.dtype, self.margin = dtype, margin
        self.register_buffer("amax_history", torch.zeros(history))
        self.register_buffer("scale", torch.ones(()))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        q = (x * self.scale).to(self.dtype).to(x.dtype) / self.scale
        with torch.no_grad():
            self.amax_history.copy_(torch.roll(self.amax_history, 1))
            self.amax_history[0] = x.abs().amax()
            self.scale.copy_(torch.finfo(self.dtype).max / self.amax_history.max() / 2 ** self.margin)
        return q


class ActQuant(DelayedScaling):
    """Activations through fp8, straight-through gradient."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + (self.quantize(h.detach()) - h.detach())


class _QuantGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):  # noqa: ANN001, ANN205
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return ctx.owner.quantize(g), None


class GradQuant(DelayedScaling):
    """Identity in the forward; the gradient goes through fp8 in the backward (a custom autograd Function)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _QuantGrad.apply(h, self)


class FreshQuant(nn.Module):
    """Current scaling: the scale is computed from the tensor being cast, every step."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.detach()
        scale = torch.finfo(E4M3).max / x.abs().amax()
        return h + ((x * scale).to(E4M3).to(x.dtype) / scale - x)


class Net(nn.Module):
    def __init__(self, quant: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.q = quant
        self.fc2 = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(8)  # activations ~14

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.q(self.fc1(x)))


def _diagnose(quant: nn.Module, lr: float, steps: int = 3) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Net(quant)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # the update makes the range grow step by step
    return ampdoctor.diagnose(model, x, precision=None, optimizer=opt, steps=steps,
                              loss_fn=lambda out, b: -out.float().pow(2).mean())


def _amax_by_step(dtype: torch.dtype, lr: float, steps: int) -> list[float]:
    """The activations' |max| at each step of the same training, run by hand (what the scale had to cover)."""
    torch.manual_seed(0)
    model = Net(ActQuant(dtype))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        out.append(model.fc1(x).abs().amax().item())
        (-model(x).float().pow(2).mean()).backward()
        opt.step()
    return out


@pytest.mark.parametrize("dtype,becomes", [(E4M3, "±448 (saturated)"), (E5M2, "inf")])
def test_stale_amax_history_saturates_the_forward_cast_at_the_step_it_grows(dtype, becomes):
    report = _diagnose(ActQuant(dtype), lr=0.1)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase, f.step) == ("fp8-scale", "error", "q", CAST, "forward", 2)
    assert not [g for g in report.findings if g.code == "fp8-scale" and g.step < 2]  # steps 0 and 1 still fit
    amax = _amax_by_step(dtype, 0.1, 3)
    fmax = torch.finfo(dtype).max
    ev, d = f.evidence, f.evidence["delayed_scaling"]
    assert ev["out_of_range_becomes"] == becomes and ev["n_clipped"] > 0
    assert ev["amax"] == pytest.approx(amax[2], rel=1e-5)  # the current amax
    assert d["scale_step"] == 1 and d["written_by"] == {"op": "aten.copy_.default", "module": "q",
                                                        "phase": "forward", "step": 1}
    assert d["history_amax"] == pytest.approx(amax[1], rel=1e-5)  # the amax the history held
    assert d["scale_max"] == pytest.approx(amax[1], rel=1e-5)  # fmax / stale scale: the largest |x| it represents
    assert ev["scale"] == pytest.approx(fmax / amax[1], rel=1e-5)
    assert ev["fitting_scale"] == pytest.approx(fmax / amax[2], rel=1e-5)  # the scale that would fit
    assert d["amax_growth"] == pytest.approx(amax[2] / amax[1], rel=1e-4) and d["fitting_margin"] == 2
    assert "delayed scaling: the scale was computed from an older amax" in f.explanation.lower()
    assert f.fixes[0].params == {"margin": 2}


def test_margin_that_covers_the_growth_is_clean():
    report = _diagnose(ActQuant(margin=2), lr=0.1)  # the same buffers and update order, scale / 4
    assert report.ok and "fp8-scale" not in report.codes(), [(f.code, f.step) for f in report.findings]


def test_current_scaling_over_the_same_steps_is_clean():
    report = _diagnose(FreshQuant(), lr=0.1)  # the scale is recomputed each step: never from an earlier step
    assert report.ok and not report.findings, [(f.code, f.step) for f in report.findings]


def test_stale_gradient_scale_saturates_the_backward_cast():
    report = _diagnose(GradQuant(), lr=0.01)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase, f.step) == ("fp8-scale", "error", "q", CAST, "backward", 1)
    d = f.evidence["delayed_scaling"]
    assert d["scale_step"] == 0 and d["written_by"]["phase"] == "backward"
    assert d["history_amax"] == pytest.approx(d["scale_max"], rel=1e-5) and d["amax_growth"] > 464 / 448
    assert f.evidence["amax"] == pytest.approx(d["history_amax"] * d["amax_growth"], rel=1e-5)


def test_gradient_margin_that_covers_the_growth_is_clean():
    report = _diagnose(GradQuant(margin=2), lr=0.01)
    assert report.ok and "fp8-scale" not in report.codes(), [(f.code, f.step) for f in report.findings]


class Plain(nn.Module):
    """Three Linears: under precision "fp8" each runs through ampdoctor's emulated fp8 (delayed scaling, margin 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc2(self.fc1(x)))


def _emulated(lr: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Plain()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return ampdoctor.diagnose(model, x, precision="fp8", optimizer=opt, steps=3,
                              loss_fn=lambda out, b: -out.float().pow(2).mean())


def test_emulated_delayed_scaling_names_the_first_step_that_saturates():
    report = _emulated(0.1)
    by = {(f.module, f.evidence["role"]): f for f in report.findings if f.code == "fp8-scale"}
    f = by[("fc3", "input")]  # amax 8.35 -> 12.8 between steps 0 and 1: the stale scale clips the largest by 56%
    assert (f.severity, f.op, f.phase, f.step) == ("warning", "aten.linear.default", "forward", 1)
    first = f.evidence["first_saturated"]
    assert first["step"] == 1 and first["amax_history"] < first["amax"] and first["saturated"] > 0
    assert f.evidence["clip_relative"] > 0.5 and f.evidence["clip_error_share"] > 0.5
    assert "delayed scaling: the scale was computed from an older amax" in f.explanation
    assert by[("fc3", "grad_output")].phase == "backward"
    assert all(g.step == g.evidence["first_saturated"]["step"] > 0 for g in by.values())
    # fc2's input grows 4% at step 2: one value of 128 clipped by 4%, less error than rounding -- not a warning
    stats = [s for s in report.summary["fp8"] if (s["module"], s["role"]) == ("fc2", "input")]
    assert stats[2]["saturated"] == 1 and stats[2]["amax"] / stats[2]["amax_history"] < 1.05
    assert by.get(("fc2", "input")) is None or by[("fc2", "input")].severity == "info"


def test_emulated_delayed_scaling_with_ranges_that_do_not_grow_is_clean():
    report = _emulated(0.0)  # the same three steps, nothing moves: the history covers every amax
    assert "fp8-scale" not in report.codes(), [(f.code, f.module, f.step) for f in report.findings]
