"""A loss written in the training loop (a focal loss on the model's logits, fp16 autocast emulated on CPU) under
``ampdoctor run``: the watch records the step's loss code (the torch calls from the model's output to
``backward()``), so the in-process replay runs it and names the op, phase and the script's line, as for the same
loss inside a module. Where no loss code was recorded (a plain ``ampdoctor.watch``, a reproducer file), the report
says that the replay ran the forward alone, why, and what to do, instead of a bare "overflow, backward, <root>".
The healthy twin stays clean, and the script's results are bitwise those of a run without ampdoctor.

Mechanism: fp16 ``sigmoid(-20)`` underflows to 0, ``log(0) = -inf``, and the backward of ``log`` divides by 0.
"""

from __future__ import annotations

import textwrap

from ampdoctor.findings import Finding, Report
from ampdoctor.integrations.run import run_script
from ampdoctor.watch._rules import not_reproduced, with_unreproduced

LOOP = """
    import sys, torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].bias.fill_(float(sys.argv[1]))      # confident logits: sigmoid leaves fp16's range
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(8, 16)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            p = torch.sigmoid(logits)
            loss = (-(1 - p) ** 2.0 * torch.log(p)).mean()
        loss.backward()
        opt.step()
"""

IN_MODULE = """
    import sys, torch
    from torch import nn
    torch.manual_seed(0)
    class Focal(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        def forward(self, x):
            p = torch.sigmoid(self.net(x))
            return (-(1 - p) ** 2.0 * torch.log(p)).mean()
    model = Focal()
    with torch.no_grad():
        model.net[2].bias.fill_(float(sys.argv[1]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(8, 16)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x)
        loss.backward()
        opt.step()
"""


def _run(tmp_path, src: str, arg: str) -> Report:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(src))
    return run_script(["python", str(script), arg])


def _keys(r: Report) -> list[tuple[str, str, str, str]]:
    return [(f.code, f.module, f.op, f.phase) for f in r.findings]


def test_loop_loss_is_replayed_and_the_op_named(tmp_path) -> None:
    r = _run(tmp_path, LOOP, "-20")
    assert r.summary["script"] == {"status": "completed"} and "not_reproduced" not in r.summary["replay"]
    keys = _keys(r)
    assert keys[0] == ("underflow", "", "aten.sigmoid.default", "forward"), keys   # fp16 sigmoid(-20) == 0
    assert ("overflow", "", "aten.log.default", "forward") in keys, keys            # log(0) = -inf
    assert r.findings[0].severity == "error" and r.findings[0].evidence["source"] == "train.py:14"
    assert r.findings[keys.index(("overflow", "", "aten.log.default", "forward"))].evidence["source"] == "train.py:15"
    assert not [f for f in r.findings if not f.op], keys        # the generic "<root>, no op" finding gave way
    from torch.overrides import _get_current_function_mode_stack
    assert not _get_current_function_mode_stack()              # the recorder left the mode stack


def test_plain_watch_without_loss_code_says_it_cannot_reproduce_and_why() -> None:
    import torch
    from torch import nn

    import ampdoctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].bias.fill_(-20.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                p = torch.sigmoid(model(torch.randn(8, 16)))
                loss = (-(1 - p) ** 2.0 * torch.log(p)).mean()
            loss.backward()
            opt.step()
    r = w.report()
    assert r.summary["replay"]["reproduced"] is False, r.summary["replay"]
    assert r.summary["replay"]["not_reproduced"]["reason"] == "loss-outside-model"
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("overflow", "", "", "backward", "error"), _keys(r)
    assert f.evidence["replay"] == "not-reproduced" and f.evidence["replay_reason"] == "loss-outside-model"
    assert "outside the model" in f.explanation and "fp16-amp" in f.explanation
    assert "loss_fn=" in " ".join(x.snippet for x in f.fixes)
    assert not [g for g in r.findings if g.op], _keys(r)      # nothing located that the replay never ran


def test_results_are_bitwise_those_of_a_run_without_ampdoctor(tmp_path) -> None:
    import runpy
    import sys

    import torch

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOOP) + "torch.save(model.state_dict(), sys.argv[2])\n")
    for arg in ("0", "-20"):
        run_script(["python", str(script), arg, str(tmp_path / "watched.pt")])
        old = sys.argv[:]
        try:
            sys.argv = [str(script), arg, str(tmp_path / "plain.pt")]
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = old
        a, b = torch.load(tmp_path / "watched.pt"), torch.load(tmp_path / "plain.pt")
        assert a.keys() == b.keys(), arg
        for k in a:     # NaN weights (the unprotected failing run) compare by position
            assert torch.equal(a[k].isnan(), b[k].isnan()) and torch.equal(a[k].nan_to_num(), b[k].nan_to_num()), k


