"""Hidden overflow is still overflow (issue 13 item 5): an inf the target makes and a guard catches.

A clamp to ±65000, ``nan_to_num`` or ``where(isinf(h), 0, h)`` right after a Linear that overflows fp16 leaves
nothing inf downstream; the origin is still the Linear (``overflow``), with the guard in ``caught_by``. The healthy
twin's values fit, the guard never clips, and nothing is reported. T5's own fp16 clamp (it runs only when the hidden
states are fp16) is the real-model case.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampdoctor

GUARDS = {
    "clamp": (lambda h: torch.clamp(h, -65000.0, 65000.0), "aten.clamp.default"),
    "nan_to_num": (lambda h: torch.nan_to_num(h), "aten.nan_to_num.default"),
    "where_isinf": (lambda h: torch.where(torch.isinf(h), torch.zeros_like(h), h), "aten.where.self"),
}


class Block(nn.Module):
    def __init__(self, guard: str, gain: float) -> None:
        super().__init__()
        self.guard = GUARDS[guard][0]
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 4)
        with torch.no_grad():
            self.up.weight.mul_(gain)  # gain 6e4: outputs ~1.4e5 in fp32, beyond fp16's 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.guard(self.up(x))) * 1e-3)


class Net(nn.Module):
    def __init__(self, guard: str, gain: float) -> None:
        super().__init__()
        self.block = Block(guard, gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _diagnose(guard: str, gain: float, precision: str) -> ampdoctor.Report:
    torch.manual_seed(0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return ampdoctor.diagnose(Net(guard, gain), x, precision=precision, loss_fn=lambda o, b: o.float().pow(2).mean())


@pytest.mark.parametrize("precision", ["fp16", "fp16-amp"])
@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_guard_caught_overflow_is_reported_at_the_producer(guard, precision):
    report = _diagnose(guard, 6e4, precision)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "overflow", "error", "block.up", "aten.addmm.default", "forward")
    ev = f.evidence
    assert ev["caught_by"]["op"] == GUARDS[guard][1] and ev["caught_by"]["module"] == "block"
    assert ev["caught_by"]["in_reference"] is True  # the guard runs in fp32 too: only the target's values were inf
    if guard == "clamp":
        assert ev["caught_by"]["bounds"] == [-65000.0, 65000.0]
    assert ev["ref_absmax"] > 65504 and ev["n_inf"] > 0 and ev["ratio_to_max"] > 1
    assert "hidden" in f.explanation


@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_guard_that_never_clips_is_clean(guard):
    report = _diagnose(guard, 10.0, "fp16")
    assert report.ok and not report.findings, [(f.code, f.module) for f in report.findings]


def _t5(gain: float):  # noqa: ANN202
    from transformers import T5Config, T5ForConditionalGeneration

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=2, d_kv=8,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(gain)  # bf16-pretrained magnitudes: ~1e5
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, 32, (2, 8), generator=g),
             "labels": torch.randint(1, 32, (2, 4), generator=g)}
    return model, batch


def test_t5_own_fp16_clamp_hides_the_wo_overflow():
    model, batch = _t5(8e4)
    report = ampdoctor.diagnose(model, batch, precision="fp16")  # .half(): T5Block's fp16 clamp runs
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "overflow", "error", "encoder.block.0.layer.1.DenseReluDense.wo", "aten.mm.default", "forward")
    caught = f.evidence["caught_by"]
    assert caught["module"] == "encoder.block.0" and caught["op"].startswith("aten.clamp")
    assert caught["in_reference"] is False  # the clamp runs only on fp16 hidden states
    assert caught["bound_absmax"] == 64504.0 and f.evidence["ref_absmax"] > 65504


def test_t5_healthy_twin_has_no_overflow():
    model, batch = _t5(1.0)
    report = ampdoctor.diagnose(model, batch, precision="fp16")
    assert "overflow" not in report.codes() and not [f for f in report.findings if f.severity == "error"]
