"""Run CUDA's autocast policy on any device: ``cuda_autocast`` makes a CPU run cast like a CUDA run would.

CPU autocast (torch 2.13) keeps ``softmax``, ``pow``, ``exp``, ``layer_norm``, ``sum``, ``norm`` ... in fp16 where
CUDA autocast runs them in fp32 (see :mod:`ampdoctor.precision._cuda_policy`), so a CPU reproduction of a GPU
fp16-AMP failure can overflow where the GPU does not, or the other way round. Inside ``cuda_autocast`` every
torch call follows the CUDA lists instead.

>>> import torch
>>> from ampdoctor.precision.emulation import cuda_autocast
>>> x = torch.full((4,), 300.0)
>>> with cuda_autocast(torch.float16):
...     y = torch.nn.functional.linear(x, torch.eye(4)).pow(2)      # linear in fp16, pow in fp32 (as on CUDA)
>>> y.dtype, bool(torch.isfinite(y).all())
(torch.float32, True)
>>> with torch.autocast("cpu", dtype=torch.float16):              # CPU policy: pow stays fp16 -> 90000 = inf
...     z = torch.nn.functional.linear(x, torch.eye(4)).pow(2)
>>> z.dtype, bool(torch.isfinite(z).all())
(torch.float16, False)

Design
    * A private ``TorchFunctionMode`` sees every torch-level call (``torch.*``, ``F.*``, ``Tensor`` methods and
      dunders, ``torch.ops.aten.*``), maps the callable to its aten base name (``Tensor.__matmul__`` -> ``matmul``,
      ``F.softmax`` / ``Tensor.softmax`` -> ``softmax``) and casts its floating tensor arguments, also inside lists
      and tuples, as the CUDA policy says. Casts happen above autograd, so gradients flow through them as they do
      through CUDA autocast's casts.
    * The autocast state (enabled, dtype) of ``device_type`` is the thread-local one torch keeps:
      ``cuda_autocast`` sets it on enter and restores it on exit (also on exceptions), so user code that enters
      ``torch.autocast(device_type, ...)`` inside, or asks ``torch.is_autocast_enabled()``, composes: a nested
      ``torch.autocast("cpu", dtype=torch.bfloat16)`` is emulated with the CUDA policy in bf16, a nested
      ``torch.autocast("cpu", enabled=False)`` turns the emulation off for its block.
    * Every intercepted call runs with native autocast disabled (``torch._C._DisableAutocast``), so the device's
      own policy never applies on top. Calls that are not in the CUDA lists run with the mode re-entered, so the
      torch calls made by Python composites (``F.normalize``, ``F.interpolate``, ``F.multi_head_attention_forward``)
      are emulated one by one, as the dispatcher does on CUDA. Calls that are in the lists run their internals
      without autocast, as CUDA's autocast kernels do.
    * C++ composite ops (``torch.square`` -> ``pow``, ``F.cross_entropy`` -> ``log_softmax`` + ``nll_loss``,
      ``torch.linalg.norm`` -> ``linalg_vector_norm`` ...) decompose below ``__torch_function__``; CUDA autocast casts
      their inner ops. The op registry's composites (``ampdoctor.trace.declare_composite``, read here as
      ``COMPOSITE_POLICY``) give them the policy of their first inner op (measured: see
      ``tests/precision/test_emulation.py``, which compares against torch's own CUDA autocast kernels run on fake
      CUDA tensors).
    * Not modelled: the cast cache (numerically irrelevant), ops called from C++ extensions or TorchScript (they
      bypass ``__torch_function__``), and a ``torch.autocast(enabled=False)`` entered by user code that runs *inside*
      a torch call (a custom autograd Function's backward): such a block keeps the state of the enclosing call.

GEMMs (``cuda_gemm``)
    CUDA computes fp16/bf16 matrix products with fp32 accumulation and rounds the output once (cuBLAS
    ``CUBLAS_COMPUTE_32F``; cuDNN convolutions likewise). torch's CPU kernels for fp16 (and, without AVX512-BF16,
    bf16) are blocked differently and, on CPUs without AVX512-FP16/AMX, up to ~100x slower than fp32.
    :class:`cuda_gemm` is a ``TorchDispatchMode`` that computes every fp16/bf16 CPU GEMM and convolution (see
    :data:`GEMM_OPS`) in float32 from the (exactly widened) low-precision inputs and rounds each output once to
    the input dtype: CUDA's numerics, at fp32 speed. It works below autograd, so backward GEMMs are covered too;
    entered *before* a trace, the trace still records ``aten.mm`` with fp16 inputs and output.
    ``AMPDOCTOR_GEMM=native`` (or ``cuda_gemm(enabled=False)``) keeps torch's own kernels.

No host sync; no RNG consumed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import FunctionType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode

from ampdoctor.errors import ScenarioError
from ampdoctor.precision._cuda_policy import (
    BANNED_MESSAGE,
    COMPOSITE_POLICY,
    CUDA_OVERLOADS,
    CUDA_POLICY,
)
from ampdoctor.trace import DUNDERS, HALF_DTYPES, Kind, ops_with

log = logging.getLogger(__name__)

#: dtypes ``cuda_autocast`` accepts (the lower-precision dtypes CUDA autocast supports).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = HALF_DTYPES

#: Torch-level dunders and their aten op (the op registry's; in-place dunders map to in-place ops, never autocast).
DUNDER_OPS: dict[str, str] = DUNDERS

def _cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                        reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """``aten::cross_entropy_loss`` step by step (``aten/src/ATen/native/LossNLL.cpp``), for the mode to cast.

    Its ``log_softmax`` passes ``dtype=self.scalar_type()`` explicitly, so CUDA autocast leaves it in the input
    dtype (fp16 log-probabilities); ``nll_loss`` is fp32, the ``sum`` reductions are fp32_set_opt_dtype.
    ``reduction``: 0 none, 1 mean, 2 sum.
    """
    class_dim = 0 if input.dim() == 1 else 1
    n_classes = input.shape[class_dim]
    logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
    weight_shape = [1] * input.dim()
    if input.dim() > 1:
        weight_shape[class_dim] = n_classes
    if input.shape == target.shape:  # class probabilities
        t = target * (1 - label_smoothing) + label_smoothing / n_classes if label_smoothing > 0 else target
        prod = logp * t if weight is None else logp * t * weight.view(weight_shape)
        if reduction == 0:
            return -prod.sum(class_dim)
        if reduction == 2:
            return -prod.sum()
        return -prod.sum() / (input.numel() / n_classes)
    nll = torch._C._nn.nll_loss_nd(logp, target, weight, reduction, ignore_index)  # type: ignore[arg-type]
    if label_smoothing <= 0:
        return nll
    smooth = -(logp if weight is None else logp * weight.view(weight_shape)).sum(class_dim)
    ignore_mask = target == ignore_index
    smooth.masked_fill_(ignore_mask, 0.0)
    if reduction == 1:
        denom = (~ignore_mask).sum() if weight is None else weight.gather(0, target.masked_select(~ignore_mask)).sum()
        smooth = smooth.sum() / denom
    elif reduction == 2:
        smooth = smooth.sum()
    mul = torch.ops.aten.mul.Scalar  # a Python float * Tensor would dispatch mul.Tensor; keep ATen's ops
    return mul(nll, 1 - label_smoothing) + mul(smooth, label_smoothing / n_classes)


#: C++ composites whose inner ops CUDA autocast treats differently from any single policy: run step by step in
#: Python under the mode, so each inner op gets its own policy.
COMPOSITE_EMULATORS: dict[str, Callable[..., Any]] = {"cross_entropy_loss": _cross_entropy_loss}

_GET_DTYPE = torch.get_autocast_dtype
# Calls ``func`` skipping the mode once, so that the torch calls ``func`` makes reach the (re-entered) mode.
_redispatch = getattr(torch.overrides, "redispatch_function", None) or torch._C._skip_one_hop_torch_function
_IS_ENABLED = torch.is_autocast_enabled


def torch_op_name(func: Callable[..., Any]) -> tuple[str, str | None]:
    """The aten base name and overload (``None``: not known) a torch-level callable dispatches to.

    >>> torch_op_name(torch.Tensor.__matmul__), torch_op_name(torch.ops.aten.pow.Tensor_Scalar)
    (('matmul', None), ('pow', 'Tensor_Scalar'))
    """
    if isinstance(func, torch._ops.OpOverload):
        if func.namespace != "aten":
            return "", None
        return func._opname, "" if func._overloadname == "default" else func._overloadname
    if isinstance(func, torch._ops.OpOverloadPacket):
        return (func._qualified_op_name.split("::", 1)[-1], None) if func._qualified_op_name.startswith("aten::") \
            else ("", None)
    name = getattr(func, "__name__", "")
    return DUNDER_OPS.get(name, name), None


def cuda_policy_of(func: Callable[..., Any], kwargs: dict[str, Any] | None = None) -> str | None:
    """The CUDA autocast policy ``cuda_autocast`` applies to a call of ``func`` (``None``: run as given)."""
    if kwargs and kwargs.get("out") is not None:  # ``.out`` overloads are never autocast
        return None
    name, overload = torch_op_name(func)
    policy = CUDA_POLICY.get(name)
    if policy is not None:
        if overload is not None and overload not in CUDA_OVERLOADS[name]:
            return None
        return policy
    return COMPOSITE_POLICY.get(name)


def _eligible(t: Any, device_type: str) -> bool:
    """CUDA's ``is_eligible``: a defined floating tensor of the autocast device, not float64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == device_type


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        mapped = [_map_tensors(o, fn) for o in obj]
        return mapped if isinstance(obj, list) else tuple(mapped)
    return obj


