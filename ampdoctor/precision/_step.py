"""The one step runner: copies prepared for a precision, N steps under its context, observers on the side.

Every caller that runs a user's step runs it here -- the diagnosis (traced target and fp32 reference), the fix
verification curves (untraced), ``headroom`` and the benches -- so they all run *the same* step:

1. :func:`prepare` deep-copies the model, optimizer and scaler together (so the copied optimizer points at the
   copied parameters) and the batch, casts the model, the optimizer's state and the batch for the precision
   (fp32 for the reference), applies the spec's transforms and re-syncs a DDP reducer after a cast.
2. :class:`StepLoop` runs ``steps`` steps of the user's ``train_step`` (or forward, loss, backward, optimizer
   step) under the precision's context (autocast, emulated CUDA autocast, fp8; the reference disables autocast).
3. :class:`Observer` objects see the loop at fixed points (around the loop, before each step, after the
   forward, before the backward, with the gradients ready, after the step, on an exception); the trace is one,
   :class:`GradSnapshot` and :class:`ParamSnapshot` are others. With no observer the loop is the plain step.

The loop reads each step's loss back once (one host sync per step) and, when a GradScaler is enabled, its scale.
The caller's RNG state is not touched here: callers wrap a run in :func:`saved_rng` so the reference and the
target start from the same RNG state (dropout masks agree).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.precision import _distributed
from ampdoctor.precision._contexts import (
    AMP_DTYPES,
    LOW_DTYPES,
    _bind_train_step,
    _emulation_scope,
    _fp8_context,
    _gemm_context,
    _NoAutocast,
    _precision_context,
    call_model,
    cast_batch,
    cast_optimizer_state,
    copy_objects,
    default_loss,
    device_of,
    map_batch,
    saved_rng,
)
from ampdoctor.precision._input_errors import untrainable
from ampdoctor.precision._shared_copy import SharedCopy
from ampdoctor.precision._spec import ScenarioError, StepSpec

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# 1. prepare the copies


@dataclass
class Prepared:
    """Copies of a step's objects, cast and transformed for one run. ``precision`` is None for the reference."""

    model: nn.Module
    optimizer: Any
    scaler: Any
    batch: Any
    device: torch.device
    precision: str | None
    reference: bool


def prepare(spec: StepSpec, *, reference: bool, round_to: torch.dtype | None = None,
            shared: SharedCopy | None = None) -> Prepared:
    """One copy of the step's objects, cast for the run: fp32 (``reference``) or ``spec.precision``.

    The optimizer's state is cast with its parameters; the spec's transforms are applied after the cast and a
    DDP reducer is re-synced (a cast leaves its gradient hooks on stale accumulators). ``round_to`` (reference
    only) rounds the floating parameters, buffers and batch tensors to that dtype and back, so the fp32 run starts
    from exactly what a run in that dtype starts from (the step's own rounding noise). ``shared``: a previous run's
    copy hands its storages over (:class:`~ampdoctor.precision._shared_copy.SharedCopy`). No host sync.
    """
    model, opt, scaler = copy_objects(spec, shared.take() if shared is not None else None)
    try:
        batch = copy.deepcopy(spec.batch)
    except Exception as e:
        raise ScenarioError(f"cannot copy the batch ({type(e).__name__}: {e}); ampdoctor runs the step several times "
                            "on copies: pass tensors and plain containers (dicts, tuples, lists)") from e
    dtypes = _distributed.param_dtypes(model)
    if reference and scaler is not None and scaler.is_enabled():
        # fp32 needs no loss scaling, and unscaling by a power of two is exact in fp32: the reference runs the
        # step as the user means it, so a step whose updates read still-scaled gradients differs from it by the
        # scale (loss-scaling-misuse) instead of repeating the mistake. The scaler stays enabled at scale 1 (never
        # grown) so the reference runs the same ops as the target -- ``scaler.scale(loss)`` is still a ``mul`` --
        # and its records stay aligned with the target's (a disabled scaler drops that op and its backward)
        scaler = torch.amp.GradScaler(getattr(scaler, "_device", "cuda"), init_scale=1.0, growth_interval=2**30)
    if reference:
        if any(t.is_floating_point() and t.dtype != torch.float32
               for t in list(model.parameters()) + list(model.buffers())):
            model.to(torch.float32)
            cast_optimizer_state(opt, torch.float32)
        batch = cast_batch(batch, torch.float32, only_low=True)
        if round_to is not None:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    if t.is_floating_point():
                        t.copy_(t.to(round_to).to(t.dtype))
            batch = map_batch(batch, lambda t: t.to(round_to).to(t.dtype) if t.is_floating_point() else t)
    elif spec.precision in LOW_DTYPES:
        model.to(LOW_DTYPES[spec.precision])
        cast_optimizer_state(opt, LOW_DTYPES[spec.precision])
        batch = cast_batch(batch, LOW_DTYPES[spec.precision])
    for transform in spec.transforms:
        transform(model, opt, scaler)
    _distributed.resync_after_cast(model, dtypes)
    return Prepared(model, opt, scaler, batch, device_of(model), None if reference else spec.precision, reference)


