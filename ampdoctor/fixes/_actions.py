"""Fix actions: one registered builder per fix id, turning a proposal's ``params`` into a :class:`FixPlan`.

A plan changes a run without editing the user's source: ``transforms`` are callables ``fn(model, optimizer,
scaler)`` applied to the run's copies after the precision cast (see :class:`ampdoctor.precision.StepSpec`),
``spec_changes`` replace fields of the step (``precision``, ``scaler``), ``training_changes`` are what the user's
loop must do that no model change can (a new optimizer group, a GradScaler).

Module-scoped transforms install forward pre/post hooks on the named modules of the copy (the post hook with
``always_call=True``, so a context entered in the pre hook is left also when the forward raises). Torch-function
modes entered by those hooks are active only while the module (and its children) run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

LOW_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: ``clamp``'s default bound: fp16's max less a margin, so a clamped value survives a later add (T5's choice).
FP16_CLAMP = float(torch.finfo(torch.float16).max) - 1000.0
_PRECISION_DTYPE = {"fp16": torch.float16, "fp16-amp": torch.float16, "bf16": torch.bfloat16,
                    "bf16-amp": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class FixContext:
    """What a builder may look at: the diagnosed setting, never the data.

    ``precision``: the precision of the failing run; ``module``: the finding's module (default scope of
    module-scoped fixes); ``param_dtype``: the lowest floating dtype among the model's parameters as given
    (``"float16"`` when the user called ``.half()`` themselves).
    """

    precision: str | None = None
    module: str = ""
    device_type: str = "cpu"
    param_dtype: str = "float32"
    has_scaler: bool = False
    has_train_step: bool = False
    #: the user's model as given (read only: a builder may copy values from it, e.g. fp32 buffers)
    model: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, model: nn.Module, precision: str | None, module: str = "", scaler: Any = None,
           train_step: Any = None) -> FixContext:
        dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
        low = next((d for d in LOW_DTYPES if d in dtypes), torch.float32)
        dev = next((p.device.type for p in model.parameters()), "cpu")
        return cls(precision, module, dev, _name(low), scaler is not None, train_step is not None, model)


@dataclass(frozen=True)
class FixPlan:
    """One fix, ready to apply: transforms for the run's copies, step changes, and what to tell the user."""

    id: str
    params: dict[str, Any]
    description: str
    snippet: str
    transforms: tuple[Callable[..., None], ...] = ()
    spec_changes: dict[str, Any] = field(default_factory=dict)
    training_changes: tuple[Any, ...] = ()


@dataclass(frozen=True)
class FixAction:
    """A registered fix: ``build(params, ctx) -> FixPlan``; ``params`` names the arguments it accepts."""

    id: str
    summary: str
    params: tuple[str, ...]
    build: Callable[[dict[str, Any], FixContext], FixPlan]


#: Fix id -> action. Filled by :func:`register_fix`; one action per id.
FIXES: dict[str, FixAction] = {}


