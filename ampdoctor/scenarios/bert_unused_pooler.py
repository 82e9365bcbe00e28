"""BERT fine-tuned on a token-level loss under fp16 AMP: the pooler is computed but never reaches the loss, so
``pooler.dense`` gets no gradient (``grad is None``) on every step.

Real-world failure
    Token classification, sentence-embedding (SimCSE-style) and distillation setups load ``BertModel`` (which
    builds a pooler by default) and build the loss from ``last_hidden_state`` only.  ``pooler.dense`` runs in the
    forward but is not in the loss's autograd graph, so its ``.grad`` stays ``None``.  What happens next depends
    on the training stack: ``DistributedDataParallel`` (``find_unused_parameters=False``) raises "Expected to
    have finished reduction in the prior iteration" on the second step; fp16 master-weight optimizers that
    flatten every gradient into one buffer (apex ``FP16_Optimizer`` / ``FusedAdam``, older fairseq and
    ColossalAI fp16 optimizers) crash with ``'NoneType' object has no attribute ...``; ``torch.optim`` and
    ``GradScaler`` skip the parameter silently, so the run "works" while carrying dead weights, optimizer state
    and wasted compute.
Mechanism
    Autograd only populates ``.grad`` for leaves reached backwards from the loss.  The pooler output
    ``tanh(dense(h[:, 0]))`` is returned in ``pooler_output`` and dropped by the loss, so ``AccumulateGrad`` is
    never executed for ``pooler.dense.weight`` / ``.bias``.  The failure is independent of the dtype.
Public evidence
    NVIDIA/apex #131 (BERT fine-tuned from an inner layer: ``FP16_Optimizer`` fails flattening a ``None``
    grad); huggingface/sentence-transformers #1454 (DDP fails because of the unused pooling layer);
    allenai/allennlp #5682 (transformer classifier under DDP, unused pooler); princeton-nlp/SimCSE #109 (the
    pooler is not trained); openai/jukebox #252 (fp16 optimizer and unused layers); hpcaitech/ColossalAI PR #432
    (fp16 optimizer ``None`` grad bug); pytorch/pytorch #57473.
Reproduction
    ``BertModel`` from a tiny config (hidden 32, 2 layers, with the default pooler), a padded batch of 3
    sequences, a token-level distillation loss (MSE of ``last_hidden_state`` against a fixed teacher embedding of
    each real token), AdamW and ``torch.amp.GradScaler("cpu")``.  Precision ``"fp16-amp"``: the cause is
    dtype-independent, but the scenario is the fp16 training run in which the crash (or the silent skip) is
    met; the rest of the step is numerically healthy (finite loss and gradients, no skipped step), so the
    unused parameters are the only finding.
Known fixes
    ``BertModel(config, add_pooling_layer=False)`` (or ``AutoModel.from_pretrained(..., add_pooling_layer=False)``);
    leave the pooler parameters out of the optimizer (``requires_grad_(False)``); under DDP,
    ``find_unused_parameters=True`` as a last resort (it costs a graph traversal per step).
EXPECT
    codes ["unused-parameters"], module "pooler.dense" (owner of the parameters whose grad is None after
    backward), phase "backward".

Run ``python -m ampdoctor.scenarios.bert_unused_pooler`` to see the failure.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel

EXPECT = {"codes": ["unused-parameters"], "module": "pooler.dense", "phase": "backward"}

VOCAB_SIZE = 100
HIDDEN = 32


def token_distillation_loss(output: Any, batch: dict[str, torch.Tensor], teacher: torch.Tensor) -> torch.Tensor:
    """MSE between each real token's hidden state and the teacher's embedding of that token (fp32)."""
    real = batch["attention_mask"].bool()
    student = output.last_hidden_state[real].float()
    return F.mse_loss(student, teacher[batch["input_ids"][real]])


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        model = BertModel(cfg).train()     # add_pooling_layer=True is the default
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(VOCAB_SIZE, HIDDEN, generator=g)
    input_ids = torch.randint(1, VOCAB_SIZE, (3, 10), generator=g)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0
    input_ids[attention_mask == 0] = 0     # [PAD]
    return {
        "model": model,
        "batch": {"input_ids": input_ids, "attention_mask": attention_mask},
        "loss_fn": functools.partial(token_distillation_loss, teacher=teacher),
        "precision": "fp16-amp",
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
        "scaler": torch.amp.GradScaler("cpu"),
    }


if __name__ == "__main__":
    spec = make()
    model, batch, opt, scaler = spec["model"], spec["batch"], spec["optimizer"], spec["scaler"]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = spec["loss_fn"](model(**batch), batch)
    scaler.scale(loss).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    print(f"fp16-amp loss {loss.item():.4f}; parameters with grad None after backward: {no_grad}")
    try:   # what a flattening fp16 master-weight optimizer does with the grads
        torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        flat = "flattened"
    except AttributeError as e:
        flat = f"AttributeError: {e}"
    print(f"flattening all grads into one fp32 master buffer: {flat}")
    scaler.step(opt)
    scaler.update()
    print(f"torch AdamW + GradScaler: step taken, scale {scaler.get_scale():g} (pooler skipped silently)")
    ok = no_grad == ["pooler.dense.weight", "pooler.dense.bias"] and flat.startswith("AttributeError")
    print("REPRODUCED: unused pooler -> grad None -> flattening fp16 optimizers crash" if ok else "NOT REPRODUCED")
