"""A checkpoint saved in 16 bits, loaded with ``dtype="auto"`` and trained with mixed precision: told before step 0.

``Trainer(fp16=True)`` keeps fp32 master weights and casts per op; a model loaded from a bf16/fp16 checkpoint with
``dtype="auto"`` is 16-bit already, so the optimizer updates 16-bit weights in place, and with fp16 weights a
GradScaler raises ``Attempting to unscale FP16 gradients``. The finding (``low-precision-params``, step 0, its
``setup`` evidence) must exist when the first step begins, and an fp32-loaded twin must get none.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import ampdoctor  # noqa: E402
from ampdoctor.integrations.hf import AmpDoctorCallback  # noqa: E402
from tests.integrations._hf_data import Pairs  # noqa: E402


def checkpoint(tmp_path, dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, num_labels=2)
    path = str(tmp_path / "ckpt")
    transformers.BertForSequenceClassification(cfg).to(dtype).save_pretrained(path)
    return path


class AtFirstStep(transformers.TrainerCallback):
    """What the watch's report holds when step 0 begins (nothing has run yet)."""

    def __init__(self, cb: AmpDoctorCallback) -> None:
        self.cb, self.codes = cb, None

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self.codes is None:
            self.codes = [(f.code, f.severity, f.step) for f in self.cb.watch.report().findings]


def train(tmp_path, model: nn.Module, callbacks: list) -> list[float]:
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, report_to=[], fp16=True,
                                          per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                                          disable_tqdm=True, seed=0, data_seed=0, learning_rate=1e-3)
    tr = transformers.Trainer(model=model, args=args, train_dataset=Pairs(), callbacks=callbacks)
    tr.train()
    return [e["loss"] for e in tr.state.log_history if "loss" in e]


@pytest.mark.parametrize("saved", [torch.bfloat16, torch.float16])
def test_16bit_checkpoint_under_trainer_fp16_is_an_error_before_step_0(tmp_path, saved, caplog) -> None:
    path = checkpoint(tmp_path, saved)
    model = transformers.BertForSequenceClassification.from_pretrained(path, dtype="auto")
    assert next(model.parameters()).dtype == saved          # what dtype="auto" does: the checkpoint's dtype
    cb = AmpDoctorCallback()
    first = AtFirstStep(cb)
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        train(tmp_path, model, [cb, first])
    assert first.codes is not None and first.codes[0] == ("low-precision-params", "error", 0)
    f = cb.report.findings[0]
    assert (f.code, f.severity, f.module, f.phase, f.step) == ("low-precision-params", "error", "", "optimizer", 0)
    n = sum(1 for p in model.parameters() if p.requires_grad)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[saved]
    assert f.evidence["dtypes"] == {name: n} and f.evidence["requested"] == "fp16" and f.evidence["setup"]
    assert "Trainer(fp16=True)" in f.title and "dtype=torch.float32" in f.fixes[0].snippet
    if saved == torch.float16:
        assert "Attempting to unscale FP16 gradients" in f.explanation
    else:
        assert "bf16=True" in f.fixes[1].snippet and not cb.report.ok
        assert "the parameters are bf16" in cb.report.summary["precision_note"]
    assert any("low-precision-params" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_fp32_loaded_twin_gets_no_setup_finding_and_the_same_losses(tmp_path) -> None:
    path = checkpoint(tmp_path, torch.bfloat16)
    plain = transformers.BertForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    watched = transformers.BertForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    cb = AmpDoctorCallback()
    a = train(tmp_path / "a", plain, [])
    b = train(tmp_path / "b", watched, [cb])
    assert a == b and len(a) == 3
    assert "low-precision-params" not in cb.report.codes()


def test_a_gradscaler_over_fp16_weights_is_named_and_the_users_error_is_unchanged(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            with ampdoctor.watch(model, opt, scaler) as w:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8).half()).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
    f = w.report().findings[0]
    assert (f.code, f.severity, f.step, f.evidence["dtypes"]) == ("low-precision-params", "error", 0, {"float16": 4})
    assert any("Attempting to unscale FP16" in r.getMessage() for r in caplog.records)


def test_a_gradscaler_over_fp32_weights_gets_no_setup_finding() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler) as w:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            w.step(loss)
    assert w.report().ok and "low-precision-params" not in w.report().codes()


RUN_SCRIPT = """
import sys, tempfile, torch, transformers
from tests.integrations._hf_data import Pairs
torch.manual_seed(0)
cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, num_labels=2)
path = tempfile.mkdtemp()
transformers.BertForSequenceClassification(cfg).to(torch.bfloat16).save_pretrained(path)
dtype = "auto" if sys.argv[1] == "auto" else torch.float32
model = transformers.BertForSequenceClassification.from_pretrained(path, dtype=dtype)
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, report_to=[], fp16=True,
                                      per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
transformers.Trainer(model=model, args=args, train_dataset=Pairs()).train()
"""


@pytest.mark.parametrize("load", ["auto", "float32"])
def test_ampdoctor_run_reads_the_trainers_fp16_request(tmp_path, load) -> None:
    from ampdoctor.integrations.run import run_script

    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT)
    r = run_script(["python", str(script), load])
    assert r.summary["script"] == {"status": "completed"}
    setup = [f for f in r.findings if f.evidence.get("setup")]
    if load == "float32":
        assert setup == [] and "low-precision-params" not in r.codes()
        return
    assert setup and setup[0] is r.findings[0] and setup[0].severity == "error"
    assert setup[0].evidence["by"] == "TrainingArguments(fp16=True)" and setup[0].evidence["dtypes"] == {"bfloat16": 25}


@pytest.mark.parametrize("mixed", [True, False])
def test_true_16_bit_training_asked_for_is_not_a_setup_error(mixed) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, opt) as w:
        w.expect_precision("bf16", "Trainer(precision='bf16-mixed')" if mixed else "Trainer(precision='bf16-true')",
                           mixed=mixed)
        setup = [f for f in w.report().findings if f.evidence.get("setup")]
    if mixed:       # bf16 weights under bf16 mixed precision: pure bf16 training, a warning
        assert [(f.code, f.severity) for f in setup] == [("low-precision-params", "warning")]
    else:           # "bf16-true": 16-bit weights are what was asked for
        assert setup == []
