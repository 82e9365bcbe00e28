"""What every run of a step shares: precision contexts, batch casting, calling the model, copies, RNG.

Used by the step runner (:mod:`ampdoctor.precision._step`) and the inference runs (generation, positions,
compiled); one definition of each.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.precision._spec import FP8_FORMATS, ScenarioError, StepSpec
from ampdoctor.trace import DTYPES, HALF_DTYPES

log = logging.getLogger(__name__)

#: Precisions that cast the whole model (and the batch) to a low-precision dtype.
LOW_DTYPES: dict[str, torch.dtype] = {i.short: i.dtype for i in DTYPES.values() if i.dtype in HALF_DTYPES}
#: Precisions that run under autocast to a low-precision dtype.
AMP_DTYPES: dict[str, torch.dtype] = {f"{name}-amp": dt for name, dt in LOW_DTYPES.items()}


# ---------------------------------------------------------------------------------------------------------------
# small helpers shared by every path


class _NoAutocast(TorchFunctionMode):
    """Runs every torch call with autocast disabled, also inside a user's own ``torch.autocast`` block."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if torch.is_autocast_enabled(self.device_type):
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (else buffer; else CPU)."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def map_batch(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor in nested dicts, tuples and lists replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_batch(v, fn)) for k, v in obj.items()) if type(obj) is dict else {
            k: map_batch(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(map_batch(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_batch(v, fn) for v in obj]
    return obj


def cast_batch(batch: Any, dtype: torch.dtype, only_low: bool = False) -> Any:
    """Floating tensors of ``batch`` cast to ``dtype`` (``only_low``: only the fp16/bf16 ones)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if only_low and t.dtype not in HALF_DTYPES:
            return t
        return t.to(dtype)

    return map_batch(batch, cast)


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple/list, ``model()`` for None, else
    ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if batch is None:
        return model()
    return model(batch)


def default_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returns itself: ``output.loss`` / ``output["loss"]`` or a scalar float output."""
    loss = getattr(output, "loss", None)
    if isinstance(output, dict) and loss is None:
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.is_floating_point():
        return output
    return None


def _bind_train_step(train_step: Any, optimizer: Any, scaler: Any) -> dict[str, Any]:
    try:
        params = inspect.signature(train_step).parameters
    except (TypeError, ValueError):
        return {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw: dict[str, Any] = {}
    if optimizer is not None and ("optimizer" in params or var_kw):
        kw["optimizer"] = optimizer
    if scaler is not None and ("scaler" in params or var_kw):
        kw["scaler"] = scaler
    return kw


@contextlib.contextmanager
def saved_rng() -> Iterator[None]:
    """Save the global RNG states and restore them on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def copy_objects(spec: StepSpec, memo: dict[Any, Any] | None = None) -> tuple[nn.Module, Any, Any]:
    """Deep copies of the spec's model, optimizer and scaler, made together (one copy, shared references kept).

    ``memo``: a ``deepcopy`` memo seeded with the copies of some tensors (a shared copy's recycled storages,
    :mod:`ampdoctor.precision._shared_copy`)."""
    try:
        model, optimizer, scaler = copy.deepcopy((spec.model, spec.optimizer, spec.scaler), memo)
    except Exception as e:
        raise ScenarioError(
            f"cannot copy the model/optimizer/scaler ({type(e).__name__}: {e}); ampdoctor runs on copies so that "
            "your objects are never changed: make them deep-copyable (no open files, locks or generators held)"
        ) from e
    _strip_instrument_hooks(model, optimizer)
    _carry_tensor_hooks(spec.model, model)
    return model, optimizer, scaler


def _carry_tensor_hooks(src: nn.Module, model: nn.Module) -> None:
    """Gradient hooks on the user's parameters (``p.register_hook``, ``register_post_accumulate_grad_hook``: a
    clamp or ``nan_to_num`` of the gradients) are part of the step, but ``deepcopy`` of a tensor drops them: the
    copy's parameters get the same hook functions, in order (ampdoctor's own instruments excepted)."""
    for p, q in zip(src.parameters(), model.parameters()):
        for h in (p._backward_hooks or {}).values():
            if not getattr(h, "_ampdoctor_hook", False):
                q.register_hook(h)
        for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            if not getattr(h, "_ampdoctor_hook", False):
                q.register_post_accumulate_grad_hook(h)


def _strip_instrument_hooks(model: nn.Module, optimizer: Any) -> None:
    """A copy runs without ampdoctor's own instruments (a watch on the user's model): their hooks are marked
    ``_ampdoctor_hook`` and shared, not copied, by ``deepcopy``; drop them from the copy."""
    pairs = [(d, extras) for m in model.modules() for d, extras in (
        (m._forward_pre_hooks, (m._forward_pre_hooks_with_kwargs,)),
        (m._forward_hooks, (m._forward_hooks_with_kwargs, m._forward_hooks_always_called)),
        (m._backward_hooks, ()))]
    if isinstance(optimizer, torch.optim.Optimizer):
        pairs += [(optimizer._optimizer_step_pre_hooks, ()), (optimizer._optimizer_step_post_hooks, ())]
    for d, extras in pairs:
        for key in [k for k, h in d.items() if getattr(h, "_ampdoctor_hook", False)]:
            del d[key]
            for extra in extras:
                extra.pop(key, None)


def _emulated(device: torch.device, policy: str) -> bool:
    """Whether a target run on ``device`` emulates CUDA (autocast policy, GEMM numerics): ``policy="cuda"`` off-GPU."""
    return policy == "cuda" and device.type != "cuda"


def _precision_context(precision: str | None, device: torch.device, policy: str) -> Any:
    if precision in AMP_DTYPES:
        dtype = AMP_DTYPES[precision]
        if _emulated(device, policy):
            try:
                from ampdoctor.precision.emulation import cuda_autocast
            except ImportError:  # emulation not available: native autocast stands in
                return torch.autocast(device.type, dtype=dtype)
            return cuda_autocast(dtype, device_type=device.type)
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def _emulation_scope(precision: str | None, device: torch.device, policy: str) -> Any:
    """The CUDA-policy emulation kept on the torch-function mode stack for a whole target step, autocast off.

    Autocast entered anywhere in the step then follows the CUDA policy, not only the forward's own
    :func:`_precision_context`: a non-reentrant ``torch.utils.checkpoint`` re-enters the forward's autocast state
    for its recompute during the backward, and a recompute under CPU's native policy would produce tensors of other
    dtypes than the emulated forward saved (``CheckpointError``); a user ``train_step`` may enter ``torch.autocast``
    itself. With autocast off the mode casts nothing (see :class:`ampdoctor.precision.emulation.cuda_autocast`)."""
    if precision not in AMP_DTYPES or not _emulated(device, policy):
        return contextlib.nullcontext()
    from ampdoctor.precision.emulation import cuda_autocast

    return cuda_autocast(AMP_DTYPES[precision], enabled=False, device_type=device.type)


def _gemm_context(precision: str | None, device: torch.device, policy: str) -> Any:
    """fp16/bf16 GEMMs with fp32 accumulation (CUDA's numerics) for a CUDA-policy target run off-GPU.

    Entered before the observers (the trace), so the trace records the GEMMs in their low dtype.
    ``AMPDOCTOR_GEMM=native`` keeps torch's own CPU kernels (see :class:`ampdoctor.precision.emulation.cuda_gemm`)."""
    if not _emulated(device, policy) or (precision not in AMP_DTYPES and precision not in LOW_DTYPES):
        return contextlib.nullcontext()
    from ampdoctor.precision.emulation import cuda_gemm, gemm_choice

    return cuda_gemm(gemm_choice() == "cuda", device_type=device.type)


def _fp8_context(precision: str | None, model: nn.Module, recipe: Any = None) -> Any:
    """``fp8_autocast`` of an fp8 precision: the user's ``recipe`` (:attr:`StepSpec.fp8_recipe`), else
    ``Fp8Recipe()`` in the precision's format."""
    if precision not in FP8_FORMATS:
        return contextlib.nullcontext()
    from ampdoctor.precision.fp8 import Fp8Recipe, fp8_autocast

    return fp8_autocast(model, recipe if recipe is not None else Fp8Recipe(format=FP8_FORMATS[precision]))


def cast_optimizer_state(opt: Any, dtype: torch.dtype) -> None:
    """Optimizer state follows its parameters' dtype (as after ``model.half()`` and a fresh optimizer)."""
    if opt is None:
        return
    for st in opt.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                st[k] = v.to(dtype)
