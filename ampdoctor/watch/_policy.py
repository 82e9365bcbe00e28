"""What a watch does with an anomaly: write a reproducer, replay it in process, then warn, raise or skip.

Order matters for fault isolation: the reproducer and the replay are extras; when either fails (a full disk,
a model that cannot be copied) it is logged once and the user's decision — ``raise`` or ``skip`` — still
happens. Memory is bounded: a window of the latest anomalies plus per-kind counters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.findings import Finding, Report
from ampdoctor.watch import _reproducer
from ampdoctor.watch._detectors import WINDOW, Detection
from ampdoctor.watch._method_step import CallsReplay
from ampdoctor.watch._options import AnomalyError, WatchOptions
from ampdoctor.watch._payload import StepInputs
from ampdoctor.watch._prestate import PreUpdate
from ampdoctor.watch._ranks import RankAgreement
from ampdoctor.watch._rules import NONFINITE_CODES, not_reproduced, unreproduced_on_rank
from ampdoctor.watch._sinks import Sinks

log = logging.getLogger("ampdoctor.watch")

#: kinds whose optimizer step ``on_anomaly="skip"`` drops
SKIPPABLE = ("nonfinite-loss", "nonfinite-grads", "grad-spike")
#: kinds a replay only locates (its own replay slot, not counted in MAX_REPLAYS): never raised or skipped
LOCATE_ONLY = ("zero-grads",)
#: in-process replays per run at most (the first anomaly's, and later ones while none located an error)
MAX_REPLAYS = 3


@dataclass(frozen=True)
class Anomaly:
    detection: Detection
    #: detected before the optimizer wrote the step's update (the model's state is the step's pre-step state)
    pre_step: bool
    #: the weights are untouched by this step (pre-step, or GradScaler skipped it): safe to replay
    clean_state: bool
    inputs: StepInputs
    #: the earlier update that wrote the non-finite state this anomaly's step started from (replayed instead)
    prior: PreUpdate | None = None


class AnomalyPolicy:
    """Applies ``on_anomaly`` (and the op-level replay of ``locate``) to each anomaly."""

    def __init__(self, options: WatchOptions, sinks: Sinks, *, payload: Callable[[Anomaly], dict[str, Any]],
                 copy_model: Callable[[], nn.Module], skip_step: Callable[[], None],
                 earlier: Callable[[Anomaly], Anomaly] = lambda a: a) -> None:
        self.options = options
        self.sinks = sinks
        self._payload = payload
        self._copy_model = copy_model
        self._skip_step = skip_step
        self._earlier = earlier
        #: the replay moved to the update that wrote the non-finite state (``Watch._earlier``): steps, parameters
        self.moved: dict[str, Any] | None = None
        self.kinds_seen: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=WINDOW)
        self.reproducers: list[str] = []
        self.replay_report: Report | None = None
        self.replay_error: str | None = None
        self.replay_note: str | None = None
        #: why the replay found no inf/NaN origin for the anomaly it replayed (``_rules.not_reproduced``)
        self.unreproduced: dict[str, Any] | None = None
        self.replay_step: int | None = None
        #: the replay of a ``zero-grads`` anomaly (compared with fp32: underflow at an op, or zero in fp32 too)
        self.zero_replay: Report | None = None
        self.zero_replay_step: int | None = None
        #: replays run so far (a later anomaly is replayed while none located an error, see ``_replay_open``)
        self.replays = 0
        self.skipped_by_guard = 0
        self.deferred: AnomalyError | None = None
        #: how the in-process replay runs the step (``train_step(model, batch, optimizer=, scaler=)`` of
        #: :func:`ampdoctor.diagnose`); None: the root module is called with the recorded inputs
        self.train_step: Callable[..., Any] | None = None
        #: the model method that is the step (``training_step``), recorded in reproducers; "" for the root's forward
        self.step_method = ""
        #: the loss code recorded in a step (``_loss_code.LossCodeTap.program``), replayed when the model
        #: returns no loss and no ``train_step`` is given
        self.loss_code: Callable[[int], Any] | None = None
        #: data-parallel ranks agree on raise/skip (:mod:`ampdoctor.watch._ranks`); None: decide locally
        self.ranks: RankAgreement | None = None
        #: the precision a framework was asked for, and by what (``Watch.expect_precision``)
        self.requested: tuple[str, str] | None = None
        #: 16-bit parameters under a mixed precision request, found before step 0 (``_setup.py``)
        self.setup: Finding | None = None
        #: an FSDP model: no payload (its state_dict and forward are collectives), so no reproducer and no replay
        self.sharded = False
        self._pending_raise: AnomalyError | None = None
        self._want_skip = False
        self._writer_broken = False

    @property
    def locates(self) -> bool:
        return self.options.on_anomaly == "replay" or self.options.locate

    def handle(self, a: Anomaly, *, can_raise: bool) -> None:
        o, d = self.options, a.detection
        first = d.kind not in self.kinds_seen
        self.kinds_seen.add(d.kind)
        self.counts[d.kind] += 1
        if d.kind in LOCATE_ONLY:
            path = self._locate_only(a) if first else None
            self.recent.append({"kind": d.kind, "step": d.record.step, "message": d.message, "reproducer": path})
            self.sinks.anomaly(d.message + (f" Reproducer: {path}" if path else ""), first=first)
            return
        path = self._extras(a, write=first) if first or self._replay_open else None
        if self.ranks is not None:
            self._tell_ranks(a)
        self.recent.append({"kind": d.kind, "step": d.record.step, "message": d.message, "reproducer": path})
        text = d.message + (f" Reproducer: {path}" if path else "")  # logged by "ampdoctor.watch": no prefix
        if o.on_anomaly == "raise":
            err = AnomalyError(f"ampdoctor.watch: {text}", kind=d.kind, step=d.record.step, reproducer=path)
            if self.ranks is not None:      # raised at the step's agreement, on every rank together
                self._pending_raise = self._pending_raise or err
                return
            if can_raise:
                raise err
            if self.deferred is None:
                self.deferred = err
            return
        if o.on_anomaly == "skip" and a.pre_step and d.kind in SKIPPABLE:
            if self.ranks is not None:      # skipped at the step's agreement, on every rank together
                self._want_skip = True
                text += " The optimizer step is skipped on every rank (gradients set to None)."
            else:
                self._skip_step()
                self.skipped_by_guard += 1
                text += " The optimizer step was skipped (gradients set to None)."
        self.sinks.anomaly(text, first=first)

    def _tell_ranks(self, a: Anomaly) -> None:
        """What this rank saw, for the step's exchange: its own non-finite loss (local to the rank) or, for
        gradients (DDP all-reduces them: maybe received), the origin its replay of that step located, if any."""
        assert self.ranks is not None
        d = a.detection
        step = d.record.step
        if d.kind == "nonfinite-loss":
            self.ranks.note_own(step, {"kind": d.kind})
        elif d.kind == "nonfinite-grads":
            self.ranks.note_grads(step)
        root = self.replay_report.root_cause if self.replay_report is not None else None
        # an error only: a warning (gradients that overflow only scaled, as GradScaler's calibration makes them) is
        # no origin -- a rank whose replay sees received inf/NaN that way must not claim the job's first value
        if (root is not None and self.replay_step == step and root.code in NONFINITE_CODES
                and root.severity == "error" and (root.module or root.op)):
            # a collapse is detected (and replayed) at its run's 3rd skip; the data overflowed from its first one
            first = d.first_step if d.first_step is not None else step
            self.ranks.note_own(first, {"kind": d.kind, "code": root.code, "module": root.module, "op": root.op,
                                        "phase": root.phase})

    def agree(self, step: int, *, skip: bool = True) -> None:
        """The step's agreement (every rank calls it at each optimizer pre-step check, and once after
        GradScaler-skipped steps with ``skip=False``: no update to drop there, a wanted skip waits for the next
        pre-step one): when any rank must skip, every rank drops the update; when any rank must raise, every rank
        raises (its own error, or one naming the other ranks). One tiny collective on the watch's own group."""
        ranks = self.ranks
        if ranks is None:
            return
        own, self._pending_raise = self._pending_raise, None
        want = self._want_skip and skip
        if skip:
            self._want_skip = False
        raised, skipped = ranks.agree(own is not None, want, blocking=None if skip else True)
        if skipped:
            self._skip_step()
            self.skipped_by_guard += 1
            if not want:
                log.warning("step %d: %d other rank(s) saw an anomaly; this rank skips the update "
                            "too, so the replicas stay equal", step, skipped)
        if raised:
            raise own or AnomalyError(
                f"ampdoctor.watch: step {step}: {raised} other rank(s) of {ranks.world_size} saw an anomaly and "
                f"stop (on_anomaly='raise'); rank {ranks.rank} stops with them before the update",
                kind="other-rank", step=step)

    def take_pending(self) -> AnomalyError | None:
        """A raise that no agreement took yet (seen after the last optimizer step): raised at the watch's exit."""
        err, self._pending_raise = self._pending_raise, None
        return err

    @property
    def _replay_open(self) -> bool:
        """A later anomaly may still be replayed: no replay ran yet, or the ones that ran (at most
        :data:`MAX_REPLAYS`) reproduced the inf/NaN but judged them no error -- e.g. GradScaler calibrating its
        initial scale, whose gradients overflow only scaled (a warning), before the run's real failure starts at a
        later step. A replay that did not reproduce the anomaly keeps its place (its report says why)."""
        if not self.locates or self.replays >= MAX_REPLAYS or self.replay_error is not None:   # fails again
            return False
        r = self.replay_report
        if r is None:
            return True
        seen = any(f.code in NONFINITE_CODES for f in r.findings)     # it reproduced the inf/NaN and judged them
        return seen and not any(f.severity == "error" for f in r.findings)   # benign: the real failure is later

    def _extras(self, a: Anomaly, *, write: bool = True) -> str | None:
        """Reproducer (``write``: the first anomaly of a kind) and replay (while :attr:`_replay_open`); their
        failures never stop the decision."""
        o = self.options
        if self.sharded:
            if self.replay_note is None:
                self.replay_note = (f"step {a.detection.record.step} was not replayed and no reproducer was written: "
                                    "the model is FSDP-sharded, and copying or running it on one rank alone would "
                                    "issue collectives the other ranks never join; the report keeps the "
                                    "module-level hint and the ranks' agreement (origin_rank)")
            return None
        replay = self._replay_open
        write = write and o.reproducer_dir is not None
        if not write and not replay:
            return None
        try:
            if a.clean_state:
                a = self._earlier(a)
            payload = self._payload(a)
        except Exception as exc:  # noqa: BLE001 - the decision (raise/skip) must still happen
            log.warning("recording step %d failed (%s: %s); no reproducer or replay for it",
                        a.detection.record.step, type(exc).__name__, exc)
            return None
        path = self._write(payload, a) if write else None
        if replay:
            if a.clean_state:
                self._replay(payload, path)
            elif self.replay_note is None:
                self.replay_note = (f"step {a.detection.record.step} was not replayed: its {a.detection.kind} was "
                                    "seen after the optimizer had written the update, so the recorded state is "
                                    "already the corrupted one; call w.step(loss) before optimizer.step()")
        return path

    def _locate_only(self, a: Anomaly) -> str | None:
        """Reproducer and replay of a :data:`LOCATE_ONLY` anomaly (a pre-step state only); the replay goes to its own
        slot, so a later inf/NaN anomaly is still replayed."""
        o = self.options
        if self.sharded or not a.pre_step or not (self.locates or o.reproducer_dir is not None):
            return None
        try:
            payload = self._payload(a)
        except Exception as exc:  # noqa: BLE001 - an extra: the watch goes on
            log.warning("recording step %d failed (%s: %s); no reproducer or replay for it",
                        a.detection.record.step, type(exc).__name__, exc)
            return None
        path = self._write(payload, a) if o.reproducer_dir is not None else None
        if self.locates and self.replay_error is None:
            report = self._run_replay(payload, path)
            if report is not None:
                self.zero_replay, self.zero_replay_step = report, int(payload["step"])
                # the report takes only its underflow findings: logging its root cause (an overflow of the
                # replay's scaled backward, say) would warn of what the report never says
                flushed = [f for f in report.findings if f.code == "underflow"]
                if flushed:
                    self._log_root(dataclasses.replace(report, findings=tuple(flushed)), int(payload["step"]))
                else:
                    log.info("replay of step %s: no underflow against fp32 (the zero gradients are not a precision "
                             "effect)", payload["step"])
        return path

    def _write(self, payload: dict[str, Any], a: Anomaly) -> str | None:
        if self._writer_broken:
            return None
        d = a.detection
        try:
            path = _reproducer.save_reproducer(payload, str(self.options.reproducer_dir),
                                               f"step{d.record.step:06d}-{d.kind}.pt")
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: warn once, keep deciding
            self._writer_broken = True
            log.warning("writing the reproducer failed (%s: %s); no more reproducers are written, "
                        "the watch goes on", type(exc).__name__, exc)
            return None
        self.reproducers.append(path)
        return path

    def _replay_step(self, payload: dict[str, Any]) -> tuple[Any, Any]:
        """``(loss_fn, train_step)`` of the replay: the user's ``train_step``; else the loop's recorded loss code,
        on the last call's output or, when it reads several forwards, on the step's last calls (CallsReplay)."""
        if self.loss_code is None or self.train_step is not None or self.step_method:
            return None, self.train_step
        program = self.loss_code(int(payload["step"]))
        if program is None:
            return None, None
        calls = len(payload.get("calls") or ())
        if program.forwards == 1 and calls <= 1:
            return program.loss_fn, None
        # several forwards in the step (gradient accumulation's micro-batches): every one runs, under the trace,
        # from the RNG state before the first, and the loss code on the last; a micro-batch that overflowed
        # before the last is then located too, not only the last one's (healthy) forward
        enough = calls >= program.forwards
        return None, CallsReplay(program) if enough else None

    def _run_replay(self, payload: dict[str, Any], path: str | None) -> Report | None:
        try:
            loss_fn, train_step = self._replay_step(payload)
            with torch.enable_grad():   # may run inside optimizer.step(), which disables grad
                return _reproducer.replay_payload(payload, self._copy_model, origin=path or "",
                                                  train_step=train_step, loss_fn=loss_fn)
        except Exception as exc:  # noqa: BLE001 - a failed replay must not stop training
            self.replay_error = f"{type(exc).__name__}: {exc}"
            log.warning("replaying step %d failed (%s); the watch goes on", payload["step"],
                        self.replay_error)
            return None

    @staticmethod
    def _log_root(report: Report, step: int) -> None:
        root = report.root_cause
        if root is not None:
            log.warning("replay of step %d: %s in %s (%s, %s)", step, root.code,
                        root.module or "<root>", root.op or "op unknown", root.phase)

    def _replay(self, payload: dict[str, Any], path: str | None) -> None:
        self.replays += 1
        report = self._run_replay(payload, path)
        if report is None:
            return
        if self.replay_report is not None:
            log.warning("the replay of step %s located no error; replaying step %d instead",
                        self.replay_step, payload["step"])
        self.replay_report = report
        self.replay_step = int(payload["step"])
        self.unreproduced = not_reproduced(report, str(payload["anomaly"]), self.replay_step,
                                           self.train_step is not None or bool(self.step_method))
        if self.unreproduced is not None:   # on a rank that only received the inf/NaN: says so (no collective)
            said = unreproduced_on_rank(self.unreproduced, self.ranks.summary() if self.ranks is not None else None)
            log.warning("%s", (said or self.unreproduced)["note"])
        self._log_root(report, int(payload["step"]))


__all__ = ["LOCATE_ONLY", "Anomaly", "AnomalyPolicy", "SKIPPABLE"]
