"""The always-on guard: ``with watch(model, optimizer, scaler) as w:`` around the user's own training loop.

How the guard learns about a step, without replacing any method of the user's objects:

* ``optimizer.register_step_pre_hook`` runs just before the update. The gradients are checked there (one fused
  on-device reduction, ``torch._foreach_norm``, read back together with everything else pending: ONE host read
  per step). If ``optimizer.step(closure)`` is called (Lightning, LBFGS), the pre-hook hands the optimizer a
  closure that runs the user's closure and then the check, so the check still sees this step's gradients.
  ``register_step_post_hook`` closes the step.
* GradScaler skips ``optimizer.step()`` when it finds inf/NaN, so no optimizer hook fires for a skipped step.
  The guard notices instead that ``scaler.update()`` ran: ``update()`` replaces the scaler's per-optimizer state
  dict with a new object. At the next event the guard sees (the root module's next forward, the next optimizer
  hook, ``w.step()``, ``w.report()``, exit), a changed dict in which our optimizer reached ``STEPPED`` while no
  optimizer step happened means: skipped. GradScaler's own ``found_inf`` decides; the guard adds no reduction
  and no read for a skipped step (the gradient norms, for spikes and coverage, are taken for applied steps only).
  The scale is cloned on the device (no read) and read back with the next per-step read. Optimizers that
  unscale themselves (``_step_supports_amp_scaling``, fused Adam) are stepped anyway; their ``found_inf`` is
  read with the step's read.
* A forward pre-hook on the root module keeps a *reference* (no copy) to the last inputs and notes the RNG state
  and the autocast settings. During the first ``coverage_steps`` steps, post-accumulate-grad hooks on the
  trainable parameters record which parameters receive a gradient in each backward (they fire every backward,
  skipped step or not), and forward pre-hooks on parameter-owning modules note autocast when it is entered
  inside the model's ``forward`` (accelerate). These hooks are removed once coverage is measured.

Observation has no side effects: hooks only read; nothing is cast, copied into the model or drawn from the RNG.
Host syncs: one ``tolist()`` per optimizer step (none for a step GradScaler skipped); more only when an
anomaly is handled (reproducer copies, confirmation of non-finite gradients) or when ``report()`` is called.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from ampdoctor.errors import AnomalyError
from ampdoctor.findings._types import Report
from ampdoctor.watch import _reproducer, _rules
from ampdoctor.watch._rules import Coverage, LostUpdates, StepRecord

log = logging.getLogger(__name__)

ON_ANOMALY = ("warn", "raise", "skip", "replay")
#: Anomaly kinds the guard reacts to.
KINDS = ("nonfinite-loss", "nonfinite-grads", "grad-spike", "loss-scale-collapse")
_LOW_DTYPES = (torch.float16, torch.bfloat16)
_MAX_PENDING = 64
#: step records kept for the report (a window: memory stays flat however long training runs)
_MAX_RECORDS = 4096

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class WatchOptions:
    """Options of :func:`watch` (validated on construction; see :func:`watch` for their meaning)."""

    on_anomaly: str = "warn"
    reproducer_dir: str | None = None
    coverage_steps: int = 3
    grad_spike_factor: float = 10.0
    tensorboard: str | None = None
    collapse_steps: int = 3
    spike_window: int = 50
    source: str = ""

    def __post_init__(self) -> None:
        if self.on_anomaly not in ON_ANOMALY:
            raise ValueError(f"invalid on_anomaly {self.on_anomaly!r}, expected one of "
                             f"{', '.join(repr(v) for v in ON_ANOMALY)}")
        for name in ("coverage_steps", "collapse_steps", "spike_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if self.coverage_steps < 0:
            raise ValueError(f"coverage_steps must be >= 0 (0 turns coverage checks off), got {self.coverage_steps}")
        if self.collapse_steps < 1 or self.spike_window < 1:
            raise ValueError("collapse_steps and spike_window must be >= 1")
        if isinstance(self.grad_spike_factor, bool) or not isinstance(self.grad_spike_factor, (int, float)):
            raise TypeError(f"grad_spike_factor must be a number, got {type(self.grad_spike_factor).__name__}")
        if not self.grad_spike_factor > 1.0:
            raise ValueError(f"grad_spike_factor must be > 1 (a norm this many times the running median is a "
                             f"spike), got {self.grad_spike_factor}")
        for name in ("reproducer_dir", "tensorboard"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a directory path or None, got {type(v).__name__}")
        if not isinstance(self.source, str):
            raise TypeError(f"source must be a str (a scenario or script path), got {type(self.source).__name__}")


@dataclass
class _Iteration:
    """The open step: what the hooks saw since the last step closed."""

    record: StepRecord
    forward_seen: bool = False
    seen: set[int] = field(default_factory=set)
    call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    batch: Any = None
    has_batch: bool = False
    rng: dict[str, Any] | None = None
    loss: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.forward_seen or bool(self.seen)


@dataclass
class _Anomaly:
    kind: str
    record: StepRecord
    it: _Iteration
    message: str
    pre_step: bool


def _guarded(method: F) -> F:
    """Run a hook body; an unexpected error disables the watch with one warning and training goes on."""

    @functools.wraps(method)
    def wrapper(self: Watch, *args: Any, **kwargs: Any) -> Any:
        if self._disabled is not None or not self._active or not self._ready:
            return None
        try:
            return method(self, *args, **kwargs)
        except AnomalyError:
            raise
        except Exception as exc:  # noqa: BLE001 - the guard must never break the user's training
            self._disable(exc)
            return None

    return wrapper  # type: ignore[return-value]


def _unwrap_optimizer(optimizer: Any) -> Any:
    """accelerate/transformers wrappers keep the real optimizer in ``.optimizer``; hooks belong on that one."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


