"""The content of a reproducer: the pre-step state of one anomalous step, as plain tensors and values.

See :mod:`ampdoctor.watch._reproducer` for the keys. Building a payload copies the model's state, gradients,
optimizer state and batch to the CPU (a sync); it runs only for the first anomaly of each kind.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.precision import FP8_FORMATS
from ampdoctor.precision.fp8 import active_recipe
from ampdoctor.trace import HALF_DTYPES
from ampdoctor.watch import _reproducer
from ampdoctor.watch._record import StepRecord
from ampdoctor.watch._scaler import GradScalerView

_LOW_DTYPES = HALF_DTYPES


@dataclass(frozen=True)
class StepInputs:
    """What the step's forward was called with (kept by reference until the next forward) and its RNG state."""

    batch: Any = None
    has_batch: bool = False
    call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    rng: dict[str, Any] | None = None
    #: every root-module call of the step, in order (a GAN's discriminator on real and fake batches), and the RNG
    #: state before the first; empty when more than ``MAX_STEP_CALLS`` were made (the replay then runs the last)
    calls: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...] = ()
    first_rng: dict[str, Any] | None = None
    #: every batch observed in the step (Lightning's micro-batches under ``accumulate_grad_batches``), in order
    batches: tuple[Any, ...] = ()


#: root-module calls of one step a reproducer keeps (all of them are replayed when the step has several)
MAX_STEP_CALLS = 8


@dataclass
class Iteration:
    """The open step: what the hooks saw since the last step closed."""

    record: StepRecord
    forward_seen: bool = False
    seen: set[int] = field(default_factory=set)
    call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    batch: Any = None
    has_batch: bool = False
    rng: dict[str, Any] | None = None
    loss: torch.Tensor | None = None
    micro: bool = False     # more than one loss given in this step: each is a micro-batch's

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    first_rng: dict[str, Any] | None = None
    batches: list[Any] = field(default_factory=list)

    @property
    def active(self) -> bool:      # a batch observed (Lightning's micro-batch) also opens the step
        return self.forward_seen or bool(self.seen) or bool(self.batches)

    def inputs(self) -> StepInputs:
        calls = tuple(self.calls) if len(self.calls) <= MAX_STEP_CALLS else ()
        batches = tuple(self.batches) if len(self.batches) <= MAX_STEP_CALLS else ()
        return StepInputs(self.batch, self.has_batch, self.call, self.rng, calls, self.first_rng, batches)


def rng_state(device_type: str) -> dict[str, Any]:
    """The global RNG states (a CPU copy of a few KB; reading a CUDA generator's state does not sync)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if device_type == "cuda" else None}


#: the precision name of an emulated fp8 block, by its recipe's format
FP8_PRECISION_OF: dict[str, str] = {fmt: name for name, fmt in FP8_FORMATS.items()}


def fp8_settings() -> dict[str, Any]:
    """``{"fp8_recipe": fields}`` inside ampdoctor's emulated fp8 block (its innermost recipe), else ``{}``."""
    recipe = active_recipe()
    return {} if recipe is None else {"fp8_recipe": dataclasses.asdict(recipe)}


