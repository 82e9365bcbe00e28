"""Lightning, a module with only ``training_step`` + ``self.log``, fp16 mixed precision with a GradScaler (what
``precision="16-mixed"`` is on a GPU: the plugin is given explicitly, as CPU Lightning would switch to bf16),
``gradient_clip_val`` and ``accumulate_grad_batches=2``; batch 20 (the FIRST micro-batch of optimizer step 10) has
inputs of ~2.5e5 > fp16's 65504, so its loss is NaN.

Before: its loss was counted in step 9 (no root forward marks a Lightning step as begun), "not replayed: seen after
the optimizer had written the update", and a replay would have run only the step's last (healthy) micro-batch.
Now: step 10, and the replay runs ``training_step`` on both micro-batches, naming ``net.0``'s input cast
(``aten._to_copy``), forward. The healthy twin trains bitwise as unwatched and is clean.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from ampdoctor.integrations.lightning import AmpDoctorCallback  # noqa: E402

BAD_BATCH = 20


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(big: float, watched: bool) -> tuple[Net, AmpDoctorCallback | None]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 16, generator=g), torch.randn(96, 1, generator=g)
    x[4 * BAD_BATCH:4 * BAD_BATCH + 4] *= big
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, cb = Net(), AmpDoctorCallback() if watched else None
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, gradient_clip_val=1.0, accumulate_grad_batches=2,
                        callbacks=[cb] if cb else [], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    trainer.fit(model, loader)
    return model, cb


def test_a_late_micro_batch_overflow_is_located_at_its_step() -> None:
    model, cb = fit(1e5, True)
    assert cb is not None and cb.report is not None
    assert model.losses[BAD_BATCH] != model.losses[BAD_BATCH]       # the truth: that micro-batch's loss is NaN
    r = cb.report
    assert [a["step"] for a in r.summary["anomalies"]] == [BAD_BATCH // 2]
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase, first.step) == (
        "overflow", "net.0", "aten._to_copy.default", "forward", BAD_BATCH // 2), \
        [(f.code, f.module, f.op, f.phase, f.step) for f in r.findings]


def test_healthy_twin_is_clean_and_bitwise_unchanged() -> None:
    plain, _ = fit(1.0, False)
    watched, cb = fit(1.0, True)
    assert plain.losses == watched.losses and len(plain.losses) == 24
    assert cb is not None and cb.report is not None and cb.report.ok, cb.report.codes()
