"""A watched training loop inside ampdoctor's emulated fp8 block: the reproducer records the user's recipe, and the
replay diagnoses the step with it (not with ``Fp8Recipe()``).

The model: a LoRA-style pair of linears whose second weight starts at zero (LoRA's B). The user's recipe has no amax
floor (``amax_floor=0``, as unguarded hand-written or older recipes): the zero weight's amax 0 gives scale
``448 / 0 = inf`` and ``0 * inf = NaN`` - the loss is NaN at step 0. The default recipe floors amax at 1e-12 and
would never reproduce it: a replay that ran the default would report a healthy step.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampdoctor.precision import Fp8Recipe, fp8_autocast
from ampdoctor.precision.fp8 import active_recipe, fp8_disabled
from ampdoctor.watch import ReproducerError, load_reproducer, replay, watch

UNGUARDED = Fp8Recipe(scaling="dynamic", amax_floor=0.0)


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        m[1].weight.zero_()  # LoRA's B
    return m


def _train(tmp_path, recipe: Fp8Recipe) -> list[float]:
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    with watch(m, opt, reproducer_dir=tmp_path):
        for _ in range(2):
            opt.zero_grad()
            with fp8_autocast(m, recipe):
                loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


def test_the_reproducer_records_the_recipe_and_the_replay_runs_it(tmp_path):
    losses = _train(tmp_path, UNGUARDED)
    assert math.isnan(losses[0])                              # the truth: 0 * inf in the zero weight's quantisation
    files = sorted(tmp_path.glob("*.pt"))
    assert files, "no reproducer written"
    payload = load_reproducer(files[0])
    prec = payload["precision"]
    assert prec["name"] == "fp8" and prec["fp8_recipe"] == {"format": "hybrid", "scaling": "dynamic",
                                                            "amax_history_len": 1024, "margin": 0, "amax_floor": 0.0}
    report = replay(files[0], model_factory=_net)
    assert report.precision == "fp8" and not report.ok
    top = report.findings[0]  # the user's layer's GEMM, not the quantiser's reciprocal (its bookkeeping is untraced)
    assert (top.code, top.severity.value, top.module, top.op, top.phase) == ("fp8-scale", "error", "1",
                                                                            "aten.linear.default", "forward")
    assert not any(f.op.startswith("aten.reciprocal") for f in report.findings)
    layer = next(f for f in report.findings if f.code == "fp8-scale" and "roles" in f.evidence)  # per-layer stats
    assert (layer.module, layer.op, layer.phase) == ("1", "aten.linear.default", "forward")
    assert layer.evidence["roles"]["weight"]["zero_amax_tensors"] >= 1 and layer.evidence["amax_floor"] == 0.0


def test_the_default_recipe_trains_clean_and_records_no_nan(tmp_path):
    losses = _train(tmp_path, Fp8Recipe(scaling="dynamic"))      # amax floored at 1e-12: the twin is finite
    assert all(math.isfinite(v) for v in losses) and not list(tmp_path.glob("*.pt"))


def test_the_active_recipe_is_the_innermost_block_and_none_outside():
    m = _net()
    assert active_recipe() is None
    with fp8_autocast(m, UNGUARDED):
        assert active_recipe() == UNGUARDED
        with fp8_disabled():
            assert active_recipe() is None
    assert active_recipe() is None


def test_a_broken_recorded_recipe_is_a_clear_error(tmp_path):
    _train(tmp_path, UNGUARDED)
    payload = load_reproducer(sorted(tmp_path.glob("*.pt"))[0])
    payload["precision"]["fp8_recipe"] = {"format": "hybrid", "scaling": "sometimes"}
    with pytest.raises(ReproducerError, match="fp8_recipe"):
        replay(payload, model_factory=_net)