def _iter_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_tensors(o)


def _cast_all(args: tuple, kwargs: dict, dtype: torch.dtype, device_type: str) -> tuple[tuple, dict]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if _eligible(t, device_type) and t.dtype != dtype else t

    return _map_tensors(args, cast), {k: _map_tensors(v, cast) for k, v in kwargs.items()}


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("input", kwargs.get("self"))


def _promote_type(args: tuple, kwargs: dict, lower: torch.dtype, device_type: str) -> torch.dtype:
    """CUDA's ``promote_type``/``prioritize``: float32 wins, float64 is ignored, two different low types raise."""
    current = lower
    for t in _iter_tensors((args, tuple(kwargs.values()))):
        if not _eligible(t, device_type):
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif not (current == lower and t.dtype == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def apply_cuda_policy(policy: str, args: tuple, kwargs: dict, dtype: torch.dtype,
                      device_type: str) -> tuple[tuple, dict]:
    """The arguments CUDA autocast would pass on for ``policy`` (see ``CastPolicy`` in ``autocast_mode.h``)."""
    if policy == "lower":
        return _cast_all(args, kwargs, dtype, device_type)
    if policy == "fp32":
        return _cast_all(args, kwargs, torch.float32, device_type)
    explicit_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    if policy == "fp32_set_opt_dtype":
        if _eligible(_first_tensor(args, kwargs), device_type) and not explicit_dtype:
            kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs
    if policy == "fp32_append_dtype":
        first = _first_tensor(args, kwargs)
        if _eligible(first, device_type) and not explicit_dtype:
            if args:
                args = (first.to(torch.float32),) + tuple(args[1:])
            else:
                key = "input" if "input" in kwargs else "self"
                kwargs = {**kwargs, key: first.to(torch.float32)}
        return args, kwargs
    if policy == "promote":
        return _cast_all(args, kwargs, _promote_type(args, kwargs, dtype, device_type), device_type)
    if policy == "banned":
        if any(isinstance(t, torch.Tensor) and t.device.type == device_type
               for t in _iter_tensors((args, tuple(kwargs.values())))):
            raise RuntimeError(BANNED_MESSAGE)
        return args, kwargs
    raise ValueError(f"unknown autocast policy {policy!r}")


def _autocast_available(device_type: Any) -> bool:
    if not isinstance(device_type, str):
        return False
    try:
        return bool(torch._C._is_autocast_available(device_type))
    except RuntimeError:  # not a device string at all
        return False


class _CudaPolicyMode(TorchFunctionMode):
    """Casts the arguments of every torch call as CUDA autocast would, for tensors of ``device_type``."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        # (enabled, dtype) of the torch calls this mode is running: inside them native autocast is disabled, so
        # the thread-local flag no longer tells the user's state (see the module docstring).
        self._frames: list[tuple[bool, torch.dtype]] = []
        self._redispatched: Any = None

    def _state(self) -> tuple[bool, torch.dtype]:
        if _IS_ENABLED(self.device_type):
            return True, _GET_DTYPE(self.device_type)
        if self._frames:
            return self._frames[-1]
        return False, _GET_DTYPE(self.device_type)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self._redispatched is func:  # the one-hop skip did not take for this callable: run it as it is
            self._redispatched = None
            return func(*args, **kwargs)
        self._redispatched = None
        state = self._state()
        policy = cuda_policy_of(func, kwargs) if state[0] else None
        emulator = COMPOSITE_EMULATORS.get(torch_op_name(func)[0]) if state[0] and "out" not in kwargs else None
        self._frames.append(state)
        try:
            with torch._C._DisableAutocast():
                if emulator is not None:
                    with self:
                        return emulator(*args, **kwargs)
                if policy is not None:
                    args, kwargs = apply_cuda_policy(policy, tuple(args), kwargs, state[1], self.device_type)
                    return func(*args, **kwargs)
                if isinstance(func, FunctionType):  # a Python composite: emulate the torch calls it makes
                    self._redispatched = func
                    try:
                        with self:
                            return _redispatch(func, types, args, kwargs)
                    finally:
                        self._redispatched = None
                return func(*args, **kwargs)
        finally:
            self._frames.pop()


class cuda_autocast:  # noqa: N801 - a context manager named like torch.autocast
    """Emulate CUDA's autocast op policy on ``device_type`` (default ``"cpu"``) for the duration of the block.

    >>> with cuda_autocast(torch.float16):                                    # doctest: +SKIP
    ...     loss = model(batch).float().pow(2).mean()
    >>> loss.backward()                                                       # doctest: +SKIP

    ``dtype`` is the lower-precision dtype (``torch.float16`` or ``torch.bfloat16``); ``enabled=False`` disables
    autocast for the block (a nested ``torch.autocast(device_type, ...)`` is still emulated with the CUDA policy).
    On exit the autocast state of ``device_type`` and the torch-function mode stack are as they were found, also
    after an exception. Nested ``cuda_autocast`` blocks share one mode. Outputs of lower-precision ops are in
    ``dtype``; ``binary_cross_entropy`` raises the error CUDA autocast raises. No host sync.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, enabled: bool = True, *, device_type: str = "cpu") -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"invalid dtype {dtype!r} for cuda_autocast: expected one of "
                             f"{', '.join(map(str, SUPPORTED_DTYPES))}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if not _autocast_available(device_type):
            raise ValueError(f"invalid device_type {device_type!r}: expected a device type autocast supports, "
                             "e.g. 'cpu' or 'cuda' (the type of the tensors the model runs on)")
        self.dtype = dtype
        self.enabled = enabled
        self.device_type = device_type
        self._saved: list[tuple[bool, torch.dtype, _CudaPolicyMode | None]] = []

    def __enter__(self) -> cuda_autocast:
        dev = self.device_type
        active = any(isinstance(m, _CudaPolicyMode) and m.device_type == dev
                     for m in _get_current_function_mode_stack())
        mode = None if active else _CudaPolicyMode(dev)
        self._saved.append((_IS_ENABLED(dev), _GET_DTYPE(dev), mode))
        torch.set_autocast_enabled(dev, self.enabled)
        torch.set_autocast_dtype(dev, self.dtype)
        if mode is not None:
            try:
                mode.__enter__()
            except BaseException:
                prev_enabled, prev_dtype, _ = self._saved.pop()
                torch.set_autocast_enabled(dev, prev_enabled)
                torch.set_autocast_dtype(dev, prev_dtype)
                raise
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:  # noqa: ANN001
        prev_enabled, prev_dtype, mode = self._saved.pop()
        try:
            if mode is not None:
                mode.__exit__(exc_type, exc_val, exc_tb)
        finally:
            torch.set_autocast_enabled(self.device_type, prev_enabled)
            torch.set_autocast_dtype(self.device_type, prev_dtype)


