"""What the framework callbacks (HF Trainer, Lightning) share: their watch options, checked when the callback is
built, with ``on_anomaly="raise"`` turned into the framework's own way of stopping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ampdoctor.findings import Report
from ampdoctor.watch import check_watch_options


def callback_watch_options(watch_options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(options for watch(), whether the callback stops training on an anomaly)``. A typo raises here, not inside
    the training run. ``on_anomaly="raise"`` becomes ``"skip"`` (the anomalous update is dropped) plus the stop
    flag: a callback asks the framework to stop instead of raising through its training loop."""
    check_watch_options(**watch_options)
    stop = watch_options.get("on_anomaly") == "raise"
    return ({**watch_options, "on_anomaly": "skip"} if stop else watch_options), stop


def owner_module(root: nn.Module, optimizer: Any) -> nn.Module:
    """The smallest submodule of ``root`` holding every parameter ``optimizer`` updates (``root`` itself when none
    does): with several optimizers (a GAN's generator and discriminator) each is watched over its own model, so the
    other's parameters are not "missing from the optimizer"."""
    params = {id(p) for g in getattr(optimizer, "param_groups", []) for p in g["params"]}
    best, size = root, sum(1 for _ in root.parameters())
    for m in root.modules():
        own = [id(p) for p in m.parameters()]
        if params and params <= set(own) and len(own) < size:
            best, size = m, len(own)
    return best


def merged_report(reports: Sequence[Report], source: str) -> Report:
    """One report for several watches (one per optimizer): their findings in order, each watch's summary kept."""
    if len(reports) == 1:
        return reports[0]
    findings = tuple(f for r in reports for f in r.findings)
    summary = {"source": source, "watches": len(reports), "per_watch": [r.summary for r in reports],
               "steps": max((r.summary.get("steps", 0) for r in reports), default=0)}
    return Report(findings, reports[0].precision, summary, reports[0].layers, source)
