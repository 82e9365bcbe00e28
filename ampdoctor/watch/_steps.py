"""Step detection: the hooks that tell a watch where a step begins and ends, and the step's life cycle.

How the guard learns about a step, without replacing any method of the user's objects:

* ``optimizer.register_step_pre_hook`` runs just before the update. The gradients are checked there (one fused
  on-device reduction, ``torch._foreach_norm``, read back together with everything else pending: ONE host read
  per step). If ``optimizer.step(closure)`` is called (Lightning, LBFGS), the pre-hook hands the optimizer a
  closure that runs the user's closure and then the check. ``register_step_post_hook`` closes the step.
* GradScaler skips ``optimizer.step()`` when it finds inf/NaN, so no optimizer hook fires for a skipped step.
  The guard notices instead that ``scaler.update()`` ran (:class:`~ampdoctor.watch._scaler.GradScalerView`). At
  the next event the guard sees (the root module's next forward, the next optimizer hook, ``w.step()``,
  ``w.report()``, exit), an update in which our optimizer reached ``STEPPED`` while no optimizer step happened
  means: skipped. GradScaler's own ``found_inf`` decides; no reduction and no read for a skipped step.
* A forward pre-hook on the root module keeps a *reference* (no copy) to the step's inputs (each call's) and notes
  the RNG state and the autocast settings. During the first ``coverage_steps`` steps, post-accumulate-grad hooks on the
  trainable parameters record which parameters receive a gradient, and forward pre-hooks on parameter-owning
  modules note autocast entered inside the model's ``forward`` (accelerate). Those hooks go once coverage is
  measured.

Every hook is a :class:`Hook`: marked as ampdoctor's (``_ampdoctor_hook``) and never deep-copied, so a copy of a
watched model (``diagnose`` on it, a replay) carries no watch."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampdoctor.findings import group_by_owner
from ampdoctor.watch._detectors import (
    DetectorState,
    GradsSeen,
    LossSeen,
    LostSeen,
    ProbeSeen,
    ScaleSeen,
    StepClosed,
    collapse_due,
    run_detectors,
)
from ampdoctor.watch._hooks import Health, Hook, guarded
from ampdoctor.watch._options import AnomalyError, WatchOptions
from ampdoctor.watch._params import Parameters, local_grad
from ampdoctor.watch._payload import MAX_STEP_CALLS, Iteration, fp8_settings, rng_state
from ampdoctor.watch._policy import Anomaly, AnomalyPolicy
from ampdoctor.watch._prestate import PreUpdate, take
from ampdoctor.watch._probe import GradProbe
from ampdoctor.watch._record import (
    Coverage,
    FoundInf,
    GradNorms,
    LossValue,
    LostCounts,
    LostUpdates,
    Pending,
    ProbeFlags,
    Readback,
    ScaleValue,
    StepRecord,
)
from ampdoctor.watch._scaler import GradScalerView
from ampdoctor.watch._sinks import Sinks

log = logging.getLogger("ampdoctor.watch")
#: step records kept for the report (a window: memory stays flat however long training runs)
MAX_RECORDS = 4096

class StepTracker:
    """The hooks and the step life cycle: opens and closes step records, queues device values for the step's
    single read, feeds what is read back to the detectors and hands their anomalies to the policy."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: GradScalerView | None,
                 options: WatchOptions, sinks: Sinks, health: Health) -> None:
        self.model, self.optimizer, self.scaler, self.options = model, optimizer, scaler, options
        self.sinks, self.health = sinks, health
        self.policy: AnomalyPolicy | None = None
        self.handles: list[Any] = []
        self.coverage_handles: list[Any] = []
        self.module_handles: list[tuple[str, Any]] = []

    # ------------------------------------------------------------------ setup / teardown
    def setup(self) -> None:
        model, opt, o = self.model, self.optimizer, self.options
        self.params = ps = Parameters(model, opt)
        self.ddp_strict = (isinstance(model, nn.parallel.DistributedDataParallel)
                           and not getattr(model, "find_unused_parameters", False))
        self.device_type = next((p.device.type for p in model.parameters()), "cpu")
        self.state = DetectorState(o, backoff=self.scaler.backoff_factor if self.scaler is not None else 0.5,
                                   confirm_nonfinite=ps.confirm_nonfinite, owners=ps.owners,
                                   coverage_open=o.coverage_steps > 0,
                                   lost=LostUpdates(dtypes={n: str(p.dtype).replace("torch.", "") for n, p in ps.low}))
        self.lost_left = o.coverage_steps if ps.low else 0
        self.lp_before: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.prior: PreUpdate | None = None     # the last update's pre-step state while lp_before is (``_prestate``)
        self.step = self.unwatched_updates = 0
        self.records: list[StepRecord] = []
        self.n_steps = self.n_skipped_trimmed = 0
        self.it = Iteration(StepRecord(0))
        self.last_it: Iteration | None = None
        #: the latest closed iterations (their inputs, by reference), for anomalies read back after the step closed
        self.recent: deque[Iteration] = deque(maxlen=4)
        self.readback = Readback()
        self.queue: list[Anomaly] = []
        self.explicit = False
        #: the watched optimizer stopped stepping while the weights keep changing (rebuilt optimizer, R12)
        self.orphaned = False
        self.weights_version = self._weights_version()
        self.autocast: dict[str, Any] = {"autocast": False, "autocast_dtype": None, "device_type": self.device_type}
        self.cov_steps, self.cov_seen = 0, set[int]()
        self.coverage: Coverage | None = None if o.coverage_steps > 0 else Coverage(0, (), (), ps.not_in_optimizer)
        sc = self.scaler
        self.scaler_token = sc.token() if sc is not None else None
        self.stepped_token: Any = None
        #: a GradScaler-skipped step closed since the last agreement (ranks): exchanged at the next training forward
        self.skip_unagreed = False
        self.scale_snapshot = sc.scale_copy() if sc is not None else None
        self.probe = GradProbe(ps.trainable, self.health)   # armed when GradScaler starts skipping
        self._register_hooks()

    def _register_hooks(self) -> None:
        model, opt = self.model, self.optimizer
        self.handles.append(model.register_forward_pre_hook(Hook(self.on_forward), with_kwargs=True))
        self.module_handles.append(("", self.handles[-1]))
        if opt is not None:
            self.handles.append(opt.register_step_pre_hook(Hook(self.on_opt_pre)))
            self.handles.append(opt.register_step_post_hook(Hook(self.on_opt_post)))
        if self.options.coverage_steps > 0:
            for _, p in self.params.trainable:
                self.coverage_handles.append(p.register_post_accumulate_grad_hook(Hook(self.on_grad)))
            for mod_name, mod in model.named_modules():
                if mod is not model and any(True for _ in mod.parameters(recurse=False)):
                    h = mod.register_forward_pre_hook(Hook(self.on_inner_forward))
                    self.coverage_handles.append(h)
                    self.module_handles.append((mod_name, h))

    def remove_hooks(self) -> None:
        """Remove every hook; one that fails to go does not keep the others (the first error is re-raised)."""
        handles = self.handles + self.coverage_handles + self.probe.handles
        self.handles, self.coverage_handles, self.module_handles, self.probe.handles = [], [], [], []
        failed: Exception | None = None
        for h in handles:
            try:
                h.remove()
            except Exception as exc:  # noqa: BLE001 - keep removing
                failed = failed or exc
        if failed is not None:
            raise failed

    def finish(self) -> None:
        self.poll_scaler()
        if self.optimizer is None and not self.explicit and self.it.active:
            self.close(skipped=False)
        self.read()
        if self.coverage is None:
            self.end_coverage()
        self.handle_queue(can_raise=False)

    def sync(self) -> None:
        self.poll_scaler()
        self.read()
        self.handle_queue(can_raise=False)

    # ------------------------------------------------------------------ hooks
    @guarded
    def on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.poll_scaler()
        if not torch.is_grad_enabled():     # evaluation between steps: not part of a training step
            self.handle_queue(can_raise=True)
            return
        if self.optimizer is not None and not self.orphaned:
            self._check_optimizer_steps()
        if self.optimizer is None and not self.explicit and self.it.forward_seen:
            self.close(skipped=False)
        self.handle_queue(can_raise=True)
        if self.skip_unagreed:
            self._agree_skipped()
        self.note_call(args, kwargs, rng_state(self.device_type))

    def _agree_skipped(self) -> None:
        """The ranks' agreement for GradScaler-skipped steps, which reach no optimizer pre-step check: at the first
        training forward after them (every rank runs it, and DDP's all-reduced gradients make GradScaler skip the
        same steps on every rank, so every rank exchanges here alike). Skipped steps only: a healthy step gets no
        extra collective. Reads the skipped step's pending values first (its loss; a skipped step had no read), so
        this rank's own inf/NaN and its replay's origin are in the table."""
        self.skip_unagreed = False
        self.read()
        self.handle_queue(can_raise=True)
        assert self.policy is not None
        self.policy.agree(self.step, skip=False)

    def _weights_version(self) -> int | None:
        ps = self.params.opt_params
        return ps[0]._version if self.optimizer is not None and ps else None

    def _check_optimizer_steps(self) -> None:
        """Notice weights that change without the watched optimizer stepping (a new optimizer built mid-run):
        one counter read per forward, no sync. Twice in a row (a user's in-place clamp after a step is once) means
        the watch no longer sees the steps: warn once and close a step at each ``w.step(loss)`` from then on."""
        v = self._weights_version()
        if v is None or v == self.weights_version:
            return
        self.weights_version = v
        self.unwatched_updates += 1
        if self.unwatched_updates >= 2:
            self.orphaned = True
            log.warning("the weights changed %d times without the watched optimizer stepping: "
                        "it is no longer the one in use (rebuilt mid-run?). Gradient checks now run only at "
                        "w.step(loss); to watch the new optimizer's steps, watch it: ampdoctor.watch(model, "
                        "new_optimizer)", self.unwatched_updates)

    def note_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], rng: dict[str, Any] | None) -> None:
        it = self.it
        it.forward_seen = True
        it.call = (args, kwargs)
        it.rng = rng if rng is not None else rng_state(self.device_type)
        if len(it.calls) <= MAX_STEP_CALLS:     # one more than kept: too many, the replay runs the last call
            it.calls.append(it.call)
        it.first_rng = it.first_rng or it.rng
        self.note_autocast()

    @guarded
    def observe_batch(self, batch: Any) -> None:
        self.poll_scaler()
        self.it.batch, self.it.has_batch = batch, True
        self.it.batches += [batch] if len(self.it.batches) <= MAX_STEP_CALLS else []   # one more than kept: too many
        self.it.rng = self.it.first_rng = self.it.rng or rng_state(self.device_type)
        self.handle_queue(can_raise=True)

    @guarded
    def on_inner_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.autocast["autocast"]:
            self.note_autocast()

    def note_autocast(self) -> None:
        if torch.is_autocast_enabled(dt := self.device_type):
            self.autocast = {"autocast": True, "autocast_dtype": str(torch.get_autocast_dtype(dt)).replace(
                "torch.", ""), "device_type": dt}
        if fp8 := fp8_settings():  # inside ampdoctor's emulated fp8 block: a replay runs its recipe
            self.autocast = {**self.autocast, **fp8}

    @guarded
    def on_grad(self, p: torch.Tensor) -> None:   # inside backward(): an error here must never reach it
        self.it.seen.add(id(p))

    @guarded
    def on_opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.poll_scaler()
        self.skip_unagreed = False      # the pre-step agreement below takes the skipped steps in
        self.unwatched_updates = 0
        self.handle_queue(can_raise=True)
        if self.params.changed():        # add_param_group since the last step: re-read names and roles
            self.params.refresh()
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self.before_update()
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

    @guarded
    def _checked_before_update(self) -> None:
        self.before_update()

    @guarded
    def on_opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.lp_before:
            parts, names = [], []
            for name, p, before in self.lp_before:
                g = p.grad
                if g is None or g.is_sparse:
                    continue
                nz = g != 0
                parts.append(torch.stack([(nz & (p.detach() == before)).sum(), nz.sum()]).to(torch.float32))
                names.append(name)
            self.lp_before = []
            if parts:
                self.readback.add(LostCounts(torch.cat(parts), tuple(names)))
                self.state.lost.steps += 1
                self.lost_left -= 1
        if self.scaler is not None:
            self.stepped_token = self.scaler.token()
        self.weights_version = self._weights_version()
        self.close(skipped=self.it.record.skipped, scale_known=True)

    @guarded
    def on_step(self, loss: Any, batch: Any) -> None:
        self.poll_scaler()
        it = self.it
        # with an optimizer, a loss given after optimizer.step() (no forward since) belongs to the step just closed
        last = self.last_it
        late = self.optimizer is not None and not self.orphaned and not it.active and last is not None
        target = last if late and last is not None else it
        if loss is not None:
            t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            if not late:
                self.hold_loss(t)
            else:
                self.readback.add(LossValue(t.float().sum().reshape(1), target.record))
        if batch is not None:
            target.batch, target.has_batch = batch, True
        if self.optimizer is None or self.orphaned:
            self.explicit = True
            if it.active or loss is not None:
                self.before_update()
                self.close(skipped=False, scale_known=True)
        self.handle_queue(can_raise=True)

    def hold_loss(self, t: torch.Tensor) -> None:
        """Keep ``t`` as the open step's loss, checked with its single read (an earlier one is checked too)."""
        if self.it.loss is not None:
            self.readback.add(LossValue(self.it.loss.float().sum().reshape(1), self.it.record, micro=True))
        self.it.loss, self.it.micro = t, self.it.micro or self.it.loss is not None

    # ------------------------------------------------------------------ step life cycle
    def poll_scaler(self) -> None:
        """Notice a ``scaler.update()`` since the last event; a step GradScaler skipped is closed here."""
        sc = self.scaler
        if sc is None:
            return
        token = sc.token()
        if token is self.scaler_token:
            if self.scale_snapshot is None:
                self.scale_snapshot = sc.scale_copy()
            return
        old, self.scaler_token = self.scaler_token, token
        # GradScaler.step(optimizer) ran in the finished scaler iteration but no optimizer step did: skipped
        if old is not None and old is not self.stepped_token and sc.stepped_in(old, self.optimizer):
            scale = self.scale_snapshot if self.scale_snapshot is not None else sc.scale_before_backoff()
            self.close(skipped=True, scale=scale)
            self.skip_unagreed = self.policy is not None and self.policy.ranks is not None
        self.scale_snapshot = sc.scale_copy()

    def before_update(self) -> None:
        """Check this step's gradients (and loss/scale): one fused reduction and one host read."""
        it, rec = self.it, self.it.record
        grads: list[torch.Tensor] = []
        names: list[str] = []
        sparse: list[tuple[str, torch.Tensor]] = []
        for name, p in zip(self.params.opt_names, self.params.opt_params):
            g = p.grad
            if g is None:
                continue
            g = local_grad(g)
            if g.is_sparse:
                sparse.append((name, g))
            else:
                grads.append(g)
                names.append(name)
        if not it.seen and self.coverage is None:
            it.seen = {id(p) for p in self.params.opt_params if p.grad is not None}   # attached after this backward
        found_inf = getattr(self.optimizer, "found_inf", None) if self.optimizer is not None else None
        if isinstance(found_inf, torch.Tensor):   # optimizers that unscale themselves (fused Adam) under GradScaler
            self.readback.add(FoundInf(found_inf.reshape(1), rec))
        if grads or sparse:
            norms = [n.float() for n in torch._foreach_norm(grads, 2.0, dtype=torch.float32)] if grads else []
            norms += [torch.linalg.vector_norm(g.coalesce().values().float()) for _, g in sparse]
            dev = norms[0].device
            self.readback.add(GradNorms(torch.stack([n.to(dev) for n in norms]), rec,
                                        tuple(names + [n for n, _ in sparse])))
        if it.loss is not None:
            self.readback.add(LossValue(it.loss.float().sum().reshape(1), rec, micro=it.micro))
            it.loss = None
        if self.scaler is not None and self.scale_snapshot is not None:
            self.readback.add(ScaleValue(self.scale_snapshot, rec))
            self.scale_snapshot = None
        if self.lost_left > 0 and not self.explicit:
            self.lp_before = [(n, p, p.detach().clone()) for n, p in self.params.low
                              if p.grad is not None and not p.grad.is_sparse]
        self.read(current=it)
        self.handle_queue(can_raise=True)     # may replay the previous update from self.prior
        assert self.policy is not None
        self.policy.agree(rec.step)
        self.prior = take(self.model, self.optimizer, rec, it.inputs(), self.lp_before) if self.lp_before else None

    def close(self, *, skipped: bool, scale: torch.Tensor | None = None, scale_known: bool = False) -> None:
        it = self.it
        rec = it.record
        rec.skipped = skipped
        probed = self.probe.harvest() if self.probe.armed else None
        if probed is not None:
            self.readback.add(ProbeFlags(probed[0], rec, probed[1]))
        if skipped and not self.state.health.overflow_params and probed is None:
            self.probe.arm()        # names the overflowing parameters in the next (likely skipped too) backward
        if scale is not None:
            self.readback.add(ScaleValue(scale, rec))
        elif not scale_known and self.scale_snapshot is not None:
            self.readback.add(ScaleValue(self.scale_snapshot, rec))
        if it.loss is not None:
            self.readback.add(LossValue(it.loss.float().sum().reshape(1), rec, micro=it.micro))
            it.loss = None
        self.records.append(rec)
        self.n_steps += 1
        if len(self.records) > 2 * MAX_RECORDS:  # old steps' deferred reads are long resolved
            cut = len(self.records) - MAX_RECORDS
            self.n_skipped_trimmed += sum(1 for r in self.records[:cut] if r.skipped)
            del self.records[:cut]
        if self.coverage is None:
            if it.seen:
                self.cov_steps += 1
                self.cov_seen |= it.seen
            if self.step + 1 >= self.options.coverage_steps:
                self.end_coverage()
        self.last_it = it
        self.recent.append(it)
        self.step += 1
        self.it = Iteration(StepRecord(self.step))
        if skipped and collapse_due(self.state):
            self.read()                 # the run's scales are needed for the message
        self._detect(StepClosed(rec), it, pre_step=False)
        if self.readback.full:
            self.read()

    def end_coverage(self) -> None:
        ps = self.params
        never: tuple[str, ...] = ()
        if self.cov_steps > 0:
            never = tuple(n for n, p in ps.trainable if id(p) not in self.cov_seen)
        zero = tuple(n for n, all_zero in self.state.zero_grads.items() if all_zero and n not in never)
        self.coverage = Coverage(self.cov_steps, never, zero, ps.not_in_optimizer)
        self.state.coverage_open = False
        for h in self.coverage_handles:
            h.remove()
        self.coverage_handles = []
        self.module_handles = self.module_handles[:1]
        if never:
            groups = group_by_owner(never, ps.owners)
            log.warning("%d trainable parameter(s) never received a gradient in the first %d step(s) "
                        "(modules: %s); see w.report()", len(never), self.cov_steps,
                        ", ".join(g or "<root>" for g in groups))

    # ------------------------------------------------------------------ the per-step read
    def read(self, current: Iteration | None = None) -> None:
        """Read every pending device value back with ONE host transfer and hand it to the detectors."""
        for value, numbers in self.readback.read():
            self._apply(value, numbers, current)

    def _apply(self, value: Pending, v: list[float], current: Iteration | None) -> None:
        if isinstance(value, LossValue):
            rec = value.record
            pre = current is not None and current.record is rec
            self.sinks.scalar("loss", v[0], rec.step)
            self._detect(LossSeen(rec, v[0], not pre, value.micro), self._iteration_of(rec, current), pre_step=pre)
        elif isinstance(value, ScaleValue):
            self.sinks.scalar("loss_scale", v[0], value.record.step)
            self._detect(ScaleSeen(value.record, v[0]), None, pre_step=False)
        elif isinstance(value, FoundInf):
            value.record.skipped = v[0] > 0
        elif isinstance(value, ProbeFlags):
            self._detect(ProbeSeen(value.record, value.names, tuple(v)), None, pre_step=False)
        elif isinstance(value, LostCounts):
            self._detect(LostSeen(value.names, tuple(v)), None, pre_step=False)
        elif isinstance(value, GradNorms):
            rec = value.record
            pre = current is not None and current.record is rec
            self._detect(GradsSeen(rec, value.names, tuple(v)), self._iteration_of(rec, current), pre_step=pre)
            if rec.grad_norm is not None and not rec.skipped:
                self.sinks.scalar("grad_norm", rec.grad_norm, rec.step)

    def _detect(self, event: Any, it: Iteration | None, *, pre_step: bool) -> None:
        for d in run_detectors(event, self.state):
            src = it if it is not None else self._iteration_of(d.record, None)
            self.queue.append(Anomaly(d, pre_step, pre_step or d.record.skipped, src.inputs()))

    def _iteration_of(self, rec: StepRecord, current: Iteration | None) -> Iteration:
        for it in (current, self.it, *reversed(self.recent)):
            if it is not None and it.record is rec:
                return it
        return Iteration(rec)

    def handle_queue(self, *, can_raise: bool) -> None:
        queue, self.queue = self.queue, []
        assert self.policy is not None
        for i, a in enumerate(queue):
            try:
                self.policy.handle(a, can_raise=can_raise)
            except AnomalyError:
                self.queue = queue[i + 1:] + self.queue     # the rest is handled at the next event
                raise


__all__ = ["Iteration", "StepTracker"]
