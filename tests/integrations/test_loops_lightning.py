"""Lightning as its docs teach it: ``accumulate_grad_batches=2``, ``gradient_clip_val``, ``configure_optimizers``
returning an optimizer with a per-step LR-scheduler dict, a ``validation_step`` run mid-training, ``self.log``, and
``precision="16-true"`` (fp16 weights: the one way to train in fp16 on CPU). A middle Linear's weights (x 3e5,
still below fp16's max) make its output overflow (``> 65504``); LayerNorm then turns the inf into NaN.

The default replay runs ``training_step`` on the accumulated step and names the Linear, ``aten.addmm``, forward;
validation batches are not steps. The healthy twin stays free of inf/NaN findings and trains bitwise as unwatched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

L = pytest.importorskip("lightning")

from ampdoctor.integrations.lightning import AmpDoctorCallback  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
        with torch.no_grad():
            self.net[2].weight.mul_(scale)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x.to(self.dtype)).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x.to(self.dtype)).float(), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-4)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2), "interval": "step"}}


def _data(n: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def fit(scale: float, callbacks: list) -> Module:
    L.seed_everything(0, verbose=False)
    m = Module(scale)
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0, precision="16-true",
                        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=4, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(m, _data(64), _data(8))
    return m


def test_accumulated_clipped_scheduled_fit_names_the_overflowing_linear() -> None:
    cb = AmpDoctorCallback()
    fit(3e5, [cb])
    r = cb.report
    first = r.findings[0]
    assert (first.code, first.module, first.phase) == ("overflow", "net.2", "forward"), r.findings
    assert first.op in ("aten.addmm.default", "aten.mm.default")
    assert r.summary["steps"] == 4 and r.precision == "fp16"
    assert r.summary["replay"]["summary"]["forward_only"] is False             # training_step, backward, update


def test_healthy_twin_is_clean_and_bitwise_unchanged() -> None:
    plain = fit(1.0, [])
    cb = AmpDoctorCallback()
    watched = fit(1.0, [cb])
    r = cb.report
    assert r.ok and "replay" not in r.summary and r.summary["steps"] == 4
    assert not [f for f in r.findings if f.code in ("overflow", "nan-from-inf")]
    for (n, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n
