"""accelerate as its docs teach it: ``Accelerator(gradient_accumulation_steps=4)``, ``accelerator.accumulate(model)``,
``clip_grad_norm_`` on the sync step, an LR scheduler, and the loss computed in the loop from the model's output
(the model returns no loss). The model is ``.half()`` and its head's weights make outputs of ~300-1000: the squared
error ``(out - y) ** 2`` overflows fp16 in the loop's own code (``> 65504``), although every module's output fits.

``watch_accelerator`` records that loss code, so the default replay runs it (forward, loss, backward, update) and
names ``aten.pow``, forward, with this file's line; the healthy twin stays clean and trains bitwise as unwatched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

accelerate = pytest.importorskip("accelerate")

from ampdoctor.integrations.accelerate import watch_accelerator  # noqa: E402


def train(scale: float, watched: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    acc = accelerate.Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(scale)
    model = model.half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)      # eps=1e-8 would be 0 in fp16
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    def loop(w):  # type: ignore[no-untyped-def]
        for x, y in loader:
            with acc.accumulate(model):
                out = model(x.half())
                loss = (out - y.half()).pow(2).mean()                 # LOSS-POW: squared error in fp16
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                if w is not None:
                    w.step(loss)

    if not watched:
        loop(None)
        return acc.unwrap_model(model), None
    with watch_accelerator(acc, model, opt) as w:
        loop(w)
    return acc.unwrap_model(model), w.report()


def _line(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line" not in text)


def test_loss_code_of_an_accumulating_loop_is_replayed_and_named() -> None:
    _, r = train(3000.0, True)
    first = r.findings[0]
    assert (first.code, first.op, first.phase, first.module) == ("overflow", "aten.pow.Tensor_Scalar", "forward", ""), \
        [(f.code, f.module, f.op, f.phase) for f in r.findings]
    assert first.evidence["source"] == f"test_loops_accelerate.py:{_line('LOSS-POW')}"
    assert r.summary["steps"] == 3 and r.summary["replay"]["summary"]["forward_only"] is False


def test_healthy_twin_is_clean_and_bitwise_unchanged() -> None:
    plain, _ = train(1.0, False)
    watched, r = train(1.0, True)
    assert r.ok and "replay" not in r.summary and r.summary["steps"] == 3
    for (n, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n
