"""NaN loss right after switching on fp16 AMP -- but the batch itself already contains NaN: a hand-written feature
standardisation divided a constant column by its zero standard deviation.  Not a precision problem.

Real-world failure
    Tabular pipelines standardise features with statistics of the training data,
    ``(x - mean) / std``.  A column that is constant in that data (a counter that is always 0 in this extract,
    a one-hot level that never occurs, a sensor stuck at its default) has ``std == 0`` and every value becomes
    ``0 / 0 = NaN`` (or ``+-inf`` for ``c / 0``).  The NaN loss often shows up together with another change --
    enabling AMP, a new learning rate -- and gets blamed on it; GradScaler then skips every step and halves its
    scale without a word.  fp32 gives the same NaN.
Mechanism
    The first ``nn.Linear`` multiplies the NaN column into every hidden unit (``NaN * w = NaN``), so every output,
    the loss and all gradients are NaN, in every precision.  No operation of the model creates a non-finite
    value: it enters with the input.
Public evidence
    vislearn/FrEIA #121 (ActNorm initialised on a channel with std 0 -> NaN), ml5js/ml5-next-gen #204
    (min-max normalisation of a constant input column -> NaN -> infinite loss), facebookresearch/pytorch_GAN_zoo
    #89 (division by zero in a normalisation when min == max), prs-eth/Marigold #111 (NaN loss caused by NaN in
    the input batch).
Reproduction
    ``TabularClassifier`` (Linear 6 -> 32, ReLU, Linear 32 -> 2) on 8 rows of 6 raw features standardised by
    hand, where feature 4 ("returns in the last 30 days") is 0 for every row -> that column is NaN; cross-entropy
    in fp32, AdamW and ``torch.amp.GradScaler("cpu")``, precision ``"fp16-amp"``.
Known fixes
    guard the standardisation (``std.clamp_min(eps)`` or drop constant columns, e.g. sklearn's
    ``StandardScaler`` leaves zero-variance features unscaled); validate batches (``torch.isfinite(x).all()``)
    in the data pipeline; impute missing values.
EXPECT
    codes ["nonfinite-input"], module "" (no module: the batch), phase "forward".

Run ``python -m ampdoctor.scenarios.nonfinite_input`` to see the failure.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"codes": ["nonfinite-input"], "module": "", "phase": "forward"}

#: Raw feature ranges: age, tenure (months), orders, basket value, returns in the last 30 days, support tickets.
FEATURE_LOW = (18.0, 1.0, 0.0, 5.0, 0.0, 0.0)
FEATURE_HIGH = (80.0, 120.0, 60.0, 400.0, 0.0, 6.0)


class TabularClassifier(nn.Module):
    def __init__(self, num_features: int = 6, width: int = 32, num_classes: int = 2) -> None:
        super().__init__()
        self.hidden = nn.Linear(num_features, width)
        self.out = nn.Linear(width, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(features)))


def standardize(raw: torch.Tensor) -> torch.Tensor:
    """The bug under study: no guard for constant columns (std 0 -> 0 / 0 = NaN)."""
    return (raw - raw.mean(0)) / raw.std(0)


def churn_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TabularClassifier()
    g = torch.Generator().manual_seed(1)
    low, high = torch.tensor(FEATURE_LOW), torch.tensor(FEATURE_HIGH)
    raw = (low + (high - low) * torch.rand(8, len(FEATURE_LOW), generator=g)).round()
    labels = torch.randint(0, 2, (8,), generator=g)
    return {
        "model": model,
        "batch": {"features": standardize(raw)},
        "loss_fn": functools.partial(churn_loss, labels=labels),
        "precision": "fp16-amp",
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "scaler": torch.amp.GradScaler("cpu"),
    }


if __name__ == "__main__":
    spec = make()
    x = spec["batch"]["features"]
    print(f"batch: NaN per feature column {torch.isnan(x).sum(0).tolist()}")
    for name, amp in (("fp32", False), ("fp16-amp", True)):
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = spec["loss_fn"](spec["model"](**spec["batch"]), spec["batch"])
        print(f"{name:8s}: loss {loss.item()}")
        if not amp:
            ok = math.isnan(loss.item()) and bool(torch.isnan(x[:, 4]).all()) and bool(torch.isfinite(x[:, :4]).all())
        else:
            ok = ok and math.isnan(loss.item())
    print("REPRODUCED: NaN already in the input batch (std 0 column) -> NaN loss in every precision" if ok
          else "NOT REPRODUCED")
