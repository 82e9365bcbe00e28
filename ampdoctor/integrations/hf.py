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

from ampdoctor.findings._types import Report
from ampdoctor.watch import Watch, watch

log = logging.getLogger(__name__)


class AmpDoctorCallback(TrainerCallback):
    """Watch a ``Trainer`` run; ``watch_options`` go to :func:`ampdoctor.watch` (``on_anomaly``, ...)."""

    def __init__(self, **watch_options: Any) -> None:
        self.watch_options = watch_options
        self.watch: Watch | None = None
        self.report: Report | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.close()
        if model is None:
            log.warning("ampdoctor: Trainer passed no model to on_train_begin; nothing is watched")
            return
        scaler = getattr(optimizer, "scaler", None)      # accelerate's AcceleratedOptimizer holds the GradScaler
        self.watch = watch(model, optimizer, scaler, **self.watch_options)
        self.watch.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is not None:
            self.watch.step()       # no loss here; notices a GradScaler-skipped step without waiting for the forward

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

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


def _log_report(report: Report) -> None:
    if not report.findings:
        log.info("ampdoctor: no findings over %s step(s)", report.summary.get("steps", 0))
        return
    level = logging.INFO if report.ok else logging.WARNING
    for f in report.findings:
        log.log(level, "ampdoctor: [%s] %s at %s: %s", f.severity, f.code, f.module or "<root>", f.title)
