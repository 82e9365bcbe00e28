"""fp8 (emulated, per-tensor delayed scaling) on a Llama-like block whose MLP has a massive-activation neuron.

One neuron of the gated MLP fires at ~1e4 against a median |x| ~0.07 (what Llama's "super weights" do). Its
per-tensor amax sets the scale of the whole down-projection input: the bulk lands in e4m3's subnormal range and a
third of it flushes to 0. The truth is computed here with a plain quantise-dequantise; the healthy twin (no
outlier) must stay free of warnings, and so must delayed scaling's ordinary small amax growth between steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.precision import make_spec
from ampdoctor.precision.fp8 import Fp8Recipe, fp8_autocast, fp8_disabled


class Block(nn.Module):
    """RMSNorm -> SwiGLU MLP -> residual, Llama's layout; ``outlier`` makes neuron 5 fire at ~1e4."""

    def __init__(self, outlier: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.RMSNorm(32)
        self.gate, self.up = nn.Linear(32, 96, bias=False), nn.Linear(32, 96, bias=False)
        self.down = nn.Linear(96, 32, bias=False)
        self.head = nn.Linear(32, 8, bias=False)
        with torch.no_grad():
            for lin in (self.gate, self.up, self.down, self.head):
                lin.weight.normal_(0, 0.08)
            if outlier:
                self.gate.weight[5].mul_(100.0)
                self.up.weight[5].mul_(100.0)
                self.down.weight[:, 5] = 0.0
                self.down.weight[3, 5] = 0.3     # the massive activation goes to residual channel 3 only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(x)


def _batch() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def _diagnose(outlier: bool) -> ampdoctor.Report:
    model = Block(outlier)
    return ampdoctor.diagnose(model, _batch(), precision="fp8", steps=2,
                              optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                              loss_fn=lambda out, b: out.float().pow(2).mean())


def _truth(outlier: bool) -> tuple[float, float, float]:
    """(amax, median |x| of the nonzero values, fraction of them flushed) of down's input, per-tensor e4m3."""
    m = Block(outlier)
    seen: list[torch.Tensor] = []
    m.down.register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach()))
    m(_batch())
    x = seen[0]
    scale = 448.0 / x.abs().max()
    q = (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale
    nz = x != 0
    return float(x.abs().max()), float(x.abs()[nz].median()), float(((q == 0) & nz).sum() / nz.sum())


def test_outlier_neuron_names_down_proj_input_with_the_precision_it_loses() -> None:
    amax, median, flushed = _truth(True)
    assert amax / median > 1e4 and flushed > 0.1          # the truth: a third of the bulk becomes 0
    report = _diagnose(True)
    warn = [f for f in report.findings if f.severity != "info"]
    assert [(f.code, f.module, f.op, f.phase, f.evidence["role"]) for f in warn] == \
        [("fp8-scale", "down", "aten.linear.default", "forward", "input")]
    ev = warn[0].evidence
    assert abs(ev["amax"] / amax - 1) < 0.05               # the fp8 run's gate/up are quantised: close, not equal
    assert abs(ev["median_abs"] / median - 1) < 0.05 and ev["amax_over_median"] > 1e4
    assert ev["median_bits"] < ev["format_bits"] == 4      # the median sits in e4m3's subnormals
    assert abs(ev["underflowed"] / ev["nonzero"] - flushed) < 0.05
    assert "subnormal range" in warn[0].explanation and "median |x|" in warn[0].explanation
    assert warn[0].fixes[0].id == "keep_fp32" and warn[0].fixes[0].params == {"modules": ["down"]}


def test_healthy_twin_and_small_delayed_scaling_growth_raise_no_warning() -> None:
    report = _diagnose(False)
    assert all(f.severity == "info" for f in report.findings), [(f.module, f.title) for f in report.findings]
    for f in report.findings:   # delayed scaling clips a value or two by a few percent: less than rounding
        assert f.evidence.get("clip_error_share", 0.0) < 0.5 and not f.fixes


def test_keeping_the_layer_out_of_fp8_is_the_verified_fix() -> None:
    model = Block(True)
    spec = make_spec(model, _batch(), precision="fp8", steps=2,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                     loss_fn=lambda out, b: out.float().pow(2).mean())
    report = ampdoctor.diagnose_and_fix(spec, steps=4, until_verified=True)
    down = next(f for f in report.findings if f.module == "down")
    keep = next(p for p in down.fixes if p.id == "keep_fp32")
    assert keep.verified and keep.params["modules"] == ["down"], keep.verification
    result = ampdoctor.fix(model, report)
    assert "fp8_autocast(enabled=False)" in result.snippet
    with fp8_autocast(result.model) as fp8:       # the fixed model's down projection is no longer quantised
        result.model(_batch())
    assert {t.module for t in fp8.stats().tensors} == {"gate", "up", "head"}


def test_fp8_disabled_runs_the_block_unquantised_and_records_nothing() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with fp8_autocast(lin, Fp8Recipe(scaling="dynamic")) as fp8:
        quantised = lin(x)
        with fp8_disabled():
            plain = lin(x)
            plain.sum().backward()
    assert torch.equal(plain, F.linear(x, lin.weight, lin.bias)) and not torch.equal(quantised, plain)
    assert [t.role for t in fp8.stats().tensors] == ["input", "weight"]   # the disabled call left no record
