"""A field case under a real ``transformers.Trainer`` with ``AmpDoctorCallback`` (tiny BERT, CPU, ``model.half()``):
a multi-label head whose confident logits (~10) make ``sigmoid`` exactly 1 in fp16, so the hand-written BCE's
``log(1 - p)`` is ``log(0)`` and the first step's loss is inf (the saturation -> pole mechanism of
kornia/kornia#918, on a second family). The callback's default replay must name the saturated sigmoid as the
root cause; the healthy twin (logits ~3) never replays and gets no saturation or inf/NaN finding.
"""

from __future__ import annotations

import torch
import transformers
from _field_cases import Tagger

from ampdoctor.integrations.hf import AmpDoctorCallback


class TaggerWithLoss(Tagger):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = super().forward(input_ids)
        p = torch.sigmoid(logits)
        assert labels is not None
        t = labels.to(p.dtype)
        loss = -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).float().mean()
        return {"loss": loss, "logits": logits}


class Tags(torch.utils.data.Dataset):
    def __init__(self, n: int = 16) -> None:
        self.ids = torch.randint(1, 64, (n, 6), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": torch.zeros(5)}  # the confident tags are all wrong


def _train(tmp_path, bias: float) -> AmpDoctorCallback:  # noqa: ANN001
    torch.manual_seed(0)
    model = TaggerWithLoss()
    with torch.no_grad():
        model.tags.weight.mul_(0.1)
        model.tags.bias.fill_(bias)
    cb = AmpDoctorCallback()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True,
                                          per_device_train_batch_size=4, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0, data_seed=0)
    transformers.Trainer(model=model.half(), args=args, train_dataset=Tags(), callbacks=[cb]).train()
    return cb


def test_trainer_replay_names_the_saturated_sigmoid(tmp_path) -> None:  # noqa: ANN001
    r = _train(tmp_path / "bad", 10.0).report
    assert r.precision == "fp16" and "replay" in r.summary
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("saturation", "", "aten.sigmoid.default", "forward",
                                                             "error"), r.findings
    assert f.evidence["pole_op"] == "aten.log.default" and f.evidence["input_absmax"] > f.evidence[
        "saturation_threshold"]
    twin = _train(tmp_path / "ok", 3.0).report
    assert "replay" not in twin.summary
    assert not [g for g in twin.findings if g.code in ("saturation", "overflow", "nan-from-inf")], twin.findings
