"""The recording ``TorchDispatchMode``: one record per floating-point op output, statistics kept on device.

Lineage is tracked by tensor geometry: every floating output registers ``(storage pointer, offset, shape,
stride, dtype)`` as produced by its record; an input is linked to the latest record that produced that
geometry. Writes through another view of the same storage (``index_put_``, ``masked_fill_`` on a slice) are
caught by a per-storage writer index, and such an input gets fresh statistics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ampdoctor.trace._dtypes import flushes_to_zero
from ampdoctor.trace._identity import STORAGE, Pins
from ampdoctor.trace._identity import tensor_key as _key
from ampdoctor.trace._modules import ModuleAttribution, user_frame
from ampdoctor.trace._opdesc import OpDesc, dtype_name, flat, gather, op_desc
from ampdoctor.trace._ops import Literal, literal_values
from ampdoctor.trace._sample import Sketches
from ampdoctor.trace._stats import (
    CHEAP_FIELDS,
    FULL,
    FULL_FIELDS,
    HEADROOM_FORMATS,
    Scratch,
    cheap_stats,
    full_stats,
    lite_stats,
    zeros_lite_row,
)
from ampdoctor.trace._writes import WriteLog

_current_node = torch._C._current_autograd_node
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_NO_DISPATCH = torch._C._DisableTorchDispatch
_DISPATCH_STACK = torch._C._len_torch_dispatch_stack


def _outside_modes(fn: Any, t: torch.Tensor, *extra: Any) -> Any:
    """``fn(t, *extra)`` with no dispatch mode below this one seeing its ops (the trace's statistics and samples are
    ours, not the step's: a precision emulation below must not cast, count or intercept them).

    A plain tensor's ops skip the Python dispatch key (one C++ guard, ~2 us); a subclass (``DTensor``) keeps its own
    ``__torch_dispatch__`` and only the modes are popped (``_disable_current_modes``, ~35 us: once per output it
    cost the CUDA-policy target run ~0.5 s at 220M parameters). Same kernels either way: the same numbers."""
    if not _DISPATCH_STACK():
        return fn(t, *extra)
    if type(t) is torch.Tensor:
        with _NO_DISPATCH():
            return fn(t, *extra)
    with _disable_current_modes():
        return fn(t, *extra)


class OpRecord:
    """One floating-point tensor seen by the trace: an op output, or a leaf (parameter, input, constant).

    ``kind`` is ``"op"``, ``"param"`` or ``"input"``. ``inputs`` are indices of the records that produced
    the op's floating inputs. ``stats`` is filled when the step is read back (a dict of floats).
    """

    __slots__ = (
        "index", "op", "module", "phase", "step", "node", "dtype", "shape", "inputs", "row", "kind",
        "src", "scalars", "literals", "name", "stats", "input_dtypes", "out_pos", "align",
        "sample", "index_src",
    )

    def __init__(self, index: int, op: str, module: str, phase: str, step: int, node: str, dtype: torch.dtype,
                 shape: tuple[int, ...], inputs: tuple[int, ...], row: int, kind: str = "op") -> None:
        self.index = index
        self.op = op
        self.module = module
        self.phase = phase
        self.step = step
        self.node = node
        self.dtype = dtype
        self.shape = shape
        self.inputs = inputs
        self.row = row
        self.kind = kind
        self.src: tuple[str, int] | None = None
        self.scalars: tuple[float, ...] = ()
        #: the op's declared literal arguments this call passed as numbers (``trace._ops.literal_values``)
        self.literals: tuple[tuple[Literal, float], ...] = ()
        self.name = ""
        self.stats: dict[str, float] = {}
        self.input_dtypes: tuple[str, ...] = ()
        self.out_pos = 0
        self.sample: tuple[float, ...] = ()  # values at fixed positions, step 0 (``trace._sample``)
        self.index_src: tuple[int, ...] = ()  # records its integer inputs (indices) were computed from

    def __repr__(self) -> str:
        return f"OpRecord(#{self.index} {self.op} module={self.module!r} {self.phase} {self.dtype} {self.shape})"


def _safe(fn: Any, t: torch.Tensor, *extra: Any, width: int | None = None) -> Any:
    """Statistics must never break the user's step: on failure, a row of NaN marks the record unknown.

    They run outside every other mode (torch-function modes such as the precision emulation: off in the whole
    handler, see ``__torch_dispatch__``; dispatch modes below this one: disabled here): they are ours, not the
    step's, so nothing may cast, count or intercept them."""
    try:
        return _outside_modes(fn, t, *extra)
    except Exception:  # noqa: BLE001 - observation must not raise into user code
        n = width if width is not None else len(CHEAP_FIELDS) if fn is cheap_stats else len(FULL_FIELDS)
        return torch.full((n,), math.nan, dtype=torch.float64, device=t.device)


def _placeholder(t: torch.Tensor, n: int) -> torch.Tensor:
    """A finite all-zero statistics row for a tensor whose contents are not data yet."""
    return torch.zeros(n, dtype=torch.float64, device=t.device)


class RecordingMode(TorchDispatchMode):
    """Records every floating op output. ``full=False`` keeps only ``aminmax`` per output (cheap tier)."""

    def __init__(self, attribution: ModuleAttribution, *, full: bool = True) -> None:
        super().__init__()
        self.attr = attribution
        self.full = full
        self.records: list[OpRecord] = []
        self.rows: list[Any] = []
        self.producer: dict[tuple[Any, ...], int] = {}
        self.storage_writer: dict[int, int] = {}  # storage identity -> latest record that wrote into it
        self.pins = Pins()  # keys stored below never match a later storage at a reused address
        self.step = 0
        self.in_optimizer = False
        self.seen_backward = False
        self._calls_seen = 0
        self.error: dict[str, Any] | None = None
        self.param_ptrs: dict[int, str] = {}
        self.ptr_owner: dict[int, str] = {}
        self.buffer_ptrs: dict[int, str] = {}  # storage of a registered floating buffer -> its qualified name
        self.batch_ptrs: set[int] = set()
        self.enabled = True
        self.headroom = False
        #: which full-row statistics this run computes (``trace._stats.Request``: the caller's analysis declares it)
        self.request = FULL
        self.scratch = Scratch()
        self._row_base = 0
        self._read_upto = 0
        self.sketch = Sketches(self.pins.key)  # step-0 samples, decision indices, integer tensors' sources
        self.writes = WriteLog(attribution)  # in-place writes into module state (:mod:`._writes`)

    # -- helpers -------------------------------------------------------------------------------------------
    def _phase(self, node: Any) -> str:
        if node is not None:
            self.seen_backward = True
            return "backward"
        if self.in_optimizer:
            return "optimizer"
        if self.attr.calls != self._calls_seen:
            self._calls_seen = self.attr.calls
            self.seen_backward = False
        if self.seen_backward and not self.attr.stack:
            return "optimizer"
        return "forward"

    def _loop_code(self, phase: str) -> bool:
        """The user's step code after the backward, outside every module and ``optimizer.step``: module ``""``."""
        return phase == "optimizer" and not self.in_optimizer and not self.attr.stack

    def _module(self, node: Any, phase: str, tensors: list[torch.Tensor]) -> str:
        if phase == "backward":
            return self.attr.backward_owner(node)
        if phase != "optimizer":
            return self.attr.current
        if self._loop_code(phase):
            return ""
        for t in tensors:
            try:
                name = self.ptr_owner.get(t.untyped_storage().data_ptr())
            except Exception:
                name = None
            if name is not None:
                return name
        for t in tensors:  # temporaries and state created inside step(): the module of their producer
            key = _key(t)
            idx = self.producer.get(key) if key is not None else None
            if idx is not None and self.records[idx].module:
                return self.records[idx].module
        return ""

    def _leaf(self, t: torch.Tensor, key: tuple[Any, ...] | None, phase: str, module: str) -> int:
        idx = len(self.records)
        ptr = key[0] if key is not None else None
        pname = self.param_ptrs.get(ptr) if ptr is not None else None
        kind = "param" if pname is not None and phase != "optimizer" else (
            "batch" if ptr in self.batch_ptrs else "input")
        row_index = self._row_base + len(self.rows)
        rec = OpRecord(idx, "", module, phase, self.step, "", t.dtype, tuple(t.shape), (), row_index, kind)
        rec.name = pname or (self.buffer_ptrs.get(ptr, "") if kind == "input" and ptr is not None else "")
        if not self.full:
            row = _safe(cheap_stats, t)
        elif kind == "param":
            row = self._lite_row(t)
        else:
            row = self._full_row(t, None)
        if self.full and self.step == 0:
            _outside_modes(self.sketch.sample, t, row_index, self.step, phase)
        self.rows.append(row)
        self.records.append(rec)
        if key is not None:
            self.producer[key] = idx
        return idx

    def _input_index(self, t: torch.Tensor, phase: str, module: str) -> int:
        key = self.pins.key(t)
        if key is None:
            return -1
        idx = self.producer.get(key)
        w = self.storage_writer.get(key[STORAGE])
        if idx is None or (w is not None and w > idx):
            # unseen, or changed through another view since it was produced: fresh statistics
            idx2 = self._leaf(t, key, phase, module)
            if w is not None and idx is not None:
                self.records[idx2].inputs = (idx, w)
            elif w is not None:
                self.records[idx2].inputs = (w,)
            elif idx is not None:
                self.records[idx2].inputs = (idx,)
            if w is not None:  # named after the op that wrote through the other view
                self.records[idx2].kind = "op"
                self.records[idx2].op = self.records[w].op
            return idx2
        return idx

    # -- dispatch ------------------------------------------------------------------------------------------
    def _cheap(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The cheap tier: one ``aminmax`` per floating output; views skipped (their base is recorded), and in
        the optimizer step only writes into parameter storage."""
        node = _current_node()
        phase = self._phase(node)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            self._record_error(func, args, kwargs, node, phase, "", e)
            raise
        d = op_desc(func)
        op, mutable = d.name, d.mutable
        if d.view or d.uninit or d.collective:
            return out
        if phase == "optimizer":
            outs: list[torch.Tensor] = []
            flat(out, outs)
            if not outs and mutable:
                self._written(func, args, kwargs, outs)
            for t in outs:
                if t.is_floating_point():
                    try:
                        mod = self.ptr_owner.get(t.untyped_storage().data_ptr())
                    except Exception:
                        mod = None
                    if mod is not None:
                        self._cheap_record(op, mod, phase, node, t)
            return out
        module = self.attr.backward_owner(node) if phase == "backward" else self.attr.current
        if type(out) is torch.Tensor:
            if out.is_floating_point():
                self._cheap_record(op, module, phase, node, out)
            return out
        outs = []
        flat(out, outs)
        for t in outs:
            if t.is_floating_point():
                self._cheap_record(op, module, phase, node, t)
        return out

    def _cheap_record(self, op: str, module: str, phase: str, node: Any, t: torch.Tensor) -> None:
        rec = OpRecord(len(self.records), op, module, phase, self.step,
                       type(node).__name__ if node is not None else "", t.dtype, tuple(t.shape), (),
                       self._row_base + len(self.rows))
        try:
            self.rows.append(cheap_stats(t))
        except Exception:  # noqa: BLE001 - observation must not raise into user code
            nan = torch.full((), math.nan, device=t.device)
            self.rows.append((nan, nan))
        self.records.append(rec)

    def _written(self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor]) -> None:
        """Arguments an in-place op writes (``_foreach_add_`` returns nothing: these are its outputs)."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                flat(kwargs.get(arg.name) if arg.kwarg_only else (args[i] if i < len(args) else None), outs)

    def _record_error(self, func: Any, args: Any, kwargs: Any, node: Any, phase: str, module: str,
                      e: Exception, in_idx: tuple[int, ...] = ()) -> None:
        if self.error is not None:
            return
        ins: list[torch.Tensor] = []
        flat(args, ins)
        for v in kwargs.values():
            flat(v, ins)
        if not module:
            module = self._module(node, phase, ins)
        self.error = {
            "inputs": self.sketch.error_inputs(in_idx, ins),
            "op": str(func), "module": module, "phase": phase, "step": self.step,
            "node": type(node).__name__ if node is not None else "",
            "input_dtypes": [str(t.dtype).replace("torch.", "") for t in ins],
            "scalars": [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)],
            "message": str(e).split("\n")[0][:300],
            "type": type(e).__name__,
            "src": user_frame() if phase == "forward" or self._loop_code(phase) else None,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        # Below the torch-function layer: a call reaches this handler after every torch-function mode and subclass
        # on its way (or, from the autograd engine, without any). The bookkeeping and the op's re-call run with
        # torch functions off, so a mode on the stack (the CUDA-policy emulation's step-wide scope, a fix's scope)
        # sees exactly the calls it sees without the trace: none of ours, no second pass of the op.
        with _NO_TORCH_FUNCTION():
            kwargs = kwargs or {}
            if not self.enabled:
                return func(*args, **kwargs)
            if not self.full:
                return self._cheap(func, args, kwargs)
            return self._full_op(func, args, kwargs)

    def _full_op(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The full tier: link the op's floating inputs to their records, run it, record its floating outputs."""
        node = _current_node()
        phase = self._phase(node)
        d = op_desc(func)
        ins, scalars = gather(args, kwargs, d.write_only)
        floats = [t for t in ins if t.is_floating_point()]
        module = self._module(node, phase, ins)
        in_idx = tuple([self._input_index(t, phase, module) for t in floats if not t.is_meta])
        pending = self.writes.before(func, args, kwargs, node, module) if d.writes else None
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            self._record_error(func, args, kwargs, node, phase, module, e, in_idx)
            raise
        if pending is not None:
            self.writes.after(pending, d.name, phase, module, self.step, len(self.records), user_frame())
        if type(out) is torch.Tensor:
            outs = [out]
        else:
            outs = []
            flat(out, outs)
            if not outs and d.mutable:
                self._written(func, args, kwargs, outs)
        if outs:
            shared = (user_frame() if phase == "forward" or (phase == "optimizer" and self._loop_code(phase)) else None,
                      tuple(scalars), literal_values(d.base, args, kwargs, d.arg_names) if d.literals else (),
                      tuple([dtype_name(t.dtype) for t in floats]),
                      self.sketch.index_sources(ins) if len(floats) < len(ins) else ())
            node_name = type(node).__name__ if node is not None else ""
            for pos, t in enumerate(outs):
                if t.is_floating_point() and not t.is_meta:
                    self._record_output(d, node, node_name, phase, module, in_idx, shared, pos, t, len(outs))
                elif not t.is_meta:  # an integer output: its sources, and a decision's indices (trace._sample)
                    self.sketch.integer(t, (d.name, d.base), module, phase, self.step, in_idx, ins, pos, args,
                                        kwargs)
        return out

    def _record_output(self, d: OpDesc, node: Any, node_name: str, phase: str, module: str, in_idx: tuple[int, ...],
                       shared: tuple[Any, ...], pos: int, t: torch.Tensor, n_outs: int) -> None:
        """One floating output of a full-tier op: a record, its statistics row (or a shared or placeholder one).

        ``shared``: what every output of the op shares, ``(src, scalars, literals, input dtypes, index sources)``."""
        idx = len(self.records)
        mod = (self._module(node, phase, [t]) or module) if phase == "optimizer" and n_outs > 1 else module
        rec = OpRecord(idx, d.name, mod, phase, self.step, node_name, t.dtype, tuple(t.shape), in_idx,
                       self._row_base + len(self.rows))
        rec.out_pos = pos
        first = self.records[in_idx[0]] if in_idx and in_idx[0] >= 0 else None
        # uninitialised memory and views of it (collective outputs keep their statistics: the rank agreement in
        # ampdoctor.precision._distributed reads them and tolerates either side of the asynchronous update)
        uninit = d.uninit or (d.view and first is not None and first.kind == "alloc")
        if (first is not None and d.alias and n_outs == 1
                and first.row >= self._row_base and first.dtype == t.dtype and first.kind != "alloc"
                and not (self.headroom and (first.kind == "param" or first.phase == "optimizer"))):
            rec.row = first.row  # same elements: same statistics, no extra reductions
            rec.src, rec.scalars, rec.literals, rec.input_dtypes = shared[:4]
        elif uninit:
            rec.kind = "alloc"
            self.rows.append(_placeholder(t, len(FULL_FIELDS) + (len(HEADROOM_FORMATS) if self.headroom else 0)))
        else:
            rec.src, rec.scalars, rec.literals, rec.input_dtypes, rec.index_src = shared
            if phase == "optimizer" and not any(flushes_to_zero(v, t.dtype) for _, v in rec.literals):
                self.rows.append(self._lite_row(t, d.zeros))  # (a literal 0 in the dtype: full counts, literal rules)
            else:
                row = self._full_row(t, d.bounded)
                above = self.request.samples_above  # (a host row's |max| is known: a sample no reader reads is skipped)
                if (phase != "optimizer" and self.step == 0
                        and (not above or not isinstance(row, list) or row[0] > above)):
                    _outside_modes(self.sketch.sample, t, rec.row, self.step, phase)
                self.rows.append(row)
        self.records.append(rec)
        key = self.pins.key(t)
        if key is not None:
            self.producer[key] = idx
            if d.mutable:
                self.storage_writer[key[STORAGE]] = idx

    def _lite_row(self, t: torch.Tensor, zeros: bool = False) -> Any:
        """:func:`lite_stats` (parameter leaves, optimizer outputs); in headroom mode padded with zero flush counts.

        Headroom reads only forward and backward op records, so a headroom trace keeps the statistics a plain one
        has (alias rows shared, parameters and optimizer outputs lite; only an op aliasing a lite row gets its own
        full row, which headroom reads): one run serves both ``check``'s headroom and its diagnosis."""
        row: Any = zeros_lite_row(t) if zeros else None  # the output of an all-zero op: known unread
        if row is None:
            try:  # (:func:`_safe` inlined: once per optimizer output)
                row = _outside_modes(lite_stats, t, self.scratch)
            except Exception:  # noqa: BLE001 - observation must not raise into user code
                row = torch.full((len(FULL_FIELDS),), math.nan, dtype=torch.float64, device=t.device)
        if not self.headroom:
            return row
        pad = [0.0] * len(HEADROOM_FORMATS)
        return row + pad if isinstance(row, list) else torch.cat([row, row.new_zeros(len(HEADROOM_FORMATS))])

    def _full_row(self, t: torch.Tensor, bounded: str | None) -> Any:
        """Full statistics of ``t`` (+ flush counts in headroom mode): a device row or a host list."""
        try:  # (:func:`_safe` inlined: once per forward and backward output)
            return _outside_modes(full_stats, t, bounded, self.scratch, self.headroom, self.request)
        except Exception:  # noqa: BLE001 - observation must not raise into user code
            width = len(FULL_FIELDS) + (len(HEADROOM_FORMATS) if self.headroom else 0)
            return torch.full((width,), math.nan, dtype=torch.float64, device=t.device)

    # -- read back -----------------------------------------------------------------------------------------
    def read(self) -> None:
        """Read the statistics of all records not read yet back to the host: ONE host sync per device."""
        from ampdoctor.trace._stats import CHEAP_FIELDS, FULL_FIELDS

        fields = FULL_FIELDS if self.full else CHEAP_FIELDS
        if self.full and self.headroom:
            fields = fields + tuple(f"flush_{name}" for name, _, _ in HEADROOM_FORMATS)
        rows, base = self.rows, self._row_base
        unread = self.writes.unread()
        if rows or unread:
            values: list[list[float]] = [[] for _ in rows]
            if self.full:  # with the write rows, the samples and decisions: one transfer per device
                values = self.writes.read_with(rows, unread, len(fields), self.sketch, base,
                                               self.records[self._read_upto:])
            else:  # (min, max) pairs: one stack per device and dtype, one read per device
                groups: dict[Any, list[int]] = {}
                for i, (mn, _) in enumerate(rows):
                    groups.setdefault((mn.device, mn.dtype), []).append(i)
                per_dev: dict[Any, list[tuple[list[int], torch.Tensor]]] = {}
                for (dev, _), idxs in groups.items():
                    pair = torch.stack([torch.stack([rows[i][0] for i in idxs]),
                                        torch.stack([rows[i][1] for i in idxs])], 1).to(torch.float64)
                    per_dev.setdefault(dev, []).append((idxs, pair))
                for parts in per_dev.values():
                    mat = torch.cat([p for _, p in parts]).cpu().tolist()
                    flat_idx = [i for idxs, _ in parts for i in idxs]
                    for i, v in zip(flat_idx, mat):
                        values[i] = v
            for rec in self.records[self._read_upto:]:
                rec.stats = dict(zip(fields, values[rec.row - base]))
            self._row_base += len(rows)
            self.rows = []
        self._read_upto = len(self.records)
