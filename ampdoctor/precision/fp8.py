"""Emulated FP8 linear layers (Transformer-Engine style) with per-tensor scaling statistics, on any device.

>>> import torch
>>> from ampdoctor.precision.fp8 import Fp8Recipe, fp8_autocast
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> with fp8_autocast(model, Fp8Recipe(scaling="dynamic")) as fp8:
...     model(torch.randn(4, 8)).sum().backward()
>>> s = fp8.stats()                                  # one host sync, here
>>> [(t.module, t.role, t.format) for t in s.select(module="2")]
[('2', 'input', 'e4m3'), ('2', 'weight', 'e4m3'), ('2', 'grad_output', 'e5m2')]

Inside ``fp8_autocast`` every ``F.linear`` call (so every ``nn.Linear``) is replaced by an autograd Function that
quantises the input and the weight to fp8 in the forward, and the incoming gradient (``grad_output``) in the
backward, then computes in float32 from the dequantised tensors (output and gradients in the caller's dtypes; the
bias gradient comes from the unquantised ``grad_output``, as Transformer Engine fuses it).

Recipe semantics (:class:`Fp8Recipe`)
    ``format``   ``"hybrid"`` (TE's HYBRID: e4m3 forward, e5m2 gradients), ``"e4m3"`` or ``"e5m2"`` everywhere.
    ``scaling``  ``"dynamic"``: scale from the tensor's own amax (current scaling);
                 ``"delayed"``: scale from the max of the amax history of the previous ``amax_history_len`` calls
                 of that layer and role (TE ``DelayedScaling`` with ``amax_compute_algo="max"``); the first call
                 has no history and uses its current amax. The current amax is pushed after quantising.
    ``scale``    ``fmax / max(amax, amax_floor) / 2**margin``; quantise = ``(x * scale).clamp(-fmax, fmax)`` cast to
                 fp8 (saturating, as TE does), dequantise = ``q / scale``.
    ``amax_floor``  real recipes floor amax (torchao ``1e-12``; TE keeps the previous scale when amax is 0) so an
                 all-zero tensor (a zero-initialised LoRA B) does not give ``scale = inf`` and ``0 * inf = NaN``.
                 ``amax_floor=0`` reproduces the unguarded recipe: the stats then report amax 0 and scale inf.

Statistics (:class:`Fp8TensorStats`, one per call and role) are reduced on the device: amax, scale, the amax the
scale came from, saturated count (``|x * scale|`` beyond what rounds to fmax: > 464 for e4m3, >= 61440 for e5m2),
underflow count (nonzero elements that quantise to 0), nonzero count, numel, the median |x| of the nonzero values
(where the bulk sits when an outlier sets amax), the squared quantisation error and its part from saturated
elements. :meth:`Fp8Autocast.stats` reads them back with a single host sync. A trace sees none of the quantiser's
ops. Calls are attributed to the innermost module of ``model`` running the ``F.linear`` (forward pre/post hooks,
removed on exit, also on exceptions); ``call`` numbers the ``F.linear`` calls within one forward of that module (0
for an ``nn.Linear``). :func:`fp8_disabled` runs a block's linears unquantised (TE's nested
``fp8_autocast(enabled=False)``: layers kept in high precision).

Measured on torch 2.13: casting to ``torch.float8_e4m3fn`` saturates (1e6 and inf become 448, NaN stays NaN);
casting to ``torch.float8_e5m2`` does not (1e6 becomes inf) - hence the explicit clamp.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.trace import untraced

log = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("hybrid", "e4m3", "e5m2")
SCALINGS: tuple[str, ...] = ("dynamic", "delayed")
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class _Fp8Format:
    name: str
    dtype: torch.dtype
    max: float
    # |x * scale| that round to ``max`` in an fp8 grid with unlimited range stop here (midpoint to the next value);
    # the midpoint itself rounds to even: down for e4m3 (448 = 1.75 * 2**8, even mantissa), up for e5m2.
    round_limit: float
    limit_saturates: bool


E4M3 = _Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 464.0, False)
E5M2 = _Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 61440.0, True)
_BY_NAME = {"e4m3": E4M3, "e5m2": E5M2}


@dataclass(frozen=True)
class Fp8Recipe:
    """How tensors are scaled and cast to fp8 (see the module docstring for the exact semantics).

    >>> Fp8Recipe(format="hybrid", scaling="delayed", amax_history_len=16, margin=0, amax_floor=1e-12)
    Fp8Recipe(format='hybrid', scaling='delayed', amax_history_len=16, margin=0, amax_floor=1e-12)
    """

    format: str = "hybrid"
    scaling: str = "delayed"
    amax_history_len: int = 1024
    margin: int = 0
    amax_floor: float = 1e-12

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"invalid format {self.format!r}: expected one of {', '.join(map(repr, FORMATS))}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"invalid scaling {self.scaling!r}: expected one of {', '.join(map(repr, SCALINGS))}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0 (bits of headroom), got {self.margin!r}")
        if isinstance(self.amax_floor, bool) or not isinstance(self.amax_floor, (int, float)) \
                or not math.isfinite(self.amax_floor) or self.amax_floor < 0:
            raise ValueError(f"amax_floor must be a finite number >= 0 (e.g. 1e-12; 0 disables the floor), "
                             f"got {self.amax_floor!r}")

    @classmethod
    def parse(cls, text: str, format: str | None = None) -> Fp8Recipe:
        """A recipe from its command-line spelling: comma-separated ``field=value`` pairs, or a bare scaling
        (``delayed``/``dynamic``) or format name; ``format`` (the precision's) applies when the text names none.

        >>> Fp8Recipe.parse("delayed,amax_history_len=16,margin=1", format="e4m3")
        Fp8Recipe(format='e4m3', scaling='delayed', amax_history_len=16, margin=1, amax_floor=1e-12)

        Raises ``ValueError`` saying which item is wrong and what is allowed."""
        fields: dict[str, Any] = {}
        items = [i.strip() for i in str(text).split(",") if i.strip()]
        if not items:
            raise ValueError(f"empty fp8 recipe {text!r}: {_RECIPE_HELP}")
        for item in items:
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                key, value = ("scaling", key) if key in SCALINGS else ("format", key) if key in FORMATS else (key, "")
                if not value:
                    raise ValueError(f"fp8 recipe item {item!r} is neither field=value nor a scaling "
                                     f"({'/'.join(SCALINGS)}) or format ({'/'.join(FORMATS)}): {_RECIPE_HELP}")
            if key not in _RECIPE_FIELDS:
                raise ValueError(f"unknown fp8 recipe field {key!r}; the fields are {', '.join(_RECIPE_FIELDS)}")
            if key in fields:
                raise ValueError(f"fp8 recipe field {key!r} is given twice in {text!r}")
            fields[key] = _RECIPE_FIELDS[key](key, value)
        if format is not None:
            fields.setdefault("format", format)
        return cls(**fields)

    def format_of(self, role: str) -> str:
        """The fp8 format (``"e4m3"``/``"e5m2"``) used for a tensor role."""
        if role not in ROLES:
            raise ValueError(f"invalid role {role!r}: expected one of {', '.join(map(repr, ROLES))}")
        if self.format == "hybrid":
            return "e5m2" if role == "grad_output" else "e4m3"
        return self.format


def _int_field(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"fp8 recipe field {key} must be an int, got {value!r}") from None


def _float_field(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"fp8 recipe field {key} must be a number (e.g. 1e-12), got {value!r}") from None


def _str_field(key: str, value: str) -> str:
    return value


_RECIPE_FIELDS: dict[str, Any] = {"format": _str_field, "scaling": _str_field, "amax_history_len": _int_field,
                                  "margin": _int_field, "amax_floor": _float_field}
_RECIPE_HELP = ("e.g. 'scaling=delayed,amax_history_len=16,margin=1' or 'dynamic' (fields: format, scaling, "
                "amax_history_len, margin, amax_floor)")


@dataclass(frozen=True)
class Fp8TensorStats:
    """What one quantisation of one tensor did. ``amax_history`` is the amax the scale came from."""

    module: str
    call: int
    role: str
    format: str
    step: int
    amax: float
    scale: float
    amax_history: float
    saturated: int
    underflowed: int
    nonzero: int
    numel: int
    #: median |x| of the nonzero values before scaling: where the bulk sits (an outlier sets ``amax``)
    median_abs: float = 0.0
    #: sum of squared quantisation errors ``(dequantised - x)**2`` of the whole tensor, in x's units
    error_sq: float = 0.0
    #: the part of ``error_sq`` from saturated elements (what clipping at fmax adds to the rounding error)
    clip_error_sq: float = 0.0

    @property
    def saturated_fraction(self) -> float:
        """Saturated elements / all elements."""
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def underflow_fraction(self) -> float:
        """Elements flushed to zero / nonzero elements (the ones that could be lost)."""
        return self.underflowed / self.nonzero if self.nonzero else 0.0


@dataclass(frozen=True)
class Fp8Stats:
    """Every quantisation recorded in an :func:`fp8_autocast` block, in call order."""

    recipe: Fp8Recipe
    tensors: tuple[Fp8TensorStats, ...]

    def select(self, module: str | None = None, role: str | None = None) -> tuple[Fp8TensorStats, ...]:
        """The records of one module and/or role."""
        return tuple(t for t in self.tensors if (module is None or t.module == module)
                     and (role is None or t.role == role))

    def by_module(self) -> dict[str, tuple[Fp8TensorStats, ...]]:
        """Records grouped by module, modules in order of first use."""
        out: dict[str, list[Fp8TensorStats]] = {}
        for t in self.tensors:
            out.setdefault(t.module, []).append(t)
        return {k: tuple(v) for k, v in out.items()}


class _ScaleState:
    """Amax history of one (module, call, role), kept on the tensor's device."""

    __slots__ = ("history", "steps")

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None
        self.steps = 0


class _Recorder:
    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.states: dict[tuple[str, int, str], _ScaleState] = {}
        self.meta: list[tuple[str, int, str, str, int, int]] = []
        self.rows: list[torch.Tensor] = []

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, module: str, call: int, role: str) -> torch.Tensor:
        """Quantise-dequantise ``x`` for ``role`` (float32), statistics on the device; ``untraced``: a NaN made here
        must not read as the user's first NaN, at an op the user never wrote (findings read the statistics)."""
        recipe = self.recipe
        fmt = _BY_NAME[recipe.format_of(role)]
        state = self.states.setdefault((module, call, role), _ScaleState())
        with untraced():
            xf = x.detach().to(torch.float32)
            amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
            if recipe.scaling == "delayed" and state.history is not None:
                amax_used = state.history[: min(state.steps, recipe.amax_history_len)].amax()
            else:
                amax_used = amax
            scale = fmt.max / torch.clamp(amax_used, min=recipe.amax_floor) / (2.0 ** recipe.margin)
            xs = xf * scale
            q = xs.clamp(-fmt.max, fmt.max).to(fmt.dtype).to(torch.float32)
            out = q / scale
            self._record(xf, xs, q, scale, amax, amax_used, fmt, state)
            self.meta.append((module, call, role, fmt.name, state.steps, xf.numel()))
            state.steps += 1
        return out

    def _record(self, xf: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                amax_used: torch.Tensor, fmt: _Fp8Format, state: _ScaleState) -> None:
        mag = xs.abs()  # one quantisation's statistics row (on the device) and the amax history update
        saturated = (mag >= fmt.round_limit) if fmt.limit_saturates else (mag > fmt.round_limit)
        nonzero = xf != 0
        underflowed = (q == 0) & nonzero
        median = _median_nonzero(xf, nonzero)
        err_sq = (q - xs).square() / scale.square()
        if self.recipe.scaling == "delayed":
            if state.history is None:
                state.history = xf.new_zeros(self.recipe.amax_history_len)
            state.history[state.steps % self.recipe.amax_history_len] = amax
        self.rows.append(torch.stack([amax, scale, amax_used, saturated.sum().to(torch.float32),
                                      underflowed.sum().to(torch.float32), nonzero.sum().to(torch.float32),
                                      median, err_sq.sum(), (err_sq * saturated).sum()])
                         .to(torch.float64))

    def stats(self) -> Fp8Stats:
        if not self.rows:
            return Fp8Stats(self.recipe, ())
        dev = self.rows[0].device
        values = torch.stack([r.to(dev, non_blocking=True) for r in self.rows]).cpu().tolist()  # the one sync
        out = []
        for (module, call, role, fmt, step, numel), v in zip(self.meta, values):
            out.append(Fp8TensorStats(module, call, role, fmt, step, float(v[0]), float(v[1]), float(v[2]),
                                      int(v[3]), int(v[4]), int(v[5]), numel, float(v[6]), float(v[7]),
                                      float(v[8])))
        return Fp8Stats(self.recipe, tuple(out))