def precision_settings(autocast: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The precision a step ran in: autocast as seen during the forward, else the parameters' main dtype."""
    dtypes = [p.dtype for p in params]
    main = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    name = None
    recipe = autocast.get("fp8_recipe")
    if isinstance(recipe, dict) and recipe.get("format") in FP8_PRECISION_OF:
        name = FP8_PRECISION_OF[recipe["format"]]
    elif autocast["autocast"] and autocast["autocast_dtype"] in ("float16", "bfloat16"):
        name = "fp16-amp" if autocast["autocast_dtype"] == "float16" else "bf16-amp"
    elif main == torch.float16:
        name = "fp16"
    elif main == torch.bfloat16:
        name = "bf16"
    return {"name": name, **autocast, "param_dtype": str(main).replace("torch.", "")}


def local_module(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds (a replay runs it alone, so it never issues a collective) or that
    ``torch.compile`` wraps (a replay runs it eagerly, op by op: a compiled graph hides the ops it fuses)."""
    while True:
        inner = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(inner, nn.Module):
            model = inner
        else:
            return model


def hf_config(model: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config as plain values (``to_dict()``), to rebuild the architecture without code."""
    cfg = getattr(local_module(model), "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return _reproducer.to_saveable(to_dict())  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - a config that does not serialise: replay then needs --factory
        return None


def build_payload(*, step: int, kind: str, message: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  scaler: GradScalerView | None, scale: float | None, inputs: StepInputs,
                  precision: dict[str, Any], source: str, device_type: str, step_method: str = "") -> dict[str, Any]:
    dropped: list[str] = []
    if inputs.has_batch:
        batch = inputs.batch
    elif inputs.call is not None:
        batch = _reproducer.batch_from_call(*inputs.call)
    else:
        batch = None
    scaler_state = None
    if scaler is not None and scaler.scaler is not None:
        scaler_state = scaler.state_dict()
        if scaler_state is not None and scale is not None:
            scaler_state["scale"] = scale
    local = local_module(model)
    names = {id(p): n for n, p in local.named_parameters()}
    call = inputs.call
    several = not inputs.has_batch and len(inputs.calls) > 1
    calls = ([{"args": _reproducer.to_saveable(list(a), dropped, "args"),
               "kwargs": _reproducer.to_saveable(k, dropped, "kwargs")} for a, k in inputs.calls] if several else None)
    micro = ([_reproducer.to_saveable(b, dropped, "batch") for b in inputs.batches]
             if inputs.has_batch and len(inputs.batches) > 1 else None)
    rng = (inputs.first_rng if several or micro else None) or inputs.rng or rng_state(device_type)
    return {
        "format": _reproducer.FORMAT, "version": _reproducer.VERSION,
        "step": step, "anomaly": kind, "message": message,
        "model_state": _reproducer.to_saveable(dict(local.state_dict())),
        "grads": {n: _reproducer.to_saveable(p.grad) for n, p in local.named_parameters()},
        "batch": _reproducer.to_saveable(batch, dropped, "batch"),
        "call": (None if call is None else
                 {"args": _reproducer.to_saveable(list(call[0]), dropped, "args"),
                  "kwargs": _reproducer.to_saveable(call[1], dropped, "kwargs")}),
        "dropped": dropped,
        "optimizer_state": None if optimizer is None else _reproducer.to_saveable(optimizer.state_dict()),
        "optimizer_class": "" if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "optimizer_params": None if optimizer is None else [[names.get(id(p), "") for p in g["params"]]
                                                            for g in optimizer.param_groups],
        "scaler_state": scaler_state,
        "scaler_device": None if scaler_state is None or scaler is None else scaler.device,
        "calls": calls,
        "micro_batches": micro,
        "rng": rng,
        "precision": precision,
        "source": source,
        "step_method": step_method,
        "model_class": f"{type(local).__module__}.{type(local).__qualname__}",
        "hf_config": hf_config(model),
        "torch_version": str(torch.__version__),
    }


def copy_without_hooks(model: nn.Module, keep: object, handles: Sequence[tuple[str, Any]]) -> nn.Module:
    """A deep copy of the local module without the watch's forward hooks (``keep`` is not copied)."""
    local = local_module(model)
    clone = copy.deepcopy(local, {id(keep): keep})
    path = next((n for n, m in model.named_modules() if m is local), "")     # "module.", "_orig_mod.", ...
    prefix = f"{path}." if path else ""
    mods = dict(clone.named_modules())
    for mod_name, h in handles:
        name = mod_name[len(prefix):] if prefix and mod_name.startswith(prefix) else mod_name
        m = mods.get(name)
        if m is not None:
            for d in (m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs):
                d.pop(h.id, None)
    return clone


__all__ = ["MAX_STEP_CALLS", "Iteration", "StepInputs", "build_payload", "copy_without_hooks", "hf_config",
           "local_module", "precision_settings", "rng_state"]