# --- GEMMs: fp32 accumulation, one rounding of the output ----------------------------------------------------------

#: aten GEMM-like ops (default overloads) that ``cuda_gemm`` computes in float32: everything ``mm``/``addmm``/
#: ``bmm``/``baddbmm``/``matmul``/``linear``/``einsum`` and convolutions decompose into below autograd.
GEMM_OPS: frozenset[Any] = frozenset(getattr(torch.ops.aten, n).default for n in ops_with(Kind.GEMM))
# (looked up by identity: an OpOverload's ``__hash__`` is a Python call, paid by every op the mode sees; GEMM_OPS holds
# the overloads, so their ids stay theirs)
_GEMM_IDS: frozenset[int] = frozenset(id(f) for f in GEMM_OPS)
#: low-precision dtypes whose GEMMs ``cuda_gemm`` widens.
GEMM_DTYPES: frozenset[torch.dtype] = frozenset(SUPPORTED_DTYPES)
#: ``AMPDOCTOR_GEMM`` values: ``cuda`` (fp32 accumulation, default) or ``native`` (torch's kernels).
GEMM_CHOICES: tuple[str, ...] = ("cuda", "native")
GEMM_ENV = "AMPDOCTOR_GEMM"


def gemm_choice(gemm: str | None = None) -> str:
    """``gemm`` if given, else ``$AMPDOCTOR_GEMM``, else ``"cuda"``; anything else raises ``ScenarioError``."""
    value = gemm if gemm is not None else os.environ.get(GEMM_ENV, "cuda")
    if value not in GEMM_CHOICES:
        src = "gemm" if gemm is not None else f"${GEMM_ENV}"
        raise ScenarioError(f"invalid {src} {value!r}: expected one of {', '.join(map(repr, GEMM_CHOICES))} "
                         "('cuda': fp16/bf16 GEMMs accumulate in fp32 as on CUDA; 'native': torch's CPU kernels)")
    return value