def _median_nonzero(xf: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """The (lower) median |x| of the nonzero values, 0 when all are zero: the sorted |x| hold the zeros first, so the
    median sits ``zeros + (nonzero - 1) // 2`` in (a tensor index: no boolean indexing, no host sync)."""
    if not xf.numel():
        return xf.new_zeros(())
    flat = xf.abs().flatten().sort().values
    nnz = nonzero.sum()
    idx = (flat.numel() - nnz) + torch.clamp(nnz - 1, min=0) // 2
    return flat.gather(0, idx.clamp(max=flat.numel() - 1).reshape(1)).reshape(())


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, site):  # noqa: ANN001, ANN205
        recorder, module, call = site
        xq = recorder.quantize(x, module, call, "input")
        wq = recorder.quantize(weight, module, call, "weight")
        out = torch.matmul(xq, wq.t())
        if bias is not None:
            out = out + bias.to(torch.float32)
        ctx.save_for_backward(xq, wq)
        ctx.site = site
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        xq, wq = ctx.saved_tensors
        recorder, module, call = ctx.site
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        gq = recorder.quantize(grad, module, call, "grad_output")
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.matmul(gq, wq).to(x_dtype)
        if ctx.needs_input_grad[1]:
            gw = torch.matmul(gq.reshape(-1, gq.shape[-1]).t(), xq.reshape(-1, xq.shape[-1])).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            gb = grad.to(torch.float32).reshape(-1, grad.shape[-1]).sum(0).to(b_dtype)
        return gx, gw, gb, None


