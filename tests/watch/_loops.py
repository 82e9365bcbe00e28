"""The small model and training loop the watch's fault and robustness tests share (one copy: duplicates D5)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def net(opt_kwargs: dict[str, Any] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 4-8-1 MLP (seed 0) and its AdamW(lr=1e-2)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, **(opt_kwargs or {}))


def loop(m: nn.Module, opt: torch.optim.Optimizer, n: int, *, bad: int | None = None, w: Any = None,
         dtype: torch.dtype = torch.float32) -> list[float]:
    """``n`` plain steps on seeded batches (step ``bad`` gets an inf input); ``w.step(loss)`` when a watch is given."""
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(n):
        x = torch.randn(3, 4, generator=g).to(dtype)
        if i == bad:
            x[0, 0] = math.inf
        opt.zero_grad()
        loss = m(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        if w is not None:
            w.step(loss)
        losses.append(float(loss.detach()))
    return losses
