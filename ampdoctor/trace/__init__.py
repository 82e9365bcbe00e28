"""Op-level numerics observation: every aten op in forward, backward and the optimizer step.

>>> import torch
>>> from torch import nn
>>> from ampdoctor.trace import trace
>>> model = nn.Linear(4, 2).half()
>>> with torch.no_grad():
...     _ = model.weight.fill_(60.0)
>>> with trace(model, full=True) as t:            # also trace(model, optimizer): backward and the step
...     y = model(torch.full((1, 4), 300.0, dtype=torch.float16))    # 4 * 300 * 60 = 72000 > 65504
>>> result = t.result()          # one host sync: statistics are read back here
>>> result.first_nonfinite
OpRecord(#4 aten.addmm.default module='' forward torch.float16 (1, 2))

``full=False`` (the default of :func:`trace`) is the cheap tier: one ``aminmax`` per floating output, no
lineage. ``full=True`` keeps full statistics (abs max, smallest nonzero, inf/NaN/zero/subnormal counts) and
the lineage of every value; :func:`ampdoctor.diagnose` uses it.

Side effects: forward pre/post hooks on every submodule and step pre/post hooks on the optimizer, all
removed on exit (also on exceptions). No RNG is consumed and no result changes. Host syncs: none per op on an
accelerator; :meth:`Trace.result` reads all statistics with one device-to-host copy per device. (On CPU, where
no device sync exists, full statistics of large tensors read their range first to skip counts known to be 0.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.trace._autocast import (
    AUTOCAST,
    AUTOCAST_DEVICES,
    AUTOCAST_POLICIES,
    CUDA_CUDNN_ONLY,
    AutocastClass,
    AutocastPolicy,
    autocast_class,
    declare_autocast,
    declare_composite,
)
from ampdoctor.trace._dtypes import (
    DTYPES,
    FP8_DTYPES,
    HALF_DTYPES,
    HEADROOM_FORMATS,
    DTypeInfo,
    dtype_info,
    dtype_name,
    unit_roundoff,
)
from ampdoctor.trace._keyed_samples import KeyedSamples, record_keys
from ampdoctor.trace._lineage import Lineage, analyse_lineage, feeders, has_nan, is_nonfinite
from ampdoctor.trace._mode import OpRecord, RecordingMode, _key
from ampdoctor.trace._modules import ModuleAttribution, frame_boundary, iter_tensors, user_frame
from ampdoctor.trace._ops import (
    ALIAS_OPS,
    DUNDERS,
    OPS,
    Bound,
    Family,
    Kind,
    Literal,
    OpInfo,
    Reduces,
    Role,
    Upcast,
    adds_an_offset,
    family_ops,
    literal_values,
    op_base,
    op_info,
    ops_with,
    ops_with_literal,
    torch_names,
)
from ampdoctor.trace._stats import (
    CHEAP_FIELDS,
    FULL,
    FULL_FIELDS,
    HEADROOM_ONLY,
    REFERENCE,
    REFERENCE_HEADROOM,
    Request,
    dtype_limits,
)
from ampdoctor.trace._writes import WRITE_FIELDS, WriteRecord, state_index

__all__ = [
    "frame_boundary",
    "user_frame",
    "trace",
    "untraced",
    "Trace",
    "TraceResult",
    "OpRecord",
    "KeyedSamples",
    "Lineage",
    "FULL_FIELDS",
    "CHEAP_FIELDS",
    "dtype_limits",
    "DTYPES",
    "DTypeInfo",
    "FP8_DTYPES",
    "HALF_DTYPES",
    "HEADROOM_FORMATS",
    "dtype_info",
    "dtype_name",
    "unit_roundoff",
    "OPS",
    "DUNDERS",
    "AUTOCAST",
    "AUTOCAST_DEVICES",
    "AUTOCAST_POLICIES",
    "CUDA_CUDNN_ONLY",
    "AutocastClass",
    "AutocastPolicy",
    "autocast_class",
    "declare_autocast",
    "declare_composite",
    "Bound",
    "Family",
    "Kind",
    "Literal",
    "OpInfo",
    "Reduces",
    "Role",
    "Upcast",
    "family_ops",
    "literal_values",
    "op_base",
    "op_info",
    "ops_with",
    "record_keys",
    "ops_with_literal",
    "torch_names",
    "iter_tensors",
    "ModuleAttribution",
    "is_nonfinite",
    "has_nan",
    "analyse_lineage",
    "feeders",
    "ALIAS_OPS",
    "adds_an_offset",
    "WriteRecord",
    "WRITE_FIELDS",
    "Request",
    "FULL",
    "REFERENCE",
    "REFERENCE_HEADROOM",
    "HEADROOM_ONLY",
]

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


@dataclass
class TraceResult:
    """Records of one traced run, with statistics on the host."""

    records: list[OpRecord]
    full: bool
    error: dict[str, Any] | None = None
    marks: dict[str, list[int]] = field(default_factory=dict)
    #: step-0 decision ops (argmax, topk, sort, ``max.dim``) with their indices (``trace._sample.Decision``)
    decisions: list[Any] = field(default_factory=list)
    #: every in-place write into a parameter, buffer or accumulated gradient (full statistics only)
    writes: list[WriteRecord] = field(default_factory=list)

    @property
    def first_nonfinite(self) -> OpRecord | None:
        return next((r for r in self.records if is_nonfinite(r)), None)

    @property
    def first_nan(self) -> OpRecord | None:
        key = "n_nan" if self.full else None
        for r in self.records:
            if key is None:
                if r.stats and (r.stats["min"] != r.stats["min"] or r.stats["max"] != r.stats["max"]):
                    return r
            elif r.stats.get("n_nan", 0) > 0:
                return r
        return None

    def lineage(self) -> Lineage:
        if not self.full:
            raise ValueError("lineage needs full statistics: use trace(..., full=True)")
        return analyse_lineage(self.records)


class Trace:
    """Context manager that records a model's ops. Use :func:`trace` to make one."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, full: bool = False,
                 request: Request = FULL):
        if not isinstance(model, nn.Module):
            raise TypeError(f"trace() needs an nn.Module, got {type(model).__name__}")
        if not isinstance(request, Request):
            raise TypeError(f"trace(request=...) needs an ampdoctor.trace.Request, got {type(request).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.attribution = ModuleAttribution(model)
        self.mode = RecordingMode(self.attribution, full=full)
        self.mode.request = request
        self._handles: list[Any] = []
        self._active = False
        self.marks: dict[str, list[int]] = {}
        self.on_optimizer_pre: list[Any] = []
        self.on_optimizer_post: list[Any] = []

    def __enter__(self) -> Trace:
        self.attribution.__enter__()
        try:
            if self.optimizer is not None:
                self._handles.append(self.optimizer.register_step_pre_hook(self._opt_pre))
                self._handles.append(self.optimizer.register_step_post_hook(self._opt_post))
            with _NO_TORCH_FUNCTION():
                self._index_params()
            self.mode.__enter__()
            self._active = True
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._active:
                self.mode.__exit__(None, None, None)
                self._active = False
                self.mode.scratch.clear()
        finally:
            self._remove()

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.attribution.remove()

    def _index_params(self) -> None:
        ptrs: dict[int, str] = {}
        owners: dict[int, str] = {}
        names = self.attribution.param_names
        owner_of = self.attribution.param_owner
        for p in self.model.parameters():
            name = names.get(id(p), "")
            tensors = [p, p.grad]
            if self.optimizer is not None:
                tensors += [s for s in self.optimizer.state.get(p, {}).values()
                            if isinstance(s, torch.Tensor) and s.numel() > 1]
            for t in tensors:
                if t is not None:
                    try:
                        ptr = t.untyped_storage().data_ptr()
                    except Exception:
                        continue
                    ptrs[ptr] = name
                    owners[ptr] = owner_of.get(id(p), "")
        self.mode.param_ptrs = ptrs
        self.mode.ptr_owner = owners
        buffers: dict[int, str] = {}
        for name, b in self.model.named_buffers():  # leaves read from module state are named after their buffer
            if b.is_floating_point():
                try:
                    buffers.setdefault(b.untyped_storage().data_ptr(), name)
                except Exception:
                    continue
        self.mode.buffer_ptrs = buffers
        if self.mode.full:
            self.mode.writes.state_ptrs = state_index(self.model)

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.marks.setdefault("optimizer_step", []).append(len(self.mode.records))
        with _paused(self.mode):  # (torch functions off: the parameter index and the callbacks are ours)
            self._index_params()
            for cb in self.on_optimizer_pre:
                cb()
        self.mode.in_optimizer = True

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.mode.in_optimizer = False
        if self.on_optimizer_post:
            with _paused(self.mode):
                for cb in self.on_optimizer_post:
                    cb()

    # -- runner hooks --------------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        self.mode.step = step
        if self.mode.full:
            with _paused(self.mode):
                self.mode.writes.state_ptrs = state_index(self.model)

    def index_of(self, t: torch.Tensor) -> int | None:
        """Record index that produced tensor ``t`` (``None`` if unseen)."""
        key = _key(t)
        return None if key is None else self.mode.producer.get(key)

    def paused(self) -> Any:
        """A context for the caller's own tensor work inside a traced step (a runner's gradient coverage): not
        recorded, and no torch-function mode on the stack sees it."""
        return _paused(self.mode)

    def mark(self, kind: str, tensors: Any) -> None:
        """Remember which records produced ``tensors`` (e.g. ``"loss"``, ``"output"``)."""
        with _NO_TORCH_FUNCTION():
            for t in iter_tensors(tensors):
                if t.is_floating_point():
                    idx = self.index_of(t)
                    if idx is not None:
                        self.marks.setdefault(kind, []).append(idx)

    def result(self) -> TraceResult:
        """Read the statistics back (one host sync per device) and return the records."""
        with _paused(self.mode):
            self.mode.read()
        return TraceResult(self.mode.records, self.mode.full, self.mode.error, self.marks,
                           self.mode.sketch.decisions, self.mode.writes.records)


class _paused:
    """The trace's own work between ops (parameter index, read-back, the runner's callbacks): not recorded, and with
    torch functions off, so no torch-function mode or subclass on the stack sees it."""

    def __init__(self, mode: RecordingMode) -> None:
        self.mode = mode
        self.no_tf = _NO_TORCH_FUNCTION()

    def __enter__(self) -> None:
        self.prev = self.mode.enabled
        self.mode.enabled = False
        self.no_tf.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.no_tf.__exit__(None, None, None)
        finally:
            self.mode.enabled = self.prev


class untraced:
    """A library's own bookkeeping inside whatever traced step is running in this thread (the fp8 emulation's amax,
    scale and statistics): every trace's recording mode on the dispatch stack pauses, and torch functions are off,
    as for the trace's own work. Does nothing outside a trace; nests."""

    def __enter__(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        with contextlib.ExitStack() as stack:  # a pause that fails to enter unpauses the ones entered before it
            for m in _get_current_dispatch_mode_stack():
                if isinstance(m, RecordingMode):
                    stack.enter_context(_paused(m))
            self._stack = stack.pop_all()

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # every pause exits, also when one of them raises


def trace(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, full: bool = False,
          request: Request = FULL) -> Trace:
    """Observe every aten op that ``model`` (and ``optimizer.step``) runs inside the ``with`` block.

    ``request`` (full tier): which statistics to compute (:class:`Request`; those left out read NaN).

    >>> with trace(model, opt) as t:                     # doctest: +SKIP
    ...     model(x).sum().backward(); opt.step()
    >>> t.result().first_nonfinite                      # doctest: +SKIP

    Leaves the model, optimizer and results untouched; syncs with the device only in :meth:`Trace.result`.
    """
    return Trace(model, optimizer, full=full, request=request)
