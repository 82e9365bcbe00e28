"""Replaying a step that lives in the model's ``training_step(batch, batch_idx)`` method (Lightning's protocol), or
that called the root module several times (:class:`CallsReplay`).

A ``LightningModule`` often has no ``forward`` for its batch: the step is ``training_step``. A watch told so
(``Watch.replay_with(..., method="training_step")``) records ``step_method`` in its reproducers, and
:func:`ampdoctor.replay` of such a file runs :func:`training_step_replay` on the rebuilt model, so
``ampdoctor replay FILE.pt --factory mypkg:make_module`` needs no ``train_step`` code either. Only the method
named in the file is ever called, and only from :data:`STEP_METHODS` (a reproducer is data).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

#: the step methods a reproducer may name
STEP_METHODS = ("training_step",)


class MicroBatches(list):  # type: ignore[type-arg]
    """The batches of one optimizer step under gradient accumulation (Lightning's ``accumulate_grad_batches``), in
    order: :func:`training_step_replay` runs ``training_step`` on each and backpropagates their mean, as Lightning
    divides each micro-batch's loss by their number. Built at replay time from a reproducer's ``micro_batches``."""


class OverMicroBatches:
    """``train_step`` over a step's micro-batches: the replay's (mapped, copied) batch is the plain list of them;
    it is marked :class:`MicroBatches` again before ``train_step`` (:func:`training_step_replay`) runs."""

    def __init__(self, train_step: Any) -> None:
        self.train_step = train_step

    def __call__(self, model: Any, batch: Any, optimizer: Any = None, scaler: Any = None) -> Any:
        return self.train_step(model, MicroBatches(batch), optimizer=optimizer, scaler=scaler)


def training_step_replay(model: Any, batch: Any, optimizer: Any = None, scaler: Any = None,
                         batch_idx: int = 0) -> Any:
    """The step as Lightning runs it, on the replay's copy: ``training_step``, then (automatic optimization)
    backward and update with the replay's optimizer/GradScaler. The copy has no trainer: ``self.log`` is a no-op
    there. Manual optimization: ``self.optimizers()`` and ``self.manual_backward`` of the copy are bound to the
    replay's optimizer and a plain backward (instance attributes of the copy only); the step is left to the module."""
    if not callable(getattr(model, "training_step", None)):
        raise TypeError(f"{type(model).__name__} has no training_step(batch, batch_idx) to replay")
    manual = not getattr(model, "automatic_optimization", True)
    if manual:
        model.optimizers = lambda *a, **k: optimizer
        model.manual_backward = lambda loss, *a, **k: loss.backward(*a, **k)
    micro = list(batch) if isinstance(batch, MicroBatches) and not manual else [batch]
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # "self.log() without a Trainer" on the copy
        for i, b in enumerate(micro):           # each micro-batch under the trace: any of them may overflow
            out = model.training_step(b, batch_idx - len(micro) + 1 + i if len(micro) > 1 else batch_idx)
            losses.append(out.get("loss") if isinstance(out, Mapping) else out)
    tensors = [x for x in losses if isinstance(x, torch.Tensor)]
    loss = losses[0] if len(losses) == 1 else (torch.stack([x.float() for x in tensors]).mean()
                                               if len(tensors) == len(losses) else None)
    if manual or not isinstance(loss, torch.Tensor):
        return loss if isinstance(loss, torch.Tensor) else None
    if loss.requires_grad:
        _backward_and_step(loss, optimizer, scaler)
    elif optimizer is not None:
        optimizer.zero_grad()
    return loss


def _backward_and_step(loss: torch.Tensor, optimizer: Any, scaler: Any) -> None:
    """``zero_grad``, ``backward`` of the (scaled) loss and the (scaler's) optimizer step, as a training loop does."""
    if optimizer is not None:
        optimizer.zero_grad()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if optimizer is not None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()


class CallsReplay:
    """The default replay of a step whose root module was called several times (a GAN's discriminator on the real
    and the fake batch): ``batch`` is the recorded calls (``[{"args": [...], "kwargs": {...}}, ...]``), run in
    their order so that a failure in any call is traced, not only in the last. When every call returns a loss
    (a scalar, or ``.loss``) their sum is backpropagated and the update made, as :func:`ampdoctor.diagnose` runs a
    model's own loss; with ``program`` (the loop's loss code recorded over the step's last ``program.forwards``
    forwards, ``_loss_code.LossProgram``) that loss is run on those calls' outputs, and under gradient accumulation
    (one recorded loss per call) each call's own loss, summed as the micro-batches' gradients add up; otherwise the
    calls run forward only (``forward_only``: the loss was computed outside)."""

    def __init__(self, program: Any = None) -> None:
        self.program = program
        self.forward_only = False

    def __call__(self, model: Any, batch: Any, optimizer: Any = None, scaler: Any = None) -> Any:
        from ampdoctor.precision import default_loss

        outputs = [model(*c["args"], **c["kwargs"]) for c in batch]
        micro = self.program.micro_batches if self.program is not None and self.program.forwards == 1 else ()
        if len(micro) > 1 and len(micro) == len(outputs):    # gradient accumulation: each micro-batch's own loss
            losses = [p.run([out]) for p, out in zip(micro, outputs)]
        elif self.program is not None and len(outputs) >= self.program.forwards:
            losses = [self.program.run(outputs[len(outputs) - self.program.forwards:])]
        else:
            found = [default_loss(out) for out in outputs]
            losses = [x for x in found if x is not None] if all(x is not None for x in found) else []
        if not losses or not all(x.requires_grad for x in losses):
            self.forward_only = True
            return None
        loss = torch.stack([x.float() for x in losses]).sum()
        _backward_and_step(loss, optimizer, scaler)
        return loss


__all__ = ["STEP_METHODS", "CallsReplay", "MicroBatches", "OverMicroBatches", "training_step_replay"]
