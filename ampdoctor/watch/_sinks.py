"""Where a watch's live output goes: the log, TensorBoard, and framework loggers registered by integrations.

Every sink is isolated: a sink that raises is dropped with one warning and the others go on, so a broken writer
never changes or stops the user's training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ampdoctor.watch")

#: ``fn(tag, value, step)``: a framework logger (HF ``log_history``, Lightning ``self.log``) fed by the watch
ScalarSink = Callable[[str, float, int], None]


class Sinks:
    def __init__(self) -> None:
        self._tb: Any = None
        self._scalar_sinks: list[ScalarSink] = []

    def open_tensorboard(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # presence checked by WatchOptions.check_environment

        self._tb = SummaryWriter(log_dir=logdir)

    def add_scalar_sink(self, fn: ScalarSink) -> None:
        self._scalar_sinks.append(fn)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """``ampdoctor/<tag>`` at the training step ``step`` in every scalar sink."""
        if self._tb is not None:
            try:
                self._tb.add_scalar(f"ampdoctor/{tag}", value, step)
            except Exception as exc:  # noqa: BLE001 - a broken writer must not stop training
                self._drop_tensorboard(exc)
        for fn in list(self._scalar_sinks):
            try:
                fn(f"ampdoctor/{tag}", value, step)
            except Exception as exc:  # noqa: BLE001
                self._scalar_sinks.remove(fn)
                log.warning("a framework logger failed (%s: %s); it gets no more values",
                            type(exc).__name__, exc)

    def _drop_tensorboard(self, exc: BaseException) -> None:
        log.warning("the TensorBoard writer failed (%s: %s); TensorBoard output stops, the watch "
                    "goes on", type(exc).__name__, exc)
        self._tb = None

    @staticmethod
    def anomaly(text: str, *, first: bool) -> None:
        """One warning for the first anomaly of a kind; later ones at debug level."""
        if first:
            log.warning(text)
        else:
            log.debug(text)

    def close(self) -> None:
        tb, self._tb = self._tb, None
        self._scalar_sinks = []
        if tb is not None:
            try:
                tb.close()
            except Exception:  # noqa: BLE001
                log.debug("closing the TensorBoard writer failed", exc_info=True)


__all__ = ["ScalarSink", "Sinks", "log"]