# ---------------------------------------------------------------------------------------------------------------
# 2. observers


class Observer:
    """Sees a :class:`StepLoop` at fixed points; every method is optional (the defaults do nothing).

    An observer may read anything and must change nothing the step computes, with two documented exceptions:
    ``grads_ready`` may add an optimizer when the step has none (``loop.prep.optimizer = ...``, so a verification
    curve trains) and may unscale the gradients through the step's scaler (``scaler.step`` then skips its own
    unscale: the same numbers).
    """

    def context(self, loop: StepLoop) -> Any:
        """Entered around the whole loop, outermost first (the trace's mode and hooks)."""
        return contextlib.nullcontext()

    def step_start(self, loop: StepLoop, step: int) -> None:
        """Before step ``step``."""

    def forward_done(self, loop: StepLoop, step: int, output: Any, loss: Any) -> None:
        """After the forward and the loss (the loop's own path; a ``train_step`` is opaque)."""

    def before_backward(self, loop: StepLoop, step: int, loss: torch.Tensor) -> None:
        """Before ``loss.backward()`` (the loop's own path)."""

    def grads_ready(self, loop: StepLoop, step: int) -> None:
        """After the backward, before the optimizer step (the loop's own path; also with no optimizer). A
        ``train_step`` is opaque: observers that need its gradients hook the optimizer (as the trace does)."""

    def step_end(self, loop: StepLoop, step: int, loss: torch.Tensor | None) -> None:
        """After the step, before its loss is read back."""

    def own_work(self, loop: StepLoop) -> Any:
        """Entered around the loop's own tensor work between steps (reading the loss and the scale back): not the
        step's ops (the trace pauses, so they are not recorded)."""
        return contextlib.nullcontext()

    def failed(self, loop: StepLoop, step: int, exc: BaseException) -> None:
        """The step raised ``exc``; the loop records it and stops. Raise to turn it into another error."""

    def finish(self, loop: StepLoop) -> None:
        """After the loop, also after a failed step (inside no context)."""


@dataclass
class StepResult:
    """What a :class:`StepLoop` ran: per step, the loss (None: no scalar loss) and the GradScaler's scale."""

    losses: list[float | None] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    forward_only: bool = False
    #: float32 copies of the floating outputs of a forward-only step (only with ``keep_outputs=True``)
    outputs: list[torch.Tensor] | None = None
    exc: BaseException | None = None
    exc_step: int | None = None
    exc_traceback: str = ""
    #: per-tensor fp8 statistics when the precision is emulated fp8 (:class:`ampdoctor.precision.Fp8Stats`)
    fp8: Any = None

    @property
    def finite_steps(self) -> int:
        """Steps before the first missing or non-finite loss."""
        n = 0
        for v in self.losses:
            if v is None or v != v or v in (float("inf"), float("-inf")):
                break
            n += 1
        return n


def float_outputs(output: Any) -> list[torch.Tensor]:
    """float32 copies of every floating tensor in ``output`` (nested dicts/tuples/lists and model outputs)."""
    from ampdoctor.trace import iter_tensors

    return [t.detach().float().clone() for t in iter_tensors(output) if t.is_floating_point()]


