"""Distributed runs (DDP, FSDP under ``torchrun``): which rank a report comes from, and which rank's op made the
non-finite values that every rank ends up with.

Under data parallelism each rank runs the same model on its own batch; the gradient all-reduce (DDP) or
reduce-scatter (FSDP) mixes the ranks' gradients, so one rank's inf/NaN become every rank's. On a rank whose own
computation stayed finite, the trace first sees the bad values in a collective's output (``c10d.allreduce_``) or
in the views DDP copies out of its bucket (``aten.as_strided`` in the optimizer phase): an op that did nothing
wrong. :func:`received_origins` tells such *received* values apart from values the rank created itself
(:func:`own_origins`), and :func:`agree` lets the ranks share, with ONE ``all_reduce`` of a small integer tensor
per diagnosis (no barrier), where each rank's own non-finite values started. A rank that only received them then
reports the origin on the rank that produced them (the model is the same on every rank, so the module is named by
its index in ``named_modules()`` and the op by a checksum of its name).

Only torch and the op registry are imported. Nothing here runs a collective except :func:`agree`, and
:func:`agree` only runs for a model wrapped in DDP or FSDP (whose forward already needs every rank to take part).
"""

from __future__ import annotations

import logging
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.trace import Kind, ops_with

log = logging.getLogger(__name__)

#: op namespaces of collectives, as the trace names ops (``"c10d.allreduce_.default"``)
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
_PHASES = ("forward", "backward", "optimizer", "setup")
#: namespaces of ops that copy parameters and gradients in and out of collective buffers (FSDP2)
_BUFFER_NAMESPACES = frozenset({"fsdp"})
#: finding fields (duck-typed: this layer does not import :mod:`ampdoctor.findings`)
_FINDING_KEY = ("step", "phase", "module", "op")
#: codes about the training setup, not about where values turn non-finite
_SETUP_CODES = frozenset({"unused-parameters", "low-precision-params", "loss-scaling-misuse", "loss-scale-collapse"})


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


