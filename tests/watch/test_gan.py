"""Two optimizers, two GradScalers, one loop (a GAN): a watch per model. The discriminator's first Linear has fp16-
representable weights (x 1e5, ~3.5e4) that overflow fp16 on the real batch under autocast (``> 65504``): D's loss is
NaN and both scalers skip every step (the generator's gradients pass through D's weights too).

The discriminator is called three times per iteration (real, fake for its own loss, fake again for G's loss), so the
default replay -- the last call with its inputs -- cannot stand for D's step; the documented way is to give the
step's batch (``w.step(loss, batch=...)``) and the step itself (``w.replay_with(train_step)``): the replay then names
``0``, ``aten.addmm``, forward. Both watches coexist (their hooks and scalers apart), both report the collapse, the
healthy twin is clean and the two models train bitwise as without the watches.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor

BCE = nn.BCEWithLogitsLoss()


def d_loss(D: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return BCE(D(real).float(), torch.ones(len(real), 1)) + BCE(D(fake).float(), torch.zeros(len(fake), 1))


def d_step(model, batch, optimizer=None, scaler=None):  # type: ignore[no-untyped-def]
    """The discriminator's step, as ``ampdoctor.diagnose`` calls a ``train_step``."""
    loss = d_loss(model, *batch)
    if scaler is None:
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss
    scaler.scale(loss).backward()
    if optimizer is not None:
        scaler.step(optimizer)
        scaler.update()
    return loss


def train(scale: float, watched: bool, default_replay: bool = False):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    D = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    with torch.no_grad():
        D[0].weight.mul_(scale)
    oG, oD = (torch.optim.Adam(m.parameters(), 1e-3, betas=(0.5, 0.999)) for m in (G, D))
    sG, sD = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    wD = ampdoctor.watch(D, oD, sD, loss_code=default_replay) if watched else None
    wG = ampdoctor.watch(G, oG, sG) if watched else None
    if wD is not None and wG is not None:
        wD.__enter__()
        wG.__enter__()
        if not default_replay:
            wD.replay_with(d_step)
    try:
        for _ in range(4):
            real, z = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            oD.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = G(z)
            loss_d = d_loss(D, real, fake.detach())
            sD.scale(loss_d).backward()
            sD.step(oD)
            sD.update()
            oG.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = BCE(D(fake).float(), torch.ones(8, 1))
            sG.scale(loss_g).backward()
            sG.step(oG)
            sG.update()
            if wD is not None and wG is not None:
                wD.step(loss_d, batch=None if default_replay else (real, fake.detach()))
                wG.step(loss_g)
    finally:
        if wD is not None and wG is not None:
            wG.__exit__(None, None, None)
            wD.__exit__(None, None, None)
    return (G, D), (wD.report(), wG.report()) if wD is not None and wG is not None else None


def test_discriminator_step_replayed_with_its_own_step_names_the_linear() -> None:
    _, (rd, rg) = train(1e5, True)
    first = rd.findings[0]
    assert (first.code, first.module, first.op, first.phase) == ("overflow", "0", "aten.addmm.default", "forward"), \
        [(f.code, f.module, f.op, f.phase) for f in rd.findings]
    assert "loss-scale-collapse" in rd.codes() and "loss-scale-collapse" in rg.codes()
    assert not rd.ok and not rg.ok


def test_healthy_gan_is_clean_and_bitwise_unchanged() -> None:
    plain, _ = train(1.0, False)
    watched, (rd, rg) = train(1.0, True)
    assert rd.ok and rg.ok and rd.codes() == [] and rg.codes() == []
    for a, b in zip(plain, watched):
        for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), n


def test_default_replay_runs_every_call_of_the_step_and_the_recorded_loss() -> None:
    """No ``replay_with``, no ``batch=``: the watch keeps each of the step's discriminator calls (the generator's
    fake from the previous iteration, the real batch, the fake batch) and records the loop's loss code over the
    real and the fake call (``loss_code=True``); the default replay runs all the calls and that loss, so the
    overflow in the first, real call is found. The healthy twin stays clean and bitwise."""
    _, (rd, _) = train(1e5, True, default_replay=True)
    first = rd.findings[0]
    assert (first.code, first.module, first.op, first.phase) == ("overflow", "0", "aten.addmm.default", "forward"), \
        [(f.code, f.module, f.op, f.phase) for f in rd.findings]
    assert rd.summary["replay"]["summary"]["replayed_calls"] == 3
    assert rd.summary["replay"]["summary"]["forward_only"] is False
    plain, _ = train(1.0, False)
    watched, (rd, rg) = train(1.0, True, default_replay=True)
    assert rd.ok and rg.ok and rd.codes() == [] and rg.codes() == []
    for a, b in zip(plain, watched):
        for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), n
