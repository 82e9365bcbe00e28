"""The mechanism of fixes: run a named module of a copy under a context, and the transforms built on it.

A transform is a callable ``fn(model, optimizer, scaler)`` applied to a run's copy after the precision cast
(see :class:`ampdoctor.precision.StepSpec`). Module-scoped transforms install forward pre/post hooks on the
named modules (the post hook with ``always_call=True``, so a context entered in the pre hook is left also when the
forward raises); torch-function modes entered by those hooks are active only while the module (and its children)
run. Every hook's handle is kept on the module (:func:`scopes_of`, :func:`remove_scopes`), so a fix can be removed.
The catalogue of fixes that use these transforms is :mod:`ampdoctor.fixes._actions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.precision import fp8_disabled
from ampdoctor.trace import (
    DUNDERS,
    HALF_DTYPES,
    Family,
    Kind,
    Role,
    family_ops,
    ops_with,
    ops_with_literal,
    torch_names,
)

log = logging.getLogger(__name__)

LOW_DTYPES: tuple[torch.dtype, ...] = HALF_DTYPES
#: ``clamp``'s default bound: fp16's max less a margin, so a clamped value survives a later add (T5's choice).
FP16_CLAMP = float(torch.finfo(torch.float16).max) - 1000.0

# ---------------------------------------------------------------------------------------------------------------
# small helpers


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], _depth: int = 0) -> Any:
    """``obj`` with ``fn`` applied to every tensor in nested tuples/lists/dicts (types kept where possible)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _depth > 6:
        return obj
    if isinstance(obj, tuple):
        values = [map_tensors(v, fn, _depth + 1) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, list):
        return [map_tensors(v, fn, _depth + 1) for v in obj]
    if isinstance(obj, dict):
        items = {k: map_tensors(v, fn, _depth + 1) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(**items)
        except TypeError:
            return items
    return obj


def _tensors(obj: Any, _depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth <= 6 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, _depth + 1)
    elif _depth <= 6 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, _depth + 1)


def _first_low(obj: Any) -> torch.dtype | None:
    return next((t.dtype for t in _tensors(obj) if t.dtype in LOW_DTYPES), None)


def _get_module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        raise ValueError(f"the model has no module named {name!r}; use a qualified name from "
                         "model.named_modules(), e.g. 'encoder.block.0.layer.1.DenseReluDense.wo'") from None


def _device_type(module: nn.Module, args: Any, kwargs: Any) -> str:
    t = next(iter(_tensors((args, kwargs))), None)
    if t is not None:
        return t.device.type
    return next((p.device.type for p in module.parameters()), "cpu")


def _to_fp32_state(opt: Any, params: Iterable[torch.Tensor]) -> None:
    """Optimizer state of ``params`` (Adam moments) follows its parameters to float32."""
    if opt is None:
        return
    for p in params:
        st = opt.state.get(p)
        if not st:
            continue
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0 and v.dtype in LOW_DTYPES:
                st[k] = v.float()


def _upcast_module(module: nn.Module, opt: Any) -> torch.dtype | None:
    """Make ``module``'s floating parameters and buffers float32; returns the low dtype they had (or None)."""
    low = next((t.dtype for t in list(module.parameters()) + list(module.buffers()) if t.dtype in LOW_DTYPES), None)
    if low is not None:
        module.float()
        _to_fp32_state(opt, module.parameters())
    return low


# ---------------------------------------------------------------------------------------------------------------
# the module scope: hooks that run a module in a context


