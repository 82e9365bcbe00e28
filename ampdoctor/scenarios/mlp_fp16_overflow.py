"""A regression MLP trained in fp32 on raw (unstandardised) sensor readings, run with ``model.half()``: its hidden
Linear produces pre-activations up to 1.75e5, above fp16's 65504 -> inf -> inf - inf = NaN in the head -> NaN loss.

Real-world failure
    Networks trained in fp32 without normalisation layers, on inputs in physical units (rpm in the thousands,
    temperatures in kelvin, pressures in hPa), settle on activations of 1e4..1e5 -- fine in fp32 and bf16.  Cast
    to fp16 for faster inference or fine-tuning (``model.half()``, TensorRT/ONNX fp16 export), the largest hidden
    pre-activations exceed 65504 and become inf; the next layer sums +inf and -inf contributions and returns
    NaN for most samples.  Nothing in the model is wrong in fp32.
Mechanism
    ``hidden`` (Linear 64 -> 64) computes ``h @ W.T + b`` with inputs up to 1.5e4 (after ``input_proj`` and ReLU,
    still finite in fp16) and writes 9% of its outputs above 65504 in magnitude: fp16 stores +-inf.  ReLU keeps
    the +inf; ``head`` multiplies several +inf units by weights of both signs and accumulates
    ``inf + (-inf) = NaN``.  The MSE loss (computed in fp32) is NaN, and so is every gradient.
Public evidence
    NVlabs/tiny-cuda-nn #219 (a half-precision MLP returns NaN), huggingface/transformers #12225 (fp16 NaN loss
    when a feed-forward ``fc2`` output reaches 6.06e4), Blaizzy/mlx-vlm PR #293 (clip activations above 65504
    for fp16), huggingface/transformers #39972 (fp16 overflow in a model trained in higher precision).
Reproduction
    ``SensorRegressor``: ``input_proj`` (Linear 6 -> 64), ReLU, ``hidden`` (Linear 64 -> 64), ReLU, ``head``
    (Linear 64 -> 1); weights at the scale of a model trained on raw inputs (``input_proj`` x6, ``hidden`` x16,
    ``head`` x0.01 of PyTorch's default init, all |w| < 3); 16 rows of 6 raw engine readings (rpm 800..6000,
    coolant 330..380 K, oil pressure 150..450 kPa, manifold pressure 900..1050 hPa, throttle 0..120, intake air
    270..310 K); MSE against the fuel-flow target in fp32; precision ``"fp16"`` (model and inputs cast to fp16;
    every input fits fp16).  fp32 predictions are 47..234 and the loss finite (970).
Known fixes
    standardise the inputs (and retrain), or fold the input scaling into the first layer; run the model in bf16;
    keep ``hidden`` (and what follows) in fp32; rescale the weights of consecutive layers (``W1 / s``,
    ``W2 * s`` keeps a ReLU network's function) so that activations fit fp16.
EXPECT
    codes ["overflow"], module "hidden" (its fp16 addmm writes inf; the first NaN appears in ``head``), phase
    "forward".

Run ``python -m ampdoctor.scenarios.mlp_fp16_overflow`` to see the failure.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"codes": ["overflow"], "module": "hidden", "phase": "forward"}

#: Raw engine readings: rpm, coolant (K), oil pressure (kPa), manifold pressure (hPa), throttle, intake air (K).
FEATURE_LOW = (800.0, 330.0, 150.0, 900.0, 0.0, 270.0)
FEATURE_HIGH = (6000.0, 380.0, 450.0, 1050.0, 120.0, 310.0)
#: Weight scales relative to PyTorch's default init, like a model trained on raw inputs.
WEIGHT_SCALES = {"input_proj": 6.0, "hidden": 16.0, "head": 0.01}


class SensorRegressor(nn.Module):
    def __init__(self, num_features: int = 6, width: int = 64) -> None:
        super().__init__()
        self.input_proj = nn.Linear(num_features, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, readings: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.input_proj(readings))
        h = torch.relu(self.hidden(h))
        return self.head(h).squeeze(-1)


def fuel_flow_loss(pred: torch.Tensor, batch: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target)


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SensorRegressor()
    with torch.no_grad():
        for name, scale in WEIGHT_SCALES.items():
            getattr(model, name).weight.mul_(scale)
    g = torch.Generator().manual_seed(1)
    low, high = torch.tensor(FEATURE_LOW), torch.tensor(FEATURE_HIGH)
    readings = low + (high - low) * torch.rand(16, len(FEATURE_LOW), generator=g)
    target = 60.0 + 0.03 * readings[:, 0] + 20.0 * torch.rand(16, generator=g)    # fuel flow, ~80..260
    return {"model": model, "batch": {"readings": readings},
            "loss_fn": functools.partial(fuel_flow_loss, target=target), "precision": "fp16"}


if __name__ == "__main__":
    spec = make()
    for name, model, dtype in (("fp32", spec["model"], torch.float32),
                               ("fp16", copy.deepcopy(spec["model"]).half(), torch.float16)):
        seen: dict[str, Any] = {}
        model.input_proj.register_forward_hook(
            lambda m, a, o, seen=seen: seen.update(input_proj=o.float().abs().max().item()))
        model.hidden.register_forward_hook(lambda m, a, o, seen=seen: seen.update(
            hidden=o.float().abs().max().item(), hidden_inf=int(torch.isinf(o).sum())))
        batch = {"readings": spec["batch"]["readings"].to(dtype)}
        pred = model(**batch)
        loss = spec["loss_fn"](pred, batch)
        print(f"{name}: input_proj absmax {seen['input_proj']:.4g}, hidden absmax {seen['hidden']:.4g} "
              f"({seen['hidden_inf']} inf), NaN predictions {int(torch.isnan(pred).sum())}/16, loss {loss.item():.4g}")
        if name == "fp32":
            ok = math.isfinite(loss.item()) and seen["hidden"] > 65504
        else:
            ok = ok and math.isnan(loss.item()) and seen["hidden_inf"] > 0 and seen["input_proj"] < 65504
    print("REPRODUCED: fp16 overflow in `hidden` -> inf - inf = NaN in `head` -> NaN loss" if ok else "NOT REPRODUCED")
