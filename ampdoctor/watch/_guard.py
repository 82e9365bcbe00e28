"""The always-on guard: ``with watch(model, optimizer, scaler) as w:`` around the user's own training loop.

:class:`Watch` is a façade over small parts with one job each: step detection (``_steps``, ``_hooks``,
``_scaler``), the device-side readback (``_record``), detectors (``_detectors``), the anomaly policy and the
op-level replay (``_policy``, ``_payload``, ``_reproducer``), sinks (``_sinks``) and the report (``_report``,
``_rules``). See :mod:`ampdoctor.watch._steps` for how a step is seen.

Observation has no side effects: hooks only read; nothing is cast, copied into the model or drawn from the RNG.
Host syncs: one ``tolist()`` per optimizer step (none for a step GradScaler skipped, but one under data
parallelism, where the ranks exchange their table after skipped steps: :mod:`ampdoctor.watch._ranks`); more only when an
anomaly is handled (reproducer copies, the replay, confirmation of non-finite gradients) or when ``report()``
is called.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any, Literal

import torch
from torch import nn

from ampdoctor.findings import Report
from ampdoctor.watch._hooks import Health
from ampdoctor.watch._loss_code import LossCodeTap
from ampdoctor.watch._method_step import STEP_METHODS
from ampdoctor.watch._options import KINDS, ON_ANOMALY, AnomalyError, OnAnomaly, WatchOptions
from ampdoctor.watch._params import unwrap_optimizer
from ampdoctor.watch._payload import build_payload, copy_without_hooks
from ampdoctor.watch._policy import Anomaly, AnomalyPolicy
from ampdoctor.watch._prestate import moved_to, nonfinite_state, prior_payload
from ampdoctor.watch._ranks import RankAgreement, is_sharded
from ampdoctor.watch._report import backward_dtype, build_report, precision_of
from ampdoctor.watch._scaler import GradScalerView
from ampdoctor.watch._setup import mixed_setup_finding
from ampdoctor.watch._sinks import ScalarSink, Sinks
from ampdoctor.watch._steps import StepTracker

log = logging.getLogger("ampdoctor.watch")


class Watch:
    """A cheap guard over a training loop; use :func:`watch` to build one and enter it with ``with``.

    Param groups added to the optimizer later are re-read at the next step. An optimizer rebuilt mid-run (the
    weights change twice without the watched one stepping) gets one warning, and gradients are then checked at
    each ``w.step(loss)``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None, options: WatchOptions | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None:
            optimizer = unwrap_optimizer(optimizer)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one in "
                                f".optimizer), got {type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        options = options if options is not None else WatchOptions()
        if not isinstance(options, WatchOptions):
            raise TypeError(f"options must be WatchOptions, got {type(options).__name__}")
        names = {id(p) for p in model.parameters()}
        if optimizer is not None:
            opt_params = [p for g in optimizer.param_groups for p in g["params"]]
            if opt_params and not any(id(p) in names for p in opt_params):
                raise ValueError("the optimizer updates none of the model's parameters; pass the optimizer built over "
                                 "model.parameters() (or the model it trains)")
        options.check_environment()
        self.model, self.optimizer, self.options = model, optimizer, options
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._health = Health()
        self._entered = self._exited = False
        self._sinks = Sinks()
        self._tracker = StepTracker(model, optimizer, GradScalerView(self.scaler) if self.scaler is not None
                                    else None, options, self._sinks, self._health)
        self._policy = AnomalyPolicy(options, self._sinks, payload=self._payload, copy_model=self._copy_model,
                                     skip_step=lambda: self._tracker.params.drop_grads(), earlier=self._earlier)
        self._tracker.policy = self._policy
        self._policy.sharded = is_sharded(model)
        self._loss_tap: LossCodeTap | None = None
        self._log_note = False      # expect_precision(log_note=True): log the precision_note on exit

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Watch:
        if self._entered:
            raise RuntimeError("this Watch was already entered; create a new one with ampdoctor.watch(...)")
        self._entered = True
        self._health.active = True
        try:
            self._tracker.setup()
            self._tracker.state.backward_dtype = lambda: backward_dtype(self._tracker)
            self._policy.ranks = RankAgreement.create(self.model, self.options.on_anomaly,   # collective
                                                      self.options.ranks)
            if self.options.tensorboard is not None:
                self._sinks.open_tensorboard(os.fspath(self.options.tensorboard))
            self._health.ready = True
            if self._tracker.scaler is not None and self._policy.setup is None:   # a GradScaler over fp16 weights
                self._setup_finding("fp16", "a GradScaler (fp16 loss scaling)", only_fp16=True)
            if self.options.loss_code:
                self.record_loss_code()
        except Exception as exc:  # noqa: BLE001
            self._health.disable(exc)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        deferred: AnomalyError | None = None
        try:
            if self._health.working:
                try:
                    self._tracker.finish()
                except AnomalyError as e:
                    deferred = e
                except Exception as e:  # noqa: BLE001
                    self._health.disable(e)
            deferred = deferred or self._policy.deferred or self._policy.take_pending()
            if self._health.working and self._policy.ranks is not None:
                try:
                    self._policy.ranks.finish()     # the last table: a wait, no new collective
                except Exception as e:  # noqa: BLE001
                    self._health.disable(e)
        finally:
            try:
                if self._loss_tap is not None:
                    self._loss_tap.close()
                self._tracker.remove_hooks()    # removes every hook even when one fails, then re-raises
            except Exception as e:  # noqa: BLE001 - must not escape __exit__ (nor hide the user's error)
                self._health.disable(e)
            finally:
                self._health.active = False
                self._exited = True
                self._sinks.close()
        if self._log_note:
            self._log_precision_note()
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
        self._require_entered("step")
        if loss is not None and not isinstance(loss, (torch.Tensor, int, float)):
            raise TypeError(f"loss must be a tensor or a number, got {type(loss).__name__}")
        self._tracker.on_step(loss, batch)

    def observe_batch(self, batch: Any) -> None:
        """Record ``batch`` as the inputs of the step in progress (stored in a reproducer). Only needed when the
        model is not called through its root module (Lightning's ``training_step``); keeps a reference, no copy."""
        self._require_entered("observe_batch")
        self._tracker.observe_batch(batch)

    def observe_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], rng: dict[str, Any] | None = None) -> None:
        """Record a forward call of the root module that this watch's own hook did not see (it was attached during
        that very forward: ``ampdoctor run`` at step 0); ``rng`` is the RNG state before that forward."""
        if self._health.working:
            self._tracker.note_call(tuple(args), dict(kwargs), rng)

    def scaler_among(self, scalers: list[torch.amp.GradScaler]) -> None:
        """The optimizer is stepped by one of ``scalers`` (enabled GradScalers; a script with one per optimizer, as
        in a GAN): the watch takes the one whose ``scaler.step(optimizer)`` it sees first, so the steps it skips
        are seen from the first one on. Call before entering the watch, which must have no scaler of its own."""
        if self._entered or self.scaler is not None:
            raise RuntimeError("scaler_among() goes before `with`, on a watch built without a scaler")
        enabled = [s for s in scalers if isinstance(s, torch.amp.GradScaler) and s.is_enabled()]
        if enabled:
            self._tracker.scaler = GradScalerView(enabled[0], self.optimizer, tuple(enabled[1:]))

    def replay_with(self, train_step: Any, *, method: str = "") -> None:
        """Replay an anomalous step with ``train_step(model, batch, optimizer=..., scaler=...)`` (as
        :func:`ampdoctor.diagnose` calls it: forward, backward and update on the replay's copies) instead of calling
        the root module with the recorded inputs; for frameworks whose step is not the root's forward (Lightning's
        ``training_step``, a Trainer's ``compute_loss``). ``method="training_step"``: the step is that method of the
        model, recorded in reproducers so that :func:`ampdoctor.replay` of the file runs it too."""
        if train_step is not None and not callable(train_step):
            raise TypeError(f"train_step must be callable as train_step(model, batch), got {train_step!r}")
        if method and method not in STEP_METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, STEP_METHODS))} or '', got {method!r}")
        self._policy.train_step, self._policy.step_method = train_step, method

    def record_loss_code(self, *, losses: bool = False) -> None:
        """Record each step's loss code (the torch calls from the model's output to ``backward()``, when the model
        returns no loss) so that the in-process replay runs it too (:mod:`ampdoctor.watch._loss_code`);
        ``ampdoctor run`` turns it on. No effect with :meth:`replay_with` or after the watch was disabled.
        ``losses=True``: a loss the model returns itself (``output.loss``) is checked as the step's loss, as if given
        to :meth:`step`, for loops that give none (``ampdoctor run``, the HF callback): an inf/NaN loss in the very
        first forward is then an anomaly of that step, not read as GradScaler calibrating its scale."""
        self._require_entered("record_loss_code()")
        if self._loss_tap is None and self._health.working:
            self._loss_tap = LossCodeTap(self.model, self.optimizer, lambda: self._tracker.it.record.step,
                                         self._health)
            self._policy.loss_code = self._loss_tap.program
        if losses and self._loss_tap is not None:
            self._loss_tap.on_loss = self._tracker.hold_loss

    def expect_precision(self, requested: str, by: str, *, mixed: bool = True, log_note: bool = False) -> None:
        """What the user asked ``by`` (a framework: ``"Trainer(fp16=True)"``) to run, ``"fp16"`` or ``"bf16"``;
        a report whose steps ran otherwise says so (``precision_note``), e.g. fp16 on CPU that runs in fp32.
        ``mixed`` (autocast over fp32 weights, not Lightning's ``"16-true"``): 16-bit trainable parameters are
        reported now, before step 0 (``low-precision-params``, :mod:`ampdoctor.watch._setup`), and logged.
        ``log_note``: the watch's exit also logs the ``precision_note`` (for a caller that, unlike the HF and
        Lightning callbacks, logs no report of its own)."""
        if requested not in ("fp16", "bf16"):
            raise ValueError(f"requested precision must be 'fp16' or 'bf16', got {requested!r}")
        self._policy.requested = (requested, by)
        self._log_note = log_note
        if mixed:
            self._setup_finding(requested, by)

    def _log_precision_note(self) -> None:
        try:
            note = self.report().summary.get("precision_note")
        except Exception as e:  # noqa: BLE001 - a failure inside the watch never reaches the user's training
            log.debug("no precision note (%s: %s)", type(e).__name__, e)
            return
        if note:
            log.warning("%s", note)

    def _setup_finding(self, requested: str, by: str, *, only_fp16: bool = False) -> None:
        """Judge the trainable parameters' dtypes against mixed precision now, before step 0, and log it."""
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if only_fp16 and not any(p.dtype == torch.float16 for _, p in params):
            return
        f = mixed_setup_finding(requested, by, params)
        self._policy.setup = f
        if f is not None:
            log.log(logging.ERROR if f.severity == "error" else logging.WARNING, "[%s] %s: %s Fix: %s",
                    f.severity, f.code, f.explanation, f.fixes[0].title)

    def add_scalar_sink(self, fn: ScalarSink) -> None:
        """Also send the watch's scalars (``ampdoctor/loss``, ``ampdoctor/loss_scale``, ``ampdoctor/grad_norm``)
        to ``fn(tag, value, step)`` (a framework's logger); a sink that raises is dropped with one warning."""
        self._sinks.add_scalar_sink(fn)

    def report(self) -> Report:
        """The findings so far (``loss-scale-collapse``, ``unused-parameters``, ``low-precision-params``, non-finite
        losses/gradients, and a replay's findings first when it located an origin). Reads pending values (a sync)."""
        if self._health.working:
            try:
                self._tracker.sync()
            except AnomalyError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._health.disable(exc)
        if not self._health.ready:     # setup failed (or never entered) before anything was recorded
            return Report((), None, {"source": "watch", "disabled": self._health.disabled}, (), "watch")
        try:
            return build_report(self._tracker, self._policy, self._health.disabled)
        except Exception as exc:  # noqa: BLE001 - a report must not raise for an internal error
            self._health.disable(exc)
            return Report((), None, {"source": "watch", "disabled": self._health.disabled}, (), "watch")

    def counters(self) -> dict[str, float]:
        """Cheap running values for a framework's logger (no report is built, no sync): ``steps``,
        ``skipped_steps``, ``anomalies`` and, when known, the last ``loss_scale`` and ``grad_norm``."""
        t = self._tracker
        if not self._health.ready:
            return {}
        out: dict[str, float] = {"steps": t.n_steps, "skipped_steps": t.state.health.skipped,
                                 "anomalies": sum(self._policy.counts.values())}
        if t.state.health.last is not None:
            out["loss_scale"] = t.state.health.last
        norm = next((r.grad_norm for r in reversed(t.records[-4:]) if r.grad_norm is not None), None)
        if norm is not None:
            out["grad_norm"] = norm
        return out

    @property
    def disabled(self) -> str | None:
        """Why the watch disabled itself after an internal error (``None`` while it works)."""
        return self._health.disabled

    # ------------------------------------------------------------------ internals
    def _require_entered(self, what: str) -> None:
        if not self._entered:
            raise RuntimeError(f"Watch.{what}() was called before the watch was entered: use it as "
                               "`with ampdoctor.watch(model, optimizer, scaler) as w:` around the training loop")
        if self._exited:  # a NaN reported after the block would be silently ignored
            raise RuntimeError(f"Watch.{what}() was called after the watch's `with` block ended; it observes "
                               "nothing then: keep the training loop inside `with ampdoctor.watch(...) as w:`")

    def _payload(self, a: Anomaly) -> dict[str, Any]:
        t, d = self._tracker, a.detection
        payload = build_payload(step=d.record.step, kind=d.kind, message=d.message, model=self.model,
                                optimizer=self.optimizer, scaler=t.scaler, scale=d.record.scale, inputs=a.inputs,
                                precision=precision_of(t), source=self.options.source, device_type=t.device_type,
                                step_method=self._policy.step_method)
        return prior_payload(a.prior, payload)

    def _earlier(self, a: Anomaly) -> Anomaly:
        """The anomaly to record and replay: ``a`` itself, or -- when its step STARTED from inf/NaN parameters or
        optimizer state -- the previous update, which wrote them (its pre-step state, kept by the tracker)."""
        try:
            bad = nonfinite_state(self.model, self.optimizer)
            if not bad:
                return a
            d, prior = a.detection, self._tracker.prior
            usable = prior is not None and prior.record.step == d.record.step - 1
            info = moved_to(d.record.step, bad, prior if usable else None, self.options.coverage_steps)
            if self._policy.moved is None:      # the first one: the one the replay runs
                self._policy.moved = info
                log.warning("%s", info["note"])
            if prior is None or not usable:
                return a
            moved = dataclasses.replace(a, inputs=prior.inputs, prior=prior, detection=dataclasses.replace(
                d, record=prior.record, message=f"{d.message} {info['note']}"))
        except Exception as exc:  # noqa: BLE001 - the step's own replay still runs
            log.warning("checking the state step %d started from failed (%s: %s)",
                        a.detection.record.step, type(exc).__name__, exc)
            return a
        return moved

    def _copy_model(self) -> nn.Module:
        return copy_without_hooks(self.model, self, self._tracker.module_handles)


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
          scaler: torch.amp.GradScaler | None = None, *, on_anomaly: OnAnomaly = "warn",
          reproducer_dir: str | os.PathLike[str] | None = None, coverage_steps: int = 3,
          grad_spike_factor: float = 10.0, tensorboard: str | os.PathLike[str] | None = None,
          collapse_steps: int = 3, source: str = "", locate: bool = True, ranks: bool = True,
          loss_code: bool = False) -> Watch:
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
    consecutive skipped steps = collapse; over the whole run, see :class:`WatchOptions`). During the first
    ``coverage_steps`` steps: trainable parameters that never get a gradient or only exact zeros, trainable
    parameters missing from the optimizer, and parameters kept in fp16/bf16 without fp32 master copy whose updates
    round away.

    ``locate`` (default on): the first anomaly whose step state is still clean (seen before the optimizer wrote it,
    or a step GradScaler skipped) is replayed in process from that pre-step state — a deep copy of the local
    (DDP-unwrapped) module, the optimizer/scaler state, the batch and RNG — under :func:`ampdoctor.diagnose`,
    which names the module, op and phase; its findings then lead :meth:`Watch.report`. The replay never issues a
    collective. Cost: nothing per step; on that anomaly one CPU copy of the model state and one diagnosis.
    ``locate=False`` keeps the module-level hint only. ``loss_code=True``: a loss the loop computes from the output
    is recorded each step, so the replay runs it too (:meth:`Watch.record_loss_code`; integrations turn it on).

    ``on_anomaly``: ``"warn"`` logs one warning per anomaly kind; ``"raise"`` raises :class:`AnomalyError` from
    the call where it is detected (``optimizer.step()`` before the weights change, or the next forward for
    GradScaler-skipped steps); ``"skip"`` sets every gradient of the optimizer to ``None`` before a step with
    non-finite loss/gradients or a norm spike, so built-in optimizers leave parameters and state untouched (as
    GradScaler does); ``"replay"`` is ``"warn"`` with ``locate`` forced on. Under DDP/FSDP (process group of 2+
    ranks; ``ranks=False`` turns it off) the ranks exchange one tiny table per optimizer step on a group of the
    watch's own (:mod:`ampdoctor.watch._ranks`): every report names the rank that saw the first non-finite value
    (``origin_rank``), and ``"raise"``/``"skip"`` happen on every rank together. With ``reproducer_dir``, the first
    anomaly of each kind is written there (see :mod:`ampdoctor.watch._reproducer`). ``tensorboard``: a log dir
    for scalars (needs ``pip install tensorboard``). ``source``: a scenario/script path stored in reproducers.
    Bad options (an unknown ``on_anomaly``, an unwritable directory, TensorBoard missing) raise here.

    Side effects: none on the numbers (20 steps with or without watch are bitwise identical) and none on the
    objects after exit (every hook is removed, also on exceptions). Cost: one fused reduction over the
    gradients and one host read per optimizer step; none for a step GradScaler skipped (one with the ranks'
    agreement on). During the first
    ``coverage_steps`` steps only: one Python call per parameter per backward, and a copy of the fp16/bf16
    parameters the optimizer updates (to measure lost updates). The inputs of the last forward are kept by
    reference until the next one. An internal error disables the failing part with one warning; training continues.
    Param groups added later are re-read; a rebuilt optimizer gets one warning (:class:`Watch`).
    """
    # long: the docstring is the reference of every option; the body is six lines
    def path(v: Any) -> Any:  # a wrong type is reported by WatchOptions, naming the argument
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    opts = WatchOptions(on_anomaly=on_anomaly, reproducer_dir=path(reproducer_dir), coverage_steps=coverage_steps,
                        grad_spike_factor=grad_spike_factor, tensorboard=path(tensorboard),
                        collapse_steps=collapse_steps, source=source, locate=locate, ranks=ranks,
                        loss_code=loss_code)
    return Watch(model, optimizer, scaler, opts)


def check_watch_options(**options: Any) -> None:
    """Raise now, as :func:`watch` would, for keyword options it would reject (an unknown name, a typo in
    ``on_anomaly``, a wrong type): the framework callbacks call it when they are built, not inside ``fit()``."""
    params = inspect.signature(watch).parameters
    unknown = sorted(set(options) - {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY})
    if unknown:
        raise TypeError(f"unknown watch option(s) {', '.join(map(repr, unknown))}; the options are: "
                        + ", ".join(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY))
    fields = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
    WatchOptions(**fields)


__all__ = ["KINDS", "ON_ANOMALY", "AnomalyError", "Watch", "WatchOptions", "check_watch_options", "watch"]
