"""Element-wise sketches of traced tensors: a fixed sample of values per output, and decision ops' indices.

Tensor norms and |max| hide element-wise damage (``sin`` of a badly rounded angle keeps its norm; an argmax can
flip while the logits' norm agrees to 0.1%). The trace therefore keeps, per floating output of step 0, the
values at :data:`SAMPLE` fixed positions -- the same positions in the target and the reference run, chosen by a
generator seeded with the tensor's size (the global RNG is not touched) -- and, per decision op (argmax, topk,
sort, ``max.dim``), its integer output (up to :data:`MAX_DECISION` elements) and the number of rows whose
chosen value ties with the next candidate. Everything stays on the device until the step is read back.

Cost: one gather of 64 elements per output (``torch.take`` of logical positions: no copy of a non-contiguous
tensor), and for a decision op one ``topk`` of its input.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from ampdoctor.trace._ops import Kind, ops_with

#: values sampled per output (all of them for smaller tensors)
SAMPLE = 64
#: float64 elements per block the samples are kept in (1 MiB)
SAMPLE_BLOCK = 1 << 17
#: ops whose integer output is a choice between values (argmax, topk, sort): kept for the reference comparison
DECISIONS = ops_with(Kind.DECISION)
_SMALLEST, _PICKS_K, _ORDERS = ops_with(Kind.PICKS_SMALLEST), ops_with(Kind.PICKS_K), ops_with(Kind.ORDERS)
_THRESHOLDS = ops_with(Kind.THRESHOLDS)
#: integer outputs of decision ops kept exactly up to this many elements
MAX_DECISION = 1 << 16


class Sampler:
    """Gathers up to :data:`SAMPLE` values of a tensor at fixed positions (the same positions for the same size).

    Positions are logical (row-major) element indices, so one ``torch.take`` reads them from any layout: no copy of
    a non-contiguous tensor, one op per output, and the plan depends on the size alone."""

    def __init__(self) -> None:
        self._positions: dict[tuple[int, Any], torch.Tensor] = {}

    def _plan(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        key = (n, t.device)
        pos = self._positions.get(key)
        if pos is None:  # host arithmetic on Python ints: no tensor is read
            idx = range(n) if n <= SAMPLE else sorted(random.Random(n).sample(range(n), SAMPLE))
            pos = torch.tensor(list(idx), dtype=torch.int64, device=t.device)
            self._positions[key] = pos
        return pos

    def take(self, t: torch.Tensor) -> torch.Tensor | None:
        """Up to ``SAMPLE`` values of ``t`` in its own dtype (one gather; converted when read, by dtype group)."""
        if t.numel() == 0:
            return None
        return torch.take(t, self._plan(t))


@dataclass
class Decision:
    """One decision op's integer output: ``indices`` (host list after the read, ``None`` when too large),
    ``rows`` (the decisions it makes: its output's elements along the decided dim collapsed), ``ties``
    (rows whose chosen value equals the next candidate's in the input; for a sort, rows where two neighbours in
    the order are equal)."""

    op: str
    module: str
    phase: str
    step: int
    input_index: int
    out_pos: int
    shape: tuple[int, ...]
    k: int
    device_indices: Any = None
    device_ties: Any = None
    indices: list[int] | None = None
    ties: int | None = None
    align: tuple[Any, ...] = field(default_factory=tuple)


def _dim_k(base: str, args: Any, kwargs: Any, x: torch.Tensor) -> tuple[int | None, int]:
    """The decided dimension (None: the whole flattened tensor) and how many winners each row picks."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
    if base in _PICKS_K:
        k = int(args[1] if len(args) > 1 else kwargs.get("k", 1))
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        return int(dim), k
    if base in _ORDERS:
        return int(-1 if dim is None else dim), x.shape[int(-1 if dim is None else dim)] if x.dim() else 1
    return (None if dim is None else int(dim)), 1


def make_decision(base: str, op: str, module: str, phase: str, step: int, input_index: int, out_pos: int,
                  t: torch.Tensor, args: Any, kwargs: Any) -> Decision | None:
    """Keep the integer output ``t`` of decision op ``base`` and count its ties (no host sync)."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if base in _THRESHOLDS:
        return _threshold_decision(op, module, phase, step, input_index, out_pos, t, x)
    if x is None or not x.is_floating_point() or t.numel() > MAX_DECISION or x.numel() == 0:
        return None
    dim, k = _dim_k(base, args, kwargs, x)
    d = Decision(op, module, phase, step, input_index, out_pos, tuple(t.shape), k, t.detach().clone())
    if base in _ORDERS:
        dd = -1 if dim is None else dim
        n = x.shape[dd] if x.dim() else 0
        if n > 1 and tuple(t.shape) == tuple(x.shape):  # rows where two neighbours in the order are equal
            v = x.detach().gather(dd, t)
            d.device_ties = (v.narrow(dd, 1, n - 1) == v.narrow(dd, 0, n - 1)).any(dd).sum()
    else:
        v = x.detach().reshape(-1) if dim is None else x.detach()
        if base in _SMALLEST or (base in _PICKS_K and not kwargs.get(
                "largest", args[3] if len(args) > 3 else True)):
            v = -v
        dd = 0 if dim is None else dim
        if v.shape[dd] > k:
            top = v.topk(k + 1, dd).values
            d.device_ties = (top.select(dd, k - 1) == top.select(dd, k)).sum()
    return d


def _threshold_decision(op: str, module: str, phase: str, step: int, input_index: int, out_pos: int,
                        t: torch.Tensor, x: torch.Tensor | None) -> Decision | None:
    """A comparison's boolean mask of floating values, per row of its last dim as ``(count, sum of positions)`` of
    its true elements -- the kept set of a threshold on a sorted running total (a prefix) exactly, any other mask
    up to a collision of both sums -- so a row of 32000 is two integers (no host sync). Forward only: a backward's
    masks (``clamp_min``'s ``x >= min``) are autograd's, following a forward value already compared."""
    if phase != "forward" or x is None or not x.is_floating_point() or t.dtype != torch.bool or t.numel() == 0:
        return None
    m = t.detach().reshape(-1, t.shape[-1] if t.dim() else 1)
    if 2 * m.shape[0] > MAX_DECISION:
        return None
    pos = torch.arange(m.shape[1], device=m.device)
    sig = torch.stack([m.sum(-1), (m * pos).sum(-1)], -1)
    return Decision(op, module, phase, step, input_index, out_pos, (m.shape[0], 2), 2, sig)


class Sketches:
    """What the recording mode keeps besides the statistics rows: samples by row, decisions in op order."""

    def __init__(self, key: Any) -> None:
        self._tensor_key = key  # the recording mode's tensor identity (storage, offset, shape, stride, dtype)
        #: integer outputs (indices, ``.long()`` casts, comparisons) -> the floating records they were computed
        #: from, so that an op that raises on an index (out of range) names its numeric source (no statistics)
        self.int_src: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self.sampler = Sampler()
        #: row -> (device, block, offset, count): the sample's values, as float64, in :attr:`blocks`
        self.samples: dict[int, tuple[Any, int, int, int]] = {}
        #: per device, flat float64 blocks the samples are written into (:data:`SAMPLE_BLOCK` elements each). One
        #: block for ~2000 samples instead of one small tensor each: thousands of small tensors that outlive the
        #: step's transient tensors pin the holes those leave in the C heap (the freed activations could not
        #: coalesce for the gradients; bench/results/diagnose_split.md: a step-0 backward faulted fresh pages in)
        self.blocks: dict[Any, list[torch.Tensor]] = {}
        self._fill: dict[Any, int] = {}
        self.decisions: list[Decision] = []
        self._decisions_read = 0
        self._layout: dict[Any, tuple[list[tuple[int, int]], list[Decision]]] = {}
        self._got: dict[int, tuple[float, ...]] = {}

    def index_sources(self, ins: list[torch.Tensor]) -> tuple[int, ...]:
        """The floating records the integer tensors among ``ins`` were computed from."""
        return tuple(i for x in ins if not x.is_floating_point()
                     for i in self.int_src.get(self._tensor_key(x) or (), ()))

    def error_inputs(self, in_idx: tuple[int, ...], ins: list[torch.Tensor]) -> list[int]:
        """A failing op's input records; for an integer input (an index), the floating records it came from."""
        return list(dict.fromkeys([i for i in in_idx if i >= 0] + list(self.index_sources(ins))))

    def integer(self, t: torch.Tensor, names: tuple[str, str], module: str, phase: str, step: int,
                in_idx: tuple[int, ...], ins: list[torch.Tensor], pos: int, args: Any, kwargs: Any) -> None:
        """An integer output of a full-tier op: remember its sources; keep a step-0 decision's indices."""
        self.int_output(t, in_idx, ins)
        if names[1] in DECISIONS and step == 0:
            self.decision(names[1], names[0], module, phase, in_idx, pos, t, args, kwargs)

    def int_output(self, t: torch.Tensor, in_idx: tuple[int, ...], ins: list[torch.Tensor]) -> None:
        """Remember the floating records an integer output came from (through integer ops too)."""
        src = tuple(i for i in in_idx if i >= 0) or self.index_sources(ins)
        key = self._tensor_key(t)
        if key is not None and src:
            self.int_src[key] = src[:8]

    def sample(self, t: torch.Tensor, row: int, step: int, phase: str) -> None:
        """Values at fixed positions of a step-0 forward/backward tensor (also in a headroom run: ``check`` uses
        it as the diagnosis's reference)."""
        if step != 0 or phase not in ("forward", "backward"):
            return
        try:  # (:meth:`Sampler.take` inlined for a known plan: once per traced output)
            n = t.numel()
            if n == 0:
                return
            pos = self.sampler._positions.get((n, t.device))
            v = torch.take(t, pos) if pos is not None else self.sampler.take(t)
            if v is not None:
                self._keep(row, v)
        except Exception:  # noqa: BLE001 - observation must not raise into user code (sparse, subclasses)
            pass

    def _keep(self, row: int, v: torch.Tensor) -> None:
        """Copy sample ``v`` (at most :data:`SAMPLE` values) into the device's current block, widened to float64
        (exact: the same numbers a later conversion gives)."""
        dev, k = v.device, v.numel()
        blocks = self.blocks.setdefault(dev, [])
        fill = self._fill.get(dev, SAMPLE_BLOCK)
        if fill + k > SAMPLE_BLOCK:
            blocks.append(torch.empty(SAMPLE_BLOCK, dtype=torch.float64, device=dev))
            fill = 0
        blocks[-1][fill:fill + k].copy_(v)
        self.samples[row] = (dev, len(blocks) - 1, fill, k)
        self._fill[dev] = fill + k

    def decision(self, base: str, op: str, module: str, phase: str, in_idx: tuple[int, ...], pos: int,
                 t: torch.Tensor, args: Any, kwargs: Any) -> None:
        try:
            d = make_decision(base, op, module, phase, 0, in_idx[0] if in_idx else -1, pos, t, args, kwargs)
        except Exception:  # noqa: BLE001 - observation must not raise into user code
            d = None
        if d is not None:
            self.decisions.append(d)

    def devices(self) -> set[Any]:
        """Devices holding samples or decisions not read yet."""
        return {v[0] for v in self.samples.values()} | {
            d.device_indices.device for d in self.decisions[self._decisions_read:] if d.device_indices is not None}

    def read_rows(self, rows: list[Any], by_dev: dict[Any, list[int]], values: list[list[float]], base: int,
                  records: list[Any]) -> None:
        """Read the statistics rows of ``by_dev`` (tensor rows by device) into ``values`` together with the samples
        and decisions on the same device (one transfer per device); ``records`` (those read now) get samples."""
        row_ids = range(base, base + len(rows))
        for dev in list(by_dev) + [d for d in self.devices() if d not in by_dev]:
            idxs = by_dev.get(dev, [])
            ncol = len(rows[idxs[0]]) if idxs else 0
            parts = [torch.stack([rows[i] for i in idxs]).reshape(-1)] if idxs else []
            flat = torch.cat(parts + [self.pack(dev, row_ids)]).cpu().tolist()
            for j, i in enumerate(idxs):
                values[i] = flat[j * ncol:(j + 1) * ncol]
            self.unpack(dev, flat[len(idxs) * ncol:])
        self.attach(records)

    def pack(self, device: Any, rows: Any) -> torch.Tensor:
        """The samples of ``rows`` and the unread decisions on ``device`` as one float64 vector, read back with
        the statistics rows (the same transfer: one host read per device and step)."""
        have: list[tuple[int, int]] = []
        runs: list[list[int]] = []  # [block, start, end]: contiguous runs of the blocks, in row order
        for r in rows:
            v = self.samples.get(r)
            if v is None or v[0] != device:
                continue
            _, b, off, k = self.samples.pop(r)
            have.append((r, k))
            if runs and runs[-1][0] == b and runs[-1][2] == off:
                runs[-1][2] = off + k
            else:
                runs.append([b, off, off + k])
        decs = [d for d in self.decisions[self._decisions_read:]
                if d.device_indices is not None and d.device_indices.device == device]
        self._layout[device] = (have, decs)
        blocks = self.blocks.get(device, [])
        parts = [blocks[b][start:end] for b, start, end in runs]
        if not any(v[0] == device for v in self.samples.values()):  # every sample read: the blocks go
            self.blocks.pop(device, None)
            self._fill.pop(device, None)
        parts += [d.device_indices.reshape(-1).to(torch.float64) for d in decs]  # exact below 2**53
        parts += [(d.device_ties if d.device_ties is not None else torch.tensor(-1, device=device))
                  .reshape(1).to(torch.float64) for d in decs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)

    def unpack(self, device: Any, values: list[float]) -> None:
        """Take back what :meth:`pack` put after the statistics (host floats)."""
        have, decs = self._layout.pop(device, ([], []))
        pos = 0
        for r, n in have:
            self._got[r], pos = tuple(values[pos:pos + n]), pos + n
        for d in decs:
            n = d.device_indices.numel()
            d.indices, pos = [int(v) for v in values[pos:pos + n]], pos + n
        for d in decs:
            d.ties = None if values[pos] < 0 else int(values[pos])
            pos += 1
            d.device_indices = d.device_ties = None

    def attach(self, records: list[Any]) -> None:
        """Give the records just read their samples; the decisions made up to now are read."""
        for r in records:
            r.sample = self._got.get(r.row, ())  # aliases share their source's row, and its sample
        self._got = {}
        self._decisions_read = len(self.decisions)
