"""GradScaler's default initial scale (65536) is too large for gradients of ~1e2: the first steps are skipped while
it halves, then training proceeds. The live warning at the third skip must say that this is most likely the scale
calibrating (it said "the weights stopped changing. Some op produces non-finite gradients at every scale", which a
new user reads as a broken run), and the watch must not change the losses. A run whose skips start after an applied
step keeps the collapse wording."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ampdoctor


def run(watched: bool, late: bool = False) -> tuple[list[float], ampdoctor.Watch | None]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.mul_(30.0)               # outputs ~1e2: scaled fp16 gradients overflow at 65536
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4 if late else 2.0 ** 16)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(14)]
    if late:                                  # applied steps first, then inputs that overflow at any scale
        xs[3:] = [x * 1e4 for x in xs[3:]]
    losses: list[float] = []

    def loop(w: ampdoctor.Watch | None) -> None:
        for x in xs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            if w is not None:
                w.step(loss)

    if not watched:
        loop(None)
        return losses, None
    with ampdoctor.watch(model, opt, scaler, locate=False) as w:
        loop(w)
    return losses, w


@pytest.mark.parametrize("late", [False, True])
def test_the_first_skips_are_called_calibration_and_later_ones_a_collapse(caplog, late) -> None:
    with caplog.at_level(logging.WARNING, logger="ampdoctor.watch"):
        watched, w = run(True, late)
    plain, _ = run(False, late)
    assert list(map(repr, plain)) == list(map(repr, watched)) and len(plain) == 14    # exact, NaN included
    msgs = [r.getMessage() for r in caplog.records if "consecutive optimizer steps" in r.getMessage()]
    assert len(msgs) == 1, msgs
    if late:
        assert "calibrating" not in msgs[0] and "The weights stopped changing" in msgs[0], msgs[0]
    else:
        assert "skipped the first 3 consecutive optimizer steps (0..2)" in msgs[0]
        assert "calibrating a too-large initial scale" in msgs[0], msgs[0]
