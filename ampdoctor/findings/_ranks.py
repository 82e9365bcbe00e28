"""Distributed agreement: which rank's own computation produced the non-finite values, and this rank's findings
rewritten so that a rank that only received them (through a gradient all-reduce) names the producing rank.

The precision layer supplies the raw per-rank facts (:func:`~ampdoctor.precision.own_origins`,
``received_origins``) and the transport (``exchange_rows``: one ``all_reduce``); the blame and the rewriting of
findings are findings logic and live here.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ampdoctor.findings._types import CODES, Finding
from ampdoctor.precision import PHASES, RankInfo, exchange_rows, is_collective, own_origins, rank_info, wrapper_kind

log = logging.getLogger(__name__)

_FINDING_KEY = ("step", "phase", "module", "op")
#: codes about the training setup, not about where values turn non-finite
_SETUP_CODES = frozenset({"unused-parameters", "low-precision-params", "loss-scaling-misuse", "loss-scale-collapse"})
#: the code a rank reports for its own origin when none of its findings names it
_DEFAULT_CODE = "overflow"


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
    put first, naming the origin on the rank that produced it."""

    info: RankInfo
    origins: tuple[RankOrigin, ...] = ()
    received: bool = False
    received_through: str = ""
    findings: tuple[Finding, ...] = ()
    inserted: tuple[Finding, ...] = ()
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
          findings: Sequence[Finding], codes: Sequence[str] = CODES) -> Agreement | None:
    """Share each rank's own non-finite origin with the other ranks and rewrite this rank's findings.

    ``records``: the target run's trace records; ``carried``: record index -> origins it carries
    (:class:`ampdoctor.trace.Lineage`); ``harmful``: indices of the harmful origins; ``findings``: the ranked
    findings; ``codes``: the finding codes (:data:`ampdoctor.CODES`).

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
    kept: list[Finding] = [f for f in findings if not is_collective(f.op)]
    tainted = _keys_of(records, carried, received)
    own = _keys_of(records, carried, set(local))
    names = [n for n, _ in model.named_modules()]
    row = _own_row(records, local, received, kept, tainted, own, names, codes)
    table = exchange_rows(model, info, row)
    log.debug("rank %d/%d: own non-finite origin %s; all ranks: %s", info.rank, info.world_size, row, table)
    origins = _decode(table, records, names, codes)
    through = _received_through(records, received) if received else ""
    only_received = bool(received) and not local
    inserted: list[Finding] = []
    remote = [o for o in origins if o.rank != info.rank]
    if only_received and remote:
        kept = [f for f in kept if not (_finding_key(f) in tainted and _finding_key(f) not in own)]
        inserted = [_received_finding(remote[0], info, records[min(received)], through, len(origins))]
    return Agreement(info, tuple(origins), only_received, through, tuple(kept), tuple(inserted),
                     len(findings) - len(kept))


def _own_row(records: Sequence[Any], local: list[int], received: set[int], kept: list[Finding],
             tainted: set[tuple[Any, ...]], own: set[tuple[Any, ...]], names: list[str],
             codes: Sequence[str]) -> list[int]:
    """This rank's row of the exchange: ``[has own origin, step, phase, module index, op crc, code, received]``."""
    row = [0, 0, 0, 0, 0, -1, 0]
    if local:
        blame = _blamed_finding(records[min(local)], kept, tainted, own)
        if blame is not None:
            step, phase, module, op, code = blame.step, blame.phase, blame.module, blame.op, blame.code
        else:
            r = records[min(local)]
            step, phase, module, op, code = r.step, r.phase, r.module, r.op, _DEFAULT_CODE
        index = {n: i for i, n in enumerate(names)}
        row = [1, step, PHASES.index(phase) if phase in PHASES else 0, index.get(module, -1), _crc(op),
               codes.index(code) if code in codes else -1, 0]
    row[6] = 1 if received else 0
    return row


def _decode(table: list[list[int]], records: Sequence[Any], names: list[str], codes: Sequence[str]) -> list[RankOrigin]:
    """The ranks' own origins from the exchanged rows, earliest first."""
    ops = {_crc(r.op): r.op for r in records}
    origins = []
    for rank, (has, step, phase_i, mod, crc, code_i, _) in enumerate(table):
        if not has:
            continue
        origins.append(RankOrigin(rank, step, PHASES[phase_i], names[mod] if 0 <= mod < len(names) else "",
                                  ops.get(crc, ""), codes[code_i] if 0 <= code_i < len(codes) else _DEFAULT_CODE))
    origins.sort(key=lambda o: (o.step, PHASES.index(o.phase), o.rank))
    return origins


def _received_through(records: Sequence[Any], received: set[int]) -> str:
    """The collective the received non-finite values came through (``""`` if none is traced)."""
    first = records[min(received)]
    coll = first if is_collective(first.op) else next(
        (records[i] for i in first.inputs if i >= 0 and is_collective(records[i].op)), None)
    if coll is None:
        coll = next((r for r in records if is_collective(r.op) and r.step == first.step
                     and r.index < first.index), None)
    return coll.op if coll is not None else ""


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


def _received_finding(o: RankOrigin, info: RankInfo, first: Any, through: str, n_ranks: int) -> Finding:
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
    return Finding(
        o.code, "error", o.module, o.op, o.phase,
        f"{o.code} on rank {o.rank} reaches rank {info.rank} through {via}", explanation,
        {"origin_rank": o.rank, "rank": info.rank, "world_size": info.world_size, "local": False,
         "received_through": via, "received_at": {"op": first.op, "module": first.module, "phase": first.phase,
                                                  "step": first.step}},
        step=o.step)



__all__ = ["Agreement", "RankOrigin", "agree"]
