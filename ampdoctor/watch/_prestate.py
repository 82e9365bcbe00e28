"""The previous update's pre-step state, so that a replay can start at the step that WROTE a non-finite weight.

A 16-bit parameter that the optimizer updates in its own dtype can be made inf/NaN by the update itself (Adam's
``eps=1e-8`` is 0 in fp16: ``addcdiv_`` divides 0 by 0). The watch sees it only at the NEXT step (its loss or
gradients are non-finite), whose pre-step state is already the corrupted one: a replay of that step finds the
weights non-finite on entry and can only say ``nonfinite-input``. So, while the watch already copies the
low-precision weights before each update (the first ``coverage_steps`` steps, for the lost-update check), it
also keeps the rest of that update's inputs (model state, optimizer state, the step's inputs by reference) until
the next update: device copies, no host read, never more than half the device's free memory (else none is
kept and the report says so). On an anomaly whose step STARTED from non-finite parameters or
optimizer state (one check on the anomaly path, :func:`nonfinite_state`), the replay runs that earlier update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.watch import _reproducer
from ampdoctor.watch._payload import StepInputs, local_module
from ampdoctor.watch._record import StepRecord


@dataclass(frozen=True)
class PreUpdate:
    """One update's pre-step state: device copies of the model's and the optimizer's state, the step's inputs."""

    record: StepRecord
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    inputs: StepInputs


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_clone(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def fits(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether copying ``tensors`` leaves the user's training room: on a CUDA device at most half of its free
    memory (a driver query, no stream sync); host memory is not checked."""
    by_device: dict[torch.device, int] = {}
    for t in tensors:
        by_device[t.device] = by_device.get(t.device, 0) + t.numel() * t.element_size()
    for dev, size in by_device.items():
        if dev.type == "cuda" and size > torch.cuda.mem_get_info(dev)[0] // 2:
            return False
    return True


def take(model: nn.Module, optimizer: torch.optim.Optimizer | None, record: StepRecord, inputs: StepInputs,
         reuse: Sequence[tuple[str, torch.Tensor, torch.Tensor]] = ()) -> PreUpdate | None:
    """Copy the state the coming update reads (on its device: no host read), or None when the copy would not
    fit (:func:`fits`). ``reuse`` holds (name, parameter, copy) for copies the watch already made (the lost-update
    check's), so those are not copied twice."""
    copies = {id(p): c for _, p, c in reuse}
    live = local_module(model).state_dict(keep_vars=True)
    opt_state = None if optimizer is None else optimizer.state_dict()
    if not fits([v for v in live.values() if id(v) not in copies] + _tensors(opt_state)):
        return None
    state = {k: copies[id(v)] if id(v) in copies else v.detach().clone() for k, v in live.items()}
    return PreUpdate(record, state, _clone(opt_state), inputs)


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[str, ...]:
    """The floating parameters (and the tensors of their optimizer state) holding inf/NaN, by parameter name.
    One fused reduction and one host read: only on the anomaly path."""
    local = local_module(model)
    names = {id(p): n for n, p in local.named_parameters()}
    tensors: list[tuple[str, torch.Tensor]] = [(n, p.detach()) for n, p in local.named_parameters()
                                               if p.is_floating_point()]
    if optimizer is not None:
        for p, st in optimizer.state.items():
            for v in st.values() if isinstance(st, dict) else ():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    tensors.append((names.get(id(p), "?"), v.detach()))
    tensors = [(n, t) for n, t in tensors if t.numel() > 0 and not t.is_sparse]
    if not tensors:
        return ()
    norms = torch._foreach_norm([t for _, t in tensors], 2.0, dtype=torch.float32)
    flags = (~torch.isfinite(torch.stack([x.to(norms[0].device) for x in norms]))).tolist()
    return tuple(dict.fromkeys(n for (n, _), bad in zip(tensors, flags) if bad))


def moved_to(step: int, bad: Sequence[str], prior: PreUpdate | None, coverage_steps: int) -> dict[str, Any]:
    """What the report says when step ``step`` started from the inf/NaN state in ``bad``: the replay runs the
    update before it (``prior``), or, without its pre-step state, why not and what to do."""
    names = ", ".join(bad[:6]) + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
    head = (f"step {step} started from inf/NaN parameters or optimizer state ({names}): an earlier update wrote "
            "them")
    if prior is not None:
        return {"from_step": step, "to_step": prior.record.step, "nonfinite": list(bad),
                "note": f"{head}, so the replay runs step {prior.record.step}, the update that wrote them."}
    return {"from_step": step, "to_step": None, "nonfinite": list(bad),
            "note": f"{head}; the watch keeps an update's pre-step state only during the first {coverage_steps} "
                    f"step(s) of 16-bit weights the optimizer updates in their own dtype (and when the copy takes "
                    f"at most half the free device memory), so the replay runs step "
                    f"{step}, which can only find them non-finite on entry. To see the update that wrote them, "
                    f"watch with coverage_steps above {step} (or keep fp32 master weights)."}


def prior_payload(prior: PreUpdate | None, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` (built for the anomaly from the live objects) with ``prior``'s pre-step state instead: the
    gradients of that update are gone (the replay recomputes them from the step's inputs)."""
    if prior is None:
        return payload
    saved = _reproducer.to_saveable
    return {**payload, "model_state": saved(dict(prior.model_state)),
            "grads": {n: None for n in payload["grads"]},
            "optimizer_state": None if prior.optimizer_state is None else saved(prior.optimizer_state)}


__all__ = ["PreUpdate", "fits", "moved_to", "nonfinite_state", "prior_payload", "take"]