def test_loop_loss_healthy_twin_stays_clean(tmp_path) -> None:
    r = _run(tmp_path, LOOP, "0")
    assert r.summary["script"] == {"status": "completed"} and "replay" not in r.summary
    assert not [g for g in r.findings if g.code in ("overflow", "nan-from-inf", "underflow")], _keys(r)


def test_same_loss_inside_a_module_is_located(tmp_path) -> None:
    r = _run(tmp_path, IN_MODULE, "-20")
    assert r.summary["replay"].get("reproduced", True) is True and "not_reproduced" not in r.summary["replay"]
    keys = _keys(r)
    assert keys[0] == ("underflow", "", "aten.sigmoid.default", "forward"), keys
    assert ("overflow", "", "aten.log.default", "forward") in keys, keys
    assert not [g for g in r.findings if "replay_reason" in g.evidence]


def test_full_step_replay_that_stays_finite_is_not_blamed_on_the_loss() -> None:
    generic = Finding("overflow", "error", "", "", "backward", "non-finite gradients at step 3", "At step 3 ...")
    ran_step = Report((), "fp16", {"forward_only": False}, (), "")
    info = not_reproduced(ran_step, "nonfinite-grads", 3, custom_step=False)
    assert info is not None and info["reason"] == "not-repeated" and "step 3" in info["note"]
    (f,) = with_unreproduced([generic], info)
    assert f.evidence["replay_reason"] == "not-repeated" and "does not repeat" in f.explanation
    assert not any("inside a module" in x.title for x in f.fixes)
    fwd = Report((), "fp16", {"forward_only": True}, (), "")
    assert not_reproduced(fwd, "nonfinite-grads", 3, custom_step=True)["reason"] == "not-repeated"  # type: ignore[index]
    assert not_reproduced(fwd, "grad-spike", 3, custom_step=False) is None
    located = Report((Finding("overflow", "error", "fc", "aten.exp.default", "forward", "t", "e"),),
                     "fp16", {"forward_only": True}, (), "")
    assert not_reproduced(located, "nonfinite-grads", 3, custom_step=False) is None


def test_replay_of_the_reproducer_file_says_so_too(tmp_path) -> None:
    import torch
    from torch import nn

    from ampdoctor.watch import replay

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LOOP))
    run_script(["python", str(script), "-20"], reproducer_dir=str(tmp_path / "repro"))
    (path,) = sorted((tmp_path / "repro").glob("*nonfinite-grads.pt"))
    r = replay(str(path), model_factory=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("overflow", "", "", "backward", "error"), _keys(r)
    assert f.evidence["replay_reason"] == "loss-outside-model" and "outside the model" in f.explanation
    assert r.summary["replay"]["reproduced"] is False and not r.ok
    # with the script's loss, the same file names the op
    def focal(out: torch.Tensor, batch: object) -> torch.Tensor:
        p = torch.sigmoid(out)
        return (-(1 - p) ** 2.0 * torch.log(p)).mean()

    located = replay(str(path), model_factory=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                                      nn.Linear(32, 4)), loss_fn=focal)
    assert "not_reproduced" not in located.summary["replay"], _keys(located)
    assert ("overflow", "", "aten.log.default", "forward") in _keys(located), _keys(located)
