"""Healthy control: a padded batch through a BERT cast to fp16 (``model.half()``), eager attention whose additive
padding mask holds ``torch.finfo(torch.float16).min`` -- finite loss and gradients; the pooler is trained.

Real-world situation
    fp16 inference and evaluation of BERT-style encoders (``model.half()``, ``from_pretrained(dtype=torch.float16)``)
    on padded batches.  transformers builds the 4-D additive mask with the *target* dtype's minimum
    (-65504 for fp16; the original BERT used -10000.0 for the same reason): unlike -1e9 it is representable, so
    no constant overflows and every row keeps its real tokens.  A diagnosis must not report the huge negative
    mask values, the masked probabilities that are exactly 0, or the (expected, tiny) fp16 rounding as a fault.
Mechanism (why nothing is wrong)
    ``scores + mask`` adds -65504 to the padded keys; padded rows still attend to their real keys, so softmax's
    max is finite and the padded probabilities are exactly 0.  Even where ``score - 65504`` rounds to -inf
    (score < -16), a partially masked row stays finite.  Hidden states are LayerNorm-ed, the pooler's tanh inputs
    stay below ~1.7 (far from fp16 saturation at 4.5), and the loss (squared error of the pooled sentence vectors
    against fixed targets, computed in fp32) gives weight gradients of 0.02..4 -- inside fp16's normal range,
    no loss scaling needed.  One trap: ``attention.self.key.bias`` has a mathematically zero gradient (softmax
    is shift invariant), so its fp32 (~5e-9) and fp16 (~2e-5) values are both rounding noise.
Reproduction
    ``BertModel`` from a tiny config (hidden 32, 2 layers, ``attn_implementation="eager"`` so the additive
    float mask is used, ``initializer_range=0.1`` -- weights at the scale of a trained encoder; with 0.02 the
    attention is uniform and the query/key gradients sit in fp16's subnormal range), 3 sequences of 8 tokens of
    which two are right-padded (lengths 8, 5, 3), precision ``"fp16"`` (the model and floating inputs cast to
    fp16; no optimizer, so no fp16 master-weight question).
Known fixes
    none needed.
EXPECT
    healthy.

Run ``python -m ampdoctor.scenarios.healthy_bert_fp16_masks`` to see the clean step.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
from transformers import BertConfig, BertModel

EXPECT = {"healthy": True}

VOCAB_SIZE = 100
HIDDEN = 32


def pooled_regression_loss(output: Any, batch: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Sum over features of the squared error of each pooled sentence vector, averaged over sentences (fp32)."""
    return (output.pooler_output.float() - target).pow(2).sum(-1).mean()


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, attn_implementation="eager", initializer_range=0.1)
        model = BertModel(cfg).train()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB_SIZE, (3, 8), generator=g)
    attention_mask = torch.ones(3, 8, dtype=torch.long)
    attention_mask[1, 5:] = 0
    attention_mask[2, 3:] = 0
    input_ids[attention_mask == 0] = 0     # [PAD]
    target = torch.where(torch.randn(3, HIDDEN, generator=g) > 0, 0.5, -0.5)
    return {
        "model": model,
        "batch": {"input_ids": input_ids, "attention_mask": attention_mask},
        "loss_fn": functools.partial(pooled_regression_loss, target=target),
        "precision": "fp16",
    }


if __name__ == "__main__":
    spec = make()
    model = copy.deepcopy(spec["model"]).half()
    seen: dict[str, Any] = {}

    def on_attention(mod, args, kwargs):
        mask = kwargs.get("attention_mask")
        seen.update(mask_dtype=str(mask.dtype), mask_min=mask.min().item())

    model.encoder.layer[0].attention.self.register_forward_pre_hook(on_attention, with_kwargs=True)
    loss = spec["loss_fn"](model(**spec["batch"]), spec["batch"])
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    nonfinite = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    print(f"additive mask {seen['mask_dtype']} min {seen['mask_min']:g}; fp16 loss {loss.item():.4f}; "
          f"params without grad {missing}; non-finite grads {nonfinite}")
    ok = math.isfinite(loss.item()) and not missing and not nonfinite and seen["mask_min"] == -65504.0
    print("HEALTHY: finite loss and gradients in fp16 with finfo(fp16).min padding masks" if ok else "NOT HEALTHY")
