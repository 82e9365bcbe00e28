"""Rank awareness of a watch under DDP/FSDP: which rank saw the first non-finite value, and agreed decisions.

Under data parallelism every rank runs the same loop and DDP's gradient all-reduce hands one rank's inf/NaN
gradients to every rank, so each rank alone cannot tell whether it *made* them or *received* them. A watch on a
wrapped model (DDP/FSDP) in a process group of 2+ ranks therefore ends each optimizer step's check with ONE
``all_reduce`` (SUM) of ``2 + 2 * world_size`` int64 on a process group of its own (``dist.new_group()``, made once
when the watch is entered — every rank must enter it —, so the user's and DDP's collectives are never interleaved
with ours):

* ``[0]``, ``[1]``: "I must raise", "I must skip" (``on_anomaly`` ``"raise"``/``"skip"``);
* ``[2 + 2r]``: ``4 * (1 + step) + kind`` for rank ``r``'s own non-finite value since the last agreement (kind 1:
  its local loss was inf/NaN; 2: its in-process replay of non-finite gradients located an origin), 0 when none;
* ``[3 + 2r]``: 1 + the step at which rank ``r``'s gradients held inf/NaN (made or received), 0 when none.

Each rank writes only its own slots; the sum gives every rank the same table. Cost: with ``"warn"``/``"replay"``
the all-reduce is launched asynchronously (``async_op=True``) and waited for at the next step's check, so it is off
the critical path (nothing is read back for it until then); with ``"raise"``/``"skip"`` it is waited for at once
(the decision precedes the update). Only when the table shows a rank's own non-finite value do the ranks exchange
the details (the kind, and the module/op/code the replay located) with one ``all_gather_object`` — at most
:data:`MAX_GATHERS` times per run, decided from the agreed table so every rank calls it alike. Nothing else.

GradScaler-skipped steps reach no optimizer hook (DDP's all-reduced gradients make GradScaler skip the same steps
on every rank): after them, at the first training forward of the root module (which every rank runs), the tracker
reads the skipped steps' pending values, handles them (a replay may locate the origin) and exchanges the table
once, blocking, with the details (:meth:`RankAgreement.agree` ``blocking=True``): a collapse that skips to the end
of the run would otherwise never take its table in. Healthy steps get no extra collective; a skipped step gets one
host read and one collective (it had none), so the watch stays at one per step.

What the collective cannot see: anomalies seen after the last forward are not exchanged (the watch issues no
collective at exit, where ranks may be leaving on an exception). A watch that disabled itself on one rank stops
agreeing; the others then wait for the group's timeout. ``ranks=False`` turns all of this off (each rank reports alone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger("ampdoctor.watch")

#: detail exchanges (``all_gather_object``) per run at most; the table itself is exchanged every step
MAX_GATHERS = 8
#: agreed events kept for the report (memory stays flat)
MAX_EVENTS = 64
#: the kinds of a rank's own non-finite value, as coded in the exchanged table
_KINDS = ("", "nonfinite-loss", "nonfinite-grads")


def is_sharded(model: nn.Module) -> bool:
    """An FSDP model (FSDP1 wrapper, or ``fully_shard`` on it or its submodules): its forward and its state_dict
    issue collectives, so one rank alone must never run them (no in-process replay, no reproducer)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    if isinstance(model, FullyShardedDataParallel) or type(model).__name__.startswith("FSDP"):
        return True
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())   # fully_shard on submodules only


def _wrapped(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel) or is_sharded(model)


@dataclass(frozen=True)
class RankEvent:
    """What one rank saw at one step, as every rank was told: ``local`` when the rank made the non-finite value
    itself (its loss, or its replay located an origin), else its gradients held inf/NaN (made or received)."""

    step: int
    rank: int
    local: bool
    kind: str = ""
    code: str = ""
    module: str = ""
    op: str = ""
    phase: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "local": self.local, "kind": self.kind, "code": self.code,
                "module": self.module, "op": self.op, "phase": self.phase}


@dataclass
class _Local:
    """This rank's events since the last agreement."""

    own_step: int | None = None
    grads_step: int | None = None
    detail: dict[str, str] = field(default_factory=dict)


