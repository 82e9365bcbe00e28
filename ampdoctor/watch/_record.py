"""Per-step records and the device-side readback: typed pending values, read back with ONE host transfer.

During a step the guard queues device tensors (the loss, the per-parameter gradient norms, the loss scale, ...)
as typed :class:`Pending` values. :meth:`Readback.read` concatenates them on the device, reads them with one
``tolist()`` and returns each value with its numbers; nothing is read per op or per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRecord:
    """What the guard learnt about one step (one optimizer update, or one iteration without optimizer).

    Mutable on purpose: values read back from the device arrive after the record was opened.
    ``skipped`` is true when GradScaler skipped the update (non-finite gradients).
    """

    step: int
    skipped: bool = False
    loss: float | None = None
    grad_norm: float | None = None
    scale: float | None = None
    nonfinite_params: tuple[str, ...] = ()
    spike: bool = False


@dataclass
class Coverage:
    """Gradient coverage measured over the first ``coverage_steps`` steps (names as in ``named_parameters``)."""

    steps: int = 0
    never_grad: tuple[str, ...] = ()
    zero_grad: tuple[str, ...] = ()
    not_in_optimizer: tuple[str, ...] = ()


@dataclass
class LostUpdates:
    """Low-precision parameters updated in place by the optimizer: elements with a non-zero gradient
    (``updates``) and, of those, elements bit-identical after the step (``lost``)."""

    dtypes: dict[str, str] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    updates: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def add(self, name: str, lost: float, updates: float) -> None:
        self.lost[name] = self.lost.get(name, 0) + int(lost)
        self.updates[name] = self.updates.get(name, 0) + int(updates)


# ---------------------------------------------------------------------------------------------- pending values
@dataclass(frozen=True)
class Pending:
    """A device tensor waiting for the step's single read."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class LossValue(Pending):
    record: StepRecord
    micro: bool = False     # one of several losses given in the step (micro-batches under gradient accumulation)


@dataclass(frozen=True)
class ScaleValue(Pending):
    record: StepRecord


@dataclass(frozen=True)
class FoundInf(Pending):
    """``optimizer.found_inf`` of an optimizer that unscales itself (fused Adam under GradScaler)."""

    record: StepRecord


@dataclass(frozen=True)
class GradNorms(Pending):
    """One fp32 L2 norm per parameter gradient, in the order of ``names``."""

    record: StepRecord
    names: tuple[str, ...]


@dataclass(frozen=True)
class ProbeFlags(Pending):
    """Per parameter, in backward order: 1 when its gradient held inf/NaN (:mod:`ampdoctor.watch._probe`)."""

    record: StepRecord
    names: tuple[str, ...]


@dataclass(frozen=True)
class LostCounts(Pending):
    """Per low-precision parameter: (elements unchanged by the update despite a non-zero grad, non-zero grads)."""

    names: tuple[str, ...]


class Readback:
    """The queue of pending device values; :meth:`read` is the one host read."""

    def __init__(self, limit: int = 64) -> None:
        self._pending: list[Pending] = []
        self.limit = limit

    def add(self, value: Pending) -> None:
        self._pending.append(value)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        return len(self._pending) > self.limit

    def read(self) -> list[tuple[Pending, list[float]]]:
        """Every pending value with its numbers, in queue order, after ONE device-to-host transfer."""
        if not self._pending:
            return []
        parts, self._pending = self._pending, []
        dev = parts[0].tensor.device
        flat = torch.cat([p.tensor.detach().reshape(-1).to(device=dev, dtype=torch.float32) for p in parts])
        values = flat.tolist()
        out: list[tuple[Pending, list[float]]] = []
        off = 0
        for p in parts:
            n = p.tensor.numel()
            out.append((p, values[off:off + n]))
            off += n
        return out


__all__ = ["Coverage", "FoundInf", "GradNorms", "LossValue", "LostCounts", "LostUpdates", "Pending", "ProbeFlags",
           "Readback", "ScaleValue", "StepRecord"]