class _Disabled(threading.local):
    depth = 0


_DISABLED = _Disabled()


class _Active(threading.local):
    def __init__(self) -> None:
        self.blocks: list[Fp8Autocast] = []


_ACTIVE = _Active()


def active_recipe() -> Fp8Recipe | None:
    """The recipe of the innermost :func:`fp8_autocast` block active in this thread (``None`` outside one, or inside
    :func:`fp8_disabled`): what a watch records so that a replay runs the user's recipe."""
    if _DISABLED.depth or not _ACTIVE.blocks:
        return None
    return _ACTIVE.blocks[-1].recipe


@contextlib.contextmanager
def fp8_disabled() -> Iterator[None]:
    """Inside an :func:`fp8_autocast` block, run the ``F.linear`` calls of this block unquantised (in their own
    dtype), as Transformer Engine's nested ``fp8_autocast(enabled=False)`` does for layers kept in high precision.

    >>> with fp8_autocast(model) as fp8:                     # doctest: +SKIP
    ...     with fp8_disabled():
    ...         y = model.lm_head(h)                         # not quantised, no statistics recorded

    Nests; thread-local; does nothing outside an fp8 block. Backward passes of linears run inside it are not
    quantised either (they never entered the fp8 autograd Function).
    """
    _DISABLED.depth += 1
    try:
        yield
    finally:
        _DISABLED.depth -= 1


