"""Activation checkpointing under the CUDA-policy emulation: the backward's recompute is emulated as the forward was.

A non-reentrant ``torch.utils.checkpoint`` re-enters the forward's autocast state for its recompute during the
backward. Before the runner kept the emulation on the mode stack for the whole step, that recompute ran under CPU's
native autocast policy (``pow``/``softmax``/``layer_norm`` in the low dtype, where CUDA and the emulated forward use
float32), and torch raised ``CheckpointError`` (saved and recomputed dtypes differ) out of every diagnose.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdoctor
from ampdoctor.precision.emulation import cuda_autocast


class Block(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 64)
        self.out = nn.Linear(64, 32)
        with torch.no_grad():
            self.fc.weight.mul_(scale)  # scale 5e4: |fc| reaches 1.08e5 in fp32, past fp16's 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        return x + self.out(h.pow(2).softmax(-1) * h.tanh())


class Net(nn.Module):
    def __init__(self, scale: float, ckpt: bool) -> None:
        super().__init__()
        self.a, self.b, self.head, self.ckpt = Block(1.0), Block(scale), nn.Linear(32, 1), ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.a, x, use_reentrant=False) if self.ckpt else self.a(x)
        x = checkpoint(self.b, x, use_reentrant=False) if self.ckpt else self.b(x)
        return self.head(x).float().pow(2).mean()


def _diagnose(scale: float, ckpt: bool, precision: str) -> ampdoctor.Report:
    torch.manual_seed(0)
    m = Net(scale, ckpt)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    return ampdoctor.diagnose(m, x, loss_fn=lambda out, batch: out, precision=precision,
                              optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4))


def _first_error(report: ampdoctor.Report) -> tuple[str, str, str, str]:
    f = next(f for f in report.findings if f.severity.value == "error")
    return f.code, f.module, f.op, f.phase.value


@pytest.mark.parametrize("precision", ["fp16-amp", "bf16-amp"])
def test_healthy_checkpointed_model_diagnoses_clean(precision: str) -> None:
    report = _diagnose(1.0, ckpt=True, precision=precision)  # raised DiagnosisError(CheckpointError) before
    assert report.ok, [(f.code, f.module, f.op) for f in report.findings]


def test_overflow_inside_a_checkpointed_block_is_found_as_without_checkpointing() -> None:
    with_ckpt = _diagnose(5e4, ckpt=True, precision="fp16-amp")
    plain = _diagnose(5e4, ckpt=False, precision="fp16-amp")
    code, module, op, phase = _first_error(with_ckpt)
    assert (code, module, phase) == ("overflow", "b.fc", "forward"), with_ckpt.findings[0]
    assert op.startswith("aten.addmm"), op
    assert _first_error(plain) == (code, module, op, phase)


def test_recompute_under_the_scope_follows_the_cuda_policy() -> None:
    """What the runner does, by hand: the recompute's pow runs in fp32 (CUDA policy) as the emulated forward's did,
    so the saved and recomputed tensors agree; without the step-wide scope the recompute follows CPU's policy."""
    torch.manual_seed(0)
    block = Block(1.0)
    x = torch.randn(4, 32, requires_grad=True)

    def step(scoped: bool) -> None:
        scope = cuda_autocast(torch.float16, enabled=False) if scoped else torch.autocast("cpu", enabled=False)
        with scope:
            with cuda_autocast(torch.float16):
                y = checkpoint(block, x, use_reentrant=False)
            y.float().sum().backward()

    step(scoped=True)
    with pytest.raises(Exception, match="(?i)recomputed values"):
        step(scoped=False)
    assert not torch.is_autocast_enabled("cpu")


def test_hf_gpt2_with_gradient_checkpointing_enable_diagnoses() -> None:
    """The user's path: transformers' own ``gradient_checkpointing_enable()`` (non-reentrant) on GPT-2 (LayerNorm and
    softmax in every block: fp32 under the CUDA policy, bf16 under CPU's) raised CheckpointError before."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    m.gradient_checkpointing_enable()
    m.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    report = ampdoctor.diagnose(m, {"input_ids": ids, "labels": ids}, precision="bf16-amp",
                                optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4))
    assert report.ok, [(f.code, f.module, f.op) for f in report.findings]
