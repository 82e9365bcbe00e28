"""T5 (gated-gelu) models and batches shared by the benchmarks.

Two sizes: ``small`` (d_model 256, 4+4 layers, batch 4, 32 source / 16 target tokens) and ``big`` (d_model 512,
6+6 layers, batch 8, 128/128 tokens). Built from a config (random weights, fixed seed), dropout off, train mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BenchConfig:
    name: str
    d_model: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    d_kv: int
    vocab_size: int
    batch: int
    source_len: int
    target_len: int


CONFIGS: dict[str, BenchConfig] = {
    "small": BenchConfig("small", d_model=256, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4, d_kv=64,
                         vocab_size=1000, batch=4, source_len=32, target_len=16),
    "big": BenchConfig("big", d_model=512, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8, d_kv=64,
                       vocab_size=1000, batch=8, source_len=128, target_len=128),
}


def t5_model(cfg: BenchConfig, seed: int = 0) -> torch.nn.Module:
    """A ``T5ForConditionalGeneration`` (gated-gelu) with random weights, dropout off, in train mode."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_ff=cfg.d_ff, num_layers=cfg.num_layers,
        num_decoder_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads, d_kv=cfg.d_kv,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return T5ForConditionalGeneration(config).train()


def t5_batch(cfg: BenchConfig, seed: int = 1, device: str | torch.device = "cpu") -> dict[str, Any]:
    """``input_ids``/``attention_mask``/``labels`` of the config's shape (token ids from a seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (cfg.batch, cfg.source_len), generator=g)
    labels = torch.randint(1, cfg.vocab_size, (cfg.batch, cfg.target_len), generator=g)
    mask = torch.ones_like(ids)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def build(name: str, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """Model, AdamW optimizer and batch of the named config, on ``device``."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}, expected one of {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    model = t5_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, t5_batch(cfg, device=device)
