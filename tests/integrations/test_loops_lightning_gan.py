"""Lightning manual optimization with two optimizers (a GAN: ``automatic_optimization = False``, ``self.optimizers()``,
``manual_backward``), ``precision="16-true"``. The callback watched only the first optimizer over the whole module,
so the discriminator's parameters were reported "missing from the optimizer" (a false ``unused-parameters``), and
its replay of ``training_step`` crashed (``self.optimizers()`` unpacked one optimizer). Now each optimizer gets a
watch over the submodule it updates. The discriminator's first Linear (weights x 1e5, below fp16's max) overflows
fp16 on the real batch: the report is an error, and the discriminator's replay, which runs every call of its step
(real, then fake) with the recorded loss code, names that Linear's addmm; the healthy twin is clean and trains
bitwise as unwatched.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from ampdoctor.integrations.lightning import AmpDoctorCallback  # noqa: E402


class GAN(L.LightningModule):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        with torch.no_grad():
            self.D[0].weight.mul_(scale)
        self.bce = nn.BCEWithLogitsLoss()

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        opt_g, opt_d = self.optimizers()
        real = batch[0].to(self.dtype)
        fake = self.G(torch.randn(len(real), 4, dtype=self.dtype))
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        loss_d = self.bce(self.D(real).float(), ones) + self.bce(self.D(fake.detach()).float(), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = self.bce(self.D(fake).float(), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return [torch.optim.Adam(m.parameters(), 1e-3, eps=1e-4) for m in (self.G, self.D)]   # eps 1e-8: 0 in fp16


def fit(scale: float, callbacks: list) -> GAN:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g)), batch_size=4)
    m = GAN(scale)
    L.Trainer(max_steps=6, precision="16-true", accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(m, data)
    return m


def test_each_optimizer_is_watched_over_its_own_submodule() -> None:
    cb = AmpDoctorCallback()
    fit(1e5, [cb])
    r = cb.report
    assert r.summary["watches"] == 2 and not r.ok
    assert "unused-parameters" not in r.codes(), [(f.code, f.module) for f in r.findings]
    assert "replay_error" not in r.summary["per_watch"][1]
    assert any(f.severity == "error" and f.code == "overflow" for f in r.findings)
    # the discriminator's replay runs every call of its step (real, fake) and the recorded loss code: the overflow
    # in the first call, on the real batch, is located (the last call alone stays finite)
    located = [f for f in r.findings if (f.code, f.module, f.op) == ("overflow", "0", "aten.addmm.default")]
    assert located and located[0].phase == "forward", [(f.code, f.module, f.op) for f in r.findings]
    assert r.summary["per_watch"][1]["replay"]["summary"]["replayed_calls"] == 2


def test_healthy_gan_is_clean_and_bitwise_unchanged() -> None:
    plain = fit(1.0, [])
    cb = AmpDoctorCallback()
    watched = fit(1.0, [cb])
    assert cb.report.ok and "unused-parameters" not in cb.report.codes(), cb.report.codes()
    for (n, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n
