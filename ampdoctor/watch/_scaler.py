"""What the watch needs from a :class:`torch.amp.GradScaler`, read without a host sync.

GradScaler's public API syncs (``get_scale()`` reads the scale to the host) or does not exist for what the
watch must know (did ``update()`` run, did ``step()`` reach an optimizer, which device). Every private
attribute the watch reads is read in ONE function, :func:`_internals`; ``tests/watch/test_scaler_view.py``
pins that these attributes exist and behave as relied on in the supported torch versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Internals:
    per_optimizer_states: Any       # replaced by a new dict object on every update(): the step boundary
    scale: torch.Tensor | None      # the device-side scale (None before the first scale())
    device: str


def _internals(scaler: torch.amp.GradScaler) -> _Internals:
    """The only access to GradScaler's private state (torch 2.x ``torch/amp/grad_scaler.py``):

    * ``_per_optimizer_states``: ``defaultdict`` of ``{"stage": OptState, "found_inf_per_device": ...}``;
      ``update()`` rebinds it to a fresh object, ``step(opt)`` sets ``stage`` to ``OptState.STEPPED``.
    * ``_scale``: the scale tensor on the device (``get_scale()`` would read it to the host: a sync).
    * ``_device``: the device type the scaler was built for (needed to rebuild it in a replay).
    """
    return _Internals(scaler._per_optimizer_states, scaler._scale, str(scaler._device))


class GradScalerView:
    """Sync-free observation of one enabled GradScaler."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    @property
    def backoff_factor(self) -> float:
        return float(self.scaler.get_backoff_factor())

    @property
    def device(self) -> str:
        return _internals(self.scaler).device

    def token(self) -> Any:
        """An object that changes identity whenever ``update()`` runs."""
        return _internals(self.scaler).per_optimizer_states

    def scale_copy(self) -> torch.Tensor | None:
        """A device-side copy of the current scale (no read)."""
        s = _internals(self.scaler).scale
        return None if s is None else s.detach().clone()

    def scale_before_backoff(self) -> torch.Tensor | None:
        """The scale a just-skipped step used (the current one divided by the backoff factor), on the device."""
        s = _internals(self.scaler).scale
        return None if s is None else s.detach() / self.backoff_factor

    @staticmethod
    def stepped_in(token: Any, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether ``scaler.step(optimizer)`` ran in the scaler iteration whose states are ``token``."""
        keys = [id(optimizer)] if optimizer is not None else list(token)
        return any(k in token and getattr(token[k].get("stage"), "name", "") == "STEPPED" for k in keys)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scaler.state_dict())


__all__ = ["GradScalerView"]
