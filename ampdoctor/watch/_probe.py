"""Which parameters' gradients overflow: a one-backward probe, armed only on the anomaly path.

GradScaler skips a step with inf/NaN gradients before any optimizer hook could look at them, and by the next event
the watch sees (the next forward) the gradients are usually zeroed. So when a run of skipped steps starts, the
watch arms this probe for the NEXT backward: a post-accumulate-grad hook per trainable parameter records
``~isfinite(grad).all()`` on the device (no sync; read with the step's single read). Hooks fire in backward order,
so the first flagged names are the parameters nearest the overflowing op. The hooks go at the end of that step.
Cost: one Python call and one reduction per parameter, for one backward per armed probe (at most
:data:`MAX_ARMS` per run); nothing on healthy steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampdoctor.watch._hooks import Health, Hook, guarded

#: probes per run at most (a collapse keeps skipping: one capture names the parameters)
MAX_ARMS = 2


class GradProbe:
    """Per-parameter gradient finiteness over one backward, in the order the gradients were accumulated."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]], health: Health) -> None:
        self.params, self.health = params, health
        self.arms = 0
        self.handles: list[Any] = []
        self._names: dict[int, str] = {id(p): n for n, p in params}
        self._flags: list[tuple[str, torch.Tensor]] = []
        self._seen: set[int] = set()

    @property
    def armed(self) -> bool:
        return bool(self.handles)

    def arm(self) -> None:
        """Hook the next backward (no-op when armed already or :data:`MAX_ARMS` probes were taken)."""
        if self.armed or self.arms >= MAX_ARMS:
            return
        self.arms += 1
        self._flags, self._seen = [], set()
        self.handles = [p.register_post_accumulate_grad_hook(Hook(self.on_grad)) for _, p in self.params]

    @guarded
    def on_grad(self, p: torch.Tensor) -> None:   # inside backward(): an error here must never reach it
        if id(p) in self._seen or p.grad is None:
            return
        self._seen.add(id(p))
        g = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
        self._flags.append((self._names[id(p)], ~torch.isfinite(g).all()))

    def harvest(self) -> tuple[torch.Tensor, tuple[str, ...]] | None:
        """Remove the hooks; the flags (device tensor) and names of the backward they saw, if any."""
        self.remove()
        flags, self._flags = self._flags, []
        if not flags:
            return None
        return torch.stack([f.to(flags[0][1].device) for _, f in flags]), tuple(n for n, _ in flags)

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()


__all__ = ["MAX_ARMS", "GradProbe"]