class GradSnapshot(Observer):
    """Keeps float32 copies of the gradients after the backward of step ``at`` (unscaled when a scaler is on)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.grads: dict[str, torch.Tensor | None] | None = None

    def grads_ready(self, loop: StepLoop, step: int) -> None:
        if step != self.at:
            return
        prep = loop.prep
        if prep.scaler is not None and prep.scaler.is_enabled() and prep.optimizer is not None:
            prep.scaler.unscale_(prep.optimizer)
        names = {id(p): n for n, p in prep.model.named_parameters()}
        self.grads = {names.get(id(p), ""): None if p.grad is None else p.grad.detach().float().clone()
                      for p in prep.model.parameters() if p.requires_grad}


class ParamSnapshot(Observer):
    """Keeps float32 copies of the parameters after the last step."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def finish(self, loop: StepLoop) -> None:
        self.params = {n: p.detach().float().clone() for n, p in loop.prep.model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# 3. the loop


class StepLoop:
    """Runs a prepared step ``steps`` times under its precision's context, calling the observers.

    ``forward_only_steps``: stop after that many steps when the step turns out forward-only (no loss that
    requires grad). ``raise_errors``: let an exception of the step propagate instead of recording it.
    ``keep_outputs``: keep float32 copies of a forward-only step's floating outputs in the result.
    ``no_update``: steps whose own-loop optimizer step (and scaler step/update) is not run: the forward, backward
    and the observers' ``grads_ready`` still are (the diagnosis's reference, where nothing reads that update:
    :func:`ampdoctor.precision._runner.unread_updates`). A user ``train_step`` is always run whole.
    """

    def __init__(self, spec: StepSpec, prep: Prepared, *, policy: str = "cuda",
                 observers: Sequence[Observer] = (), forward_only_steps: int | None = None,
                 raise_errors: bool = False, keep_outputs: bool = False,
                 no_update: frozenset[int] = frozenset()) -> None:
        self.spec, self.prep, self.observers = spec, prep, tuple(observers)
        self.forward_only_steps, self.raise_errors, self.keep_outputs = forward_only_steps, raise_errors, keep_outputs
        self.no_update = no_update
        self.amp = contextlib.nullcontext() if prep.reference else _precision_context(prep.precision, prep.device,
                                                                                        policy)
        self.gemm = contextlib.nullcontext() if prep.reference else _gemm_context(prep.precision, prep.device,
                                                                                     policy)
        self.emulation = contextlib.nullcontext() if prep.reference else _emulation_scope(
            prep.precision, prep.device, policy)
        self.step_kw = _bind_train_step(spec.train_step, prep.optimizer, prep.scaler) if spec.train_step else {}
        self.result = StepResult()
        self._loss_checked = False
        #: the user callable running now (one of ``_input_errors.STAGES``) and the type of the model's last output
        #: (not the output: it would keep the activations alive): an error's message names whose code failed
        self.stage, self.output_type = "model", ""

    def run(self, steps: int) -> StepResult:
        """All steps; returns :attr:`result`. Host syncs: one per step (its loss), plus the scale with a scaler."""
        prep = self.prep
        no_autocast = _NoAutocast(prep.device.type) if prep.reference else contextlib.nullcontext()
        fp8 = contextlib.nullcontext() if prep.reference else _fp8_context(prep.precision, prep.model,
                                                                                 self.spec.fp8_recipe)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self.gemm)  # below the observers' dispatch modes (the trace)
                stack.enter_context(self.emulation)  # autocast anywhere in the step is emulated (checkpoint recompute)
                for ob in self.observers:
                    stack.enter_context(ob.context(self))
                stack.enter_context(no_autocast)
                stack.enter_context(fp8)
                for step in range(steps):
                    if not self._run_one(step):
                        break
            if hasattr(fp8, "stats"):
                self.result.fp8 = fp8.stats()
        finally:
            for ob in self.observers:
                ob.finish(self)
        return self.result

    def _run_one(self, step: int) -> bool:
        """One step; False when the loop must stop (the step raised, or a forward-only step was enough)."""
        for ob in self.observers:
            ob.step_start(self, step)
        try:
            loss = self._train_step(step) if self.spec.train_step is not None else self._own_step(step)
            for ob in self.observers:
                ob.step_end(self, step, loss)
            self._record(loss)
        except ScenarioError:
            raise
        except Exception as e:
            if self.raise_errors:
                raise
            for ob in self.observers:
                ob.failed(self, step, e)
            self._failed(step, e)
            return False
        limit = self.forward_only_steps
        return not (self.result.forward_only and limit is not None and step + 1 >= limit)

    def _train_step(self, step: int) -> torch.Tensor | None:
        self.stage = "train_step"
        with self.amp:
            loss = self.spec.train_step(self.prep.model, self.prep.batch, **self.step_kw)  # type: ignore[misc]
        return loss if isinstance(loss, torch.Tensor) else None

    def _own_step(self, step: int) -> torch.Tensor | None:
        prep, spec = self.prep, self.spec
        if prep.optimizer is not None:
            prep.optimizer.zero_grad(set_to_none=True)
        else:
            prep.model.zero_grad(set_to_none=True)
        grad_ctx = torch.no_grad() if self.result.forward_only else contextlib.nullcontext()
        with self.amp, grad_ctx:
            self.stage = "model"
            out = call_model(prep.model, prep.batch)
            self.output_type = type(out).__name__
            self.stage = "loss_fn"
            loss = spec.loss_fn(out, prep.batch) if spec.loss_fn is not None else default_loss(out)
            self.stage = "step"
        if spec.loss_fn is not None and not self._loss_checked:
            _check_loss(loss)
            self._loss_checked = True
        for ob in self.observers:
            ob.forward_done(self, step, out, loss)
        if loss is None or not loss.requires_grad:
            if loss is not None and prep.reference and step == 0 and (prep.optimizer is not None
                                                                      or prep.scaler is not None):
                raise untrainable(loss, spec.loss_fn is not None)
            self.result.forward_only = True
            if self.keep_outputs:
                self.result.outputs = float_outputs(out)
            return loss
        for ob in self.observers:
            ob.before_backward(self, step, loss)
        (prep.scaler.scale(loss) if prep.scaler is not None else loss).backward()
        for ob in self.observers:
            ob.grads_ready(self, step)
        if prep.optimizer is not None and step not in self.no_update:
            if prep.scaler is not None:
                prep.scaler.step(prep.optimizer)
                prep.scaler.update()
            else:
                prep.optimizer.step()
        return loss

    def _record(self, loss: torch.Tensor | None) -> None:
        """The step's loss (and scale) read back: the loop's work, not the step's (``Observer.own_work``)."""
        with contextlib.ExitStack() as stack:
            for ob in self.observers:
                stack.enter_context(ob.own_work(self))
            if loss is not None:
                with torch.no_grad():
                    self.result.losses.append(float(loss.detach().float().item()))
            else:
                self.result.losses.append(None)
            scaler = self.prep.scaler
            if scaler is not None and scaler.is_enabled():
                self.result.scales.append(float(scaler.get_scale()))

    def _failed(self, step: int, e: BaseException) -> None:
        res = self.result
        res.exc, res.exc_step = e, step
        res.exc_traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
        # the traceback's frames hold the copy and the step's activations: drop the loop's own frames and clear
        # the finished ones below them, keeping file/line for display
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        e.__traceback__ = tb
        traceback.clear_frames(tb)
        log.info("%s run raised at step %d: %s", "reference" if self.prep.reference else "target", step, e)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ScenarioError(
            "loss_fn must return a scalar Tensor, got "
            + (f"a {str(loss.dtype).replace('torch.', '')} tensor of shape {tuple(loss.shape)}"
               if isinstance(loss, torch.Tensor) else type(loss).__name__)
            + "; return a floating-point scalar, e.g. loss.mean() (not argmax or a count)")


def run_steps(spec: StepSpec, *, reference: bool, steps: int | None = None, policy: str = "cuda",
              observers: Sequence[Observer] = (), round_to: torch.dtype | None = None,
              forward_only_steps: int | None = None, raise_errors: bool = False,
              keep_outputs: bool = False) -> StepResult:
    """Prepare one copy (:func:`prepare`) and run ``steps`` (default ``spec.steps``) steps on it (:class:`StepLoop`).

    The copy is released when this returns (nothing but the observers keeps a reference to it).
    """
    prep = prepare(spec, reference=reference, round_to=round_to)
    loop = StepLoop(spec, prep, policy=policy, observers=observers, forward_only_steps=forward_only_steps,
                    raise_errors=raise_errors, keep_outputs=keep_outputs)
    return loop.run(spec.steps if steps is None else steps)


__all__ = ["AMP_DTYPES", "LOW_DTYPES", "GradSnapshot", "Observer", "ParamSnapshot", "Prepared", "StepLoop",
           "StepResult", "call_model", "cast_batch", "cast_optimizer_state", "copy_objects", "default_loss",
           "device_of", "float_outputs", "map_batch", "prepare", "run_steps", "saved_rng"]
