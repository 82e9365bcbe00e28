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
    """Sync-free observation of one enabled GradScaler, or of the one of several that steps ``optimizer``.

    With several candidates (a GAN script under ``ampdoctor run``: one scaler per optimizer, nothing in the script
    says which is whose) the view is unresolved until a candidate's per-optimizer states hold ``optimizer``: that
    happens in ``scaler.step(optimizer)`` (``unscale_`` records it, ``step`` marks it ``STEPPED``, also when it
    skips the update), and the states stay readable after ``update()`` rebinds them. Until then :meth:`token` is
    the tuple of every candidate's states (the same tuple object while none changed) and :meth:`stepped_in`
    resolves on the first iteration one of them stepped ``optimizer`` in, so the first skipped step is seen too.
    """

    def __init__(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer | None = None,
                 others: tuple[torch.amp.GradScaler, ...] = ()) -> None:
        self.scaler: torch.amp.GradScaler | None = None if others else scaler
        self.candidates = (scaler, *others)
        self.optimizer = optimizer
        self._composite: tuple[Any, ...] = ()

    @property
    def _chosen(self) -> torch.amp.GradScaler:
        return self.scaler if self.scaler is not None else self.candidates[0]

    @property
    def backoff_factor(self) -> float:
        return float(self._chosen.get_backoff_factor())

    @property
    def device(self) -> str:
        return _internals(self._chosen).device

    def token(self) -> Any:
        """An object that changes identity whenever ``update()`` runs (of the scaler stepping the optimizer)."""
        if self.scaler is None:
            states = tuple(_internals(s).per_optimizer_states for s in self.candidates)
            hit = next((s for s, st in zip(self.candidates, states) if id(self.optimizer) in st), None)
            if hit is None:
                if len(states) != len(self._composite) or any(a is not b for a, b in zip(states, self._composite)):
                    self._composite = states
                return self._composite
            self.scaler = hit
        return _internals(self.scaler).per_optimizer_states

    def scale_copy(self) -> torch.Tensor | None:
        """A device-side copy of the current scale (no read); None while unresolved."""
        s = None if self.scaler is None else _internals(self.scaler).scale
        return None if s is None else s.detach().clone()

    def scale_before_backoff(self) -> torch.Tensor | None:
        """The scale a just-skipped step used (the current one divided by the backoff factor), on the device."""
        s = None if self.scaler is None else _internals(self.scaler).scale
        return None if s is None else s.detach() / self.backoff_factor

    def stepped_in(self, token: Any, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether ``scaler.step(optimizer)`` ran in the scaler iteration whose states are ``token`` (the tuple of
        the candidates' states while unresolved: the candidate that stepped it is chosen)."""
        parts = list(zip(self.candidates, token)) if isinstance(token, tuple) else [(self.scaler, token)]
        for scaler, states in parts:
            keys = [id(optimizer)] if optimizer is not None else list(states)
            if any(k in states and getattr(states[k].get("stage"), "name", "") == "STEPPED" for k in keys):
                if self.scaler is None:
                    self.scaler = scaler
                return True
        return False

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scaler is None else dict(self.scaler.state_dict())


__all__ = ["GradScalerView"]
