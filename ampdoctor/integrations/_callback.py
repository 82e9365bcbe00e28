"""What the framework callbacks (HF Trainer, Lightning) share: their watch options, checked when the callback is
built, with ``on_anomaly="raise"`` turned into the framework's own way of stopping."""

from __future__ import annotations

from typing import Any

from ampdoctor.watch import check_watch_options


def callback_watch_options(watch_options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(options for watch(), whether the callback stops training on an anomaly)``. A typo raises here, not inside
    the training run. ``on_anomaly="raise"`` becomes ``"skip"`` (the anomalous update is dropped) plus the stop
    flag: a callback asks the framework to stop instead of raising through its training loop."""
    check_watch_options(**watch_options)
    stop = watch_options.get("on_anomaly") == "raise"
    return ({**watch_options, "on_anomaly": "skip"} if stop else watch_options), stop
