"""Lightning Trainer.fit with AmpDoctorCallback: real Lightning (optimizer.step(closure)), CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

L = pytest.importorskip("lightning.pytorch")

from ampdoctor.integrations.lightning import AmpDoctorCallback  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, plant_unused: bool = False, bad_batch: int | None = None) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.extra = nn.Linear(4, 4) if plant_unused else None
        self.bad_batch = bad_batch
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if batch_idx == self.bad_batch:
            x = x.clone()
            x[0, 0] = float("inf")
        self.seen.append({k: v.detach().clone() for k, v in self.state_dict().items()})
        return self.head(torch.relu(self.body(x))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g)), batch_size=4)


def fit(module: L.LightningModule, cb: AmpDoctorCallback, steps: int = 4) -> L.Trainer:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(module, loader())
    return trainer


def test_lightning_report_names_the_unused_module() -> None:
    torch.manual_seed(0)
    module = Module(plant_unused=True)
    cb = AmpDoctorCallback()
    fit(module, cb)
    r = cb.report
    assert [(f.code, f.module, f.phase) for f in r.findings] == [("unused-parameters", "extra", "backward")]
    assert r.summary["steps"] == 4 and len(r.summary["losses"]) == 4
    assert not module._forward_pre_hooks and not module.body.weight._post_accumulate_grad_hooks


def test_lightning_healthy_run_is_ok() -> None:
    torch.manual_seed(0)
    cb = AmpDoctorCallback()
    trainer = fit(Module(), cb)
    assert cb.report.ok and cb.report.findings == ()
    assert len(cb.report.summary["grad_norms"]) == 4
    logged = trainer.logged_metrics                     # ampdoctor's values reach the Trainer's own loggers
    assert float(logged["ampdoctor/anomalies"]) == 0.0 and float(logged["ampdoctor/skipped_steps"]) == 0.0
    assert float(logged["ampdoctor/grad_norm"]) > 0


def test_lightning_raise_drops_the_bad_update_and_stops_the_trainer() -> None:
    torch.manual_seed(0)
    module = Module(bad_batch=2)
    cb = AmpDoctorCallback(on_anomaly="raise")
    trainer = fit(module, cb, steps=6)                 # nothing raised through fit
    assert trainer.should_stop and trainer.global_step == 3
    assert cb.error is not None and "nonfinite-grads at step 2" in cb.error
    after = module.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in module.seen[2].items())   # weights of the bad step's start
    assert all(torch.isfinite(v).all() for v in after.values())
    assert cb.watch is None and cb.report is not None and not module._forward_pre_hooks
    assert float(trainer.logged_metrics["ampdoctor/anomalies"]) >= 1.0


def test_lightning_bad_option_raises_at_construction() -> None:
    with pytest.raises(ValueError, match="on_anomaly 'rasie'"):
        AmpDoctorCallback(on_anomaly="rasie")
    with pytest.raises(TypeError, match="unknown watch option.*'on_anomally'"):
        AmpDoctorCallback(on_anomally="raise")
    with pytest.raises(TypeError, match="coverage_steps must be an int"):
        AmpDoctorCallback(coverage_steps="3")


def test_lightning_grad_scaler_skipped_steps_are_seen() -> None:
    """Lightning's MixedPrecision plugin with a CPU GradScaler: scaler.step() skips, no optimizer hook fires."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Overflowing(Module):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            if batch_idx >= 2:
                x = x * 1e6                  # beyond fp16's 65504 under autocast: NaN loss, NaN grads
            return self.head(torch.relu(self.body(x))).float().pow(2).mean()

    torch.manual_seed(0)
    cb = AmpDoctorCallback()
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    trainer.fit(Overflowing(), loader())
    r = cb.report
    f = next(f for f in r.findings if f.code == "loss-scale-collapse")
    assert (f.severity, f.evidence["first_skipped_step"], f.evidence["ongoing"]) == ("error", 2, True)
    assert f.evidence["scales"][:3] == [65536.0, 32768.0, 16384.0]
    assert r.precision == "fp16-amp"
    # the default replay ran training_step (the module has no forward) with the GradScaler: the batch's cast to
    # fp16 for body's addmm is where the values (x * 1e6) leave fp16's range
    assert r.summary["replay"]["summary"]["replay"]["scaler"] is True
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase) == ("overflow", "body", "aten._to_copy.default",
                                                                 "forward")


class OnlyTrainingStep(L.LightningModule):
    """No forward: the step lives in training_step (the replay must call it, not the root module)."""

    def __init__(self, scale: float, manual: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.blow = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.automatic_optimization = not manual
        with torch.no_grad():
            self.blow.weight.mul_(scale)       # x ~ 50: blow's outputs reach ~1e6, past fp16's 65504

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.head(torch.relu(self.blow(torch.relu(self.encoder(x))))).float().pow(2).mean()
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("manual", [False, True])
def test_lightning_replay_of_training_step_names_module_and_op(manual: bool) -> None:
    """16-true on CPU: the model runs in half; the default policy replays training_step on a copy."""

    def run(scale: float) -> AmpDoctorCallback:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=g) * 50)
        cb = AmpDoctorCallback()
        L.Trainer(max_steps=1, accelerator="cpu", precision="16-true", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[cb]).fit(
            OnlyTrainingStep(scale, manual), torch.utils.data.DataLoader(data, batch_size=4))
        return cb

    r = run(3e4).report
    assert r.summary["replay"]["summary"]["replay"]["step"] == 0
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase) == ("overflow", "blow", "aten.addmm.default", "forward")
    twin = run(1.0).report
    assert "replay" not in twin.summary and not any(f.code == "overflow" for f in twin.findings)


def make_only_training_step() -> OnlyTrainingStep:
    """``--factory`` for the replay below: the architecture (its weights come from the reproducer)."""
    return OnlyTrainingStep(1.0)


@pytest.mark.parametrize("manual", [False, True])
def test_ampdoctor_replay_of_a_training_step_reproducer(tmp_path, manual: bool) -> None:
    """``ampdoctor replay FILE.pt --factory ...`` of a LightningModule with no forward: the file says the step is
    ``training_step``, so the replay runs that method (and names blow's addmm) without any train_step code."""
    import json

    from click.testing import CliRunner

    from ampdoctor.cli import main

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) * 50)
    cb = AmpDoctorCallback(reproducer_dir=str(tmp_path / "repro"))
    L.Trainer(max_steps=1, accelerator="cpu", precision="16-true", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[cb]).fit(
        OnlyTrainingStep(3e4, manual), torch.utils.data.DataLoader(data, batch_size=4))
    files = sorted((tmp_path / "repro").iterdir())
    assert files, "no reproducer written"
    assert torch.load(files[0], weights_only=True)["step_method"] == "training_step"
    factory = "tests.integrations.test_lightning:make_only_training_step"
    res = CliRunner().invoke(main, ["replay", str(files[0]), "--factory", factory, "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output                    # an error finding
    first = json.loads((tmp_path / "r.json").read_text())["findings"][0]
    assert (first["code"], first["module"], first["op"], first["phase"]) == ("overflow", "blow", "aten.addmm.default",
                                                                           "forward")
