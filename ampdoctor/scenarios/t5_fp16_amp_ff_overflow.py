"""T5 v1.1 fine-tuned with fp16 AMP: the feed-forward output projection ``wo`` overflows to inf under autocast, and
the T5 block's fp16 clamp never fires because the residual stream is fp32 -> NaN loss from the first step.

Real-world failure
    T5 v1.1, mT5, Flan-T5 and t5-large were pretrained in bf16.  Their feed-forward blocks produce outputs of
    ~1e5 (the residual stream of these checkpoints carries such values), which bf16 (max 3.4e38) holds and fp16
    (max 65504) does not.  With ``Trainer(fp16=True)``, Lightning ``precision="16-mixed"`` or a hand-written
    ``torch.autocast(dtype=torch.float16)`` loop, the loss is NaN from the first steps and ``GradScaler`` silently
    skips every optimizer step while halving its scale.
Mechanism
    Autocast runs every ``nn.Linear`` as an fp16 matmul, including ``DenseReluDense.wo``: the model class lists
    ``_keep_in_fp32_modules = ["wo"]``, but that list only affects how ``from_pretrained(dtype=torch.float16)``
    loads weights -- autocast ignores it.  ``wo``'s matmul gets finite fp16 operands (inputs |x| <= ~360,
    weights |w| <= ~340) and writes outputs of ~1.2e5: fp16 stores inf.  ``T5Block`` clamps inf only under
    ``if hidden_states.dtype == torch.float16``; with fp32 master weights the residual add
    ``fp32 hidden + fp16 wo output`` promotes to fp32, so the guard is false and the inf reaches the next
    ``T5LayerNorm``: variance inf, rsqrt(inf) = 0, inf * 0 = NaN -> NaN logits -> NaN loss.  Note the benign -inf
    that T5 computes on every step: the relative-position bucketing takes ``log(0)`` for the zero offset and
    discards it with ``torch.where`` -- not the cause.
Public evidence
    huggingface/transformers #23918 (FP-16 training producing NaNs on t5-large / flan-t5-xl, Lightning
    ``precision="16"``), #14189 (T5 v1.1 loss NaN with fp16, native AMP and apex alike), #11461 and #10830
    (t5-large fp16 NaN loss), PR #10956 (``autocast(enabled=False)`` around ``T5LayerFF``; the "T5 fp16 surgery"
    weight rescaling in its thread); declare-lab/flan-alpaca #19 (NaN with "16-mixed": "the T5 model was
    pretrained on bf16").
Reproduction
    ``T5ForConditionalGeneration`` built from a tiny T5 v1.1 config (gated-gelu, d_model 32, d_ff 64, 2 encoder +
    1 decoder layers, untied lm_head, 8 relative-attention buckets over max distance 16 so both the exact and the
    logarithmic bucket branches run).  Block 0's feed-forward weights are scaled like a bf16-pretrained checkpoint
    (``wi_0`` x4, ``wi_1`` x16, ``wo`` x800): ``wi_0`` outputs stay below 15 (gelu_new's ``pow(x, 3)`` is finite
    in fp16), the gated product below ~360, the weights below ~340, while ``wo`` outputs reach 1.2e5 in fp32.
    One training step with labels, AdamW and ``torch.amp.GradScaler("cpu")``, precision ``"fp16-amp"``.
    bf16 autocast and fp32 give a finite loss (4.87).
Known fixes
    train in bf16 (``bf16=True``); run ``T5LayerFF`` (or at least ``wo``) with autocast disabled in fp32
    (PR #10956); clamp the feed-forward output regardless of dtype; for fp16 inference, scale the FF weights
    down ("T5 fp16 surgery").
EXPECT
    codes ["overflow", "must-stay-fp32"], module "encoder.block.0.layer.1.DenseReluDense.wo" (the autocast fp16
    matmul whose output is inf; the first NaN appears later, in encoder.block.1.layer.0.layer_norm), phase
    "forward".

Run ``python -m ampdoctor.scenarios.t5_fp16_amp_ff_overflow`` to see the failure.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import T5Config, T5ForConditionalGeneration

EXPECT = {
    "codes": ["overflow", "must-stay-fp32"],
    "module": "encoder.block.0.layer.1.DenseReluDense.wo",
    "phase": "forward",
}

VOCAB_SIZE = 64
#: Block-0 feed-forward weight scales that give bf16-pretrained magnitudes (wo output ~1.2e5 in fp32).
FF_SCALES = {"wi_0": 4.0, "wi_1": 16.0, "wo": 800.0}


def tiny_t5() -> T5ForConditionalGeneration:
    """A tiny T5 v1.1-style model in train mode (call under a fixed seed).

    The untied ``lm_head`` is rescaled to std ``d_model ** -0.5`` so the logits have the scale of a trained
    checkpoint (loss ~ln(vocab)); with transformers' default std 1.0 the scaled fp16 gradients of a healthy model
    already overflow at GradScaler's initial scale 65536.
    """
    cfg = T5Config(
        vocab_size=VOCAB_SIZE,
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        num_decoder_layers=1,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(cfg.d_model**-0.5)
    return model.train()


def make_batch() -> dict[str, torch.Tensor]:
    """Two source sequences of 12 tokens and 6 target tokens (no padding, token 0 is the pad/start token)."""
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(1, VOCAB_SIZE, (2, 12), generator=g),
        "labels": torch.randint(1, VOCAB_SIZE, (2, 6), generator=g),
    }


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_t5()
    ff = model.encoder.block[0].layer[1].DenseReluDense
    with torch.no_grad():
        for name, scale in FF_SCALES.items():
            getattr(ff, name).weight.mul_(scale)
    return {
        "model": model,
        "batch": make_batch(),
        "precision": "fp16-amp",
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
        "scaler": torch.amp.GradScaler("cpu"),
    }


def _probe(model: T5ForConditionalGeneration, batch: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict:
    """Loss and block-0 facts of one forward (autocast to ``dtype``, or fp32 when ``None``)."""
    rec: dict[str, Any] = {}

    def on_wo(mod, args, out):
        rec.update(wo_dtype=str(out.dtype), wo_absmax=out.detach().float().abs().max().item())

    def on_block0(mod, args, out):
        rec.update(block0_dtype=str(out[0].dtype), block0_inf=bool(torch.isinf(out[0]).any()))

    handles = [
        model.encoder.block[0].layer[1].DenseReluDense.wo.register_forward_hook(on_wo),
        model.encoder.block[0].register_forward_hook(on_block0),
    ]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
            rec["loss"] = model(**batch).loss.item()
    finally:
        for h in handles:
            h.remove()
    return rec


if __name__ == "__main__":
    spec = make()
    model, batch = spec["model"], spec["batch"]
    runs = {name: _probe(model, batch, dt) for name, dt in (("fp32", None), ("fp16-amp", torch.float16),
                                                             ("bf16-amp", torch.bfloat16))}
    for name, rec in runs.items():
        print(f"{name:9s}: wo output {rec['wo_dtype']:14s} absmax {rec['wo_absmax']:.4g}; block-0 output "
              f"{rec['block0_dtype']} (inf: {rec['block0_inf']}); loss {rec['loss']:.4f}")
    opt, scaler = spec["optimizer"], spec["scaler"]
    before = model.lm_head.weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped = torch.equal(before, model.lm_head.weight)
    print(f"GradScaler: step skipped={skipped}, scale 65536 -> {scaler.get_scale():g}")
    r16 = runs["fp16-amp"]
    ok = (math.isnan(r16["loss"]) and math.isinf(r16["wo_absmax"]) and r16["block0_dtype"] == "torch.float32"
          and math.isfinite(runs["bf16-amp"]["loss"]) and math.isfinite(runs["fp32"]["loss"]) and skipped)
    print("REPRODUCED: fp16 autocast wo overflow, fp32 residual bypasses the T5 clamp -> NaN loss" if ok
          else "NOT REPRODUCED")
