"""transformers.Trainer with AmpDoctorCallback: real Trainer, tiny BERT, CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from ampdoctor.integrations.hf import AmpDoctorCallback  # noqa: E402
from tests.integrations._hf_data import Pairs  # noqa: E402


def tiny_bert(plant_unused: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg)
    if plant_unused:
        model.aux_head = nn.Linear(16, 2)       # an auxiliary head that was never wired into forward()
    return model


def fit(tmp_path, model: nn.Module, callbacks: list) -> None:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True,
                                          per_device_train_batch_size=4, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0, data_seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=Pairs(), callbacks=callbacks).train()


def test_trainer_report_names_the_unused_head(tmp_path) -> None:
    model = tiny_bert(plant_unused=True)
    cb = AmpDoctorCallback()
    fit(tmp_path, model, [cb])
    r = cb.report
    assert r is not None and r.codes() == ["unused-parameters"]
    f = r.findings[0]
    assert (f.module, f.phase) == ("aux_head", "backward")
    assert f.evidence["parameters"] == ["aux_head.weight", "aux_head.bias"]
    assert r.summary["steps"] == 3
    assert not model._forward_pre_hooks and cb.watch is None


def test_trainer_healthy_run_is_ok_and_unchanged(tmp_path) -> None:
    plain = tiny_bert(plant_unused=False)
    fit(tmp_path / "a", plain, [])
    watched = tiny_bert(plant_unused=False)
    cb = AmpDoctorCallback()
    fit(tmp_path / "b", watched, [cb])
    assert cb.report.ok and cb.report.findings == ()
    assert len(cb.report.summary["grad_norms"]) == 3
    for (n, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n


def test_trainer_reproducer_replays_from_the_recorded_config_without_code(tmp_path) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    model = tiny_bert(plant_unused=False)
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight.fill_(1e38)     # its output overflows fp32
    cb = AmpDoctorCallback(reproducer_dir=tmp_path / "repro")
    fit(tmp_path / "out", model, [cb])
    root = cb.report.findings[0]                                # located in process by the default replay
    assert (root.module, root.phase) == ("bert.encoder.layer.0.intermediate.dense", "forward"), cb.report.findings
    files = sorted((tmp_path / "repro").iterdir())
    assert files, "no reproducer written"
    res = CliRunner().invoke(main, ["replay", str(files[0]), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output                       # an error finding, no --factory needed
    import json

    first = json.loads((tmp_path / "r.json").read_text())["findings"][0]
    assert (first["module"], first["op"]) == (root.module, root.op)


def test_findings_reach_log_history_and_raise_stops_the_trainer(tmp_path) -> None:
    model = tiny_bert(plant_unused=False)
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight.fill_(1e38)
    cb = AmpDoctorCallback(on_anomaly="raise", locate=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True,
                                          per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                                          disable_tqdm=True, seed=0, data_seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Pairs(), callbacks=[cb])
    trainer.train()
    hist = trainer.state.log_history
    assert trainer.state.global_step == 1                       # stopped after the first (dropped) update
    assert cb.error is not None and "nonfinite" in cb.error
    assert any(e.get("ampdoctor/anomalies", 0) >= 1 for e in hist)
    assert hist[-1]["ampdoctor/verdict"] == "error" and hist[-1]["ampdoctor/findings"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # the NaN never landed
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_trainer_fp16_weights_default_replay_names_module_and_op(tmp_path) -> None:
    """model.half() under the Trainer on CPU: the default policy replays the Trainer's own inputs (recorded by the
    root's forward pre-hook) and names the Linear whose fp16 output overflows, and the op."""

    def run(scale: float, out: str) -> AmpDoctorCallback:
        model = tiny_bert(plant_unused=False)
        with torch.no_grad():
            model.bert.encoder.layer[0].intermediate.dense.weight.normal_(0, 0.02 * scale)
        cb = AmpDoctorCallback()
        fit(tmp_path / out, model.half(), [cb])
        return cb

    r = run(5e5, "bad").report           # weights ~1e4 (fp16-representable), outputs past 65504
    assert r.precision == "fp16" and "replay" in r.summary
    first = r.findings[0]
    assert (first.code, first.module, first.phase) == ("overflow", "bert.encoder.layer.0.intermediate.dense",
                                                       "forward"), r.findings
    assert first.op in ("aten.addmm.default", "aten.mm.default", "aten.linear.default")
    twin = run(1.0, "ok").report
    assert "replay" not in twin.summary and not any(f.code == "overflow" for f in twin.findings)


def test_bad_option_raises_at_construction() -> None:
    with pytest.raises(ValueError, match="on_anomaly 'rasie'"):
        AmpDoctorCallback(on_anomaly="rasie")
    with pytest.raises(TypeError, match="unknown watch option.*'reproducer'"):
        AmpDoctorCallback(reproducer="repro")
