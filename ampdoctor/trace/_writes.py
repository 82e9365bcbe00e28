"""In-place writes to module state: the update each one applies against the same write computed wider.

Every op that writes into the storage of a parameter, a registered buffer or an accumulated gradient
(``copy_``, ``lerp_``, ``mul_``, ``add_``, ``addcdiv_``, ``index_put_``, a batch norm's running statistics,
``_foreach_*_`` in an optimizer, ``AccumulateGrad``'s ``add_`` ...) -- from the optimizer, from the model's own
code or from the user's training-step code -- is re-run on float copies one format wider (16-bit -> float32,
float32 -> float64) before it runs for real. Per written tensor the trace keeps, on the device:

- ``numel``, ``moving``: elements whose exact update is nonzero, ``lost``: moving elements the stored write left
  unchanged (the update was below half an ulp of the stored value and rounded away), ``changed``: elements the
  stored write changed, ``intended`` / ``applied``: sums of ``|exact - old|`` and ``|new - old|``.

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

from ampdoctor.trace._dtypes import dtype_info
from ampdoctor.trace._ops import Kind, ops_with

#: the statistics of one write, in row order
WRITE_FIELDS = ("numel", "moving", "lost", "changed", "intended", "applied")


def _wider(dtype: torch.dtype) -> torch.dtype:
    """One format wider than ``dtype``: float32 for the 16-bit (and 8-bit) formats, else float64."""
    info = dtype_info(dtype)
    return torch.float32 if info is not None and info.bits <= 16 else torch.float64


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
    """A write about to run: old values and the wider re-run, taken before the op changes the tensors."""

    def __init__(self, func: Any, args: Any, kwargs: Any, tensors: list[torch.Tensor], measure: bool = True) -> None:
        self.tensors = tensors
        self.old: list[torch.Tensor | None] = []
        self.exact: list[torch.Tensor | None] = [None] * len(tensors)
        if not measure:  # logged, not measured: statistics NaN, nothing copied
            self.old = [None] * len(tensors)
            return
        with torch._C.DisableTorchFunction(), torch.no_grad(), _disable_current_modes():
            for t in tensors:
                try:
                    self.old.append(t.detach().to(_wider(t.dtype), copy=True))
                except Exception:  # noqa: BLE001 - observation must not raise into user code
                    self.old.append(None)
            if torch.Tag.nondeterministic_seeded not in func.tags:
                self._rerun(func, args, kwargs)

    def _rerun(self, func: Any, args: Any, kwargs: Any) -> None:
        memo: dict[int, torch.Tensor] = {}

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

    def rows(self) -> list[torch.Tensor]:
        """One statistics row per written tensor (after the op ran), on its device, no host sync."""
        out = []
        with torch._C.DisableTorchFunction(), torch.no_grad(), _disable_current_modes():
            for t, old, exact in zip(self.tensors, self.old, self.exact):
                out.append(_row(t, old, exact))
        return out


def _row(t: torch.Tensor, old: torch.Tensor | None, exact: torch.Tensor | None) -> torch.Tensor:
    nan = torch.full((len(WRITE_FIELDS),), math.nan, dtype=torch.float64, device=t.device)
    if old is None:
        return nan
    try:
        applied = t.detach().to(old.dtype) - old
        changed = applied != 0
        vals = [torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device)]
        if exact is not None and exact.shape == old.shape:
            intended = exact - old
            moving = intended != 0
            vals += [moving.sum(), (moving & ~changed).sum(), changed.sum(), intended.abs().sum()]
        else:
            n = torch.tensor(math.nan, dtype=torch.float64, device=t.device)
            vals += [n, n, changed.sum(), n]
        vals.append(applied.abs().sum())
        return torch.stack([v.to(torch.float64) for v in vals])
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
        #: which writes are measured: ``(tensor, (target, name, owner)) -> bool``, asked before the op runs; None:
        #: all. An unmeasured write is still logged (op, tensor, order: the ``seq`` of later writes stays aligned)
        #: with NaN statistics, and costs no copy: a caller that knows which writes its analysis reads skips the
        #: others' old-value copy and wider re-run (the diagnosis: see ``ampdoctor.precision._runner``)
        self.measure: Any = None

    def before(self, func: Any, args: Any, kwargs: Any, node: Any
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
        measure = self.measure is None or any(self.measure(t, m) for t, m in zip(picked, meta))
        return PendingWrite(func, args, kwargs, picked, measure), meta

    def after(self, pending: tuple[PendingWrite, list[tuple[str, str, str]]], op: str, phase: str, module: str,
              step: int, index: int, src: tuple[str, int] | None) -> None:
        """Log the writes of an op that ran (``index``: the first record it makes)."""
        for row, t, (target, name, owner) in zip(pending[0].rows(), pending[0].tensors, pending[1]):
            k = (step, target, name)
            seq = self._seq.get(k, 0)
            self._seq[k] = seq + 1
            self.records.append(WriteRecord(index, op, phase, step, module, owner, target, name,
                                            str(t.dtype).replace("torch.", ""), seq, src, row=row))

    def unread(self) -> list[WriteRecord]:
        return [w for w in self.records if w.row is not None]

    def read_with(self, rows: list[Any], writes: list[WriteRecord], width: int, sketch: Any, base: int,
                  records: list[Any]) -> list[list[float]]:
        """The trace's statistics rows (host lists as they are, tensor rows stacked per device) read back in one
        transfer per device together with ``writes`` (padded with zeros to ``width``) and the sketches; fills
        the writes' ``stats`` and returns the rows' values."""
        ext = rows + [torch.cat([w.row, w.row.new_zeros(max(0, width - len(WRITE_FIELDS)))]) for w in writes]
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
