"""transformers.Trainer on a ``.half()`` tiny BERT with the foreach AdamW (``optim="adamw_torch"``, eps=1e-8: 0 in
fp16): the callback's replay runs the update that wrote the NaN weights (see ``test_prior_update``). Trainer's
fused default computes in fp32 internally and does not fail this way."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ampdoctor.integrations.hf import AmpDoctorCallback  # noqa: E402
from tests.integrations.test_hf import Pairs, tiny_bert  # noqa: E402


def _fit(tmp_path, eps: float) -> AmpDoctorCallback:
    model = tiny_bert(plant_unused=False)
    with torch.no_grad():
        model.classifier.weight.mul_(1e-3)      # tiny gradients upstream: grad**2 underflows in fp16
    cb = AmpDoctorCallback()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True,
                                          adam_epsilon=eps, optim="adamw_torch", max_grad_norm=0.0,
                                          per_device_train_batch_size=4, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0, data_seed=0)
    transformers.Trainer(model=model.half(), args=args, train_dataset=Pairs(), callbacks=[cb]).train()
    return cb


def test_trainer_replays_the_update_that_wrote_the_nan_weights(tmp_path) -> None:
    r = _fit(tmp_path / "bad", 1e-8).report
    assert r.summary["replay_moved"]["to_step"] == 0
    assert r.summary["replay"]["summary"]["replay"]["step"] == 0
    keys = [(f.code, f.module, f.op, f.phase) for f in r.findings]
    assert ("low-precision-params", "bert.embeddings.word_embeddings", "aten.addcdiv_.default", "optimizer") in keys
    assert not any(f.code == "nonfinite-input" for f in r.findings)
    twin = _fit(tmp_path / "ok", 1e-4).report
    assert "replay" not in twin.summary and "replay_moved" not in twin.summary