class _Scope:
    """Forward pre/post hooks that run a module inside a context and hand its output back in the right dtype.

    Pre hook: note whether autocast is on and the low dtype of the inputs; enter ``autocast(enabled=False)``
    and/or a torch-function mode; cast fp16/bf16 inputs to float32 when ``upcast_inputs``. Post hook (also on
    exceptions): leave the contexts in reverse order; when autocast was off (a whole-model fp16/bf16 cast), cast
    float32 outputs back to the inputs' low dtype, which the next layer's weights have (unless ``cast_back`` is off:
    the model's own output, no next layer). Under autocast the float32 output is returned as is: autocast narrows
    it at the next op that runs in low precision, and a cast here would bring back the overflow the scope removed.
    """

    def __init__(self, *, upcast_inputs: bool = False, disable_autocast: bool = False,
                 mode: Callable[[], TorchFunctionMode] | None = None, model_dtype: torch.dtype | None = None,
                 cast_back: bool = True) -> None:
        self.upcast_inputs = upcast_inputs
        self.cast_back = cast_back
        self.disable_autocast = disable_autocast
        self.mode = mode
        self.model_dtype = model_dtype
        self._stack: list[tuple[list[Any], bool, torch.dtype | None]] = []

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dev = _device_type(module, args, kwargs)
        autocast_on = torch.is_autocast_enabled(dev)
        floats = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        back = _first_low((args, kwargs))
        if back is None and not floats:
            back = self.model_dtype
        entered: list[Any] = []
        try:
            if self.disable_autocast:
                ctx: Any = torch.autocast(dev, enabled=False)
                ctx.__enter__()
                entered.append(ctx)
                off = fp8_disabled()  # and out of an (emulated) fp8 block: the module's linears run unquantised
                off.__enter__()
                entered.append(off)
            if self.mode is not None:
                m = self.mode()
                m.__enter__()
                entered.append(m)
        except BaseException:
            for c in reversed(entered):
                c.__exit__(None, None, None)
            raise
        self._stack.append((entered, autocast_on, back))
        if self.upcast_inputs:
            args, kwargs = map_tensors((args, kwargs), _to_fp32)
        return args, kwargs

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._stack:
            return output
        entered, autocast_on, back = self._stack.pop()
        for c in reversed(entered):
            c.__exit__(None, None, None)
        if output is None or autocast_on or back is None or not self.cast_back:
            return output
        return map_tensors(output, lambda t: t.to(back) if t.dtype == torch.float32 else t)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in LOW_DTYPES else t


def _install_scope(module: nn.Module, scope: _Scope) -> list[Any]:
    return [module.register_forward_pre_hook(scope.pre, with_kwargs=True),
            module.register_forward_hook(scope.post, with_kwargs=True, always_call=True)]


def scopes_of(model: nn.Module, kind: type) -> list[Any]:
    """Hook objects of ``kind`` installed on ``model``'s modules (to read a clamp's counter after a run)."""
    out = []
    for m in model.modules():
        for h in m._forward_hooks.values():
            owner = getattr(h, "__self__", h)
            if isinstance(owner, kind) and owner not in out:
                out.append(owner)
    return out


# ---------------------------------------------------------------------------------------------------------------
# torch-function modes used inside scopes


