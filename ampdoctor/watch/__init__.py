"""``ampdoctor.watch``: a cheap always-on guard for real training loops, its reproducers and their replay.

>>> with ampdoctor.watch(model, optimizer, scaler, reproducer_dir="repro") as w:   # doctest: +SKIP
...     for batch in loader:
...         train_step(batch)
...         w.step(loss)
>>> w.report().codes()                                                             # doctest: +SKIP
['loss-scale-collapse']
>>> ampdoctor.replay("repro/step000003-loss-scale-collapse.pt", model_factory=build_model)  # doctest: +SKIP

A runnable one: the batch of step 2 holds a NaN; the guard's replay names the cause (``nonfinite-input``):

>>> import torch, ampdoctor
>>> from torch import nn
>>> gen = torch.Generator().manual_seed(0)
>>> model = nn.Linear(4, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with ampdoctor.watch(model, opt) as w:      # warnings go to logging
...     for step in range(3):
...         opt.zero_grad()
...         x = torch.randn(2, 4, generator=gen)
...         x[0, 0] = float("nan") if step == 2 else x[0, 0]
...         loss = model(x).pow(2).mean()
...         loss.backward()
...         opt.step()
...         w.step(loss)
>>> w.report().codes()
['nonfinite-input']

``ampdoctor.watch`` is the function :func:`watch` (re-exported with ``replay`` and ``load_reproducer`` at the
package root); this module, ``ampdoctor.watch`` as an import path, holds the rest. The guard learns about each
step through optimizer step hooks, GradScaler's own state and backward hooks on the first steps; it reads the
device back once per optimizer step. Reproducers are plain tensor dicts (``torch.load(weights_only=True)``);
:func:`replay` re-runs one under :func:`ampdoctor.diagnose`.
"""

from ampdoctor.errors import AnomalyError, ReproducerError
from ampdoctor.watch._guard import KINDS, ON_ANOMALY, Watch, WatchOptions, check_watch_options, watch
from ampdoctor.watch._method_step import training_step_replay
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
    "training_step_replay",
    "watch",
]