class _Fp8Mode(TorchFunctionMode):
    def __init__(self, owner: Fp8Autocast) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is not F.linear or _DISABLED.depth:
            return func(*args, **kwargs)
        x, weight, bias = _linear_args(args, kwargs)
        module, call = self.owner._site()
        return _Fp8Linear.apply(x, weight, bias, (self.owner._recorder, module, call))


def _linear_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    names = ("input", "weight", "bias")
    vals = list(args) + [None] * (3 - len(args))
    for i, n in enumerate(names):
        if n in kwargs:
            vals[i] = kwargs[n]
    return vals[0], vals[1], vals[2]


class Fp8Autocast:
    """Context manager returned by :func:`fp8_autocast`; :meth:`stats` reads the statistics back.

    Re-entering the same object continues the amax histories (delayed scaling across steps).
    """

    def __init__(self, model: nn.Module | None, recipe: Fp8Recipe) -> None:
        self.model = model
        self.recipe = recipe
        self._recorder = _Recorder(recipe)
        self._stack: list[list[Any]] = []  # [module name, F.linear calls so far in this forward]
        self._handles: list[Any] = []
        self._mode: _Fp8Mode | None = None

    def _site(self) -> tuple[str, int]:
        if not self._stack:
            return "", 0
        top = self._stack[-1]
        top[1] += 1
        return top[0], top[1] - 1

    def _hooks(self) -> None:
        if self.model is None:
            return
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._make_pre(name)))
            self._handles.append(mod.register_forward_hook(self._make_post(name), always_call=True))

    def _make_pre(self, name: str):  # noqa: ANN202
        def pre(module: nn.Module, args: Any) -> None:
            self._stack.append([name, 0])

        return pre

    def _make_post(self, name: str):  # noqa: ANN202
        def post(module: nn.Module, args: Any, output: Any) -> None:
            while self._stack:
                if self._stack.pop()[0] == name:
                    break

        return post

    def __enter__(self) -> Fp8Autocast:
        if self._mode is not None:
            raise RuntimeError("this fp8_autocast block is already active; create another with fp8_autocast(...)")
        try:
            self._hooks()
            self._mode = _Fp8Mode(self)
            self._mode.__enter__()
            _ACTIVE.blocks.append(self)
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:  # noqa: ANN001
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(exc_type, exc_val, exc_tb)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        if self in _ACTIVE.blocks:
            _ACTIVE.blocks.remove(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
        self._mode = None

    def stats(self) -> Fp8Stats:
        """Every quantisation so far. Syncs with the device once (one ``.cpu()`` of all statistics)."""
        return self._recorder.stats()

    def recorded(self) -> int:
        """How many quantisations have been recorded so far (no host sync): ``stats().tensors[n:]`` are the later."""
        return len(self._recorder.meta)


def fp8_autocast(model: nn.Module | None = None, recipe: Fp8Recipe | None = None) -> Fp8Autocast:
    """Run every ``F.linear`` / ``nn.Linear`` of the block as an emulated fp8 GEMM; statistics per module.

    ``model`` gives module names to the statistics (its forward hooks are removed on exit); ``None`` records
    every call under ``""``. ``recipe`` defaults to ``Fp8Recipe()`` (hybrid, delayed scaling, history 1024,
    margin 0, amax floor 1e-12). The block changes nothing in the model; no host sync until :meth:`stats`.
    Backward passes run inside or after the block both quantise ``grad_output``.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if recipe is None:
        recipe = Fp8Recipe()
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an Fp8Recipe, got {type(recipe).__name__}; e.g. Fp8Recipe(format='hybrid')")
    return Fp8Autocast(model, recipe)
