"""A causal self-attention that masks future positions with ``scores.masked_fill(mask == 0, -1e9)``, run in fp16:
torch refuses to write -1e9 into an fp16 tensor and the forward raises "value cannot be converted to type
c10::Half without overflow".

Real-world failure
    The "Annotated Transformer" idiom ``scores.masked_fill(mask == 0, -1e9)`` (also -1e10, ``-1e30``,
    ``float(2**30)``, ``-torch.finfo(torch.float32).max``) is copied into countless models trained in fp32.
    The first run with ``model.half()``, apex O2/O3 or a framework's "16-true" precision stops in the first
    forward: fp16's largest magnitude is 65504, and ``masked_fill`` checks that its Python scalar fits the
    tensor's dtype.  fp16 autocast fails the same way: the ``q @ k`` matmul returns fp16 scores.
Mechanism
    ``aten.masked_fill.Scalar`` converts the fill value to the tensor dtype with an overflow check; -1e9 is
    outside fp16's range, so it raises ``RuntimeError`` before writing anything.  Arithmetic with the same
    constant (``scores + (1 - mask) * -1e9``) does not check and stores -inf silently instead -- see
    ``fully_masked_row``.
Public evidence
    NVIDIA/apex #1052 (``masked_fill(~mask, -1e9)`` -> "value cannot be converted to type at::Half without
    overflow: -1e+09"), NVIDIA/apex #1105 (-1e10 in an attention mask under mixed precision),
    bentrevett/pytorch-seq2seq #191 (``masked_fill(mask == 0, -1e10)`` on 16-bit), QwenLM/Qwen #32
    (``float(2**30)`` written into fp16 logits), pytorch/pytorch #6292 (overflow checks of half tensors).
Reproduction
    ``TinyCausalLM``: token + position embeddings (dim 32), one pre-norm block whose ``attn`` is a hand-written
    causal self-attention with the -1e9 ``masked_fill``, an MLP, a final LayerNorm and an LM head; 2 sequences of
    12 tokens, next-token cross-entropy in fp32; precision ``"fp16"`` (model cast with ``.half()``).  fp32 runs
    and gives a finite loss (3.88, ln 48 = 3.87).
Known fixes
    a dtype-aware fill value: ``torch.finfo(scores.dtype).min`` (finite, so fully masked rows stay finite too),
    or ``float("-inf")`` when no row can be fully masked; or ``F.scaled_dot_product_attention(...,
    is_causal=True)``; never hard-code a constant that only fits fp32.
EXPECT
    codes ["constant-out-of-range"], module "blocks.0.attn" (its forward calls ``masked_fill`` with -1e9 on fp16
    scores), phase "forward".

Run ``python -m ampdoctor.scenarios.mask_constant_fp16`` to see the failure.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"codes": ["constant-out-of-range"], "module": "blocks.0.attn", "phase": "forward"}

VOCAB_SIZE = 48
DIM = 32
CONTEXT = 12


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(self.causal[:t, :t] == 0, -1e9)
        return self.proj((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size: int = VOCAB_SIZE, dim: int = DIM, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([Block(dim, heads=4, context=context)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyCausalLM()
        with torch.no_grad():      # GPT-2-style init: token/position embeddings and projections std 0.02
            for p in model.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, VOCAB_SIZE, (2, CONTEXT), generator=g)}
    return {"model": model, "batch": batch, "loss_fn": next_token_loss, "precision": "fp16"}


if __name__ == "__main__":
    spec = make()
    batch = spec["batch"]
    loss32 = spec["loss_fn"](spec["model"](**batch), batch)
    print(f"fp32: loss {loss32.item():.4f}")
    try:
        spec["loss_fn"](copy.deepcopy(spec["model"]).half()(**batch), batch)
        err = ""
    except RuntimeError as e:
        err = str(e)
    print(f"fp16: RuntimeError: {err}")
    ok = math.isfinite(loss32.item()) and "cannot be converted to type c10::Half without overflow" in err
    print("REPRODUCED: masked_fill(-1e9) on fp16 scores raises" if ok else "NOT REPRODUCED")
