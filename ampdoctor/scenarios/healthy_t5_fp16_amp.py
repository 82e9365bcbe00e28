"""Healthy control: the same tiny T5 v1.1 as ``t5_fp16_amp_ff_overflow`` with its initial (unscaled) weights,
trained one step under fp16 AMP with a GradScaler -- finite loss, finite gradients, no skipped step.

Real-world situation
    Most fp16 AMP fine-tuning runs of small T5 models are fine: activations stay far below fp16's 65504 and
    GradScaler's first scale (65536) does not overflow the scaled gradients.  A diagnosis tool must say so,
    and must not be fooled by the non-finite values a healthy T5 computes on purpose.
Mechanism (why nothing is wrong)
    Under CPU autocast the Linear layers run in fp16 with outputs of a few units (``wo`` absmax ~1); the
    residual stream and the layer norms stay fp32; cross-entropy runs in fp32.  The relative-position bucketing
    of every attention layer with a position bias computes ``log(0) = -inf`` for the zero offset and discards it
    with ``torch.where`` -- a benign -inf whose lineage never reaches the loss.
Reproduction
    ``tiny_t5()`` and ``make_batch()`` of ``t5_fp16_amp_ff_overflow`` without the feed-forward scaling, AdamW and
    ``torch.amp.GradScaler("cpu")``, precision ``"fp16-amp"``.  Loss ~4.6 (ln 64 = 4.16); every parameter gets a
    finite gradient; the scaler keeps its scale.
Known fixes
    none needed.
EXPECT
    healthy.

Run ``python -m ampdoctor.scenarios.healthy_t5_fp16_amp`` to see the clean step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampdoctor.scenarios.t5_fp16_amp_ff_overflow import make_batch, tiny_t5

EXPECT = {"healthy": True}


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_t5()
    return {
        "model": model,
        "batch": make_batch(),
        "precision": "fp16-amp",
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
        "scaler": torch.amp.GradScaler("cpu"),
    }


if __name__ == "__main__":
    spec = make()
    model, batch, opt, scaler = spec["model"], spec["batch"], spec["optimizer"], spec["scaler"]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    nonfinite = [n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    scaler.step(opt)
    scaler.update()
    print(f"fp16-amp loss {loss.item():.4f}; params without grad {missing}; non-finite grads {nonfinite}; "
          f"scale {scaler.get_scale():g}")
    ok = math.isfinite(loss.item()) and not missing and not nonfinite and scaler.get_scale() == 65536.0
    print("HEALTHY: finite loss and gradients, step taken" if ok else "NOT HEALTHY")
