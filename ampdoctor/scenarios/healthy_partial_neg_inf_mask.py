"""Healthy control: hand-written self-attention with an additive ``-inf`` key-padding mask, run in fp16, where every
query row keeps at least one real key -- the -inf values are absorbed by softmax; loss and gradients are finite.

Real-world situation
    Encoders written by hand (or ``nn.MultiheadAttention``-style code) mask padded keys with ``float("-inf")``.
    That is exact in every floating dtype, including fp16 and bf16, as long as no row is masked entirely: with
    right padding every query -- the padded ones too -- still sees the real tokens of its sequence.  A diagnosis
    tool sees thousands of -inf values in the scores on every step and must not report them: they never reach
    the loss, a gradient or a parameter.
Mechanism (why nothing is wrong)
    ``scores + bias`` with ``bias`` 0 / -inf gives -inf on padded keys; softmax subtracts a finite row max, so
    ``exp(-inf) = 0`` exactly and the padded keys get probability 0.  Backward of softmax multiplies by those
    probabilities, so the masked positions get gradient 0, not NaN.  Activations are O(1), far from fp16's range
    limits; the classifier loss is computed in fp32.
Reproduction
    ``SentenceClassifier``: token embedding (dim 32), 2 ``PaddedSelfAttention`` layers (4 heads) with residual +
    LayerNorm, masked mean pooling, a linear classifier over 3 classes; 4 right-padded sequences of lengths
    8, 5, 2, 1 (the shortest keeps one real key); cross-entropy in fp32; precision ``"fp16"`` (model and
    floating inputs cast to fp16, no optimizer).
Known fixes
    none needed.  The failing twin is ``fully_masked_row`` (a row with no real key).
EXPECT
    healthy.

Run ``python -m ampdoctor.scenarios.healthy_partial_neg_inf_mask`` to see the clean step.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"healthy": True}

VOCAB_SIZE = 40
DIM = 32
LENGTHS = (8, 5, 2, 1)


class PaddedSelfAttention(nn.Module):
    """Multi-head self-attention taking an additive bias of 0 (keep) / -inf (padded key)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + key_bias     # (B, H, T, T)
        return self.out((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d))


class SentenceClassifier(nn.Module):
    def __init__(self, vocab_size: int = VOCAB_SIZE, dim: int = DIM, num_classes: int = 3) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.layers = nn.ModuleList(PaddedSelfAttention(dim, heads=4) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids)
        keep = attention_mask.bool()
        key_bias = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))[:, None, None, :]
        for attn, norm in zip(self.layers, self.norms):
            x = norm(x + attn(x, key_bias))
        weights = attention_mask.to(x.dtype).unsqueeze(-1)
        pooled = (x * weights).sum(1) / weights.sum(1)
        return self.classifier(pooled)


def classification_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SentenceClassifier()
    g = torch.Generator().manual_seed(1)
    attention_mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    input_ids = torch.randint(1, VOCAB_SIZE, attention_mask.shape, generator=g) * attention_mask   # 0 = pad
    labels = torch.tensor([0, 2, 1, 2])
    return {"model": model, "batch": {"input_ids": input_ids, "attention_mask": attention_mask},
            "loss_fn": functools.partial(classification_loss, labels=labels), "precision": "fp16"}


if __name__ == "__main__":
    spec = make()
    model, batch = copy.deepcopy(spec["model"]).half(), spec["batch"]
    seen: dict[str, Any] = {}

    def on_attention(mod, args, out):
        seen.update(neg_inf_scores=int(torch.isneginf(args[1]).sum()) * mod.heads * args[0].shape[1])

    model.layers[0].register_forward_hook(on_attention)
    loss = spec["loss_fn"](model(**batch), batch)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    nonfinite = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    print(f"fp16: {seen['neg_inf_scores']} scores masked with -inf in layer 0; loss {loss.item():.4f}; "
          f"params without grad {missing}; non-finite grads {nonfinite}")
    ok = math.isfinite(loss.item()) and not missing and not nonfinite and seen["neg_inf_scores"] > 0
    print("HEALTHY: -inf masks with at least one real key per row are absorbed by softmax" if ok else "NOT HEALTHY")
