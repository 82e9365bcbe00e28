"""Lightning integration: a callback that watches ``Trainer.fit``.

>>> from ampdoctor.integrations.lightning import AmpDoctorCallback            # doctest: +SKIP
>>> cb = AmpDoctorCallback(on_anomaly="raise")        # stops the fit (trainer.should_stop)  # doctest: +SKIP
>>> L.Trainer(max_steps=100, callbacks=[cb]).fit(module, loader)              # doctest: +SKIP
>>> cb.report.codes()                                                         # doctest: +SKIP

Watches the LightningModule with its optimizer and the precision plugin's GradScaler (``"16-mixed"``); with several
optimizers (manual optimization, a GAN) one watch each, over the submodule that optimizer updates (their findings
merged in ``.report``; the replay then runs that submodule's last call, not ``training_step``). Lightning runs forward
and backward inside ``optimizer.step(closure)``; the watch checks the gradients right after that closure, before the
update. The batch and the loss of each step are passed from ``on_train_batch_start``/``on_train_batch_end``. Works
with ``lightning`` and ``pytorch_lightning``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch

if "pytorch_lightning" in sys.modules and "lightning" not in sys.modules:
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
else:
    try:
        from lightning.pytorch.callbacks import Callback  # type: ignore[assignment]
    except ImportError:
        try:
            from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "ampdoctor.integrations.lightning needs Lightning: pip install ampdoctor[lightning]") from e

from ampdoctor.findings import Report
from ampdoctor.integrations._callback import callback_watch_options, merged_report, owner_module
from ampdoctor.watch import Watch, training_step_replay, watch

log = logging.getLogger(__name__)


class AmpDoctorCallback(Callback):
    """Watch a Lightning fit; ``watch_options`` go to :func:`ampdoctor.watch`. The report lands in ``.report``.

    ``on_anomaly="raise"`` raises nothing through ``Trainer.fit``: the anomalous step's update is dropped (as
    ``"skip"`` does; the weights stay as they were), ``trainer.should_stop`` is set, the error is kept in
    ``self.error``, and fit ends normally with every hook removed.
    """

    def __init__(self, **watch_options: Any) -> None:
        self.watch_options, self.stop_on_anomaly = callback_watch_options(watch_options)
        self.watch: Watch | None = None
        #: one watch per optimizer (several: a GAN's generator and discriminator, each over its own submodule)
        self.watches: list[Watch] = []
        self.report: Report | None = None
        self.error: str | None = None
        self._batch_idx = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        plugin = getattr(trainer, "precision_plugin", None)
        scaler = getattr(plugin, "scaler", None)
        scaler = scaler if isinstance(scaler, torch.amp.GradScaler) else None
        if len(optimizers) > 1:     # training_step steps them all: each is watched over the submodule it updates
            log.info("ampdoctor: %d optimizers; one watch each, over the submodule it updates", len(optimizers))
            options = {"loss_code": True, **self.watch_options}   # the loss code in training_step, for replays
            self.watches = [watch(owner_module(pl_module, o), o, scaler, **options) for o in optimizers]
        else:
            self.watches = [watch(pl_module, optimizers[0] if optimizers else None, scaler, **self.watch_options)]
        for w in self.watches:
            w.__enter__()
        self.watch = self.watches[0]
        if len(self.watches) == 1:
            self.watch.replay_with(self._replay_step, method="training_step")   # also in its reproducers
        asked = _requested_precision(trainer)
        if asked is not None:           # steps that do not run the Trainer's precision: precision_note
            mixed = "mixed" in str(getattr(trainer, "precision", ""))   # "16-true": 16-bit weights are meant
            for w in self.watches:
                w.expect_precision(*asked, mixed=mixed)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self.watches) == 1:
            self.watches[0].observe_batch(batch)    # may replay the previous (GradScaler-skipped) step: old index
        self._batch_idx = batch_idx

    def _replay_step(self, model: Any, batch: Any, optimizer: Any = None, scaler: Any = None) -> Any:
        """The replay's step: the module's own ``training_step`` on the replay's copy (a LightningModule has
        often no ``forward`` for the batch), then backward and update as Lightning's automatic optimization does
        (:func:`ampdoctor.watch.training_step_replay`)."""
        return training_step_replay(model, batch, optimizer, scaler, self._batch_idx)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.watches:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        loss = loss if isinstance(loss, torch.Tensor) and len(self.watches) == 1 else None
        anomalies = 0.0
        for i, w in enumerate(self.watches):
            w.step(loss)
            counters = w.counters()
            anomalies += counters.get("anomalies", 0)
            prefix = "ampdoctor" if len(self.watches) == 1 else f"ampdoctor/optimizer{i}"
            for key, value in counters.items():     # into the Trainer's own loggers (self.log)
                if key != "steps":
                    pl_module.log(f"{prefix}/{key}", float(value), on_step=True, on_epoch=False, prog_bar=False)
        if self.stop_on_anomaly and self.error is None and anomalies:
            first = next((a for w in self.watches for a in w.report().summary.get("anomalies", [])), None)
            if first is not None:
                self.error = f"ampdoctor: {first['kind']} at step {first['step']}: {first['message']}"
                log.error("%s; stopping training (on_anomaly='raise')", self.error)
                trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        watches, self.watches, self.watch = self.watches, [], None
        if not watches:
            return
        try:
            for w in watches:
                w.__exit__(None, None, None)
        finally:
            self.report = merged_report([w.report() for w in watches], "lightning")
            if "precision_note" in self.report.summary:
                log.warning("ampdoctor: %s", self.report.summary["precision_note"])
            level = logging.INFO if self.report.ok else logging.WARNING
            for f in self.report.findings:
                log.log(level, "ampdoctor: [%s] %s at %s: %s", f.severity, f.code, f.module or "<root>", f.title)


def _requested_precision(trainer: Any) -> tuple[str, str] | None:
    """The Trainer's precision as ``("fp16"|"bf16", "Trainer(precision=...)")``; ``None`` for 32/64 bits. Lightning
    itself replaces ``"16-mixed"`` on CPU by ``"bf16-mixed"`` (with its own warning; the report's ``precision`` then
    reads ``bf16-amp``); a note comes when the steps do not run what the Trainer says (no autocast seen)."""
    asked = getattr(trainer, "precision", None)
    text = str(asked)
    if text.startswith("bf16"):
        return "bf16", f"Trainer(precision={asked!r})"
    if text.startswith("16"):
        return "fp16", f"Trainer(precision={asked!r})"
    return None
