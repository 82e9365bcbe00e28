"""``ampdoctor run`` on a plain fp16-autocast + GradScaler script whose loss is NaN in the very first forward.

A Phi decoder (parallel attention + MLP, eager attention) with outlier magnitudes in layer 1 (input LayerNorm gain
and q/k projections x30): ``q @ k^T`` reaches ~1e5 > 65504 in fp16 at step 0; fp32 is finite (loss ~4.17). The
script never gives its loss to the watch, and GradScaler skipping the first steps looks like it calibrating its
initial scale, so the watch used to wait three steps and replay step 2. The model returns its loss itself
(``labels=``): ``ampdoctor run`` now checks it as the step's loss, so the anomaly is step 0's and the replay of step 0
names ``model.layers.1.self_attn``, ``aten.bmm``, forward, and the collapse warning no longer calls the skipped steps
GradScaler calibrating (loss scaling never makes the loss itself NaN). The healthy twin (no outliers) stays clean.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from ampdoctor.integrations.run import run_script  # noqa: E402

SCRIPT = textwrap.dedent('''
    import sys, torch, transformers
    torch.manual_seed(0)
    cfg = transformers.PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, partial_rotary_factor=0.5, attn_implementation="eager", resid_pdrop=0.0,
            embd_pdrop=0.0, attention_dropout=0.0)
    model = transformers.PhiForCausalLM(cfg)
    if sys.argv[1] == "bad":
        layer = model.model.layers[1]
        with torch.no_grad():
            for w in (layer.input_layernorm.weight, layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight):
                w.mul_(30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    LOSSES = []
    for step in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        LOSSES.append(loss.item())
''')


def _run(tmp_path, which: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return run_script(["python", str(path), which])


def test_nan_loss_in_the_first_forward_is_located_at_step_0(tmp_path) -> None:
    torch.manual_seed(0)
    r = _run(tmp_path, "bad")
    anomalies = r.summary["anomalies"]
    assert (anomalies[0]["kind"], anomalies[0]["step"]) == ("nonfinite-loss", 0), anomalies
    # the skipped steps 0..2 are no GradScaler calibration (tests/watch/test_calibration_message.py is that twin)
    collapse = next(a for a in anomalies if a["kind"] == "loss-scale-collapse")
    assert "The loss itself was inf/NaN from step 0" in collapse["message"]
    assert "calibrating a too-large initial scale" not in collapse["message"]
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase, first.step) == (
        "overflow", "model.layers.1.self_attn", "aten.bmm.default", "forward", 0), \
        [(f.code, f.module, f.op, f.phase, f.step) for f in r.findings]
    assert first.evidence["ref_absmax"] > 65504 and max(r.summary["replay"]["summary"]["loss_reference"]) < 10
    assert not r.ok


def test_healthy_twin_is_clean(tmp_path) -> None:
    r = _run(tmp_path, "good")
    assert r.ok and r.summary["anomalies"] == [] and "replay" not in r.summary, r.codes()
    assert r.summary["skipped_steps"] == 0 and len(r.summary["losses"]) == 3
