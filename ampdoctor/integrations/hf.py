"""``transformers.Trainer`` integration: a callback that watches the run.

>>> from ampdoctor.integrations.hf import AmpDoctorCallback                           # doctest: +SKIP
>>> cb = AmpDoctorCallback(reproducer_dir="repro")                                    # doctest: +SKIP
>>> Trainer(model, args, train_dataset=ds, callbacks=[cb]).train()                    # doctest: +SKIP
>>> cb.report.codes()                                                                 # doctest: +SKIP

``on_train_begin`` attaches :func:`ampdoctor.watch` to the model and optimizer the Trainer passes (the
GradScaler is taken from accelerate's optimizer wrapper when mixed precision uses one); ``on_train_end``
detaches it, stores the :class:`~ampdoctor.Report` in ``cb.report`` and logs it. If training raises, call
``cb.close()`` (Trainer has no exception event); a later ``on_train_begin`` closes a left-over watch too.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ampdoctor.integrations.hf needs transformers: pip install ampdoctor[hf]") from e

from ampdoctor.findings import Report
from ampdoctor.integrations._callback import callback_watch_options
from ampdoctor.watch import Watch, watch

log = logging.getLogger(__name__)


class AmpDoctorCallback(TrainerCallback):
    """Watch a ``Trainer`` run; ``watch_options`` go to :func:`ampdoctor.watch` (``on_anomaly``, ...).

    The verdict goes where Trainer users look: each ``on_log`` adds ``ampdoctor/*`` values (loss scale, skipped
    steps, gradient norm, anomaly count) to the entry just written to ``state.log_history``, and the end of training
    appends one entry with the verdict and the finding codes. ``on_anomaly="raise"`` drops the anomalous update
    (the weights stay as they were), sets ``control.should_training_stop`` and keeps the error in ``self.error``,
    so the Trainer ends normally and every hook is removed.
    """

    def __init__(self, **watch_options: Any) -> None:
        self.watch_options, self.stop_on_anomaly = callback_watch_options(watch_options)
        self.watch: Watch | None = None
        self.report: Report | None = None
        self.error: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.close()
        if model is None:
            log.warning("ampdoctor: Trainer passed no model to on_train_begin; nothing is watched")
            return
        scaler = getattr(optimizer, "scaler", None)      # accelerate's AcceleratedOptimizer holds the GradScaler
        # a compute_loss of the user's own (the model returns no loss): the replay runs it too
        self.watch = watch(model, optimizer, scaler, **{"loss_code": True, **self.watch_options})
        self.watch.__enter__()
        if self.watch.options.loss_code:          # the model's own loss is checked: Trainer gives the watch none
            self.watch.record_loss_code(losses=True)
        for flag in ("fp16", "bf16"):       # fp16=True on CPU runs in fp32: the report says so (precision_note)
            if getattr(args, flag, False) is True:
                self.watch.expect_precision(flag, f"Trainer({flag}=True)")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        w = self.watch
        if w is None:
            return
        w.step()            # no loss here; notices a GradScaler-skipped step without waiting for the forward
        if self.stop_on_anomaly and w.counters().get("anomalies"):
            anomalies = w.report().summary.get("anomalies", [])
            if anomalies:
                first = anomalies[0]
                self.error = f"ampdoctor: {first['kind']} at step {first['step']}: {first['message']}"
                log.error("%s; stopping training (on_anomaly='raise')", self.error)
                control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        w = self.watch
        if w is None or not state.log_history:
            return
        entry = state.log_history[-1]
        for key, value in w.counters().items():
            if key != "steps":
                entry[f"ampdoctor/{key}"] = value

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report = self.close()
        if report is not None:
            entry = {"ampdoctor/verdict": "ok" if report.ok else "error",
                     "ampdoctor/findings": [f"{f.severity}:{f.code}@{f.module or '<root>'}" for f in report.findings],
                     "step": state.global_step}
            if "precision_note" in report.summary:
                entry["ampdoctor/precision_note"] = report.summary["precision_note"]
            state.log_history.append(entry)

    def close(self) -> Report | None:
        """Detach the watch (if attached), keep and log its report."""
        w, self.watch = self.watch, None
        if w is None:
            return self.report
        try:
            w.__exit__(None, None, None)
        finally:
            self.report = w.report()
            _log_report(self.report)
        return self.report

    def __del__(self) -> None:       # a Trainer that raised never calls on_train_end: never leave hooks behind
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _log_report(report: Report) -> None:
    if "precision_note" in report.summary:
        log.warning("ampdoctor: %s", report.summary["precision_note"])
    if not report.findings:
        log.info("ampdoctor: no findings over %s step(s)", report.summary.get("steps", 0))
        return
    level = logging.INFO if report.ok else logging.WARNING
    for f in report.findings:
        log.log(level, "ampdoctor: [%s] %s at %s: %s", f.severity, f.code, f.module or "<root>", f.title)
