"""accelerate: watch_accelerator over prepared objects, and accelerate's own GradScaler path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

accelerate = pytest.importorskip("accelerate")

from ampdoctor.integrations.accelerate import watch_accelerator  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.extra = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def test_prepared_objects_are_watched() -> None:
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = Net()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    with watch_accelerator(acc, model, opt) as w:
        assert w.optimizer is opt.optimizer                # the torch optimizer inside AcceleratedOptimizer
        for _ in range(4):
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            w.step(loss)
    r = w.report()
    assert [(f.code, f.module) for f in r.findings] == [("unused-parameters", "extra")]
    assert r.summary["steps"] == 4 and len(r.summary["losses"]) == 4


def test_accelerated_optimizer_with_grad_scaler_reports_skipped_steps() -> None:
    """accelerate's AcceleratedOptimizer drives scaler.step/update itself (CPU accelerate has no fp16 scaler, so
    the wrapper is built directly with a CPU GradScaler)."""
    from accelerate.optimizer import AcceleratedOptimizer

    torch.manual_seed(0)
    accelerate.Accelerator(cpu=True)
    model = Net()
    scaler = torch.amp.GradScaler("cpu")
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    g = torch.Generator().manual_seed(1)
    w = watch_accelerator(type("Acc", (), {"scaler": scaler})(), model, opt)
    with w:
        for i in range(8):
            x = torch.randn(4, 8, generator=g) * (1e6 if i >= 4 else 1.0)    # fp16 overflow from step 4 on
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            opt.step()
            opt.zero_grad()
    r = w.report()
    f = next(f for f in r.findings if f.code == "loss-scale-collapse")
    assert (f.evidence["first_skipped_step"], f.evidence["consecutive_skipped"], f.severity) == (4, 4, "error")
    assert f.evidence["scales"] == [65536.0, 32768.0, 16384.0, 8192.0]
    assert [opt.step_was_skipped] == [True]


@pytest.mark.parametrize("scale", [3e4, 1.0])
def test_accelerate_default_replay_names_module_and_op(scale: float) -> None:
    """fp16 weights under accelerate: the default policy replays the unwrapped model's recorded forward and names
    the Linear whose fp16 output overflows, and the op; the unscaled twin stays clean."""
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = Net()
    with torch.no_grad():
        model.body.weight.mul_(scale)        # x ~ 50: body's outputs reach ~1e6, past fp16's 65504
    model, opt = acc.prepare(model.half(), torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    with watch_accelerator(acc, model, opt) as w:
        for _ in range(2):
            loss = model((torch.randn(4, 8, generator=g) * 50).half()).float().pow(2).mean()
            acc.backward(loss)
            w.step(loss)
            opt.step()
            opt.zero_grad()
    r = w.report()
    if scale == 1.0:
        assert "replay" not in r.summary and not any(f.code == "overflow" for f in r.findings)
        return
    assert "replay" in r.summary
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase) == ("overflow", "body", "aten.addmm.default",
                                                                 "forward"), r.findings


def make_net() -> Net:
    """``--factory`` for the replay below: the architecture (its weights come from the reproducer)."""
    return Net()


def test_ampdoctor_replay_of_an_accelerate_reproducer(tmp_path) -> None:
    """The reproducer of an accelerate loop (fp16 weights, body's output past 65504) replays from the file with
    ``ampdoctor replay FILE.pt --factory ...`` and names the same module and op as the in-process replay."""
    import json

    from click.testing import CliRunner

    from ampdoctor.cli import main

    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = Net()
    with torch.no_grad():
        model.body.weight.mul_(3e4)
    model, opt = acc.prepare(model.half(), torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    with watch_accelerator(acc, model, opt, reproducer_dir=str(tmp_path / "repro")) as w:
        loss = model((torch.randn(4, 8, generator=g) * 50).half()).float().pow(2).mean()
        acc.backward(loss)
        w.step(loss)
        opt.step()
        opt.zero_grad()
    files = sorted((tmp_path / "repro").iterdir())
    assert files, "no reproducer written"
    factory = "tests.integrations.test_accelerate:make_net"
    res = CliRunner().invoke(main, ["replay", str(files[0]), "--factory", factory, "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    first = json.loads((tmp_path / "r.json").read_text())["findings"][0]
    assert (first["code"], first["module"], first["op"]) == ("overflow", "body", "aten.addmm.default")
    live = w.report().findings[0]
    assert (live.module, live.op) == (first["module"], first["op"])
