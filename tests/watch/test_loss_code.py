"""The loss-code recorder (``ampdoctor.watch._loss_code``): it replays exactly the recorded calls on a new output,
leaves the mode stack, and records nothing it could not replay faithfully."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from ampdoctor.watch import _loss_code
from ampdoctor.watch._loss_code import LossRecorder


def _record(make_loss, *outputs: torch.Tensor) -> LossRecorder:
    rec = LossRecorder(outputs[0])
    rec.__enter__()
    try:
        loss = make_loss(*outputs)
        loss.backward()
    finally:
        assert rec.pop() and not _get_current_function_mode_stack()
    return rec


def test_replays_the_recorded_calls_on_a_new_output() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x, y, w = torch.randn(5, 4), torch.randint(0, 3, (5,)), torch.tensor([1.0, 2.0, 0.5])
    rec = _record(lambda o: nn.functional.cross_entropy(o.float() * 2, y, weight=w) + o.pow(2).mean(), lin(x))
    assert rec.program is not None and len(rec.program.calls) >= 4
    with torch.no_grad():
        lin.weight.mul_(3)
    out = lin(x)
    expect = nn.functional.cross_entropy(out.float() * 2, y, weight=w) + out.pow(2).mean()
    assert torch.equal(rec.program.loss_fn(out), expect)


def test_refuses_what_it_cannot_replay(monkeypatch) -> None:
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    other = torch.randn(3, requires_grad=True)
    assert _record(lambda o: other.sum(), lin(x)).program is None            # backward on an unrelated tensor
    first = lin(x).pow(2).mean()                       # a GAN's discriminator: two forwards, one backward
    assert _record(lambda o: o.mean() + first, lin(x)).program is None        # the other forward's live graph
    assert _record(lambda o: (o * other).mean(), lin(x)).program is None      # a parameter: its .grad is the user's
    monkeypatch.setattr(_loss_code, "MAX_CALLS", 3)
    assert _record(lambda o: o.exp().log().sin().cos().mean(), lin(x)).program is None   # too many calls
    assert LossRecorder(3.0).failed                                           # no tensor in the output


def test_gradient_accumulation_keeps_each_steps_last_micro_batch() -> None:
    """Four forwards and backwards per optimizer step: the tap keeps one program per step (the last micro-batch,
    whose inputs a replay has), so the step before the current one -- the update a replay moves to when a step
    starts from inf/NaN weights -- still has its loss code after four more micro-batches."""
    from ampdoctor.watch._hooks import Health

    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    step = [0]
    health = Health()
    health.active = health.ready = True
    tap = _loss_code.LossCodeTap(lin, opt, lambda: step[0], health)
    try:
        for _ in range(2):
            for k in range(4):
                (lin(torch.randn(2, 4)) * (k + 1)).pow(2).mean().backward()
            opt.step()
            step[0] += 1
        tap.settle()
        first, second = tap.program(0), tap.program(1)
        assert first is not None and second is not None and first is not second
        out = lin(torch.ones(2, 4))
        assert torch.equal(first.loss_fn(out), (out * 4).pow(2).mean())    # the 4th micro-batch's loss code
    finally:
        tap.close()
    assert not _get_current_function_mode_stack()