def register_fix(fix_id: str, *, summary: str, params: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """Register ``fn(params, ctx) -> FixPlan`` as the action for ``fix_id``; a second one for the id raises."""
    if not isinstance(fix_id, str) or not fix_id:
        raise ValueError(f"fix id must be a non-empty str, got {fix_id!r}")

    def deco(fn: Callable[[dict[str, Any], FixContext], FixPlan]) -> Callable[[dict[str, Any], FixContext], FixPlan]:
        if fix_id in FIXES:
            raise ValueError(f"a fix action for {fix_id!r} is already registered ({FIXES[fix_id].build.__qualname__})")
        FIXES[fix_id] = FixAction(fix_id, summary, params, fn)
        return fn

    return deco


def build_plan(fix_id: str, params: dict[str, Any] | None, ctx: FixContext) -> FixPlan:
    """Validate ``fix_id`` and ``params`` and build the plan; raises ValueError saying what is allowed."""
    if fix_id not in FIXES:
        raise ValueError(f"unknown fix {fix_id!r}; registered fixes: {', '.join(sorted(FIXES))}")
    action = FIXES[fix_id]
    params = dict(params or {})
    unknown = sorted(set(params) - set(action.params))
    if unknown:
        raise ValueError(f"fix {fix_id!r} got unknown parameter(s) {unknown}; it accepts {list(action.params)}")
    return action.build(params, ctx)


# ---------------------------------------------------------------------------------------------------------------
# small helpers


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


def _modules_param(params: dict[str, Any], ctx: FixContext, fix_id: str) -> list[str]:
    mods = params.get("modules")
    if mods is None and params.get("module") is not None:
        mods = [params["module"]]
    if mods is None:
        mods = [ctx.module] if ctx.module else None
    if not mods or isinstance(mods, str) or not all(isinstance(m, str) for m in mods):
        raise ValueError(f"fix {fix_id!r} needs params['modules']: a list of module names from "
                         f"model.named_modules(), got {mods!r}")
    return list(dict.fromkeys(mods))


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
    float32 outputs back to the inputs' low dtype, which the next layer's weights have. Under autocast the float32
    output is returned as is: autocast narrows it at the next op that runs in low precision, and a cast here would
    bring back the overflow the scope removed.
    """

    def __init__(self, *, upcast_inputs: bool = False, disable_autocast: bool = False,
                 mode: Callable[[], TorchFunctionMode] | None = None, model_dtype: torch.dtype | None = None) -> None:
        self.upcast_inputs = upcast_inputs
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
        if output is None or autocast_on or back is None:
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


#: upcast_op families: torch function name -> what the op hands back outside autocast ("input": the inputs' low
#: dtype, for bounded results; "fp32": keep float32, for results that may not fit).
OP_FAMILIES: dict[str, dict[str, str]] = {
    "softmax": {n: "input" for n in ("softmax", "log_softmax", "_softmax", "_log_softmax")},
    "norm": {**{n: "fp32" for n in ("pow", "__pow__", "square", "var", "var_mean", "std", "std_mean", "norm",
                                    "linalg_vector_norm")},
             **{n: "input" for n in ("layer_norm", "group_norm", "rms_norm")}},
    "loss": {n: "fp32" for n in ("cross_entropy", "mse_loss", "nll_loss", "binary_cross_entropy_with_logits",
                                 "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "sum", "mean")},
    "exp": {n: "fp32" for n in ("exp", "expm1", "exp2")},
    "tanh": {"tanh": "input"},
    "sigmoid": {"sigmoid": "input"},
}


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


_FILL_FUNCS = {"masked_fill", "masked_fill_", "fill_", "full", "full_like", "where", "index_fill", "index_fill_",
               "new_full", "fill"}
_ADD_FUNCS = {"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__", "__isub__"}
_SOFTMAX_FUNCS = {"softmax", "_softmax"}


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


class _ClampHook:
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
    """Run ``modules`` in float32: parameters kept float32, autocast off, inputs upcast, outputs handed back."""

    modules: tuple[str, ...]

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        for name in self.modules:
            m = _get_module(model, name)
            low = _upcast_module(m, optimizer)
            _install_scope(m, _Scope(upcast_inputs=True, disable_autocast=True, model_dtype=low))


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
            _get_module(model, name).register_forward_hook(_ClampHook(self.bound))


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


# ---------------------------------------------------------------------------------------------------------------
# the actions


def _qual(mods: list[str]) -> str:
    return ", ".join(f"`{m or '<root>'}`" for m in mods)


@register_fix("keep_fp32", summary="run named modules in float32 (autocast off, inputs upcast, fp32 weights)",
              params=("modules", "module"))
def keep_fp32(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = _modules_param(params, ctx, "keep_fp32")
    whole = ctx.precision in ("fp16", "bf16")
    desc = f"run {_qual(mods)} in float32: autocast disabled inside, inputs upcast to float32"
    desc += (", parameters kept float32 after the model cast, outputs cast back to the model's dtype" if whole
             else ", outputs left in float32 for autocast to narrow where the next op runs in low precision")
    m0 = mods[0]
    snippet = (f"module = model.get_submodule({m0!r})\n"
               "forward = module.forward\n\n"
               "def forward_fp32(*args, **kwargs):\n"
               "    dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)\n"
               "    args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]\n"
               "    with torch.autocast(device_type, enabled=False):\n"
               "        out = forward(*args, **kwargs)\n"
               + ("    return out.to(dtype) if dtype is not None else out\n\n" if whole else "    return out\n\n")
               + ("module.float()  # after model.half(): keep this module's weights in fp32\n" if whole else "")
               + "module.forward = forward_fp32")
    return FixPlan("keep_fp32", {"modules": mods}, desc, snippet, (KeepFp32(tuple(mods)),))


@register_fix("switch_precision", summary="train in another precision (bf16 / bf16-amp: fp32's exponent range)",
              params=("precision",))
def switch_precision(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    target = params.get("precision")
    allowed = ("bf16", "bf16-amp", "fp16-amp", "fp16")
    if target not in allowed:
        raise ValueError(f"switch_precision needs params['precision'] in {allowed}, got {target!r}")
    if target.endswith("-amp"):
        dt = "bfloat16" if target.startswith("bf16") else "float16"
        snippet = f"with torch.autocast(device_type, dtype=torch.{dt}):\n    loss = loss_fn(model(**batch), batch)"
        if dt == "bfloat16":
            snippet += "\n# bf16 has fp32's exponent range: a GradScaler is not needed"
        changes: tuple[Any, ...] = (snippet,)
    else:
        dt = "bfloat16" if target == "bf16" else "float16"
        snippet = f"model = model.to(torch.{dt})"
        changes = (snippet,)
    desc = f"run in {target} instead of {ctx.precision or 'the precision the step chose itself'}"
    if ctx.has_train_step and ctx.precision is None:
        desc += " (a train_step that enters its own torch.autocast keeps its own dtype: change it there)"
    return FixPlan("switch_precision", {"precision": target}, desc, snippet, (), {"precision": target}, changes)


@register_fix("clamp", summary="clamp a module's output to ±(fp16 max - 1000) whatever its dtype",
              params=("modules", "module", "bound"))
def clamp(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = _modules_param(params, ctx, "clamp")
    bound = params.get("bound", FP16_CLAMP)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (0 < bound < math.inf):
        raise ValueError(f"clamp needs a positive finite params['bound'], got {bound!r}")
    bound = float(bound)
    desc = (f"clamp the output of {_qual(mods)} to ±{bound:g} whatever its dtype (values beyond are saturated; "
            "an fp32 residual stream is clamped too, unlike T5's `if dtype == float16` guard)")
    snippet = (f"model.get_submodule({mods[0]!r}).register_forward_hook(\n"
               f"    lambda mod, args, out: out.clamp(-{bound:g}, {bound:g}))")
    return FixPlan("clamp", {"modules": mods, "bound": bound}, desc, snippet, (ClampOutputs(tuple(mods), bound),))


@register_fix("safe_mask", summary="finite, dtype-aware mask constants and a softmax that zeroes fully masked rows",
              params=("modules", "module"))
def safe_mask(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = _modules_param(params, ctx, "safe_mask")
    desc = (f"inside {_qual(mods)}: mask constants below the dtype's range (-1e9 in fp16, -inf) become "
            "torch.finfo(dtype).min of the tensor they are written into, -inf entries of additive masks too, and a "
            "softmax over a fully masked (-inf) row returns 0 for that row")
    snippet = ("scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)\n"
               "probs = scores.softmax(-1).masked_fill(~allowed.any(-1, keepdim=True), 0.0)")
    return FixPlan("safe_mask", {"modules": mods}, desc, snippet, (ScopedMode(tuple(mods), "safe_mask"),))


@register_fix("upcast_op", summary="run one op family (softmax, norm, loss, exp, tanh, sigmoid) in float32 inside "
              "named modules", params=("modules", "module", "ops", "op"))
def upcast_op(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = _modules_param(params, ctx, "upcast_op")
    ops = params.get("ops")
    if ops is None and params.get("op") is not None:
        ops = [params["op"]]
    if not ops or isinstance(ops, str) or not all(isinstance(o, str) for o in ops):
        raise ValueError(f"upcast_op needs params['ops']: a list of op families ({', '.join(OP_FAMILIES)}) or op "
                         f"names, got {ops!r}")
    names = op_names(ops)
    desc = (f"inside {_qual(mods)}, run {', '.join(sorted(names))} in float32 (inputs upcast, autocast off); "
            "bounded results go back to the inputs' dtype, statistics stay float32")
    first = sorted(names)[0]
    snippet = f"y = torch.{first}(x.float(), ...)  # instead of torch.{first}(x, ...) in {mods[0]}"
    if "tanh" in names:
        snippet = "y = torch.tanh(x.float()).to(x.dtype)  # the backward keeps fp32's 1 - y**2"
    elif "softmax" in names:
        snippet = "probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)"
    elif "pow" in names:
        snippet = "variance = x.float().pow(2).mean(-1, keepdim=True)\nx = x * torch.rsqrt(variance + eps)"
    return FixPlan("upcast_op", {"modules": mods, "ops": list(ops)}, desc, snippet,
                   (ScopedMode(tuple(mods), "upcast", tuple(sorted(names.items()))),))


@register_fix("exclude_unused", summary="leave parameters that get no gradient out of training",
              params=("parameters",))
def exclude_unused(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    names = params.get("parameters")
    if not names or isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"exclude_unused needs params['parameters']: a list of names from model.named_parameters(), "
                         f"got {names!r}")
    names = list(dict.fromkeys(names))
    desc = (f"freeze {len(names)} parameter(s) that never get a gradient ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) and leave them out of the optimizer")
    snippet = (f"unused = {set(names)!r}\n"
               "for name, p in model.named_parameters():\n"
               "    if name in unused:\n"
               "        p.requires_grad_(False)")
    opt = ("optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=...)  "
           "# build it (and any DDP wrapper) after freezing")
    build = ("or build the model without the unused module, e.g. "
             "BertModel(config, add_pooling_layer=False) / AutoModel.from_pretrained(..., add_pooling_layer=False)")
    return FixPlan("exclude_unused", {"parameters": names}, desc, snippet, (ExcludeParameters(tuple(names)),), {},
                   (opt, build))


def _scaler_snippet(init_scale: float, growth_interval: int) -> str:
    return (f"scaler = torch.amp.GradScaler(device_type, init_scale={init_scale:g}, "
            f"growth_interval={growth_interval})\n"
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()")


@register_fix("loss_scaling", summary="dynamic loss scaling (GradScaler) with fp32 master weights",
              params=("init_scale", "growth_interval"))
def loss_scaling(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    init_scale = params.get("init_scale", 2.0 ** 16)
    growth = params.get("growth_interval", 2000)
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not (0 < init_scale < math.inf):
        raise ValueError(f"loss_scaling needs a positive finite init_scale, got {init_scale!r}")
    if isinstance(growth, bool) or not isinstance(growth, int) or growth < 1:
        raise ValueError(f"loss_scaling needs a positive int growth_interval, got {growth!r}")
    scaler = torch.amp.GradScaler(ctx.device_type, init_scale=float(init_scale), growth_interval=growth)
    changes: dict[str, Any] = {"scaler": scaler}
    transforms: tuple[Any, ...] = ()
    desc = f"scale the loss with a GradScaler (init_scale {init_scale:g}, growth_interval {growth})"
    fp16_params = ctx.precision == "fp16" or (ctx.precision is None and ctx.param_dtype == "float16")
    if fp16_params:
        # GradScaler refuses fp16 gradients, and an unscaled fp16 gradient underflows again: fp32 master weights.
        changes["precision"] = "fp16-amp"
        transforms = (Fp32Master(),)
        desc += "; the parameters become float32 master weights and fp16 comes from autocast (fp16-amp)"
    elif ctx.precision in ("bf16", "bf16-amp"):
        desc += " (bf16 rarely needs it: its range is fp32's)"
    if ctx.has_train_step:
        desc += "; a train_step that builds its own GradScaler must use these settings itself"
    snippet = _scaler_snippet(float(init_scale), growth)
    return FixPlan("loss_scaling", {"init_scale": float(init_scale), "growth_interval": growth}, desc, snippet,
                   transforms, changes, (scaler, snippet))


@register_fix("grad_scaler", summary="loss_scaling under the id the underflow rules propose",
              params=("init_scale", "growth_interval"))
def grad_scaler(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    return replace(loss_scaling(params, ctx), id="grad_scaler")


@register_fix("keep_fp32_buffers", summary="keep named buffers (rotary frequencies, ...) in float32 after a model cast",
              params=("buffers", "modules", "module"))
def keep_fp32_buffers(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    model = ctx.model
    if not isinstance(model, nn.Module):
        raise ValueError("keep_fp32_buffers needs the model (FixContext.model) to copy the float32 values from")
    bufs = list(params.get("buffers") or [])
    mods = params.get("modules") or ([params["module"]] if params.get("module") else [])
    named = dict(model.named_buffers())
    for m in mods:
        prefix = f"{m}." if m else ""
        bufs += [n for n, b in named.items() if n.startswith(prefix) and b.is_floating_point() and n not in bufs]
    if not bufs:
        raise ValueError("keep_fp32_buffers needs params['buffers'] (names from model.named_buffers()) or "
                         "params['modules'] holding floating buffers")
    missing = [n for n in bufs if n not in named]
    if missing:
        raise ValueError(f"keep_fp32_buffers: the model has no buffer(s) {missing}; use names from "
                         "model.named_buffers()")
    values = tuple((n, named[n].detach().to(torch.float32).clone()) for n in bufs)
    desc = (f"keep {', '.join(bufs[:3])}{', ...' if len(bufs) > 3 else ''} in float32 after the model cast (its "
            "original values, not the rounded ones)")
    snippet = "\n".join(f"model.get_buffer({n!r}).data = fp32_values[{n!r}]  # recomputed in float32"
                        for n in bufs[:3])
    return FixPlan("keep_fp32_buffers", {"buffers": bufs}, desc, snippet, (KeepFp32Buffers(values),))


@register_fix("fp32_master", summary="float32 parameters and optimizer state + autocast instead of .half()",
              params=())
def fp32_master(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    low = _PRECISION_DTYPE.get(ctx.precision or "", None)
    if low is None:
        low = torch.bfloat16 if ctx.param_dtype == "bfloat16" else torch.float16
    target = "bf16-amp" if low == torch.bfloat16 else "fp16-amp"
    changes: dict[str, Any] = {"precision": target}
    snippet = ("model = model.float()          # fp32 master weights; the optimizer state follows them\n"
               f"with torch.autocast(device_type, dtype=torch.{_name(low)}):\n"
               "    loss = loss_fn(model(x), y)")
    desc = f"keep parameters and optimizer state in float32 and run the ops in {_name(low)} under autocast ({target})"
    training: tuple[Any, ...] = (snippet,)
    if target == "fp16-amp" and not ctx.has_scaler:
        scaler = torch.amp.GradScaler(ctx.device_type)
        changes["scaler"] = scaler
        desc += ", with a GradScaler"
        snippet += "\n" + _scaler_snippet(2.0 ** 16, 2000)
        training = (snippet, scaler)
    return FixPlan("fp32_master", {}, desc, snippet, (Fp32Master(),), changes, training)


@register_fix("fp8_amax_floor", summary="floor the amax behind an fp8 scale (amax 0 -> scale 0 -> 0/0 = NaN)",
              params=("amax_floor", "modules", "module"))
def fp8_amax_floor(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    floor = params.get("amax_floor", 1e-12)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (0 < floor < math.inf):
        raise ValueError(f"fp8_amax_floor needs a positive finite amax_floor, got {floor!r}")
    mods = _modules_param(params, ctx, "fp8_amax_floor")
    desc = (f"floor amax at {floor:g} before the fp8 scale is computed inside {_qual(mods)} (emulated: the results "
            "of amax/max reductions that are >= 0 and below the floor are raised to it; put the clamp in your "
            "quantisation code)")
    snippet = f"amax = x.abs().amax(dim, keepdim=True).float().clamp(min={floor:g})\nscale = amax / fp8_max"
    return FixPlan("fp8_amax_floor", {"amax_floor": float(floor), "modules": mods}, desc, snippet,
                   (ScopedMode(tuple(mods), "amax_floor", float(floor)),))


__all__ = ["FIXES", "FixAction", "FixContext", "FixPlan", "build_plan", "register_fix", "map_tensors", "scopes_of"]