def _fname(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if isinstance(func, torch._ops.OpOverload):
        return func._opname
    return name


#: upcast_op families (the op registry's :class:`~ampdoctor.trace.Family` declarations): torch function name ->
#: what the op hands back outside autocast ("input": the inputs' low dtype, for bounded results; "fp32": keep
#: float32, for results that may not fit); dunders that dispatch to a member are members.
OP_FAMILIES: dict[str, dict[str, str]] = {
    f.value: {**ops, **{d: ops[b] for d, b in DUNDERS.items() if b in ops}}
    for f in Family if (ops := family_ops(f))}


def op_names(ops: Iterable[str]) -> dict[str, str]:
    """Family names, torch function names or aten overloads (``"aten.pow.Tensor_Scalar"``) -> name: rule."""
    out: dict[str, str] = {}
    for op in ops:
        if op in OP_FAMILIES:
            out.update(OP_FAMILIES[op])
            continue
        base = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
        base = base.lstrip("_") if base.lstrip("_") in _ALL_NAMES else base
        rule = _ALL_NAMES.get(base)
        if rule is None:
            raise ValueError(f"upcast_op cannot run {op!r} in float32; expected a family "
                             f"({', '.join(OP_FAMILIES)}) or one of its ops ({', '.join(sorted(_ALL_NAMES))})")
        out[base] = rule
    return out


_ALL_NAMES: dict[str, str] = {n: r for fam in OP_FAMILIES.values() for n, r in fam.items()}


class _UpcastMode(TorchFunctionMode):
    """Runs the named torch functions in float32 with autocast off (their low-precision inputs upcast)."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__()
        self.names = names

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        rule = self.names.get(_fname(func))
        low = _first_low((args, kwargs)) if rule is not None else None
        if low is None:
            return func(*args, **kwargs)
        dev = next(iter(_tensors((args, kwargs)))).device.type
        autocast_on = torch.is_autocast_enabled(dev)
        args, kwargs = map_tensors((tuple(args), dict(kwargs)), _to_fp32)
        with torch.autocast(dev, enabled=False):
            out = func(*args, **kwargs)
        if rule == "input" and not autocast_on:
            out = map_tensors(out, lambda t: t.to(low) if t.dtype == torch.float32 else t)
        return out


#: torch functions that write a literal into their output, that add one, and the (bounded) softmax: the registry's
_FILL_FUNCS = torch_names(ops_with_literal(Role.FILL))
_ADD_FUNCS = torch_names(ops_with_literal(Role.ADDEND))
_SOFTMAX_FUNCS = ops_with(Kind.SOFTMAX) & ops_with(Kind.BOUNDED)


class _SafeMaskMode(TorchFunctionMode):
    """Mask constants that fit the dtype they are written into, and a softmax that returns 0 for -inf rows.

    * A Python number below the dtype's range (``-1e9`` in fp16, ``float("-inf")`` anywhere) becomes
      ``torch.finfo(dtype).min`` of the tensor it meets; ``+inf`` written by a fill becomes ``finfo.max``.
    * ``-inf`` entries of a tensor that does not require grad (a mask) added to scores become ``finfo.min``.
    * ``softmax`` over a row whose every entry is ``-inf`` returns zeros for that row (what SDPA's safe softmax
      does) instead of ``-inf - (-inf) = NaN``; other rows are computed as before.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = _fname(func)
        if name in _SOFTMAX_FUNCS and args and isinstance(args[0], torch.Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int):
                x = args[0]
                dead = torch.isneginf(x).all(dim, keepdim=True)
                y = func(x.masked_fill(dead, 0.0), *args[1:], **kwargs)
                return y.masked_fill(dead, 0.0)
            return func(*args, **kwargs)
        dtype = kwargs.get("dtype")
        if not isinstance(dtype, torch.dtype):
            dtype = next((t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()), None)
        if dtype is None or not dtype.is_floating_point:
            return func(*args, **kwargs)
        fi = torch.finfo(dtype)
        fill = name in _FILL_FUNCS

        def fit(v: Any) -> Any:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (v < fi.min or (fill and v > fi.max)):
                return float(fi.min) if v < 0 else float(fi.max)
            if fill and isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
                return v.clamp(fi.min, fi.max)
            return v

        args = tuple(fit(a) for a in args)
        kwargs = {k: fit(v) for k, v in kwargs.items()}
        if name in _ADD_FUNCS:
            args = tuple(_finite_mask(a) for a in args)
            if "other" in kwargs:
                kwargs["other"] = _finite_mask(kwargs["other"])
        return func(*args, **kwargs)


def _finite_mask(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.requires_grad:
        return t
    return t.masked_fill(torch.isneginf(t), torch.finfo(t.dtype).min)


class _AmaxFloorMode(TorchFunctionMode):
    """Floors the non-negative results of ``amax`` / ``max`` reductions at ``floor`` (an fp8 scale's amax)."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor

    def _floor(self, r: torch.Tensor) -> torch.Tensor:
        if not r.is_floating_point():
            return r
        f = max(self.floor, float(torch.finfo(r.dtype).tiny))
        return torch.where((r >= 0) & (r < f), torch.full_like(r, f), r)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _fname(func)
        if name == "amax" and isinstance(out, torch.Tensor):
            return self._floor(out)
        if name == "max" and isinstance(out, torch.Tensor) and len(args) == 1 and not kwargs:
            return self._floor(out)
        if name == "max" and hasattr(out, "values") and hasattr(out, "indices"):
            return type(out)((self._floor(out.values), out.indices))
        return out


class ClampHook:
    """Forward hook: clamps a module's (first floating) output to ±bound and counts the values it changed.

    The count stays on the device (one tensor, summed without a host sync) until :attr:`clamped` is read.
    """

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self._count: torch.Tensor | None = None

    @property
    def clamped(self) -> int:
        return 0 if self._count is None else int(self._count.item())

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        done = [False]

        def clamp(t: torch.Tensor) -> torch.Tensor:
            if done[0] or not t.is_floating_point():
                return t
            done[0] = True
            with torch.no_grad():
                n = (t.abs() > self.bound).sum()
            self._count = n if self._count is None else self._count + n
            return t.clamp(-self.bound, self.bound)

        return map_tensors(output, clamp)


# ---------------------------------------------------------------------------------------------------------------
# transforms (deep-copyable callables applied to a run's copies)


@dataclass(frozen=True)
class KeepFp32:
    """Run ``modules`` in float32: parameters kept float32, autocast off, inputs upcast, outputs handed back
    (``fp32_outputs``: in float32, for the model's own output, where a cast back would redo the rounding)."""

    modules: tuple[str, ...]
    fp32_outputs: bool = False

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        for name in self.modules:
            m = _get_module(model, name)
            low = _upcast_module(m, optimizer)
            _install_scope(m, _Scope(upcast_inputs=True, disable_autocast=True, model_dtype=low,
                                     cast_back=not self.fp32_outputs))


@dataclass(frozen=True)
class ScopedMode:
    """Run ``modules`` with a torch-function mode active (built fresh for each forward call)."""

    modules: tuple[str, ...]
    kind: str
    arg: Any = None

    def _factory(self) -> Callable[[], TorchFunctionMode]:
        if self.kind == "upcast":
            names = dict(self.arg)
            return lambda: _UpcastMode(names)
        if self.kind == "safe_mask":
            return _SafeMaskMode
        if self.kind == "amax_floor":
            floor = float(self.arg)
            return lambda: _AmaxFloorMode(floor)
        raise ValueError(f"unknown scoped mode {self.kind!r}")

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        factory = self._factory()
        for name in self.modules:
            m = _get_module(model, name)
            low = next((t.dtype for t in m.parameters() if t.dtype in LOW_DTYPES), None)
            _install_scope(m, _Scope(mode=factory, model_dtype=low))


@dataclass(frozen=True)
class ClampOutputs:
    """Clamp the first floating output of ``modules`` to ±``bound``, whatever its dtype."""

    modules: tuple[str, ...]
    bound: float = FP16_CLAMP

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        for name in self.modules:
            _get_module(model, name).register_forward_hook(ClampHook(self.bound))


@dataclass(frozen=True)
class ExcludeParameters:
    """Leave ``parameters`` out of training: ``requires_grad_(False)`` and out of the optimizer's groups.

    A ``DistributedDataParallel`` wrapper builds its gradient buckets from the parameters that require grad when it
    is constructed; its reducer is rebuilt so the frozen parameters are no longer waited for (what freezing them
    before wrapping does).
    """

    parameters: tuple[str, ...]

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        named = dict(model.named_parameters())
        missing = [n for n in self.parameters if n not in named]
        if missing:
            raise ValueError(f"exclude_unused: the model has no parameter(s) {missing}; use names from "
                             "model.named_parameters()")
        chosen = [named[n] for n in self.parameters]
        ids = {id(p) for p in chosen}
        for p in chosen:
            p.requires_grad_(False)
            p.grad = None
        if optimizer is not None:
            for g in optimizer.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in ids]
            for p in chosen:
                optimizer.state.pop(p, None)
        if type(model).__name__ == "DistributedDataParallel" and hasattr(model, "_ddp_init_helper"):
            _rebuild_ddp_reducer(model)


def _rebuild_ddp_reducer(ddp: Any) -> None:
    try:
        params, sparse = ddp._build_params_for_reducer()
        ddp._ddp_init_helper(params, sparse, ddp._build_debug_param_to_name_mapping(params),
                             getattr(ddp, "static_graph", False))
    except Exception as e:  # private DDP API: say what to do instead
        raise RuntimeError(f"could not rebuild the DistributedDataParallel reducer ({type(e).__name__}: {e}); freeze "
                           "the parameters before wrapping the model in DDP") from e


@dataclass(frozen=True, eq=False)
class KeepFp32Buffers:
    """Put float32 buffers back after a whole-model cast: the original values, not the rounded ones."""

    values: tuple[tuple[str, torch.Tensor], ...]

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        for name, value in self.values:
            owner_name, _, attr = name.rpartition(".")
            owner = _get_module(model, owner_name)
            current = owner._buffers.get(attr)
            if current is None:
                raise ValueError(f"keep_fp32_buffers: the model has no buffer {name!r}; use names from "
                                 "model.named_buffers()")
            owner._buffers[attr] = value.to(current.device).clone()


@dataclass(frozen=True)
class Fp32Master:
    """Float32 parameters and optimizer state (the low precision then comes from autocast)."""

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        _upcast_module(model, optimizer)
