"""Gradient accumulation, the loss computed in the loop, fp16 autocast + GradScaler, clipping: a micro-batch with
huge inputs (|x| ~ 2.5e5 > fp16's 65504) that is NOT the step's last one makes the step's loss NaN.

The replay of that step used to run only the last micro-batch (healthy) and found nothing but the loss scale's
benign backward overflow (report ok). Each micro-batch's recorded loss code now runs on its own forward, so the
replay names the autocast cast of the input in module ``0`` (``aten._to_copy``), forward, at the run's step.
The healthy twin (no huge micro-batch) trains bitwise as unwatched, and the watch reports nothing.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor

ACCUM = 2
BAD_MICRO = 10          # micro-batch 10 = the first of optimizer step 5


def train(big: float, watched: bool, **options: bool) -> tuple[list[float], ampdoctor.Report | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    x[4 * BAD_MICRO:4 * BAD_MICRO + 4] *= big
    losses: list[float] = []

    def loop(w: ampdoctor.Watch | None) -> None:
        for i in range(16):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[4 * i:4 * i + 4])
            loss = nn.functional.mse_loss(out.float(), y[4 * i:4 * i + 4]) / ACCUM
            scaler.scale(loss).backward()
            losses.append(loss.item())
            if (i + 1) % ACCUM == 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            if w is not None:
                w.step(loss)            # every micro-batch's loss, as accelerate's loops give it

    if not watched:
        loop(None)
        return losses, None
    with ampdoctor.watch(model, opt, scaler, loss_code=True, **options) as w:
        loop(w)
    return losses, w.report()


def test_the_replay_runs_every_micro_batch_and_names_the_overflowing_one() -> None:
    losses, r = train(1e5, True)
    assert r is not None and not r.ok
    assert losses[BAD_MICRO] != losses[BAD_MICRO]       # NaN: the truth, computed by the loop itself
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase, first.step) == (
        "overflow", "0", "aten._to_copy.default", "forward", BAD_MICRO // ACCUM), \
        [(f.code, f.module, f.op, f.phase, f.step) for f in r.findings]
    replay = r.summary["replay"]["summary"]
    assert replay["replayed_calls"] == ACCUM and replay["forward_only"] is False


def test_healthy_twin_is_clean_and_bitwise_unchanged() -> None:
    plain, _ = train(1.0, False)
    watched, r = train(1.0, True)
    assert plain == watched and len(plain) == 16
    assert r is not None and r.ok and "replay" not in r.summary, r.codes()


def test_without_replay_the_nan_micro_batch_loss_is_still_a_finding() -> None:
    """The step's later, finite micro-batch loss used to overwrite the NaN one: the anomaly was logged, but the
    report was ok with no finding."""
    _, r = train(1e5, True, locate=False)
    assert r is not None and not r.ok
    f = r.findings[0]
    assert (f.code, f.module, f.phase, f.step) == ("overflow", "", "forward", BAD_MICRO // ACCUM), r.codes()
    assert f.evidence["loss"] != f.evidence["loss"]          # NaN