# -------------------------------------------------------------------------------------------- agreement
@dataclass(frozen=True)
class RankOrigin:
    """Where non-finite values started on ``rank``: the finding code that names them and its location."""

    rank: int
    step: int
    phase: str
    module: str
    op: str
    code: str

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "module": self.module, "op": self.op,
                "code": self.code}


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on; :func:`agree` returns it.

    ``origins``: one entry per rank whose own computation produced harmful non-finite values, earliest first.
    ``received``: this rank had non-finite values only from other ranks. ``findings``: this rank's findings
    without those that blame a local op for received values. ``inserted``: keyword arguments of findings to
    put first (``Finding(**kw)``), naming the origin on the rank that produced it."""

    info: RankInfo
    origins: tuple[RankOrigin, ...] = ()
    received: bool = False
    received_through: str = ""
    findings: tuple[Any, ...] = ()
    inserted: tuple[dict[str, Any], ...] = ()
    dropped: int = 0

    def summary(self) -> dict[str, Any]:
        """Keys for :attr:`ampdoctor.Report.summary`."""
        out: dict[str, Any] = self.info.as_dict()
        out["nonfinite_ranks"] = sorted({o.rank for o in self.origins})
        if self.origins:
            out["nonfinite_origin"] = self.origins[0].as_dict()
        if self.received:
            out["nonfinite_received_through"] = self.received_through
        return out


def _crc(op: str) -> int:
    return zlib.crc32(op.encode()) if op else 0


def _finding_key(f: Any) -> tuple[Any, ...]:
    return tuple(getattr(f, k) for k in _FINDING_KEY)


def agree(model: nn.Module, records: Sequence[Any], carried: dict[int, frozenset[int]], harmful: Sequence[int],
          findings: Sequence[Any], codes: Sequence[str]) -> Agreement | None:
    """Share each rank's own non-finite origin with the other ranks and rewrite this rank's findings.

    ``records``: the target run's trace records; ``carried``: record index -> origins it carries
    (:class:`ampdoctor.trace.Lineage`); ``harmful``: indices of the harmful origins; ``findings``: the ranked
    findings (objects with ``code``, ``severity``, ``step``, ``phase``, ``module``, ``op``); ``codes``: the
    finding codes (:data:`ampdoctor.CODES`).

    Returns ``None`` (and runs no collective) unless ``model`` is wrapped in DDP/FSDP and the process group is
    initialized. Otherwise every rank must call it the same number of times: ONE ``all_reduce`` of a
    ``(world_size, 7)`` int64 tensor, no barrier. Syncs with the host once (the tensor is read back)."""
    if wrapper_kind(model) is None:
        return None
    info = rank_info(model)
    if info is None:
        return None
    local = own_origins(records, harmful)
    received = set(harmful) - set(local)
    # a collective's output statistics are read before the (asynchronous) collective completes: never blame it
    kept: list[Any] = [f for f in findings if not is_collective(f.op)]
    tainted = _keys_of(records, carried, received)
    own = _keys_of(records, carried, set(local))
    names = [n for n, _ in model.named_modules()]
    index = {n: i for i, n in enumerate(names)}

    row = [0, 0, 0, 0, 0, -1, 0]
    if local:
        blame = _blamed_finding(records[min(local)], kept, tainted, own)
        if blame is not None:
            step, phase, module, op, code = blame.step, blame.phase, blame.module, blame.op, blame.code
        else:
            r = records[min(local)]
            step, phase, module, op, code = r.step, r.phase, r.module, r.op, "overflow"
        row = [1, step, _PHASES.index(phase) if phase in _PHASES else 0, index.get(module, -1), _crc(op),
               codes.index(code) if code in codes else -1, 0]
    row[6] = 1 if received else 0
    table = _all_reduce_rows(model, info, row)
    log.debug("rank %d/%d: own non-finite origin %s; all ranks: %s", info.rank, info.world_size, row, table)

    ops = {_crc(r.op): r.op for r in records}
    origins = []
    for rank, (has, step, phase_i, mod, crc, code_i, _) in enumerate(table):
        if not has:
            continue
        origins.append(RankOrigin(rank, step, _PHASES[phase_i], names[mod] if 0 <= mod < len(names) else "",
                                  ops.get(crc, ""), codes[code_i] if 0 <= code_i < len(codes) else "overflow"))
    origins.sort(key=lambda o: (o.step, _PHASES.index(o.phase), o.rank))

    through = ""
    if received:
        first = records[min(received)]
        coll = first if is_collective(first.op) else next(
            (records[i] for i in first.inputs if i >= 0 and is_collective(records[i].op)), None)
        if coll is None:
            coll = next((r for r in records if is_collective(r.op) and r.step == first.step
                         and r.index < first.index), None)
        through = coll.op if coll is not None else ""
    only_received = bool(received) and not local
    inserted = []
    remote = [o for o in origins if o.rank != info.rank]
    if only_received and remote:
        kept = [f for f in kept if not (_finding_key(f) in tainted and _finding_key(f) not in own)]
        inserted = [_received_finding(remote[0], info, records[min(received)], through, len(origins))]
    return Agreement(info, tuple(origins), only_received, through, tuple(kept), tuple(inserted),
                     len(findings) - len(kept))


def _blamed_finding(origin: Any, findings: Sequence[Any], tainted: set[tuple[Any, ...]],
                    own: set[tuple[Any, ...]]) -> Any:
    """The finding that names this rank's own origin: the one at the origin record, else the first error that is
    not about received values (``nonfinite-input`` names the batch, not the op that first read it)."""
    key = (origin.step, origin.phase, origin.module, origin.op)
    for f in findings:
        if _finding_key(f) == key:
            return f
    for f in findings:
        k = _finding_key(f)
        if f.severity == "error" and f.code not in _SETUP_CODES and (k in own or k not in tainted):
            return f
    return None


def _keys_of(records: Sequence[Any], carried: dict[int, frozenset[int]], origins: set[int]) -> set[tuple[Any, ...]]:
    keys = set()
    for i, carry in carried.items():
        if carry & origins:
            r = records[i]
            keys.add((r.step, r.phase, r.module, r.op))
    return keys


def _all_reduce_rows(model: nn.Module, info: RankInfo, row: list[int]) -> list[list[int]]:
    dist = torch.distributed
    device = torch.device("cpu")
    if "nccl" in info.backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.zeros(info.world_size, len(row), dtype=torch.int64, device=device)
    t[info.rank] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(t, group=process_group(model))
    return t.cpu().tolist()


def _received_finding(o: RankOrigin, info: RankInfo, first: Any, through: str, n_ranks: int) -> dict[str, Any]:
    where = f"{o.module or '<root>'} ({o.op or 'op unknown'}, {o.phase}, step {o.step})"
    via = through or "a collective"
    explanation = (
        f"Rank {o.rank} of {info.world_size} produced the non-finite values: {o.code} in {where}. This rank's own "
        f"computation stayed finite; the values arrived at step {first.step} ({first.phase}) through {via}, which "
        f"mixes the ranks' gradients, so every rank ends up with the same inf/NaN. The local op where they first "
        f"show here ({first.op or 'an untraced buffer'} in {first.module or '<root>'}) did nothing wrong. Read rank "
        f"{o.rank}'s report (same model, its own batch) for the numbers and the fixes.")
    if n_ranks > 1:
        explanation += f" {n_ranks} ranks produced non-finite values of their own; rank {o.rank}'s came first."
    return {
        "code": o.code, "severity": "error", "module": o.module, "op": o.op, "phase": o.phase, "step": o.step,
        "title": f"{o.code} on rank {o.rank} reaches rank {info.rank} through {via}",
        "explanation": explanation,
        "evidence": {"origin_rank": o.rank, "rank": info.rank, "world_size": info.world_size, "local": False,
                     "received_through": via, "received_at": {"op": first.op, "module": first.module,
                                                              "phase": first.phase, "step": first.step}},
    }


__all__ = ["Agreement", "COLLECTIVE_NAMESPACES", "RankInfo", "RankOrigin", "agree", "copy_limitation",
           "is_collective", "own_origins", "param_dtypes", "process_group", "rank_info", "received_origins",
           "resync_after_cast", "wrapper_kind"]
