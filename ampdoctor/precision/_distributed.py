"""Distributed runs (DDP, FSDP under ``torchrun``): the raw per-rank facts and the transport between ranks.

Under data parallelism each rank runs the same model on its own batch; the gradient all-reduce (DDP) or
reduce-scatter (FSDP) mixes the ranks' gradients, so one rank's inf/NaN become every rank's. On a rank whose own
computation stayed finite, the trace first sees the bad values in a collective's output (``c10d.allreduce_``) or
in the views DDP copies out of its bucket (``aten.as_strided`` in the optimizer phase): an op that did nothing
wrong. :func:`received_origins` tells such *received* values apart from values the rank created itself
(:func:`own_origins`); :func:`exchange_rows` shares one small integer row per rank with ONE ``all_reduce`` (no
barrier). Which finding names a rank's origin, and how a rank that only received the values reports the producing
rank, is findings logic: :mod:`ampdoctor.findings._ranks`.

Only torch and the op registry are imported. Nothing here runs a collective except :func:`exchange_rows`, which
``findings._ranks.agree`` calls only for a model wrapped in DDP or FSDP (whose forward already needs every rank).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.trace import Kind, ops_with

log = logging.getLogger(__name__)

#: op namespaces of collectives, as the trace names ops (``"c10d.allreduce_.default"``)
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
#: the phases as the rows of :func:`exchange_rows` number them
PHASES = ("forward", "backward", "optimizer", "setup")
#: namespaces of ops that copy parameters and gradients in and out of collective buffers (FSDP2)
_BUFFER_NAMESPACES = frozenset({"fsdp"})
#: finding fields (duck-typed: this layer does not import :mod:`ampdoctor.findings`)

def is_collective(op: str) -> bool:
    """``True`` for a collective's op name as the trace records it (``"c10d.allreduce_.default"``)."""
    return op.split(".", 1)[0] in COLLECTIVE_NAMESPACES


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the process group."""

    rank: int
    world_size: int
    backend: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size}


def wrapper_kind(model: nn.Module) -> str | None:
    """``"ddp"``, ``"fsdp"`` (``FullyShardedDataParallel``), ``"fsdp2"`` (``fully_shard``) or ``None``.

    FSDP is looked up in ``sys.modules`` (a model cannot be FSDP-wrapped if FSDP was never imported)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    fsdp1, fsdp2 = getattr(fsdp, "FullyShardedDataParallel", ()), getattr(fsdp, "FSDPModule", ())
    for mod in model.modules():
        if isinstance(mod, fsdp1):
            return "fsdp"
        if isinstance(mod, fsdp2):
            return "fsdp2"
    return None


def process_group(model: nn.Module) -> Any:
    """The process group of a DDP/FSDP wrapper (``None``: the default group)."""
    return getattr(model, "process_group", None)