def _low_dtype(args: tuple, kwargs: dict, device_type: str) -> torch.dtype | None:
    """The one fp16/bf16 dtype all floating tensor arguments share on ``device_type`` (``None``: leave as is)."""
    dtype = None
    for t in _iter_tensors((args, tuple(kwargs.values()))):
        if not t.is_floating_point():
            continue
        if t.dtype not in GEMM_DTYPES or t.device.type != device_type or (dtype is not None and t.dtype != dtype):
            return None
        dtype = t.dtype
    return dtype


def _widen(obj: Any, dtype: torch.dtype) -> Any:
    return _map_tensors(obj, lambda t: t.to(torch.float32) if t.dtype == dtype else t)


def _round(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype == torch.float32 else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_round(o, dtype) for o in obj)
    return obj


class cuda_gemm(TorchDispatchMode):  # noqa: N801 - a context manager, like cuda_autocast
    """fp16/bf16 GEMMs and convolutions on ``device_type`` computed in float32 and rounded once, as CUDA does.

    >>> a, b = torch.randn(8, 16).half(), torch.randn(16, 4).half()
    >>> with cuda_gemm():
    ...     c = a @ b
    >>> bool((c == (a.float() @ b.float()).half()).all()), c.dtype
    (True, torch.float16)

    Inputs are widened exactly (every fp16/bf16 value is a float32 value), so the only rounding is that of the
    float32 result to the input dtype: an fp32-accumulating GEMM's. Calls whose floating tensors are not all of
    one low dtype on ``device_type`` run unchanged. ``enabled=False`` makes the block a no-op. No host sync.
    """

    def __init__(self, enabled: bool = True, *, device_type: str = "cpu") -> None:
        super().__init__()
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self.enabled = enabled
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.enabled and id(func) in _GEMM_IDS:
            dtype = _low_dtype(args, kwargs, self.device_type)
            if dtype is not None:
                return _round(func(*_widen(args, dtype), **_widen(kwargs, dtype)), dtype)
        return func(*args, **kwargs)
