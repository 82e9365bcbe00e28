"""A Trainer set-up our other tests do not cover: a ``compute_loss`` of the user's own (a hand-rolled softmax on the
logits, so the model returns no loss), ``gradient_accumulation_steps=4``, ``max_grad_norm``, evaluation during
training. The model is ``.half()`` with a classifier whose weights make its logits ~30-100: fp16 ``exp`` overflows
in the loss code (``exp(12) > 65504``) and the normalisation turns inf/inf into NaN.

The callback records that loss code (``loss_code=True``), so the default replay runs it and names ``aten.exp``,
forward, with the line of this file; without it the replay ran the forward alone and could only say it did not
reproduce the NaN. The healthy twin (unscaled classifier) stays clean and trains bitwise as without the callback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from ampdoctor.integrations.hf import AmpDoctorCallback  # noqa: E402
from tests.integrations._hf_data import Pairs  # noqa: E402


class FocalTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        labels = inputs.pop("labels")
        out = model(**inputs)
        e = out.logits.exp()                                   # LOSS-EXP: a softmax by hand, in the logits' dtype
        p = e / e.sum(-1, keepdim=True)
        loss = -(((1 - p) ** 2) * torch.log(p.float() + 1e-6)).gather(1, labels[:, None]).mean()
        return (loss, out) if return_outputs else loss


def bert(scale: float) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.mul_(scale)
    return model.half()


def fit(tmp_path, model: nn.Module, callbacks: list) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=4, max_grad_norm=1.0, eval_strategy="steps", eval_steps=2, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, learning_rate=1e-3)
    FocalTrainer(model=model, args=args, train_dataset=Pairs(32), eval_dataset=Pairs(4), callbacks=callbacks).train()


def _line(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line" not in text)


def test_custom_compute_loss_is_replayed_and_its_op_named(tmp_path) -> None:
    cb = AmpDoctorCallback()
    fit(tmp_path, bert(3000.0), [cb])
    r = cb.report
    first = r.findings[0]
    assert (first.code, first.op, first.phase, first.module) == ("overflow", "aten.exp.default", "forward", ""), \
        [(f.code, f.module, f.op, f.phase) for f in r.findings]
    assert first.evidence["source"] == f"test_loops_hf.py:{_line('LOSS-EXP')}"
    assert r.summary["replay"]["summary"]["forward_only"] is False           # loss and backward ran too
    assert "nan-from-inf" in r.codes() and not r.ok


def test_healthy_twin_is_clean_and_bitwise_unchanged(tmp_path) -> None:
    plain, watched = bert(1.0), bert(1.0)
    fit(tmp_path / "a", plain, [])
    cb = AmpDoctorCallback()
    fit(tmp_path / "b", watched, [cb])
    r = cb.report
    assert r.ok and "replay" not in r.summary and r.summary["steps"] == 3
    assert not [f for f in r.findings if f.code in ("overflow", "nan-from-inf")]
    for (n, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n
    assert not any(m._forward_hooks for m in watched.modules())