def rank_info(model: nn.Module | None = None) -> RankInfo | None:
    """Rank and world size in ``model``'s process group (the default one if it has none); ``None`` when
    ``torch.distributed`` is not initialized. No collective."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    group = process_group(model) if model is not None else None
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a backend name is informative only
        backend = ""
    return RankInfo(dist.get_rank(group), dist.get_world_size(group), backend)


def param_dtypes(model: nn.Module) -> tuple[torch.dtype, ...]:
    return tuple(p.dtype for p in model.parameters())


def resync_after_cast(model: nn.Module, before: tuple[torch.dtype, ...]) -> bool:
    """Rebuild DDP's reducer when a cast changed parameter dtypes since ``before`` (:func:`param_dtypes`).

    ``model.to(torch.float16)`` replaces each parameter's ``.data`` with a new dtype, and autograd then gives the
    parameter a new gradient accumulator: the hooks DDP's reducer put on the old ones never fire again, so the
    gradients are silently no longer all-reduced (each rank trains alone). Rebuilding the reducer from the
    current parameters (what unpickling a DDP module does) restores the all-reduce. No collective; returns
    whether something was rebuilt."""
    if param_dtypes(model) == before:
        return False
    rebuilt = False
    for mod in model.modules():
        if isinstance(mod, nn.parallel.DistributedDataParallel):
            mod.__setstate__(mod.__getstate__())
            rebuilt = True
    return rebuilt


def copy_limitation(model: nn.Module) -> str | None:
    """Why :func:`ampdoctor.diagnose` cannot run this wrapper (it works on deep copies), or ``None``."""
    kind = wrapper_kind(model)
    if kind in ("fsdp", "fsdp2"):
        return (f"{'FullyShardedDataParallel' if kind == 'fsdp' else 'fully_shard (FSDP2)'} models cannot be deep-"
                "copied, and diagnose runs on copies. Diagnose the unwrapped model (on one rank, with one rank's "
                "batch), or observe the sharded run in place with ampdoctor.trace(...) or ampdoctor.watch(...)")
    return None


# ---------------------------------------------------------------------------------------------- lineage
#: ops whose output is (a view of) their first input's memory: a collective's buffer keeps its role through them
_VIEWS = ops_with(Kind.VIEW)


def _base(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) > 2 else op


def received_origins(records: Sequence[Any], origins: Sequence[int]) -> set[int]:
    """The non-finite origins (record indices) that this rank did not compute from its own data.

    Received: a collective's output; a record with a collective among its inputs (DDP's bucket views after the
    all-reduce); an untraced buffer (kind ``"input"``) first read in the backward or optimizer phase after a
    collective of the same step (gloo's reduce-scatter reduces into its input buffer in a worker thread).
    Not data at all: a buffer (an untraced one, or one an op fills into an allocation) that feeds a collective
    through views (FSDP's unsharded parameter buffer and ``fsdp.all_gather_copy_in``'s output, read before the
    all-gather fills them), and views of an uninitialised allocation (``empty``): such records describe garbage
    memory. Records carry ``op``, ``inputs``, ``kind``, ``step``, ``phase`` and
    ``index`` (:class:`ampdoctor.trace.OpRecord`)."""
    first_collective: dict[int, int] = {}
    consumers: dict[int, list[int]] = {}
    for r in records:
        if is_collective(r.op):
            first_collective.setdefault(r.step, r.index)
        for i in r.inputs:
            if i >= 0:
                consumers.setdefault(i, []).append(r.index)

    def feeds_collective(i: int, depth: int = 0) -> bool:
        for c in consumers.get(i, ()):
            op = records[c].op
            if is_collective(op) or (depth < 4 and _base(op) in _VIEWS and feeds_collective(c, depth + 1)):
                return True
        return False

    out: set[int] = set()
    for o in origins:
        r = records[o]
        ins = [records[i] for i in r.inputs if i >= 0]
        if is_collective(r.op) or any(is_collective(x.op) for x in ins):
            out.add(o)
        elif ins and all(x.kind == "alloc" for x in ins):
            out.add(o)  # a view of uninitialised memory
        elif r.kind == "input" and not ins and r.phase != "forward" and first_collective.get(r.step, o) < o:
            out.add(o)
        elif (r.kind == "input" or any(x.kind == "alloc" for x in ins)) and feeds_collective(o):
            out.add(o)  # a collective's buffer (FSDP's all-gather output), read before the collective filled it
    return out


def own_origins(records: Sequence[Any], origins: Sequence[int]) -> list[int]:
    """The origins this rank computed from its own data: ops and its batch or parameters, not received
    (:func:`received_origins`) and not a re-read of a buffer (an untraced ``"input"``, a ``"<view write>"``, an op
    of FSDP's copy-in/copy-out namespace), whose contents another thread or rank may be writing."""
    received = received_origins(records, origins)
    out = []
    for o in origins:
        r = records[o]
        if o in received:
            continue
        if r.kind in ("batch", "param") or (r.kind == "op" and r.op != "<view write>"
                                             and r.op.split(".", 1)[0] not in _BUFFER_NAMESPACES):
            out.append(o)
    return out


# -------------------------------------------------------------------------------------------- transport
def exchange_rows(model: nn.Module, info: RankInfo, row: list[int]) -> list[list[int]]:
    """Every rank's ``row`` (equal lengths), by ONE ``all_reduce`` of a ``(world_size, len(row))`` int64 tensor in
    ``model``'s process group; every rank must call it. Syncs with the host once (the table is read back)."""
    dist = torch.distributed
    device = torch.device("cpu")
    if "nccl" in info.backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.zeros(info.world_size, len(row), dtype=torch.int64, device=device)
    t[info.rank] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(t, group=process_group(model))
    return t.cpu().tolist()



__all__ = ["COLLECTIVE_NAMESPACES", "PHASES", "RankInfo", "copy_limitation", "exchange_rows", "is_collective",
           "own_origins", "param_dtypes", "process_group", "rank_info", "received_origins", "resync_after_cast",
           "wrapper_kind"]
