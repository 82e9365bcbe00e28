"""A tiny token-classification dataset the HF ``Trainer`` tests train on (seeded, 6 tokens of a 50-token vocabulary)."""

from __future__ import annotations

import torch


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 50, (n, 6), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}
