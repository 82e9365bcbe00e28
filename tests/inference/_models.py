"""Tiny decoders built from configs, with a fault that fp16 generation meets only at later positions."""

from __future__ import annotations

import torch

#: prompt length and the first position whose token carries the large channel
PROMPT = 4
SPIKE_FROM = 8


def gpt2(*, spike: bool, overflow: bool, seed: int = 0, n_positions: int = 64):
    """A 2-layer GPT-2 (hidden 32). ``spike``: from position SPIKE_FROM on, the position embedding carries channel
    0 at 50 (other channels ~0.02), so after LayerNorm that channel is ~5.6 at those positions and ~0 before.
    ``overflow``: layer 1's ``mlp.c_fc`` reads channel 0 with weight 20000, so its output reaches ~1.1e5 (> fp16's
    65504) exactly at those positions, and stays ~4e3 elsewhere; the healthy twin keeps the default weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=n_positions, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        tr = model.transformer
        tr.wte.weight[:, 0] = 0.0
        tr.wpe.weight[:, 0] = 0.0
        if spike:
            tr.wpe.weight[SPIKE_FROM:, 0] = 50.0
        if overflow:
            tr.h[1].mlp.c_fc.weight[0, :] = 20000.0  # Conv1D weight is (in, out): row 0 reads channel 0
    return model


def prompt(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 64, (1, PROMPT), generator=g)
