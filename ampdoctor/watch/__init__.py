"""``ampdoctor.watch``: a cheap always-on guard for real training loops, its reproducers and their replay.

>>> with ampdoctor.watch(model, optimizer, scaler, reproducer_dir="repro") as w:   # doctest: +SKIP
...     for batch in loader:
...         train_step(batch)
...         w.step(loss)
>>> w.report().codes()                                                             # doctest: +SKIP
['loss-scale-collapse']
>>> ampdoctor.replay("repro/step000003-loss-scale-collapse.pt", model_factory=build_model)  # doctest: +SKIP

``ampdoctor.watch`` is the function :func:`watch` (re-exported with ``replay`` and ``load_reproducer`` at the
package root); this module, ``ampdoctor.watch`` as an import path, holds the rest. The guard learns about each
step through optimizer step hooks, GradScaler's own state and backward hooks on the first steps; it reads the
device back once per optimizer step. Reproducers are plain tensor dicts (``torch.load(weights_only=True)``);
:func:`replay` re-runs one under :func:`ampdoctor.diagnose`.
"""

from ampdoctor.errors import AnomalyError, ReproducerError
from ampdoctor.watch._guard import KINDS, ON_ANOMALY, Watch, WatchOptions, check_watch_options, watch
from ampdoctor.watch._reproducer import is_replaying, load_reproducer, replay

__all__ = [
    "KINDS",
    "ON_ANOMALY",
    "AnomalyError",
    "ReproducerError",
    "Watch",
    "WatchOptions",
    "check_watch_options",
    "is_replaying",
    "load_reproducer",
    "replay",
    "watch",
]
