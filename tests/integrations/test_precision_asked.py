"""Where a framework silently runs another precision than the one asked for, the watch's report says so.

On CPU: HF ``Trainer(fp16=True)`` and accelerate ``mixed_precision="fp16"`` run the steps in fp32 (no autocast, no
GradScaler); Lightning ``precision="16-mixed"`` runs bf16 autocast instead. A report that said nothing would read as
"fp16 is fine". Each case is a real framework run on a tiny model; its twin asking for nothing has no note.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
L = pytest.importorskip("lightning")

from ampdoctor.integrations.accelerate import watch_accelerator  # noqa: E402
from ampdoctor.integrations.hf import AmpDoctorCallback as HFCallback  # noqa: E402
from ampdoctor.integrations.lightning import AmpDoctorCallback as LCallback  # noqa: E402
from tests.integrations._hf_data import Pairs  # noqa: E402
from tests.integrations.test_hf import tiny_bert  # noqa: E402


def _hf(tmp_path, **flags) -> tuple[object, list]:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True,
                                          per_device_train_batch_size=4, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0, data_seed=0, **flags)
    cb = HFCallback()
    trainer = transformers.Trainer(model=tiny_bert(False), args=args, train_dataset=Pairs(), callbacks=[cb])
    trainer.train()
    return cb.report, trainer.state.log_history


@pytest.mark.parametrize("flags, noted", [({"fp16": True}, True), ({}, False)])
def test_hf_trainer_fp16_on_cpu_runs_fp32_and_the_report_says_so(tmp_path, flags, noted) -> None:
    try:
        r, history = _hf(tmp_path, **flags)
    except (ValueError, RuntimeError) as e:      # a transformers that refuses fp16 on CPU says so itself
        pytest.skip(f"this transformers refuses fp16=True on CPU: {e}")
    assert ("precision_note" in r.summary) is noted
    if noted:
        assert r.precision is None and r.summary["precision_requested"] == "fp16"
        assert "Trainer(fp16=True) asked for fp16, but the steps ran in fp32" in r.summary["precision_note"]
        assert history[-1]["ampdoctor/precision_note"] == r.summary["precision_note"]


@pytest.mark.parametrize("mixed, noted", [("fp16", True), ("no", False)])
def test_accelerate_fp16_on_cpu_runs_fp32_and_the_report_says_so(mixed, noted, caplog) -> None:
    from accelerate.state import AcceleratorState

    caplog.set_level(logging.WARNING, logger="ampdoctor")
    AcceleratorState._reset_state(True)        # a Trainer run before fixed the process-wide state: start afresh
    acc = accelerate.Accelerator(cpu=True, mixed_precision=mixed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    with watch_accelerator(acc, model, opt) as w:
        for _ in range(2):
            with acc.autocast():
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            w.step(loss)
    r = w.report()
    assert ("precision_note" in r.summary) is noted
    if noted:
        assert r.precision is None
        assert "Accelerator(mixed_precision='fp16') asked for fp16, but the steps ran in fp32" in r.summary[
            "precision_note"]
    # logged once when the watch exits, as the HF and Lightning callbacks log it at the end of training
    logged = [rec.getMessage() for rec in caplog.records if "asked for" in rec.getMessage()]
    assert logged == ([r.summary["precision_note"]] if noted else [])  # logger "ampdoctor.watch" names the source


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_lightning_16_mixed_on_cpu_is_reported_as_the_bf16_it_runs() -> None:
    """Lightning replaces "16-mixed" by "bf16-mixed" on CPU itself (and warns): the report's precision is what ran,
    bf16 autocast, never fp16; and no note, since the steps do run the Trainer's (replaced) precision."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
    cb = LCallback()
    with pytest.warns(UserWarning, match="fp16 is not supported on CPU"):
        trainer = L.Trainer(max_steps=2, accelerator="cpu", precision="16-mixed", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[cb])
    trainer.fit(_Module(), data)
    r = cb.report
    assert r.precision == "bf16-amp" and r.summary["precision_settings"]["autocast_dtype"] == "bfloat16"
    assert "precision_note" not in r.summary
