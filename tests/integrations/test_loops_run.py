"""``ampdoctor run`` on a script as people write them: argparse arguments, a DataLoader with worker processes, a
OneCycle LR schedule, fp16 autocast with GradScaler, ``unscale_`` + gradient clipping -- and a failure that starts
at step 7, not 0: from batch 7 on the samples are unnormalised (x 3e4), so autocast's cast of the input to fp16
overflows in the first Linear (``> 65504``) and GradScaler skips every step from 7 on.

Before that, GradScaler calibrates its initial scale (65536): steps 0-2 are skipped because the *scaled* gradients
overflow. That first anomaly's replay judges it benign (unscaled, the gradients fit: a warning), so the watch
replays the later failure too: the loss ``backward()`` runs on is checked (before ``scaler.scale``), so the first
inf loss, step 7, is the anomaly replayed (before that check, the collapse at step 9 was), and the report leads
with the real cause at the run's own step (7), with no source line borrowed from the code that called the replay.
The healthy twin exits 0 with no error and its weights are bitwise those of a run without ampdoctor.
"""

from __future__ import annotations

import runpy
import sys
import textwrap

import torch

from ampdoctor.integrations.run import run_script

SCRIPT = """
    import argparse, torch, torch.nn as nn
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--outlier", type=float, default=1.0)
    p.add_argument("--out", default="")
    a = p.parse_args()

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
            self.x[28:] *= a.outlier                  # batch 7 on: unnormalised samples
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return self.x[i], self.y[i]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].weight.mul_(30)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps)
    scaler = torch.amp.GradScaler("cpu")
    loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2, shuffle=False)
    for step, (x, y) in enumerate(loader):
        if step == a.steps:
            break
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.smooth_l1_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
    if a.out:
        torch.save(model.state_dict(), a.out)
"""


def _script(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return str(path)


def test_failure_from_step_7_is_replayed_after_the_scalers_calibration(tmp_path) -> None:
    r = run_script(["python", _script(tmp_path), "--outlier", "3e4", "--lr", "1e-3"])
    assert r.summary["script"] == {"status": "completed"}
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase, first.step) == (
        "overflow", "0", "aten._to_copy.default", "forward", 7), [(f.code, f.module, f.op, f.step) for f in r.findings]
    assert first.evidence.get("source") is None           # nn.Linear has no user line; never the caller's
    collapse = next(f for f in r.findings if f.code == "loss-scale-collapse")
    assert (collapse.severity, collapse.step, collapse.module) == ("error", 7, "0")
    assert [(a["kind"], a["step"]) for a in r.summary["anomalies"]] == [    # calibration, then the real failure
        ("loss-scale-collapse", 2), ("nonfinite-loss", 7), ("nonfinite-loss", 8), ("nonfinite-loss", 9),
        ("loss-scale-collapse", 9)]


def test_healthy_twin_exits_clean_and_trains_bitwise_as_without_ampdoctor(tmp_path) -> None:
    script = _script(tmp_path)
    r = run_script(["python", script, "--out", str(tmp_path / "watched.pt")])
    assert r.ok and r.summary["script"] == {"status": "completed"}
    assert all(f.severity != "error" for f in r.findings)
    old = sys.argv[:]
    try:
        sys.argv = [script, "--out", str(tmp_path / "plain.pt")]
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = old
    plain, watched = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    assert all(torch.equal(plain[k], watched[k]) for k in plain)


GAN = """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)
    bad, out = float(sys.argv[1]), sys.argv[2]
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    oG, oD = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    sG, sD = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    bce = nn.BCEWithLogitsLoss()
    for step in range(8):
        real, z = torch.randn(8, 8) * (bad if step >= 3 else 1.0), torch.randn(8, 4)
        oD.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            loss_d = bce(D(real).float(), torch.ones(8, 1)) + bce(D(fake.detach()).float(), torch.zeros(8, 1))
        sD.scale(loss_d).backward(); sD.step(oD); sD.update()
        oG.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss_g = bce(D(fake).float(), torch.ones(8, 1))
        sG.scale(loss_g).backward(); sG.step(oG); sG.update()
    torch.save({"G": G.state_dict(), "D": D.state_dict(), "sD": sD.get_scale(), "sG": sG.get_scale()}, out)
"""


def _gan(tmp_path, bad: str, watched: bool):  # type: ignore[no-untyped-def]
    path, out = tmp_path / "gan.py", tmp_path / f"gan-{bad}-{watched}.pt"
    path.write_text(textwrap.dedent(GAN))
    r = None
    if watched:
        r = run_script(["python", str(path), bad, str(out)])
    else:
        old = sys.argv[:]
        try:
            sys.argv = [str(path), bad, str(out)]
            runpy.run_path(str(path), run_name="__main__")
        finally:
            sys.argv = old
    return r, torch.load(out)


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(torch.equal(a[m][k], b[m][k]) for m in ("G", "D") for k in a[m]) and a["sD"] == b["sD"]


def test_two_scalers_each_watch_sees_its_own_scalers_skipped_steps(tmp_path) -> None:
    """A GAN script with one GradScaler per optimizer; from step 3 the real batch is unnormalised (x 1e5), so the
    discriminator's fp16 forward overflows and its scaler skips every step from then on, while the generator's
    steps go through. The runner keeps looking at forwards until every optimizer is watched, and each watch takes
    the scaler it sees stepping its optimizer: the discriminator's watch reports its skipped steps and falling
    scale, the generator's none. Training is bitwise the run without ampdoctor."""
    r, state = _gan(tmp_path, "1e5", True)
    _, plain = _gan(tmp_path, "1e5", False)
    assert _same(state, plain) and state["sD"] < 65536.0 == state["sG"]
    assert r.summary["watches"] == 2 and r.summary["script"] == {"status": "completed"}
    g, d = r.summary["per_watch"]            # G is called first
    assert [g["steps"], d["steps"]] == [8, 8]
    assert g["skipped_steps"] == 0 and d["skipped_steps"] == 5, (g["skipped_steps"], d["skipped_steps"])
    assert d["loss_scales"][-1] < d["loss_scales"][0] and set(g["loss_scales"]) == {65536.0}
    assert "2 enabled GradScalers" in r.summary["scaler_note"] and "not seen" not in r.summary["scaler_note"]
    collapse = [f for f in r.findings if f.code == "loss-scale-collapse"]
    assert collapse and all(f.severity == "error" for f in collapse)


def test_two_scalers_healthy_twin_is_clean_and_bitwise(tmp_path) -> None:
    r, state = _gan(tmp_path, "1.0", True)
    _, plain = _gan(tmp_path, "1.0", False)
    assert _same(state, plain)
    assert [s["skipped_steps"] for s in r.summary["per_watch"]] == [0, 0]
    assert not any(f.severity == "error" for f in r.findings), r.findings
