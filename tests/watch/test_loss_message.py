"""The ``nonfinite-loss`` message says what the watch knows about the loss: a micro-batch's, of a step GradScaler
skipped, or read after its optimizer update - not "seen after its optimizer step" for an update that never ran."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.watch import watch


def _messages(nan_micro: int | None, micro_batches: int, *, late: bool = False) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with watch(model, opt, scaler, locate=False) as w:
        for k in range(micro_batches):
            x = torch.randn(2, 4, generator=g)
            if k == nan_micro:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            if not late:
                w.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if late:
            w.step(float("nan"))    # a NaN metric given after optimizer.step(): belongs to the step just closed
    return [a["message"] for a in w.report().summary["anomalies"] if a["kind"] == "nonfinite-loss"]


def test_a_micro_batch_loss_of_a_skipped_step_says_so() -> None:
    (msg,) = _messages(0, 2)
    assert "the loss is nan at step 0 (a micro-batch loss; GradScaler skipped the step's update)" in msg
    assert "after its optimizer step" not in msg


def test_the_single_loss_of_a_skipped_step_says_the_update_was_skipped() -> None:
    (msg,) = _messages(0, 1)
    assert "the loss is nan at step 0 (GradScaler skipped the step's update);" in msg


def test_a_loss_given_after_the_update_is_still_called_late() -> None:
    (msg,) = _messages(None, 1, late=True)      # finite gradients: the update ran
    assert "the loss is nan at step 0 (seen after its optimizer step);" in msg


def test_a_healthy_run_has_no_loss_message() -> None:
    assert _messages(None, 2) == []
