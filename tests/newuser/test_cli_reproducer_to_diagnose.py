"""A new user gets a reproducer from the watch and runs it with ``ampdoctor diagnose`` (the command the README shows
first). It used to answer "cannot import '...pt' as Python; a scenario is a .py file that defines make()", which
says nothing of what the file is or how to run it; now the error names ``ampdoctor replay FILE``, and that command
replays it (the batch of step 2 holds a NaN: ``nonfinite-input``). A scenario .py file next to it is still
diagnosed (the healthy twin).
"""

from __future__ import annotations

import textwrap

import torch
from click.testing import CliRunner

import ampdoctor
from ampdoctor.cli import main

NETDEF = textwrap.dedent('''
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def make():
        return {"model": build(), "batch": torch.randn(2, 4, generator=torch.Generator().manual_seed(0)),
                "loss_fn": lambda out, batch: out.float().pow(2).mean(), "precision": "fp16-amp", "steps": 1}
''')


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, list(args), env={"NO_COLOR": "1", "COLUMNS": "100"})


def _reproducer(tmp_path, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    (tmp_path / "netdef.py").write_text(NETDEF)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import netdef  # type: ignore[import-not-found]

    model = netdef.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with ampdoctor.watch(model, opt, reproducer_dir=str(tmp_path / "repro"), locate=False) as w:
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(2, 4, generator=gen)
            if step == 2:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            w.step(loss)
    paths = w.report().summary["reproducers"]
    assert paths and paths[0].endswith("step000002-nonfinite-grads.pt"), paths
    return str(paths[0])


def test_diagnose_on_a_reproducer_points_to_replay_and_replay_runs_it(tmp_path, monkeypatch) -> None:
    path = _reproducer(tmp_path, monkeypatch)
    res = _invoke("diagnose", path)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "is a torch.save file, not a scenario" in res.output and f"ampdoctor replay {path}" in res.output
    res = _invoke("replay", path, "--factory", "netdef:build")
    assert res.exit_code == 1 and "nonfinite-input" in res.output, res.output


def test_a_scenario_file_next_to_it_is_still_diagnosed(tmp_path, monkeypatch) -> None:
    (tmp_path / "scenario.py").write_text(NETDEF)
    res = _invoke("diagnose", str(tmp_path / "scenario.py"))
    assert res.exit_code == 0, res.output
