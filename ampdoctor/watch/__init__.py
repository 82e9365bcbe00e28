"""``ampdoctor.watch``: a cheap always-on guard for real training loops, its reproducers and their replay.

>>> with ampdoctor.watch(model, optimizer, scaler, reproducer_dir="repro") as w:   # doctest: +SKIP
...     for batch in loader:
...         train_step(batch)
...         w.step(loss)
>>> w.report().codes()                                                             # doctest: +SKIP
['loss-scale-collapse']
>>> ampdoctor.watch.replay("repro/step000003-loss-scale-collapse.pt", model_factory=build_model)  # doctest: +SKIP

This module is callable: ``ampdoctor.watch(model, ...)`` is :func:`watch`, so ``ampdoctor.watch`` is both the
context manager and the namespace of ``replay``/``load_reproducer``. The guard learns about each step through
optimizer step hooks, GradScaler's own state and backward hooks on the first steps; it reads the device back once
per optimizer step. Reproducers are plain tensor dicts (``torch.load(weights_only=True)``); :func:`replay` re-runs
one under :func:`ampdoctor.diagnose`.
"""

import sys
import types
from typing import Any

from ampdoctor.watch._guard import KINDS, ON_ANOMALY, AnomalyError, Watch, WatchOptions, watch
from ampdoctor.watch._reproducer import ReproducerError, is_replaying, load_reproducer, replay


class _CallableModule(types.ModuleType):
    """``ampdoctor.watch(...)`` calls :func:`watch`; attribute access is the module's."""

    def __call__(self, *args: Any, **kwargs: Any) -> Watch:
        return watch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "KINDS",
    "ON_ANOMALY",
    "AnomalyError",
    "ReproducerError",
    "Watch",
    "WatchOptions",
    "is_replaying",
    "load_reproducer",
    "replay",
    "watch",
]
