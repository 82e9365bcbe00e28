"""Lightning (``precision="16-true"``: the weights are fp16, the optimizer updates them in fp16) with
Adam(eps=1e-8): the callback's replay runs training_step of the update that wrote the NaN weights, not the step
that found them (see ``test_prior_update``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

L = pytest.importorskip("lightning.pytorch")

from ampdoctor.integrations.lightning import AmpDoctorCallback  # noqa: E402


class HalfAdam(L.LightningModule):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        self.eps = eps
        with torch.no_grad():
            self.up.weight.mul_(1e-3)      # tiny gradients: grad**2 underflows in fp16

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.down(torch.tanh(self.up(x))).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, eps=self.eps)


def _fit(eps: float) -> AmpDoctorCallback:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(20, 8, generator=g))
    cb = AmpDoctorCallback()
    L.Trainer(max_steps=4, accelerator="cpu", precision="16-true", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[cb]).fit(
        HalfAdam(eps), torch.utils.data.DataLoader(data, batch_size=5))
    return cb


def test_lightning_replays_the_update_that_wrote_the_nan_weights() -> None:
    r = _fit(1e-8).report
    assert r.summary["replay_moved"]["to_step"] == 0
    assert r.summary["replay"]["summary"]["replay"]["step"] == 0
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase) == (
        "low-precision-params", "up", "aten.addcdiv_.default", "optimizer")
    twin = _fit(1e-4).report
    assert "replay" not in twin.summary and "replay_moved" not in twin.summary
