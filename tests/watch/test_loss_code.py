"""The loss-code recorder (``ampdoctor.watch._loss_code``): it replays exactly the recorded calls on a new output,
leaves the mode stack, and records nothing it could not replay faithfully."""

from __future__ import annotations

import sys

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


def _train(watched: bool, *, fail_at: int | None = None) -> tuple[list[torch.Tensor], list[list[tuple[str, int]]],
                                                                  list[int]]:
    """Three SGD steps of a loop whose loss is computed outside the model; after each backward() a torch warning
    (``.grad`` of a non-leaf) is raised from this file. Returns the weights, each step's warning locations and the
    mode-stack depth seen right after backward() and after the step."""
    import warnings

    import ampdoctor

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    where: list[list[tuple[str, int]]] = []
    depth: list[int] = []
    w = ampdoctor.watch(m, opt, loss_code=True) if watched else None
    if w is not None:
        w.__enter__()
    try:
        for i in range(3):
            out = m(torch.randn(5, 4))
            loss = nn.functional.mse_loss(torch.sigmoid(out), torch.zeros(5, 1))
            if i == fail_at:       # backward() raises inside the recorder's handler
                try:
                    (loss * torch.ones(2)).backward()
                except RuntimeError:
                    pass
                loss = nn.functional.mse_loss(torch.sigmoid(m(torch.randn(5, 4))), torch.zeros(5, 1))
            loss.backward()
            depth.append(len(_get_current_function_mode_stack()))
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                _ = out.grad; line = sys._getframe().f_lineno   # noqa: E702 - the warning's line
            where.append([(x.filename, x.lineno - line) for x in seen])
            opt.step()
            opt.zero_grad()
            depth.append(len(_get_current_function_mode_stack()))
    finally:
        if w is not None:
            w.__exit__(None, None, None)
    return [p.detach().clone() for p in m.parameters()], where, depth


def test_recorder_leaves_the_mode_stack_when_backward_returns_or_raises() -> None:
    """Under ``loss_code=True`` the recorder is off the mode stack as soon as backward() returns, also when it
    raises; a torch warning raised after it names the user's line, not ``_loss_code.py``; training is bitwise the
    unwatched twin's."""
    for fail_at in (None, 1):
        plain, plain_where, _ = _train(False, fail_at=fail_at)
        weights, where, depth = _train(True, fail_at=fail_at)
        assert depth == [0] * 6
        assert where == plain_where and all(w == [(__file__, 0)] for w in where), where
        assert all(torch.equal(a, b) for a, b in zip(weights, plain, strict=True))


def test_a_loss_over_two_forwards_is_recorded_and_replayed_on_both_outputs() -> None:
    """A GAN discriminator's loss: the real and the (detached) fake batch through the same model; the detach of
    an input is no loss code (kept by reference), the second forward's own ops are not recorded."""
    from ampdoctor.watch._hooks import Health

    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    gen = nn.Linear(3, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    health = Health()
    health.active = health.ready = True
    tap = _loss_code.LossCodeTap(lin, opt, lambda: 0, health)
    real, fake = torch.randn(5, 4), gen(torch.randn(5, 3))
    try:
        bce = nn.functional.binary_cross_entropy_with_logits
        loss = bce(lin(real), torch.ones(5, 1)) + bce(lin(fake.detach()), torch.zeros(5, 1))
        loss.backward()
        assert not _get_current_function_mode_stack()
        program = tap.program(0)
        assert program is not None and program.forwards == 2
        a, b = lin(real * 2), lin(fake.detach() * 3)
        assert torch.equal(program.run([a, b]), bce(a, torch.ones(5, 1)) + bce(b, torch.zeros(5, 1)))
    finally:
        tap.close()
    assert not _get_current_function_mode_stack()
