"""Element samples of chosen outputs of a cheap-tier trace, named by their (phase, module, op, occurrence) key.

The cheap tier keeps one ``aminmax`` per output and no samples; a caller comparing such a run with a full-tier
float32 run sometimes needs a few outputs element by element (``check``'s quick pass: the argument of a large
softmax or sin/cos and the values upstream that could have rounded it, as the precision-loss rule compares them).
:class:`KeyedSamples` is a dispatch mode entered *above* a cheap :class:`~ampdoctor.trace.Trace`: after each op it
names the records the trace just made by the key that finds a record's twin in the other run (the n-th output of
that op in that module and phase: autocast's extra casts are other ops and do not shift the count) and, for the
keys asked for, gathers the output's values at the :class:`~ampdoctor.trace._sample.Sampler`'s positions -- the
positions the full tier samples, which depend on the size alone. Everything stays on the device until
:meth:`KeyedSamples.result` reads it in one transfer per device. No RNG is consumed, the op runs exactly once with
torch functions off (as under the trace), and the gathers run with every dispatch mode off (the trace does not
record them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ampdoctor.trace._mode import RecordingMode
from ampdoctor.trace._opdesc import flat
from ampdoctor.trace._ops import op_base
from ampdoctor.trace._sample import Sampler

#: (phase, module, op base name, occurrence): the n-th record of that op in that module and phase
Key = tuple[str, str, str, int]
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


def record_keys(records: list[Any]) -> dict[int, Key]:
    """Op records' keys by record index (how a record of one run finds its twin in another)."""
    seen: dict[tuple[str, str, str], int] = {}
    out: dict[int, Key] = {}
    for r in records:
        if r.kind != "op" or not r.op:
            continue
        k = (r.phase, r.module, op_base(r.op))
        n = seen[k] = seen.get(k, -1) + 1
        out[r.index] = (*k, n)
    return out


class KeyedSamples(TorchDispatchMode):
    """Samples of the step-0 outputs whose key is in ``wanted``, from the records ``mode`` (a cheap trace's recording
    mode, entered before this one) makes. Records the trace makes outside an op this mode sees (none in a plain
    step) are counted but not sampled: a key with no sample is one the caller cannot judge."""

    def __init__(self, mode: RecordingMode, wanted: set[Key]) -> None:
        super().__init__()
        self.rec = mode
        self.wanted = set(wanted)
        self.sampler = Sampler()
        self._seen: dict[tuple[str, str, str], int] = {}
        self._scanned = 0
        self._pending: dict[Key, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        with _NO_TORCH_FUNCTION():
            start = len(self.rec.records)
            out = func(*args, **(kwargs or {}))
            if self.wanted and len(self.rec.records) > self._scanned:
                try:
                    self._scan(start, out)
                except Exception:  # noqa: BLE001 - observation must not raise into user code; the counts may be
                    self.wanted, self._pending = set(), {}  # off now: no samples at all (nothing measured)
                    self._scanned = len(self.rec.records)
            return out

    def _scan(self, start: int, out: Any) -> None:
        """Key the records made since the last scan; sample the wanted ones this op (records from ``start``) made."""
        outs: list[torch.Tensor] | None = None
        made = 0  # floating outputs of this op matched to its records, in the trace's order
        for r in self.rec.records[self._scanned:]:
            if r.kind != "op" or not r.op:
                continue
            k = (r.phase, r.module, op_base(r.op))
            n = self._seen[k] = self._seen.get(k, -1) + 1
            if r.index < start:
                continue
            j, made = made, made + 1
            if (*k, n) not in self.wanted or r.step != 0:
                continue
            if outs is None:
                found: list[torch.Tensor] = []
                flat(out, found)
                outs = [t for t in found if t.is_floating_point()]
            if j < len(outs) and tuple(outs[j].shape) == tuple(r.shape):
                with _disable_current_modes():
                    v = self.sampler.take(outs[j].detach())
                if v is not None:
                    self._pending[(*k, n)] = v
        self._scanned = len(self.rec.records)

    def result(self) -> dict[Key, tuple[float, ...]]:
        """The samples by key, read back once per device (host floats)."""
        by_dev: dict[Any, list[Key]] = {}
        for key, v in self._pending.items():
            by_dev.setdefault(v.device, []).append(key)
        got: dict[Key, tuple[float, ...]] = {}
        with _NO_TORCH_FUNCTION(), _disable_current_modes():
            for keys in by_dev.values():
                vals = torch.cat([self._pending[k].reshape(-1).to(torch.float64) for k in keys]).cpu().tolist()
                pos = 0
                for k in keys:
                    n = self._pending[k].numel()
                    got[k], pos = tuple(vals[pos:pos + n]), pos + n
        self._pending = {}
        return got


__all__ = ["Key", "KeyedSamples", "record_keys"]
