"""``ampdoctor run`` on a plain script that trains healthily for 29 steps and then sinks GradScaler's loss scale.

Cosine attention with a learnt logit scale that nobody clamped (Swin-v2 clamps it at log 100): the task rewards
sharper attention, so Adam raises ``log_scale`` from 10.3 by a little each step; ``exp(log_scale) * cos`` is an fp16
product (a 0-dim fp32 factor times the fp16 ``q @ q^T``) and passes 65504 when ``log_scale > ln 65504 = 11.09``, at
step 29 (computed by the run itself: the first NaN loss). From then on every step overflows and is skipped and the
scale halves each step. The loss is computed by the script from the logits and never given to the watch: the watch
now checks the loss ``backward()`` runs on (before ``scaler.scale``), so the anomaly is step 29's, and its replay
names ``attn``, ``aten.mul.Tensor``, forward, at step 29 (before, the run of skipped steps was noticed at step 31
and the root cause said step 31). The healthy twin clamps the scale and stays free of inf/NaN findings.
"""

from __future__ import annotations

import logging
import math
import textwrap

from ampdoctor.integrations.run import run_script

SCRIPT = textwrap.dedent('''
    import math, sys, torch
    from torch import nn
    CLAMP = sys.argv[1] == "good"

    class CosAttn(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.v = nn.Linear(d, d, bias=False)
            self.log_scale = nn.Parameter(torch.tensor(10.3))

        def forward(self, x):
            q = nn.functional.normalize(x, dim=-1)
            s = self.log_scale.clamp(max=math.log(100.0)) if CLAMP else self.log_scale
            logits = s.exp() * (q @ q.transpose(-1, -2))
            return torch.softmax(logits, -1) @ self.v(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.attn, self.out = nn.Embedding(32, 16), CosAttn(16), nn.Linear(16, 32)

        def forward(self, ids):
            return self.out(self.attn(self.emb(ids)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    LOG_SCALES = []
    for step in range(33):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        LOG_SCALES.append(model.attn.log_scale.item())
''')


def _run(tmp_path, which: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return run_script(["python", str(path), which])


def test_the_step_whose_loss_first_goes_nan_is_the_one_located(tmp_path) -> None:
    r = _run(tmp_path, "bad")
    losses = r.summary["losses"]
    first_nan = next(i for i, v in enumerate(losses) if not isinstance(v, float) or not math.isfinite(v))
    assert first_nan == 29 and all(0 < v < 5 for v in losses[:29])      # healthy (unscaled) losses before it
    anomalies = [(a["kind"], a["step"]) for a in r.summary["anomalies"]]
    assert anomalies[0] == ("nonfinite-loss", 29) and ("loss-scale-collapse", 31) in anomalies, anomalies
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase, first.step) == (
        "overflow", "attn", "aten.mul.Tensor", "forward", 29), [(f.code, f.module, f.op, f.step) for f in r.findings]
    assert first.evidence["ref_absmax"] > 65504 and first.evidence["source"].startswith("train.py:")
    assert "loss-scale-collapse" in r.codes() and not r.ok


def test_healthy_twin_with_the_clamp_stays_finite(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ampdoctor")
    r = _run(tmp_path, "good")
    # its zero-grads replay is judged on underflow alone: no warning of an overflow the report never names (the log
    # said "replay of step 2: overflow in <root> (aten._to_copy.default, backward)" while the report was ok)
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert not any("overflow" in m for m in warned), warned
    assert any("no underflow against fp32" in rec.getMessage() for rec in caplog.records)
    assert r.summary["skipped_steps"] == 0
    # the clamp zeroes log_scale's gradient (in fp32 too): a zero-grads replay and a warning, never an inf/NaN
    assert all(a["kind"] == "zero-grads" for a in r.summary["anomalies"]), r.summary["anomalies"]
    assert not {"overflow", "nan-from-inf", "loss-scale-collapse"} & set(r.codes()) and r.ok, r.codes()
    assert all(0 < v < 5 for v in r.summary["losses"])
