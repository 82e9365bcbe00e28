"""accelerate integration: watch a loop driven by an ``Accelerator``.

>>> from ampdoctor.integrations.accelerate import watch_accelerator                     # doctest: +SKIP
>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)           # doctest: +SKIP
>>> with watch_accelerator(accelerator, model, optimizer) as w:                        # doctest: +SKIP
...     for batch in loader:
...         loss = model(**batch).loss
...         accelerator.backward(loss)
...         optimizer.step(); optimizer.zero_grad()
...         w.step(loss)
>>> w.report().codes()                                                                 # doctest: +SKIP

Uses ``accelerator.scaler`` (present for ``mixed_precision="fp16"``), the unwrapped model (no DDP prefix in
module names) and the torch optimizer inside accelerate's wrapper. Nothing of accelerate is imported.
"""

from __future__ import annotations

from typing import Any

from ampdoctor.watch import Watch, watch


def watch_accelerator(accelerator: Any, model: Any, optimizer: Any = None, **watch_options: Any) -> Watch:
    """A :class:`~ampdoctor.watch.Watch` over a prepared ``model``/``optimizer`` of ``accelerator``; when the
    steps do not run in the ``mixed_precision`` asked for, the report's ``precision_note`` says so and the watch's
    exit logs it (as the HF and Lightning callbacks do at the end of training)."""
    unwrap = getattr(accelerator, "unwrap_model", None)
    inner = unwrap(model) if callable(unwrap) else model
    # the loop's own loss code (loss = loss_fn(model(x), y)) is recorded, so the replay runs it too
    w = watch(inner, optimizer, getattr(accelerator, "scaler", None), **{"loss_code": True, **watch_options})
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp in ("fp16", "bf16"):      # mixed_precision="fp16" on CPU runs in fp32: the report says so
        w.expect_precision(mp, f"Accelerator(mixed_precision={mp!r})", log_note=True)
    return w