class RankAgreement:
    """The per-step table exchange; every rank of the job must call :meth:`agree` the same number of times (it is
    called at each optimizer pre-step check)."""

    def __init__(self, group: Any, world_size: int, rank: int, device: torch.device, blocking: bool) -> None:
        self.group, self.world_size, self.rank, self.device = group, world_size, rank, device
        self.blocking = blocking
        self.events: list[RankEvent] = []
        self.origin: RankEvent | None = None
        self.own_counts = [0] * world_size
        self.grads_counts = [0] * world_size
        self.exchanges = 0
        self.gathers = 0
        self._local = _Local()
        self._pending: tuple[torch.Tensor, Any, dict[str, str]] | None = None

    @classmethod
    def create(cls, model: nn.Module, on_anomaly: str, enabled: bool = True) -> RankAgreement | None:
        """The agreement of a data-parallel job; ``None`` (nothing exchanged) outside one or with ``enabled``
        false. Collective: every rank must create it (``dist.new_group``), which they do when entering the watch."""
        dist = torch.distributed
        if not enabled or not _wrapped(model):
            return None
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        group = dist.new_group()
        device = torch.device("cpu")
        if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(group, dist.get_world_size(), dist.get_rank(), device, on_anomaly in ("raise", "skip"))

    # ------------------------------------------------------------------ what this rank saw
    def note_own(self, step: int, detail: dict[str, str]) -> None:
        """This rank made a non-finite value at ``step`` (its loss; its replay located ``detail``)."""
        loc = self._local
        if loc.own_step is None or step < loc.own_step:
            loc.own_step = step
        if detail.get("code") or not loc.detail:
            loc.detail = {**loc.detail, **detail}

    def note_grads(self, step: int) -> None:
        """This rank's gradients held inf/NaN at ``step`` (after DDP's all-reduce: made here or received)."""
        loc = self._local
        if loc.grads_step is None or step < loc.grads_step:
            loc.grads_step = step

    # ------------------------------------------------------------------ the exchange
    def agree(self, must_raise: bool, must_skip: bool, blocking: bool | None = None) -> tuple[int, int]:
        """The number of ranks that must raise and must skip, the same on every rank (0, 0 without blocking
        decisions); resolves the previous step's table first. ``blocking`` (default: the watch's decisions need
        it) waits for the table at once and takes in the details: the exchange after GradScaler-skipped steps,
        whose table the next agreement may never come to take in (a collapse runs to the end skipping)."""
        dist = torch.distributed
        self._resolve(gather=True)
        loc, self._local = self._local, _Local()
        t = torch.zeros(2 + 2 * self.world_size, dtype=torch.int64)
        t[0], t[1] = int(must_raise), int(must_skip)
        kind = _KINDS.index(loc.detail.get("kind", "")) if loc.detail.get("kind", "") in _KINDS else 0
        t[2 + 2 * self.rank] = 0 if loc.own_step is None else 4 * (loc.own_step + 1) + kind
        t[3 + 2 * self.rank] = 0 if loc.grads_step is None else loc.grads_step + 1
        t = t.to(self.device)
        self.exchanges += 1
        if not (self.blocking if blocking is None else blocking):
            work = dist.all_reduce(t, group=self.group, async_op=True)
            self._pending = (t, work, loc.detail)
            return 0, 0
        dist.all_reduce(t, group=self.group)
        self._pending = (t, None, loc.detail)
        values = t.tolist()
        self._resolve(gather=True, values=values)
        return int(values[0]), int(values[1])

    def finish(self) -> None:
        """Take in the last exchanged table (a wait on a collective every rank issued; no new collective)."""
        self._resolve(gather=False)

    def _resolve(self, *, gather: bool, values: list[int] | None = None) -> None:
        if self._pending is None:
            return
        t, work, detail = self._pending
        self._pending = None
        if values is None:
            if work is not None:
                work.wait()
            values = t.tolist()
        own = [values[2 + 2 * r] for r in range(self.world_size)]
        grads = [values[3 + 2 * r] for r in range(self.world_size)]
        details: list[Any] = [{} for _ in range(self.world_size)]
        if gather and any(own) and self.gathers < MAX_GATHERS:     # decided from the agreed table: every rank
            self.gathers += 1
            torch.distributed.all_gather_object(details, detail, group=self.group)
        for r in range(self.world_size):
            if own[r]:
                self.own_counts[r] += 1
                d = {"kind": _KINDS[own[r] % 4 if own[r] % 4 < len(_KINDS) else 0]}
                if isinstance(details[r], dict):
                    d.update(details[r])
                self._add(RankEvent(own[r] // 4 - 1, r, True, **{k: str(d.get(k, "")) for k in
                                                                 ("kind", "code", "module", "op", "phase")}))
            if grads[r]:
                self.grads_counts[r] += 1
                self._add(RankEvent(grads[r] - 1, r, False, kind="nonfinite-grads"))

    def _add(self, e: RankEvent) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(e)
        if e.local and (self.origin is None or (e.step, e.rank) < (self.origin.step, self.origin.rank)):
            self.origin = e
            if e.rank != self.rank:
                log.warning("rank %d saw the first non-finite value of the job (%s at step %d%s); "
                            "rank %d's inf/NaN, if any, came from there", e.rank, e.kind or "non-finite", e.step,
                            f", {e.code} in {e.module or '<root>'} ({e.op or 'op unknown'})" if e.code else "",
                            self.rank)

    def received_at(self, step: int) -> bool:
        """Whether this rank's non-finite gradients at ``step`` came from another rank (none of its own then)."""
        mine = any(e.rank == self.rank and e.local and e.step == step for e in self.events)
        others = any(e.rank != self.rank and e.local and e.step == step for e in self.events)
        return others and not mine

    def summary(self) -> dict[str, Any]:
        """Keys for the report's summary; the same on every rank (but ``rank``)."""
        return {"rank": self.rank, "world_size": self.world_size,
                "origin_rank": None if self.origin is None else self.origin.rank,
                "nonfinite_origin": None if self.origin is None else self.origin.as_dict(),
                "rank_events": [e.as_dict() for e in self.events],
                "rank_own_anomalies": list(self.own_counts), "rank_nonfinite_grad_steps": list(self.grads_counts),
                "rank_exchanges": self.exchanges}


__all__ = ["MAX_EVENTS", "MAX_GATHERS", "RankAgreement", "RankEvent", "is_sharded"]
