"""fp8 casts in the user's own code (an fp32 model that quantizes its activations itself).

The checks run on any cast to a float8 dtype, judged by the cast's own input and output (the fp32 reference runs
the same user code, so it casts too). A stale scale saturates (``fp8-scale``), an unscaled tensor beyond the format
max is ``overflow``, a scale far too small flushes the values (``underflow``); each healthy twin computes its scale
from the tensor it casts and stays clean.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.findings._fp8_casts import overflow_threshold

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class FakeQuant(nn.Module):
    """Quantize-dequantize with a straight-through gradient; ``hist`` is the amax the stored scale came from."""

    def __init__(self, dtype: torch.dtype, hist: float | None) -> None:
        super().__init__()
        self.dtype = dtype
        self.fresh = hist is None
        self.register_buffer("scale", torch.tensor(torch.finfo(dtype).max / (hist or 1.0)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scale = torch.finfo(self.dtype).max / h.detach().abs().amax() if self.fresh else self.scale
        deq = (h.detach() * scale).to(self.dtype).to(h.dtype) / scale
        return h + (deq - h.detach())


class Net(nn.Module):
    def __init__(self, quant: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.act_q = quant
        self.fc2 = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(8)  # activations ~10: a scale computed for amax 1 is stale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_q(self.fc1(x)))


def _diagnose(model: nn.Module) -> ampdoctor.Report:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return ampdoctor.diagnose(model, x, precision=None, loss_fn=lambda out, b: out.float().pow(2).mean())


def _amax(model: Net) -> float:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return model.fc1(x).abs().amax().item()


def test_torch_cast_behaviour_the_evidence_states():
    # on this build the e4m3fn cast saturates (inf included), e5m2 overflows to inf: the rule reads the output
    assert torch.tensor([500.0, float("inf")]).to(E4M3).float().tolist() == [448.0, 448.0]
    assert torch.tensor([70000.0]).to(E5M2).float().item() == float("inf")
    assert overflow_threshold("float8_e4m3fn") == 464.0 and overflow_threshold("float8_e5m2") == 61440.0


@pytest.mark.parametrize("dtype,becomes", [(E4M3, "±448 (saturated)"), (E5M2, "inf")])
def test_stale_scale_saturates_the_cast(dtype, becomes):
    torch.manual_seed(0)
    model = Net(FakeQuant(dtype, hist=1.0))
    report = _diagnose(model)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "fp8-scale", "error", "act_q", "aten._to_copy.default", "forward")
    ev, fmax = f.evidence, torch.finfo(dtype).max
    amax = _amax(model)
    assert ev["amax"] == pytest.approx(amax, rel=1e-6) and ev["scale"] == fmax and ev["scale_applied_as"] == "mul"
    assert ev["fitting_scale"] == pytest.approx(fmax / amax, rel=1e-6)
    assert ev["scaled_absmax"] == pytest.approx(amax * fmax, rel=1e-5) and ev["scaled_absmax"] > fmax
    assert ev["n_clipped"] > 0 and ev["out_of_range_becomes"] == becomes
    assert ev["scale_source"]["numel"] == 1 and ev["consumer"]["op"] == "aten._to_copy.default"
    assert f"{fmax / amax:.3g}" in f.explanation


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fresh_scale_twin_is_clean(dtype):
    torch.manual_seed(0)
    report = _diagnose(Net(FakeQuant(dtype, hist=None)))
    assert report.ok and not report.findings, [(f.code, f.module) for f in report.findings]


def test_scale_far_too_small_flushes_the_cast():
    torch.manual_seed(0)
    model = Net(FakeQuant(E4M3, hist=1e7))  # scale 4.48e-5: x * scale ~ 5e-4, below e4m3's 2**-9
    f = _diagnose(model).findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "underflow", "error", "act_q", "aten._to_copy.default", "forward")
    ev = f.evidence
    assert ev["flushed_fraction"] > 0.5 and ev["format_min_subnormal"] == 2.0 ** -9
    assert ev["scale"] == pytest.approx(448 / 1e7)
    assert ev["fitting_scale"] == pytest.approx(448 / _amax(model), rel=1e-6)


class RawCast(nn.Module):
    """Casts its activations to e4m3 with no scale at all."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + (h.detach().to(E4M3).to(h.dtype) - h.detach())


@pytest.mark.parametrize("gain,bad", [(400.0, True), (8.0, False)])
def test_unscaled_cast_beyond_the_max_is_overflow(gain, bad):
    torch.manual_seed(0)
    model = Net(RawCast())
    with torch.no_grad():
        model.fc1.weight.mul_(gain / 8)  # gain 400: activations ~600 > 464; gain 8: ~12, in range
    report = _diagnose(model)
    if not bad:
        assert report.ok and not report.findings
        return
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("overflow", "act_q", "aten._to_copy.default", "forward")
    assert f.evidence["scale"] is None and f.evidence["amax"] > 464
    assert f.evidence["fitting_scale"] == pytest.approx(448 / f.evidence["amax"])


class ScaledMm(nn.Module):
    """A linear layer run as ``torch._scaled_mm`` on e4m3 operands, scales per tensor (stale or fresh)."""

    def __init__(self, fresh: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.25)
        self.fresh = fresh
        self.register_buffer("x_scale", torch.tensor(448.0))  # from an amax of 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = 448.0 / x.abs().amax() if self.fresh else self.x_scale
        ws = 448.0 / self.weight.abs().amax()
        xq, wq = (x * xs).to(E4M3), (self.weight * ws).to(E4M3)
        return torch._scaled_mm(xq, wq.t(), scale_a=(1 / xs).float(), scale_b=(1 / ws).float(),
                                out_dtype=torch.float32)


@pytest.mark.parametrize("fresh", [False, True])
def test_scaled_mm_inputs(fresh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), ScaledMm(fresh))
    with torch.no_grad():
        model[0].weight.mul_(8)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        report = ampdoctor.diagnose(model, x, precision=None)
    if fresh:
        assert report.ok and not report.findings
        return
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("fp8-scale", "1", "aten._to_copy.default", "forward")
    assert f.evidence["consumer"]["op"] == "aten._scaled_mm.default" and f.evidence["scale"] == 448.0
