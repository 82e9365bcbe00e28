"""In-place writes to module state: the update each one applies against the same write computed wider.

Every op that writes into the storage of a parameter, a registered buffer or an accumulated gradient
(``copy_``, ``lerp_``, ``mul_``, ``add_``, ``addcdiv_``, ``index_put_``, a batch norm's running statistics,
``_foreach_*_`` in an optimizer, ``AccumulateGrad``'s ``add_`` ...) -- from the optimizer, from the model's own
code or from the user's training-step code -- is re-run on float copies one format wider (16-bit -> float32,
float32 -> float64). Per written tensor the trace keeps, on the device:

- ``numel``, ``moving``: elements whose exact update is nonzero, ``lost``: moving elements the stored write left
  unchanged (the update was below half an ulp of the stored value and rounded away), ``changed``: elements the
  stored write changed, ``intended`` / ``applied``: sums of ``|exact - old|`` and ``|new - old|``.

Cost: on the CPU (where reading a value back is no device sync) the re-run waits until the write ran. An update
can only be lost where the stored write left an element unchanged, so a float32 (or wider) write is first judged by
one pass (``new - old`` into a reused buffer, then a count of the changed elements): all changed (a healthy fp32
optimizer step's weight decay and most of its updates) -- no re-run; else, with a finite update, it is re-run on its
unchanged elements only where they can be gathered for a point-wise op on one tensor (``addcdiv_``, ``mul_``,
``lerp_`` ...). Such a write's ``lost`` and ``changed`` are exact, its ``moving`` counts every changed element as
moving (a stored change implies a nonzero exact one), its ``applied`` sums the differences taken in the stored dtype
(exact for any update smaller than the value it updates; else within float32 rounding) and its ``intended`` is
unknown (NaN): only 16-bit state's and loss-scaled loop writes' exact update sizes are read (``findings._updates``).
16-bit and 8-bit writes, other ops and the training-step code's own writes (module ``""``) are re-run whole; on an
accelerator every write is, before it runs (deciding would read back). Old values are copied into buffers reused
from write to write (:class:`OldValues`) and, on the host, rows are host lists (no small tensor outlives the write).

Side effects: none. The re-run writes only into copies, under no mode and no grad; ops that draw random
numbers are not re-run (their statistics stay unknown) so no RNG is consumed. No host sync: the rows are read
back with the trace's statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ampdoctor.trace import _stats
from ampdoctor.trace._dtypes import dtype_info
from ampdoctor.trace._ops import Kind, ops_with

#: the statistics of one write, in row order
WRITE_FIELDS = ("numel", "moving", "lost", "changed", "intended", "applied")


def _wider(dtype: torch.dtype) -> torch.dtype:
    """One format wider than ``dtype``: float32 for the 16-bit (and 8-bit) formats, else float64."""
    info = dtype_info(dtype)
    return torch.float32 if info is not None and info.bits <= 16 else torch.float64


class OldValues:
    """Reusable buffers for the old values (and ``new - old``) of the writes being measured.

    A fresh buffer per write costs more than the copy into it (a large one is mmap'ed and page-faulted anew: ~5x a
    copy into a warm buffer on this CPU), and many mid-sized ones freed between the step's transients fragment the
    C heap. A write borrows one flat buffer per (dtype, device) for all its tensors (:meth:`take`) and gives it back
    once its rows are made (:meth:`give`); at most :data:`KEEP` free buffers per key are kept (the largest), and
    :meth:`clear` drops them all (the trace calls it when it reads a step's statistics back)."""

    KEEP = 2

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements (uninitialised), not handed out again until given back."""
        free = self._free.get((dtype, device), [])
        fits = [b for b in free if b.numel() >= numel]
        if fits:
            free.remove(buf := min(fits, key=lambda b: b.numel()))
            return buf
        if free:  # none fits: drop the smallest free one rather than keep it next to a larger new one
            free.remove(min(free, key=lambda b: b.numel()))
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        free = self._free.setdefault((buf.dtype, buf.device), [])
        free.append(buf)
        if len(free) > self.KEEP:  # keep the largest
            free.remove(min(free, key=lambda b: b.numel()))

    def views(self, like: list[torch.Tensor], dtypes: list[torch.dtype]) -> tuple[list[Any], list[torch.Tensor]]:
        """Buffers shaped like ``like`` in ``dtypes`` (views into flat ones, one per dtype and device), and those."""
        need: dict[tuple[torch.dtype, torch.device], int] = {}
        for t, dt in zip(like, dtypes):
            need[(dt, t.device)] = need.get((dt, t.device), 0) + t.numel()
        flat = {k: self.take(n, *k) for k, n in need.items()}
        used, out = dict.fromkeys(need, 0), []
        for t, dt in zip(like, dtypes):
            k, n = (dt, t.device), t.numel()
            out.append(flat[k][used[k]:used[k] + n].view(t.shape))
            used[k] += n
        return out, list(flat.values())

    def clear(self) -> None:
        self._free.clear()


@dataclass
class WriteRecord:
    """One in-place write into module state. ``module`` is the module whose code ran the op (``""`` for loop
    code outside every module), ``owner`` the module owning the written tensor; ``seq`` counts the writes to
    the same tensor within the step (the key that matches a write of the target to the reference's)."""

    index: int
    op: str
    phase: str
    step: int
    module: str
    owner: str
    target: str          # "parameter", "buffer" or "grad"
    name: str
    dtype: str
    seq: int
    src: tuple[str, int] | None = None
    stats: dict[str, float] = field(default_factory=dict)
    row: Any = None

    @property
    def key(self) -> tuple[int, str, str, int]:
        return (self.step, self.target, self.name, self.seq)

    @property
    def fraction_lost(self) -> float:
        moving = self.stats.get("moving", 0.0)
        return self.stats.get("lost", 0.0) / moving if moving > 0 else 0.0


def state_index(model: torch.nn.Module) -> dict[int, tuple[str, str, str]]:
    """Storage pointer -> ``(target, qualified name, owning module)`` for every parameter and buffer."""
    out: dict[int, tuple[str, str, str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=True):
        for kind, items in (("parameter", mod.named_parameters(recurse=False)),
                            ("buffer", mod.named_buffers(recurse=False))):
            for n, t in items:
                if t is None or not t.is_floating_point():
                    continue
                try:
                    ptr = t.untyped_storage().data_ptr()
                except Exception:  # noqa: BLE001 - tensors without storage are not watched
                    continue
                out.setdefault(ptr, (kind, f"{mname}.{n}" if mname else n, mname))
    return out


#: ops that write ``running_mean`` / ``running_var`` without their schema marking them written
#: (:attr:`Kind.STATS_WRITE` in the op registry)
HIDDEN_WRITES = ops_with(Kind.STATS_WRITE)
_STATS_ARGS = ("running_mean", "running_var")


def written_args(func: Any, args: Any, kwargs: Any, cache: dict[Any, tuple[tuple[int, str, bool], ...]]
                 ) -> list[torch.Tensor]:
    """The tensors an op writes (``self`` of ``add_``, each list element of ``_foreach_add_``, the running
    statistics of a batch norm in training), ``out=`` buffers excluded (their old memory is not state)."""
    pos = cache.get(func)
    if pos is None:
        hidden = _STATS_ARGS if func.overloadpacket.__name__ in HIDDEN_WRITES else ()
        pos = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                    if (a.alias_info is not None and a.alias_info.is_write or a.name in hidden)
                    and not a.kwarg_only)
        cache[func] = pos
    out: list[torch.Tensor] = []
    for i, name, _ in pos:
        v = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


class PendingWrite:
    """A write about to run: old values taken before the op changes the tensors, and the wider re-run.

    The re-run is deferred until after the op where it can be (``tensors`` are all it writes, on a host device, and
    no other argument shares their storage): :meth:`rows` then re-runs a float32 (or wider) write only where it
    left elements unchanged, and any other on the old values. Elsewhere (an accelerator: deciding would read a
    value back) it runs before the op. ``measure`` False: logged, not measured (statistics NaN, nothing copied).

    A deferred float32 write keeps its old values as a float32 copy (a memory copy; widening costs ~6x more on CPU)
    and widens them only if it must be re-run whole."""

    def __init__(self, func: Any, args: Any, kwargs: Any, tensors: list[torch.Tensor], defer: bool,
                 measure: bool = True, buffers: OldValues | None = None) -> None:
        self.tensors = tensors
        self.old: list[torch.Tensor | None] = []
        self.exact: list[torch.Tensor | None] = [None] * len(tensors)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        self._call: tuple[Any, Any, Any] | None = (func, args, kwargs) if defer and measure and not seeded else None
        self._narrow = False
        self.measured = measure
        #: the borrowed flat buffers the old values live in (given back to ``_buffers`` once the rows are made)
        self._buffers = buffers if buffers is not None else OldValues()
        self._borrowed: list[torch.Tensor] = []
        if not measure:
            self.old = [None] * len(tensors)
            return
        #: old values kept in the stored dtype (a deferred wide write), widened only for a whole re-run
        self._narrow = self._call is not None and all(_wider(t.dtype) == torch.float64 for t in tensors)
        with torch._C.DisableTorchFunction(), torch.no_grad(), _disable_current_modes():
            try:
                dtypes = [t.dtype if self._narrow else _wider(t.dtype) for t in tensors]
                bufs, self._borrowed = self._buffers.views(tensors, dtypes)
                self.old = [b.copy_(t.detach()) for b, t in zip(bufs, tensors)]
            except Exception:  # noqa: BLE001 - observation must not raise into user code
                self.old = [None] * len(tensors)
            if not defer and not seeded:
                self._rerun(func, args, kwargs, {})

    def _rerun(self, func: Any, args: Any, kwargs: Any, memo: dict[int, torch.Tensor]) -> None:
        def up(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                if not obj.is_floating_point():
                    return obj
                c = memo.get(id(obj))
                if c is None:
                    c = obj.detach().to(_wider(obj.dtype), copy=True)
                    memo[id(obj)] = c
                return c
            if isinstance(obj, (list, tuple)):
                return type(obj)(up(o) for o in obj)
            return obj

        try:
            func(*up(tuple(args)), **{k: up(v) for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001 - an op that wants its dtypes: no exact update, statistics unknown
            return
        self.exact = [memo.get(id(t)) for t in self.tensors]

    def rows(self, exact_needed: bool) -> list[Any]:
        """One statistics row per written tensor (after the op ran), no host sync on an accelerator.

        A deferred float32 (or wider) write is judged without re-running all of it unless ``exact_needed``: an
        element the write changed kept no update away, so only the elements it left unchanged can have lost one --
        none (no re-run), or, where the stored update is finite, a point-wise op on one tensor (re-run on just those
        elements). ``intended`` is then unknown (NaN) and ``moving`` counts the changed elements as moving. Any other
        deferred write re-runs whole now, on copies of the old values. On the host a row is a host list (reading a
        value costs nothing there); an unmeasured write's row is a host list of NaN: no tensor (thousands of small
        tensors that outlive the step's transients pin the holes those leave in the C heap: see
        :class:`~ampdoctor.trace._stats.Scratch`). The old values' buffers are given back when the rows are made."""
        if not self.measured:
            return [[math.nan] * len(WRITE_FIELDS) for _ in self.tensors]
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad(), _disable_current_modes():
                return self._measured_rows(exact_needed)
        finally:
            self.old, self.exact = [None] * len(self.tensors), [None] * len(self.tensors)
            for b in self._borrowed:
                self._buffers.give(b)
            self._borrowed = []

    def _measured_rows(self, exact_needed: bool) -> list[Any]:
        if self._narrow and not exact_needed and all(o is not None for o in self.old):
            rows = self._wide_rows()
            if rows is not None:
                return rows
        if self._narrow:
            self.old = [o.to(_wider(o.dtype)) if o is not None else None for o in self.old]
        applied = [_applied(t, old) for t, old in zip(self.tensors, self.old)]
        if self._call is not None:
            func, args, kwargs = self._call
            self._rerun(func, args, kwargs, {id(t): old.clone() for t, old in zip(self.tensors, self.old)
                                             if old is not None})
        return [_row(t, old, exact, a) for t, old, exact, a in zip(self.tensors, self.old, self.exact, applied)]

    def _wide_rows(self) -> list[Any] | None:
        """Rows of a deferred wide write from its unchanged elements only (see :meth:`rows`); None: re-run it all.

        ``new - old`` is taken in the stored dtype, into a borrowed buffer: zero exactly where the value did not
        change (IEEE subtraction of unequal finite numbers is never 0), and exact wherever the new value is within a
        factor 2 of the old one (Sterbenz), so ``applied`` -- summed in float64 (:func:`_abs_total`) -- equals the
        widened computation's for any update smaller than the value it updates. One pass counts the changed elements
        (NaN counts as changed); a write that changed them all is done (nothing left to lose, whatever its values)."""
        func, args, _ = self._call  # type: ignore[misc]
        diffs, borrowed = self._buffers.views(self.tensors, [t.dtype for t in self.tensors])
        self._borrowed += borrowed
        for d, t, old in zip(diffs, self.tensors, self.old):
            torch.sub(t.detach(), old, out=d)  # type: ignore[arg-type]
        changed = [int(torch.count_nonzero(d)) for d in diffs]
        totals = [_abs_total(d) for d in diffs]
        if all(c == t.numel() for c, t in zip(changed, self.tensors)):
            return [_counts_row(t, 0, total, 0) for t, total in zip(self.tensors, totals)]
        if not all(map(math.isfinite, totals)):
            return None
        t, old = self.tensors[0], self.old[0]
        if (len(self.tensors) != 1 or old is None or torch.Tag.pointwise not in func.tags or not args
                or args[0] is not t):
            return None
        unchanged = (diffs[0] == 0).reshape(-1).nonzero().squeeze(1)
        lost = _lost_where_unchanged(self._call, t, old, unchanged)  # type: ignore[arg-type]
        return None if lost is None else [_counts_row(t, unchanged.numel(), totals[0], lost)]


def _abs_total(d: torch.Tensor) -> float:
    """``sum(|d|)`` in float64, ``d`` overwritten by ``|d|``. A float32 tensor above :data:`_SUM_CHUNK` elements is
    summed per chunk in float32 and the chunk sums in float64 (``sum(dtype=float64)`` of float32 converts element by
    element: ~25x a float32 sum on this CPU); a chunk's float32 sum is within ~1e-7 of its exact sum."""
    a = d.abs_().reshape(-1)
    n = a.numel() // _SUM_CHUNK * _SUM_CHUNK
    if a.dtype != torch.float32 or n == 0:
        return float(a.sum(dtype=torch.float64))
    return float(a[:n].view(-1, _SUM_CHUNK).sum(1).sum(dtype=torch.float64)) + float(a[n:].sum(dtype=torch.float64))


_SUM_CHUNK = 1 << 16  # elements per float32 chunk of :func:`_abs_total`


def _lost_where_unchanged(call: tuple[Any, Any, Any], t: torch.Tensor, old: torch.Tensor,
                          unchanged: torch.Tensor) -> int | None:
    """Elements a point-wise in-place op on ``t`` left unchanged (``unchanged``: their logical positions) whose exact
    update is nonzero: the op re-run one format wider on just those elements (every argument broadcast to ``t`` and
    gathered there). None if it fails."""
    func, args, kwargs = call
    old_sub = torch.take(old, unchanged).to(_wider(t.dtype))

    def sub(obj: Any) -> Any:
        if obj is t:
            return old_sub.clone()
        if isinstance(obj, torch.Tensor):
            x = torch.take(obj.detach().expand(t.shape), unchanged)
            return x.to(_wider(x.dtype)) if x.is_floating_point() else x
        if isinstance(obj, (list, tuple)):
            return type(obj)(sub(o) for o in obj)
        return obj

    try:
        exact = func(*sub(tuple(args)), **{k: sub(v) for k, v in kwargs.items()})
        return int(torch.count_nonzero(exact - old_sub)) if exact.shape == old_sub.shape else None
    except Exception:  # noqa: BLE001 - a shape or dtype the gather cannot serve: re-run the whole write
        return None


def deferrable(func: Any, args: Any, kwargs: Any, written: list[torch.Tensor], picked: list[torch.Tensor]) -> bool:
    """Whether the exact re-run of a write may wait until after the op: it writes only ``picked`` (whose old values
    are copied), on host devices, and no other floating argument shares their storage (so every other argument
    still holds the values the op read)."""
    if len(written) != len(picked) or any(t.device.type not in _stats.HOST_DEVICES for t in picked):
        return False
    ptrs = set()
    for t in picked:
        try:
            ptrs.add(t.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001 - no storage: not deferred
            return False
    ids = {id(t) for t in picked}
    others: list[torch.Tensor] = []
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            others.append(v)
        elif isinstance(v, (list, tuple)):
            others.extend(x for x in v if isinstance(x, torch.Tensor))
    for t in others:
        if id(t) in ids or not t.is_floating_point():
            continue
        try:
            if t.untyped_storage().data_ptr() in ptrs:
                return False
        except Exception:  # noqa: BLE001 - no storage: not deferred
            return False
    return True


def _applied(t: torch.Tensor, old: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``|new - old|`` one format wider than the stored dtype (a fresh tensor) and its sum."""
    if old is None:
        return None
    try:  # widening is exact: the type promotion of ``sub`` computes what converting first computes
        diff = torch.sub(t.detach(), old) if t.dtype == old.dtype or old.dtype == torch.float64 else (
            t.detach().to(old.dtype) - old)
        return diff, diff.abs_().sum()
    except Exception:  # noqa: BLE001 - observation must not raise into user code
        return None


def _counts_row(t: torch.Tensor, unchanged: int, total: float, lost: int) -> list[float]:
    """The row of a wide write with ``unchanged`` elements, ``lost`` of which should have moved (its changed elements
    all moved): exact update unknown (NaN)."""
    n = t.numel()
    changed = n - unchanged
    return [float(n), float(changed + lost), float(lost), float(changed), math.nan, float(total)]


def _row(t: torch.Tensor, old: torch.Tensor | None, exact: torch.Tensor | None,
         applied: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    """The row of a write re-run whole: a host list on a host device, else one float64 device tensor (no sync)."""
    host = t.device.type in _stats.HOST_DEVICES
    nan: Any = [math.nan] * len(WRITE_FIELDS) if host else torch.full(
        (len(WRITE_FIELDS),), math.nan, dtype=torch.float64, device=t.device)
    if old is None or applied is None:
        return nan
    try:
        diff, total = applied  # |new - old|
        cnt = torch.count_nonzero  # NaN counts as nonzero, as ``!= 0`` does
        vals: list[Any] = [float(t.numel())]
        if exact is not None and exact.shape == old.shape:
            intended = exact - old
            lost = cnt(torch.where(diff == 0, intended, 0))  # moving elements the stored write left unchanged
            vals += [cnt(intended), lost, cnt(diff), intended.abs_().sum()]
        else:
            vals += [math.nan, math.nan, cnt(diff), math.nan]
        vals.append(total)
        if host:
            return [float(v) for v in vals]
        return torch.stack([v.to(torch.float64) if isinstance(v, torch.Tensor)
                            else torch.tensor(v, dtype=torch.float64, device=t.device) for v in vals])
    except Exception:  # noqa: BLE001 - observation must not raise into user code
        return nan


class WriteLog:
    """The writes into module state one trace saw; the recording mode calls :meth:`before` and :meth:`after`
    around each mutating op. ``state_ptrs`` is refreshed by the trace (:func:`state_index`) at each step."""

    def __init__(self, attribution: Any) -> None:
        self.attr = attribution
        self.state_ptrs: dict[int, tuple[str, str, str]] = {}
        self.records: list[WriteRecord] = []
        self._seq: dict[tuple[int, str, str], int] = {}
        self._cache: dict[Any, Any] = {}
        #: which writes are measured: ``(tensor, (target, name, owner), module running the op or None) -> bool``,
        #: asked before the op runs; None: all. An unmeasured write is still logged (op, tensor, order: later
        #: ``seq`` stays aligned) with NaN statistics and no copy: a caller that knows which writes its analysis
        #: reads skips the others' old-value copy and wider re-run (the diagnosis: ``ampdoctor.precision._runner``)
        self.measure: Any = None
        #: the measured writes' old-value buffers, reused from write to write within a step
        self.buffers = OldValues()

    def before(self, func: Any, args: Any, kwargs: Any, node: Any, module: str | None = None
               ) -> tuple[PendingWrite, list[tuple[str, str, str]]] | None:
        """The module state (parameters, buffers, the gradient ``AccumulateGrad`` adds into) the op writes, with
        old values and exact update taken before it runs; None when it writes none."""
        ts = written_args(func, args, kwargs, self._cache)
        if not ts:
            return None
        acc = getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None
        picked: list[torch.Tensor] = []
        meta: list[tuple[str, str, str]] = []
        for t in ts:
            if not t.is_floating_point() or t.is_meta:
                continue
            try:
                info = self.state_ptrs.get(t.untyped_storage().data_ptr())
            except Exception:  # noqa: BLE001 - tensors without storage are not watched
                continue
            if info is None and acc is not None and id(acc) in self.attr.param_names:
                info = ("grad", self.attr.param_names[id(acc)], self.attr.param_owner.get(id(acc), ""))
            if info is not None:
                picked.append(t)
                meta.append(info)
        if not picked:
            return None
        measure = self.measure is None or any(self.measure(t, m, module) for t, m in zip(picked, meta))
        defer = measure and deferrable(func, args, kwargs, ts, picked)
        return PendingWrite(func, args, kwargs, picked, defer, measure, self.buffers), meta

    def after(self, pending: tuple[PendingWrite, list[tuple[str, str, str]]], op: str, phase: str, module: str,
              step: int, index: int, src: tuple[str, int] | None) -> None:
        """Log the writes of an op that ran (``index``: the first record it makes). The training-step code's own
        writes (``module`` ``""``) keep their exact update in every dtype: ``loss-scaling-misuse`` reports it."""
        try:
            rows = pending[0].rows(not module)
        except Exception:  # noqa: BLE001 - observation must not raise into user code: statistics unknown
            rows = [[math.nan] * len(WRITE_FIELDS) for _ in pending[0].tensors]
        for row, t, (target, name, owner) in zip(rows, pending[0].tensors, pending[1]):
            k = (step, target, name)
            seq = self._seq.get(k, 0)
            self._seq[k] = seq + 1
            self.records.append(WriteRecord(index, op, phase, step, module, owner, target, name,
                                            str(t.dtype).replace("torch.", ""), seq, src, row=row))

    def unread(self) -> list[WriteRecord]:
        """The writes whose rows are not read back yet. The trace asks when it reads a step's statistics back: the
        step's writes are over, so the old-value buffers are dropped here (not held between steps or after the
        trace)."""
        self.buffers.clear()
        return [w for w in self.records if w.row is not None]

    def read_with(self, rows: list[Any], writes: list[WriteRecord], width: int, sketch: Any, base: int,
                  records: list[Any]) -> list[list[float]]:
        """The trace's statistics rows (host lists as they are, tensor rows stacked per device) read back in one
        transfer per device together with ``writes`` (padded with zeros to ``width``) and the sketches; fills
        the writes' ``stats`` and returns the rows' values."""
        pad = max(0, width - len(WRITE_FIELDS))
        ext = rows + [w.row + [0.0] * pad if isinstance(w.row, list) else torch.cat([w.row, w.row.new_zeros(pad)])
                      for w in writes]
        values: list[list[float]] = [[] for _ in ext]
        by_dev: dict[Any, list[int]] = {}
        for i, r in enumerate(ext):
            if isinstance(r, list):
                values[i] = r
            else:
                by_dev.setdefault(r.device, []).append(i)
        sketch.read_rows(ext, by_dev, values, base, records)
        for w, v in zip(writes, values[len(rows):]):
            w.stats, w.row = dict(zip(WRITE_FIELDS, v)), None
        return values[:len(rows)]