class Watch:
    """A cheap guard over a training loop; use :func:`watch` to build one. See the module docstring."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None, options: WatchOptions | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None:
            optimizer = _unwrap_optimizer(optimizer)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one in "
                                f".optimizer), got {type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        options = options if options is not None else WatchOptions()
        if not isinstance(options, WatchOptions):
            raise TypeError(f"options must be WatchOptions, got {type(options).__name__}")
        names = {id(p): n for n, p in model.named_parameters()}
        if optimizer is not None:
            opt_params = [p for g in optimizer.param_groups for p in g["params"]]
            if opt_params and not any(id(p) in names for p in opt_params):
                raise ValueError("the optimizer updates none of the model's parameters; pass the optimizer built over "
                                 "model.parameters() (or the model it trains)")
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.options = options
        self._active = False
        self._entered = False
        self._disabled: str | None = None
        self._handles: list[Any] = []
        self._coverage_handles: list[Any] = []
        self._module_handles: list[tuple[str, Any]] = []
        self._deferred: AnomalyError | None = None
        self._tb: Any = None
        self._ready = False

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Watch:
        if self._entered:
            raise RuntimeError("this Watch was already entered; create a new one with ampdoctor.watch(...)")
        self._entered = True
        self._active = True
        try:
            self._setup()
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        deferred: AnomalyError | None = None
        try:
            if self._disabled is None:
                try:
                    self._finish()
                except Exception as e:  # noqa: BLE001
                    self._disable(e)
            deferred = self._deferred
        finally:
            self._remove_hooks(self._handles + self._coverage_handles)
            self._handles, self._coverage_handles, self._module_handles = [], [], []
            self._active = False
            if self._tb is not None:
                try:
                    self._tb.close()
                except Exception:  # noqa: BLE001
                    log.debug("closing the TensorBoard writer failed", exc_info=True)
                self._tb = None
        if deferred is not None and exc_type is None:
            raise deferred
        return False

    # ------------------------------------------------------------------ public API
    def step(self, loss: torch.Tensor | float | None = None, *, batch: Any = None) -> None:
        """Tell the watch about this iteration's ``loss`` (checked on the device, read with the step's single read)
        and, optionally, its ``batch`` (stored in a reproducer instead of the last forward's inputs).

        Call it anywhere in the iteration, before or after ``optimizer.step()``. Without an optimizer it also marks
        the end of the step (gradients are checked here then). Syncs only without optimizer (the step's read).
        """
        if loss is not None and not isinstance(loss, (torch.Tensor, int, float)):
            raise TypeError(f"loss must be a tensor or a number, got {type(loss).__name__}")
        self._step_impl(loss, batch)

    def observe_batch(self, batch: Any) -> None:
        """Record ``batch`` as the inputs of the step in progress (stored in a reproducer). Only needed when the
        model is not called through its root module (Lightning's ``training_step``); keeps a reference, no copy."""
        self._observe_batch_impl(batch)

    @_guarded
    def _observe_batch_impl(self, batch: Any) -> None:
        self._poll_scaler()
        self._it.batch, self._it.has_batch = batch, True
        if self._it.rng is None:
            self._it.rng = self._rng_state()
        self._handle_queue(can_raise=True)

    def report(self) -> Report:
        """The findings so far (``loss-scale-collapse``, ``unused-parameters``, ``low-precision-params``, non-finite
        losses/gradients, and a replay's findings first when it located an origin). Reads pending values (a sync)."""
        if self._active and self._disabled is None:
            self._sync_for_report()
        return self._build_report()

    @property
    def disabled(self) -> str | None:
        """Why the watch disabled itself after an internal error (``None`` while it works)."""
        return self._disabled

    # ------------------------------------------------------------------ setup / teardown
    def _setup(self) -> None:
        model, opt, o = self.model, self.optimizer, self.options
        self._names: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
        self._owners: dict[str, str] = {}
        for mod_name, mod in model.named_modules():
            for p in mod.parameters(recurse=False):
                n = self._names.get(id(p))
                if n is not None and n not in self._owners:
                    self._owners[n] = mod_name
        self._trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if opt is not None:
            self._opt_params = [p for g in opt.param_groups for p in g["params"]]
            self._opt_names = [self._names.get(id(p), f"optimizer.param_groups[{gi}][{i}]")
                               for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]
        else:
            self._opt_params = [p for _, p in self._trainable]
            self._opt_names = [n for n, _ in self._trainable]
        opt_ids = {id(p) for p in self._opt_params}
        self._not_in_optimizer = tuple(n for n, p in self._trainable if opt is not None and id(p) not in opt_ids)
        self._low = [(n, p) for n, p in zip(self._opt_names, self._opt_params)
                     if opt is not None and p.requires_grad and (p.dtype in _LOW_DTYPES or
                                                                 (p.is_floating_point() and p.element_size() == 1))]
        self._lost = LostUpdates(dtypes={n: str(p.dtype).replace("torch.", "") for n, p in self._low})
        self._lost_left = o.coverage_steps if self._low else 0
        self._lp_before: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._ddp_strict = (isinstance(model, nn.parallel.DistributedDataParallel)
                            and not getattr(model, "find_unused_parameters", False))
        self._device_type = next((p.device.type for p in model.parameters()), "cpu")

        self._step = 0
        self._records: list[StepRecord] = []
        self._n_steps = 0
        self._n_skipped_trimmed = 0
        self._it = _Iteration(StepRecord(0))
        self._last_it: _Iteration | None = None
        self._pending: list[tuple[str, torch.Tensor, Any]] = []
        self._queue: list[_Anomaly] = []
        self._explicit = False
        self._consecutive_skips = 0
        self._norm_hist: deque[float] = deque(maxlen=o.spike_window)
        self._spikes: list[dict[str, Any]] = []
        self._anomalies: list[dict[str, Any]] = []
        self._kinds_seen: set[str] = set()
        self._reproducers: list[str] = []
        self._replay_report: Report | None = None
        self._replay_error: str | None = None
        self._autocast: dict[str, Any] = {"autocast": False, "autocast_dtype": None, "device_type": self._device_type}
        self._cov_steps = 0
        self._cov_seen: set[int] = set()
        self._cov_zero: dict[str, bool] = {}
        self._coverage: Coverage | None = None if o.coverage_steps > 0 else Coverage(0, (), (), self._not_in_optimizer)
        self._skipped_by_guard = 0

        sc = self.scaler
        self._scaler_states = sc._per_optimizer_states if sc is not None else None
        self._stepped_states: Any = None
        self._scale_snapshot = sc._scale.detach().clone() if sc is not None and sc._scale is not None else None

        self._handles.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        self._module_handles.append(("", self._handles[-1]))
        if opt is not None:
            self._handles.append(opt.register_step_pre_hook(self._on_opt_pre))
            self._handles.append(opt.register_step_post_hook(self._on_opt_post))
        if o.coverage_steps > 0:
            for _, p in self._trainable:
                self._coverage_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            for mod_name, mod in model.named_modules():
                if mod is not model and any(True for _ in mod.parameters(recurse=False)):
                    h = mod.register_forward_pre_hook(self._on_inner_forward)
                    self._coverage_handles.append(h)
                    self._module_handles.append((mod_name, h))
        if o.tensorboard is not None:
            self._tb = self._open_tensorboard(os.fspath(o.tensorboard))
        self._ready = True

    def _open_tensorboard(self, logdir: str) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("tensorboard=%r ignored: TensorBoard is not installed (pip install tensorboard)", logdir)
            return None
        return SummaryWriter(log_dir=logdir)

    @staticmethod
    def _remove_hooks(handles: list[Any]) -> None:
        for h in handles:
            h.remove()

    def _disable(self, exc: BaseException) -> None:
        if self._disabled is None:
            self._disabled = f"{type(exc).__name__}: {exc}"
            log.warning("ampdoctor.watch disabled itself after an internal error (%s); training continues "
                        "unobserved. Please report this with the traceback.", self._disabled, exc_info=exc)

    def _finish(self) -> None:
        self._poll_scaler()
        it = self._it
        if self.optimizer is None and not self._explicit and it.active:
            self._close(skipped=False)
        self._read()
        if self._coverage is None:
            self._end_coverage()
        self._handle_queue(can_raise=False)

    def _sync_for_report(self) -> None:
        try:
            self._poll_scaler()
            self._read()
            self._handle_queue(can_raise=False)
        except AnomalyError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    # ------------------------------------------------------------------ hooks
    @_guarded
    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._poll_scaler()
        if not torch.is_grad_enabled():     # evaluation between steps: not part of a training step
            self._handle_queue(can_raise=True)
            return
        if self.optimizer is None and not self._explicit and self._it.forward_seen:
            self._close(skipped=False)
        self._handle_queue(can_raise=True)
        it = self._it
        it.forward_seen = True
        it.call = (args, kwargs)
        it.rng = self._rng_state()
        self._note_autocast()

    @_guarded
    def _on_inner_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._autocast["autocast"]:
            self._note_autocast()

    def _rng_state(self) -> dict[str, Any]:
        """The global RNG states (a CPU copy of a few KB; reading a CUDA generator's state does not sync)."""
        return {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if self._device_type == "cuda" else None}

    def _note_autocast(self) -> None:
        dt = self._device_type
        if torch.is_autocast_enabled(dt):
            self._autocast = {"autocast": True, "autocast_dtype": str(torch.get_autocast_dtype(dt)).replace(
                "torch.", ""), "device_type": dt}

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._disabled is None and self._active:
            self._it.seen.add(id(p))

    @_guarded
    def _on_opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._poll_scaler()
        self._handle_queue(can_raise=True)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self._before_update()
            return None
        wrapped = self._wrap_closure(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        done = [False]

        def closure_then_check() -> Any:
            result = closure()          # the user's forward/backward: its errors are the user's
            if not done[0]:
                done[0] = True
                self._checked_before_update()
            return result

        return closure_then_check

    @_guarded
    def _checked_before_update(self) -> None:
        self._before_update()

    @_guarded
    def _on_opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        it = self._it
        if self._lp_before:
            parts, names = [], []
            for name, p, before in self._lp_before:
                g = p.grad
                if g is None or g.is_sparse:
                    continue
                nz = g != 0
                parts.append(torch.stack([(nz & (p.detach() == before)).sum(), nz.sum()]).to(torch.float32))
                names.append(name)
            self._lp_before = []
            if parts:
                self._pending.append(("lost", torch.cat(parts), names))
                self._lost.steps += 1
                self._lost_left -= 1
        if self.scaler is not None:
            self._stepped_states = self.scaler._per_optimizer_states
        self._close(skipped=it.record.skipped, scale_known=True)

    # ------------------------------------------------------------------ step logic
    @_guarded
    def _step_impl(self, loss: Any, batch: Any) -> None:
        self._poll_scaler()
        it = self._it
        # with an optimizer, a loss given after optimizer.step() (no forward since) belongs to the step just closed
        last = self._last_it
        late = self.optimizer is not None and not it.active and last is not None
        target = last if late and last is not None else it
        if loss is not None:
            t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            if not late:
                it.loss = t
            else:
                self._pending.append(("loss", t.float().sum().reshape(1), target.record))
        if batch is not None:
            target.batch, target.has_batch = batch, True
        if self.optimizer is None:
            self._explicit = True
            if it.active or loss is not None:
                self._before_update()
                self._close(skipped=False, scale_known=True)
        self._handle_queue(can_raise=True)

    def _poll_scaler(self) -> None:
        """Notice a ``scaler.update()`` since the last event; a step GradScaler skipped is closed here."""
        sc = self.scaler
        if sc is None:
            return
        states = sc._per_optimizer_states
        if states is self._scaler_states:
            if self._scale_snapshot is None and sc._scale is not None:
                self._scale_snapshot = sc._scale.detach().clone()
            return
        old, self._scaler_states = self._scaler_states, states
        # GradScaler.step(optimizer) ran in the finished scaler iteration but no optimizer step did: skipped
        if old is not None and old is not self._stepped_states and self._stepped_in(old):
            scale = self._scale_snapshot
            if scale is None and sc._scale is not None:
                scale = sc._scale.detach() / sc._backoff_factor
            self._close(skipped=True, scale=scale)
        self._scale_snapshot = sc._scale.detach().clone() if sc._scale is not None else None

    def _stepped_in(self, states: dict[int, Any]) -> bool:
        keys = [id(self.optimizer)] if self.optimizer is not None else list(states)
        return any(k in states and getattr(states[k].get("stage"), "name", "") == "STEPPED" for k in keys)

    def _before_update(self) -> None:
        """Check this step's gradients (and loss/scale): one fused reduction and one host read."""
        it = self._it
        rec = it.record
        grads: list[torch.Tensor] = []
        names: list[str] = []
        sparse: list[tuple[str, torch.Tensor]] = []
        for name, p in zip(self._opt_names, self._opt_params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                sparse.append((name, g))
            else:
                grads.append(g)
                names.append(name)
        if not it.seen and self._coverage is None:
            it.seen = {id(p) for p in self._opt_params if p.grad is not None}   # attached after this backward
        found_inf = getattr(self.optimizer, "found_inf", None) if self.optimizer is not None else None
        if isinstance(found_inf, torch.Tensor):   # optimizers that unscale themselves (fused Adam) under GradScaler
            self._pending.append(("found_inf", found_inf.reshape(1), rec))
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            dev = norms[0].device
            vec = torch.stack([n.to(dev) for n in norms])
            if sparse:
                vec = torch.cat([vec, torch.stack([torch.linalg.vector_norm(g.coalesce().values().float()).to(dev)
                                                   for _, g in sparse])])
                names += [n for n, _ in sparse]
            self._pending.append(("norms", vec, (rec, names)))
        if it.loss is not None:
            self._pending.append(("loss", it.loss.float().sum().reshape(1), rec))
            it.loss = None
        if self.scaler is not None and self._scale_snapshot is not None:
            self._pending.append(("scale", self._scale_snapshot, rec))
            self._scale_snapshot = None
        if self._lost_left > 0 and not self._explicit:
            self._lp_before = [(n, p, p.detach().clone()) for n, p in self._low if p.grad is not None]
        self._read(current=it)
        self._handle_queue(can_raise=True, pre_step=True)

    def _close(self, *, skipped: bool, scale: torch.Tensor | None = None, scale_known: bool = False) -> None:
        it = self._it
        rec = it.record
        rec.skipped = skipped
        if scale is not None:
            self._pending.append(("scale", scale, rec))
        elif not scale_known and self._scale_snapshot is not None:
            self._pending.append(("scale", self._scale_snapshot, rec))
        if it.loss is not None:
            self._pending.append(("loss", it.loss.float().sum().reshape(1), rec))
            it.loss = None
        self._records.append(rec)
        self._n_steps += 1
        if len(self._records) > 2 * _MAX_RECORDS:  # old steps' deferred reads are long resolved
            cut = len(self._records) - _MAX_RECORDS
            self._n_skipped_trimmed += sum(1 for r in self._records[:cut] if r.skipped)
            del self._records[:cut]
        if self._coverage is None:
            if it.seen:
                self._cov_steps += 1
                self._cov_seen |= it.seen
            if self._step + 1 >= self.options.coverage_steps:
                self._end_coverage()
        self._last_it = it
        self._step += 1
        self._it = _Iteration(StepRecord(self._step))
        if skipped:
            self._consecutive_skips += 1
            if self._consecutive_skips == self.options.collapse_steps:
                self._read()
                run = self._records[-self._consecutive_skips:]
                scales = [r.scale for r in run if r.scale is not None]
                fell = ""
                if scales and self.scaler is not None:
                    fell = f"from {scales[0]:g} to {scales[-1] * self.scaler._backoff_factor:g} "
                msg = (f"GradScaler skipped {len(run)} consecutive optimizer steps ({run[0].step}..{rec.step}) because "
                       f"the gradients held inf/NaN; the loss scale fell {fell}and the weights stopped changing. "
                       "Some op produces non-finite gradients at every scale: replay the reproducer (or use "
                       "on_anomaly='replay') to locate it, or try bf16 autocast.")
                self._queue.append(_Anomaly("loss-scale-collapse", rec, it, msg, pre_step=False))
        else:
            self._consecutive_skips = 0
        if len(self._pending) > _MAX_PENDING:
            self._read()

    def _end_coverage(self) -> None:
        never: tuple[str, ...] = ()
        if self._cov_steps > 0:
            never = tuple(n for n, p in self._trainable if id(p) not in self._cov_seen)
        zero = tuple(n for n, all_zero in self._cov_zero.items() if all_zero and n not in never)
        self._coverage = Coverage(self._cov_steps, never, zero, self._not_in_optimizer)
        self._remove_hooks(self._coverage_handles)
        self._coverage_handles = []
        self._module_handles = self._module_handles[:1]
        if never:
            groups = _rules.group_by_owner(never, self._owners)
            log.warning("ampdoctor.watch: %d trainable parameter(s) never received a gradient in the first %d step(s) "
                        "(modules: %s); see w.report()", len(never), self._cov_steps, ", ".join(g or "<root>"
                                                                                               for g in groups))

    # ------------------------------------------------------------------ the per-step read
    def _read(self, current: _Iteration | None = None) -> None:
        """Read every pending device value back with ONE host transfer and interpret it."""
        if not self._pending:
            return
        parts, self._pending = self._pending, []
        dev = parts[0][1].device
        flat = torch.cat([t.detach().reshape(-1).to(device=dev, dtype=torch.float32) for _, t, _ in parts])
        values = flat.tolist()
        off = 0
        for kind, t, target in parts:
            n = t.numel()
            self._apply(kind, values[off:off + n], target, current)
            off += n

    def _apply(self, kind: str, v: list[float], target: Any, current: _Iteration | None) -> None:
        if kind == "loss":
            rec: StepRecord = target
            rec.loss = v[0]
            self._scalar("loss", v[0], rec.step)
            if not math.isfinite(v[0]):
                it = current if current is not None and current.record is rec else self._iteration_of(rec)
                pre = current is not None and current.record is rec
                self._queue.append(_Anomaly(
                    "nonfinite-loss", rec, it, f"the loss is {v[0]} at step {rec.step}"
                    + ("" if pre else " (seen after its optimizer step)")
                    + "; replay the reproducer (or use on_anomaly='replay') to find the op where it starts.", pre))
        elif kind == "scale":
            target.scale = v[0]
            self._scalar("loss_scale", v[0], target.step)
        elif kind == "found_inf":
            target.skipped = v[0] > 0
        elif kind == "lost":
            for i, name in enumerate(target):
                self._lost.add(name, v[2 * i], v[2 * i + 1])
        elif kind == "norms":
            rec, names = target
            self._apply_norms(rec, names, v, current)

    def _apply_norms(self, rec: StepRecord, names: list[str], v: list[float], current: _Iteration | None) -> None:
        if rec.skipped:        # GradScaler (fused path) found inf/NaN and skips this update: its verdict stands
            return
        if self._coverage is None:
            for n, x in zip(names, v):
                self._cov_zero[n] = self._cov_zero.get(n, True) and x == 0.0
        bad = [n for n, x in zip(names, v) if not math.isfinite(x)]
        if bad:
            # a per-tensor fp32 norm can overflow for finite, huge gradients: confirm exactly (anomaly path only)
            by_name = dict(zip(self._opt_names, self._opt_params))
            flags = torch.stack([~torch.isfinite(by_name[n].grad).all() for n in bad]).tolist()
            rec.nonfinite_params = tuple(n for n, f in zip(bad, flags) if f)
        total = math.sqrt(math.fsum(x * x for x in v)) if not bad else math.inf
        rec.grad_norm = total
        self._scalar("grad_norm", total, rec.step)
        pre = current is not None and current.record is rec
        it = current if current is not None and pre else self._iteration_of(rec)
        if rec.nonfinite_params:
            owners = sorted({self._owners.get(n, "") or "<root>" for n in rec.nonfinite_params})
            self._queue.append(_Anomaly(
                "nonfinite-grads", rec, it,
                f"non-finite gradients at step {rec.step} in {len(rec.nonfinite_params)} parameter(s) "
                f"(first: {rec.nonfinite_params[0]}; modules: {', '.join(owners[:4])}); an optimizer step now writes "
                "them into the weights. Replay the reproducer (or use on_anomaly='replay') to find the op where they "
                "start; on_anomaly='skip' drops such steps.", pre))
            return
        spike, med = _rules.is_spike(total, list(self._norm_hist), self.options.grad_spike_factor)
        if math.isfinite(total):
            self._norm_hist.append(total)
        if spike or (bad and not math.isfinite(total)):
            rec.spike = True
            self._spikes.append({"step": rec.step, "grad_norm": total, "median": med})
            self._queue.append(_Anomaly(
                "grad-spike", rec, it,
                f"gradient norm {total:.4g} at step {rec.step} is {total / med:.1f}x the running median {med:.4g} "
                f"(threshold {self.options.grad_spike_factor:g}x)" if math.isfinite(med) and med > 0 else
                f"gradient norm overflowed fp32 at step {rec.step}", pre))

    def _iteration_of(self, rec: StepRecord) -> _Iteration:
        if self._last_it is not None and self._last_it.record is rec:
            return self._last_it
        return _Iteration(rec)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(f"ampdoctor/{tag}", value, step)

    # ------------------------------------------------------------------ anomalies
    def _handle_queue(self, *, can_raise: bool, pre_step: bool = False) -> None:
        queue, self._queue = self._queue, []
        for a in queue:
            self._handle(a, can_raise=can_raise, pre_step=pre_step and a.pre_step)

    def _handle(self, a: _Anomaly, *, can_raise: bool, pre_step: bool) -> None:
        o = self.options
        first = a.kind not in self._kinds_seen
        self._kinds_seen.add(a.kind)
        path: str | None = None
        if first and (o.reproducer_dir is not None or o.on_anomaly == "replay"):
            payload = self._payload(a)
            if o.reproducer_dir is not None:
                name = f"step{a.record.step:06d}-{a.kind}.pt"
                path = _reproducer.save_reproducer(payload, o.reproducer_dir, name)
                self._reproducers.append(path)
            if o.on_anomaly == "replay":
                self._replay_in_process(payload, path)
        self._anomalies.append({"kind": a.kind, "step": a.record.step, "message": a.message, "reproducer": path})
        text = f"ampdoctor.watch: {a.message}" + (f" Reproducer: {path}" if path else "")
        if o.on_anomaly == "raise":
            err = AnomalyError(text, kind=a.kind, step=a.record.step, reproducer=path)
            if can_raise:
                raise err
            if self._deferred is None:
                self._deferred = err
            return
        if o.on_anomaly == "skip" and pre_step and a.kind in ("nonfinite-loss", "nonfinite-grads", "grad-spike"):
            for p in self._opt_params:
                p.grad = None      # built-in optimizers leave a parameter (and its state) alone when grad is None
            self._skipped_by_guard += 1
            text += " The optimizer step was skipped (gradients set to None)."
        if first:
            log.warning(text)
        else:
            log.debug(text)

    def _payload(self, a: _Anomaly) -> dict[str, Any]:
        it = a.it
        dropped: list[str] = []
        if it.has_batch:
            batch = it.batch
        elif it.call is not None:
            batch = _reproducer.batch_from_call(*it.call)
        else:
            batch = None
        opt, sc = self.optimizer, self.scaler
        scaler_state = None
        if sc is not None:
            scaler_state = dict(sc.state_dict())
            if a.record.scale is not None:
                scaler_state["scale"] = a.record.scale
        return {
            "format": _reproducer.FORMAT, "version": _reproducer.VERSION,
            "step": a.record.step, "anomaly": a.kind, "message": a.message,
            "model_state": _reproducer.to_saveable(dict(self.model.state_dict())),
            "grads": {n: _reproducer.to_saveable(p.grad) for n, p in self.model.named_parameters()},
            "batch": _reproducer.to_saveable(batch, dropped, "batch"),
            "call": (None if it.call is None else
                     {"args": _reproducer.to_saveable(list(it.call[0]), dropped, "args"),
                      "kwargs": _reproducer.to_saveable(it.call[1], dropped, "kwargs")}),
            "dropped": dropped,
            "optimizer_state": None if opt is None else _reproducer.to_saveable(opt.state_dict()),
            "optimizer_class": "" if opt is None else f"{type(opt).__module__}.{type(opt).__qualname__}",
            "optimizer_params": None if opt is None else [[self._names.get(id(p), "") for p in g["params"]]
                                                          for g in opt.param_groups],
            "scaler_state": scaler_state,
            "scaler_device": None if sc is None else sc._device,
            "rng": it.rng or self._rng_state(),
            "precision": self._precision(),
            "source": self.options.source,
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "torch_version": str(torch.__version__),
        }

    def _precision(self) -> dict[str, Any]:
        ac = dict(self._autocast)
        dtypes = [p.dtype for _, p in self._trainable] or [p.dtype for p in self.model.parameters()]
        main = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
        name = None
        if ac["autocast"] and ac["autocast_dtype"] in ("float16", "bfloat16"):
            name = "fp16-amp" if ac["autocast_dtype"] == "float16" else "bf16-amp"
        elif main == torch.float16:
            name = "fp16"
        elif main == torch.bfloat16:
            name = "bf16"
        return {"name": name, **ac, "param_dtype": str(main).replace("torch.", "")}

    def _copy_model(self) -> nn.Module:
        """A deep copy of the model without this watch's hooks (for an in-process replay)."""
        clone = copy.deepcopy(self.model, {id(self): self})
        mods = dict(clone.named_modules())
        for mod_name, h in self._module_handles:
            m = mods.get(mod_name)
            if m is not None:
                for d in (m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs):
                    d.pop(h.id, None)
        return clone

    def _replay_in_process(self, payload: dict[str, Any], path: str | None) -> None:
        try:
            with torch.enable_grad():   # may run inside optimizer.step(), which disables grad
                report = _reproducer.replay_payload(payload, self._copy_model, origin=path or "")
        except Exception as exc:  # noqa: BLE001 - a failed replay must not stop training
            self._replay_error = f"{type(exc).__name__}: {exc}"
            log.warning("ampdoctor.watch: replaying step %d failed (%s); the watch goes on", payload["step"],
                        self._replay_error)
            return
        if self._replay_report is None:
            self._replay_report = report
        root = report.root_cause
        if root is not None:
            log.warning("ampdoctor.watch: replay of step %d: %s in %s (%s, %s)", payload["step"], root.code,
                        root.module or "<root>", root.op or "op unknown", root.phase)

    # ------------------------------------------------------------------ report
    def _build_report(self) -> Report:
        if not self._ready:     # setup failed before anything was recorded
            return Report((), None, {"source": "watch", "disabled": self._disabled}, (), "watch")
        recs = self._records
        coverage = self._coverage
        if coverage is None:   # still measuring: a provisional verdict on what was seen so far
            never = tuple(n for n, p in self._trainable if id(p) not in self._cov_seen) if self._cov_steps else ()
            coverage = Coverage(self._cov_steps, never, (), self._not_in_optimizer)
        backoff = self.scaler._backoff_factor if self.scaler is not None else 0.5
        cur = self._it.record       # the open step: checked (and maybe stopped by "raise") but not closed
        seen = recs + [cur] if cur.nonfinite_params or cur.loss is not None else recs
        own = (_rules.collapse_findings(recs, self.options.collapse_steps, backoff)
               + _rules.nonfinite_findings(seen, self._owners)
               + _rules.coverage_findings(coverage, self._owners, ddp=self._ddp_strict)
               + _rules.low_precision_findings(self._lost if self._low else None, self._owners))
        findings = _rules.merge_replay(own, self._replay_report)
        tail = recs[-64:]
        summary: dict[str, Any] = {
            "source": "watch",
            "steps": self._n_steps,
            "skipped_steps": self._n_skipped_trimmed + sum(1 for r in recs if r.skipped),
            "steps_skipped_by_watch": self._skipped_by_guard,
            "losses": [r.loss for r in tail if r.loss is not None],
            "grad_norms": [r.grad_norm for r in tail if r.grad_norm is not None],
            "loss_scales": [r.scale for r in tail if r.scale is not None],
            "grad_spikes": self._spikes[-32:],
            "anomalies": self._anomalies[-32:],
            "reproducers": list(self._reproducers),
            "coverage_steps": coverage.steps,
            "precision": self._precision()["name"],
            "precision_settings": self._precision(),
            "on_anomaly": self.options.on_anomaly,
            "disabled": self._disabled,
        }
        if self._replay_report is not None:
            summary["replay"] = {"source": self._replay_report.source, "summary": self._replay_report.summary}
        if self._replay_error is not None:
            summary["replay_error"] = self._replay_error
        layers = self._replay_report.layers if self._replay_report is not None else ()
        return Report(tuple(findings), self._precision()["name"], summary, layers, self.options.source or "watch")


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
          scaler: torch.amp.GradScaler | None = None, *, on_anomaly: str = "warn",
          reproducer_dir: str | os.PathLike[str] | None = None, coverage_steps: int = 3,
          grad_spike_factor: float = 10.0, tensorboard: str | os.PathLike[str] | None = None,
          collapse_steps: int = 3, source: str = "") -> Watch:
    """Guard a training loop you wrote yourself; a context manager returning a :class:`Watch`.

    >>> with ampdoctor.watch(model, optimizer, scaler, reproducer_dir="repro") as w:     # doctest: +SKIP
    ...     for batch in loader:
    ...         optimizer.zero_grad()
    ...         with torch.autocast("cuda", dtype=torch.float16):
    ...             loss = model(**batch).loss
    ...         scaler.scale(loss).backward()
    ...         scaler.step(optimizer)
    ...         scaler.update()
    ...         w.step(loss)                       # optional: also check the loss
    >>> w.report().codes()                                                               # doctest: +SKIP
    ['loss-scale-collapse']

    Per step it checks: the loss (if given to ``w.step``) and gradients are finite; the gradient norm stays under
    ``grad_spike_factor`` x its running median; GradScaler's skipped steps and scale (``collapse_steps``
    consecutive skipped steps = collapse). During the first ``coverage_steps`` steps: trainable parameters that
    never get a gradient or only exact zeros, trainable parameters missing from the optimizer, and parameters
    kept in fp16/bf16 without fp32 master copy whose updates round away.

    ``on_anomaly``: ``"warn"`` logs one warning per anomaly kind; ``"raise"`` raises :class:`AnomalyError` from
    the call where it is detected (``optimizer.step()`` before the weights change, or the next forward for
    GradScaler-skipped steps); ``"skip"`` sets every gradient of the optimizer to ``None`` before a step with
    non-finite loss/gradients or a norm spike, so built-in optimizers leave parameters and state untouched (as
    GradScaler does); ``"replay"`` rebuilds the step from its pre-step state in process (a deep copy of the
    model, the optimizer/scaler state, the batch and RNG) and runs :func:`ampdoctor.diagnose` on it, whose
    findings then lead :meth:`Watch.report`. With ``reproducer_dir``, the first anomaly of each kind is written
    there (see :mod:`ampdoctor.watch._reproducer` for the contents). ``tensorboard``: a log dir for scalars
    (needs ``pip install tensorboard``). ``source``: a scenario/script path stored in reproducers.

    Side effects: none on the numbers (20 steps with or without watch are bitwise identical) and none on the
    objects after exit (every hook is removed, also on exceptions). Cost: one fused reduction over the
    gradients and one host read per optimizer step; none for a step GradScaler skipped. During the first
    ``coverage_steps`` steps only: one Python call per parameter per backward, and a copy of the fp16/bf16
    parameters the optimizer updates (to measure lost updates). The inputs of the last forward are kept by
    reference until the next one. An internal error disables the watch with one warning; training continues.
    """
    opts = WatchOptions(on_anomaly=on_anomaly, reproducer_dir=None if reproducer_dir is None else os.fspath(
        reproducer_dir), coverage_steps=coverage_steps, grad_spike_factor=grad_spike_factor,
        tensorboard=None if tensorboard is None else os.fspath(tensorboard), collapse_steps=collapse_steps,
        source=source)
    return Watch(model, optimizer, scaler, opts)


__all__ = ["AnomalyError", "KINDS", "ON_ANOMALY", "Watch", "WatchOptions", "watch"]
