"""Agreed decisions across data-parallel ranks: ``raise`` and ``skip`` happen on every rank or on none.

Under DDP/FSDP every rank runs the same loop. If rank 1 alone raised, rank 0 would wait forever in the next
gradient all-reduce; if rank 1 alone skipped an update, the replicas' weights would drift apart. So with
``on_anomaly`` ``"raise"`` or ``"skip"`` and a wrapped model in an initialized process group of more than one rank,
each optimizer step ends its check with ONE ``all_reduce`` (MAX) of two integers — "I must raise", "I must
skip" — on a process group of its own (``dist.new_group()``, made once when the watch is entered, so the
user's and DDP's collectives are never interleaved with ours). No agreement, and no collective, otherwise.
Limit: a watch that disabled itself on one rank stops agreeing; the others then wait for the group's timeout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _wrapped(model: nn.Module) -> bool:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return isinstance(model, FullyShardedDataParallel) or type(model).__name__.startswith("FSDP")


class RankAgreement:
    """One tiny collective per optimizer step on a dedicated group; every rank of the job must call :meth:`agree`
    the same number of times (it is called at each optimizer pre-step check)."""

    def __init__(self, group: Any, world_size: int, rank: int, device: torch.device) -> None:
        self.group, self.world_size, self.rank, self.device = group, world_size, rank, device

    @classmethod
    def create(cls, model: nn.Module, on_anomaly: str) -> RankAgreement | None:
        """An agreement for a data-parallel job with ``raise``/``skip``; ``None`` (nothing to agree) otherwise.
        Collective: every rank must create it (``dist.new_group``), which they do when entering the watch."""
        dist = torch.distributed
        if on_anomaly not in ("raise", "skip") or not _wrapped(model):
            return None
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        group = dist.new_group()
        device = torch.device("cpu")
        if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(group, dist.get_world_size(), dist.get_rank(), device)

    def agree(self, must_raise: bool, must_skip: bool) -> tuple[int, int]:
        """The number of ranks that must raise and must skip (a SUM), the same on every rank. One sync."""
        dist = torch.distributed
        t = torch.tensor([int(must_raise), int(must_skip)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        raised, skipped = t.tolist()
        return int(raised), int(skipped)


__all__ = ["RankAgreement"]
