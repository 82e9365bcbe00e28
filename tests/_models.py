"""Tiny failing models (and their healthy twins) that tests in several areas build on: one definition each.

* :class:`Classifier` — ``log(softmax(z))`` of a confident classifier in fp16: softmax flushes the smallest
  probabilities (~1e-10) to 0, log(0) = -inf; ``fused=True`` is the ``log_softmax`` twin.
* :class:`RMSNet` — ``y / sqrt(mean(y*y) + eps)`` on rows that are zero (padding): an eps of 1e-10 is 0 in fp16,
  so 0/0; eps = 1e-5 is the healthy twin.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyLinear(nn.Module):
    """One ``fc`` layer, 4 -> 2: the smallest model a diagnosis runs (bad-input tests build on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Scorer(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 10)
        self.fused = fused

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.proj(h)
        return torch.log_softmax(z, -1) if self.fused else torch.log(torch.softmax(z, -1))


class Classifier(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.scorer = Scorer(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer(torch.relu(self.fc(x)))


def confident_classifier(fused: bool = False) -> tuple[Classifier, torch.Tensor, torch.Tensor]:
    """``(model, x, labels)``, seeded: the scorer's weights scaled so the smallest probabilities are ~1e-10."""
    torch.manual_seed(0)
    model = Classifier(fused)
    with torch.no_grad():
        model.scorer.proj.weight.mul_(40.0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return model, x, y


class PaddedRMS(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) * (torch.arange(x.shape[1]) % 4 != 0).to(x.dtype).unsqueeze(-1)  # padded rows are 0
        return y / torch.sqrt((y * y).mean(-1, keepdim=True) + self.eps)


class RMSNet(nn.Module):
    """:class:`PaddedRMS` (module ``block``) and a head; ``mean=True`` reduces the output to a scalar loss."""

    def __init__(self, eps: float, mean: bool = False) -> None:
        super().__init__()
        self.block = PaddedRMS(eps)
        self.out = nn.Linear(8, 1)
        self.mean = mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.block(x))
        return y.mean() if self.mean else y
