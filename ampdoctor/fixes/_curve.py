"""K-step loss curves for verification: the shared step runner (:mod:`ampdoctor.precision`), untraced.

A curve runs exactly the step the diagnosis runs (same copies, casts, optimizer state, DDP re-sync, precision
context); the only additions are observers: step 0's gradients (unscaled), and -- when the step has no optimizer
and no ``train_step`` -- a plain SGD optimizer so the curve trains.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.fixes._scope import ClampHook, scopes_of
from ampdoctor.precision import (
    GradSnapshot,
    Observer,
    StepLoop,
    StepSpec,
    call_model,
    default_loss,
    run_steps,
    saved_rng,
)

log = logging.getLogger(__name__)

#: Relative size of the first SGD update when a scenario has no optimizer of its own (see :func:`sgd_lr`).
SGD_STEP = 1e-3


@dataclass
class Curve:
    """Losses of K steps of one run, and what step 0 left behind (gradients or outputs)."""

    losses: list[float | None] = field(default_factory=list)
    grads: dict[str, torch.Tensor | None] | None = None
    outputs: list[torch.Tensor] | None = None
    forward_only: bool = False
    trained: bool = False
    exc: str = ""
    lr: float | None = None
    optimizer: str = ""
    clamped: int = 0

    @property
    def finite_steps(self) -> int:
        n = 0
        for v in self.losses:
            if v is None or not math.isfinite(v):
                break
            n += 1
        return n


def sgd_lr(model: nn.Module, loss: float, evaluate: Any) -> float:
    """A learning rate for a step that has no optimizer: backtracking (Armijo) on the fp32 reference.

    Starts from the rate whose update moves the weights by ``SGD_STEP`` of their norm and divides it by 4 until
    the update lowers the loss by at least half of what the gradient predicts (at most 12 tries). ``evaluate()``
    runs the forward on the current weights and returns the loss (the caller's RNG state is restored around it).
    Host syncs: one per try.
    """
    ps = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in ps if p.grad is not None]
    if not ps or not math.isfinite(loss):
        return SGD_STEP
    w = float(torch.stack([p.detach().float().norm() for p in ps]).norm())
    g2 = float(torch.stack([g.detach().float().norm() for g in grads]).norm() ** 2)
    if not (math.isfinite(w) and math.isfinite(g2)) or g2 == 0.0 or w == 0.0:
        return SGD_STEP
    lr = SGD_STEP * w / math.sqrt(g2)
    saved = [p.detach().clone() for p in ps]
    try:
        for _ in range(12):
            with torch.no_grad():
                for p, p0, g in zip(ps, saved, grads):
                    p.copy_(p0 - lr * g.to(p0.dtype))
            trial = evaluate()
            if trial is not None and math.isfinite(trial) and trial <= loss - 0.5 * lr * g2:
                break
            lr /= 4.0
    finally:
        with torch.no_grad():
            for p, p0 in zip(ps, saved):
                p.copy_(p0)
    return lr


def loss_value(loss: Any) -> float | None:
    """A scalar floating loss as a float (one host sync), else None."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return float(loss.detach().float())
    return None


class _AddSGD(Observer):
    """The step has no optimizer and no ``train_step``: add plain SGD after step 0's backward so the curve trains.

    The learning rate is ``lr`` or, when None, found by backtracking on this run (:func:`sgd_lr`).
    """

    def __init__(self, lr: float | None) -> None:
        self.lr = lr
        self.loss = math.nan
        self.added = False

    def before_backward(self, loop: StepLoop, step: int, loss: torch.Tensor) -> None:
        if loop.prep.optimizer is None and self.lr is None:
            value = loss_value(loss)
            self.loss = math.nan if value is None else value

    def grads_ready(self, loop: StepLoop, step: int) -> None:
        prep, spec = loop.prep, loop.spec
        if prep.optimizer is not None:
            return
        if self.lr is None:

            def evaluate() -> float | None:
                with saved_rng(), torch.no_grad(), loop.amp:
                    o = call_model(prep.model, prep.batch)
                    return loss_value(spec.loss_fn(o, prep.batch) if spec.loss_fn is not None else default_loss(o))

            self.lr = sgd_lr(prep.model, self.loss, evaluate)
        prep.optimizer = torch.optim.SGD([p for p in prep.model.parameters() if p.requires_grad], lr=self.lr)
        self.added = True


class _Clamps(Observer):
    """Counts the values clamp fixes clamped during the run."""

    def __init__(self) -> None:
        self.clamped = 0

    def finish(self, loop: StepLoop) -> None:
        self.clamped = sum(h.clamped for h in scopes_of(loop.prep.model, ClampHook))


def run_curve(spec: StepSpec, *, reference: bool, steps: int, policy: str = "cuda", lr: float | None = None,
              round_to: torch.dtype | None = None) -> Curve:
    """Run ``steps`` steps of ``spec`` on copies (fp32 reference or target precision) without tracing.

    With no optimizer and no ``train_step``, plain SGD is added so the curve trains; its learning rate is ``lr``
    or, when ``None``, found by backtracking on this run (pass the reference's to the others). ``round_to``
    (reference only) starts from weights and inputs rounded to that dtype. A forward-only step runs once. Step 0's
    gradients are kept, unscaled (not for a ``train_step``, which is opaque). The caller's RNG state is restored.
    Host syncs: one per step (the loss).
    """
    add_sgd = _AddSGD(lr) if spec.optimizer is None and spec.train_step is None else None
    grads, clamps = GradSnapshot(0), _Clamps()
    observers: list[Observer] = [ob for ob in (add_sgd, grads, clamps) if ob is not None]
    with saved_rng():
        done = run_steps(spec, reference=reference, steps=steps, policy=policy, observers=observers,
                         round_to=round_to, forward_only_steps=1, keep_outputs=True)
    curve = Curve(losses=list(done.losses), grads=grads.grads if spec.train_step is None else None,
                  forward_only=done.forward_only, trained=not done.forward_only, clamped=clamps.clamped)
    if done.forward_only:
        curve.outputs = done.outputs
    opt_type = type(spec.optimizer).__name__ if spec.optimizer is not None else ""
    curve.optimizer = opt_type
    if add_sgd is not None and add_sgd.added:
        curve.lr = add_sgd.lr
        curve.optimizer = f"SGD(lr={add_sgd.lr:.3g}) (added: the step has no optimizer)"
    if done.exc is not None:  # a crash is a result: the steps after it count as not finite
        e = done.exc
        curve.exc = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        log.info("verification run (%s) raised: %s", "reference" if reference else "target", curve.exc)
    return curve


__all__ = ["SGD_STEP", "Curve", "loss_value", "run_curve", "sgd_lr"]
