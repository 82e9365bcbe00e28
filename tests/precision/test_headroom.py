"""Headroom from one fp32 run predicts the module the low-precision run overflows in; healthy models are safe."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.precision import headroom, load_scenario_module, spec_from_module
from ampdoctor.precision.headroom import headroom_spec

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "cases"


def _forward_overflow_cases() -> list:
    if not SHARED.is_dir():
        if os.environ.get("CI") == "true":
            return [pytest.param(None, id="shared-cases-missing")]
        return []
    out = []
    for p in sorted(SHARED.glob("*.py")):
        text = p.read_text(encoding="utf-8")
        if '"overflow"' in text and '"phase": "forward"' in text:
            out.append(pytest.param(p, id=p.stem))
    return out


@pytest.mark.parametrize("path", _forward_overflow_cases())
def test_headroom_names_the_module_the_target_run_overflows(path: Path | None) -> None:
    if path is None:
        pytest.fail("../shared/cases is missing: CI must run the acceptance cases")
    module = load_scenario_module(str(path))
    h = headroom_spec(spec_from_module(module))
    report = ampdoctor.diagnose_file(str(path))
    overflow = next(f for f in report.findings if f.code in ("overflow", "must-stay-fp32"))
    fmt = "bf16" if (module.make().get("precision") or "").startswith("bf16") else "fp16"
    predicted = h.predicted_failures(fmt)
    # the target run's overflow module (or, for inline math, the module whose own code runs it) is predicted
    assert overflow.module in predicted, (overflow.module, predicted)
    row = next(r for r in h.rows if r.module == overflow.module and r.phase == "forward")
    assert row.margin_bits[fmt] < 0 and row.absmax > 65504


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(up=nn.Linear(16, 64), act=nn.GELU(), down=nn.Linear(64, 4)))


def test_healthy_model_is_safe_in_every_format_that_has_range() -> None:
    h = headroom(_mlp(), torch.randn(8, 16), loss_fn=lambda o, b: o.pow(2).mean())
    assert h.safe("fp16") and h.safe("bf16")
    assert h.keep_fp32("fp16") == []
    up = next(r for r in h.rows if r.module == "up" and r.phase == "forward")
    assert up.margin_bits["fp16"] == pytest.approx(math.log2(65504 / up.absmax))
    assert up.margin_bits["e4m3"] == pytest.approx(math.log2(448 / up.absmax))


def test_overflowing_layer_is_predicted_and_suggested_fp32() -> None:
    model = _mlp()
    with torch.no_grad():
        model.up.weight.mul_(1e5)  # up's output ~2e5 in fp32
    h = headroom(model, torch.randn(8, 16), loss_fn=lambda o, b: o.pow(2).mean())
    assert h.predicted_failures("fp16")[0] == "up"
    assert "up" in h.keep_fp32("fp16")
    assert h.safe("bf16")


def test_tiny_gradients_are_reported_as_flushing_in_fp16() -> None:
    model = _mlp()
    h = headroom(model, torch.randn(8, 16), loss_fn=lambda o, b: o.pow(2).mean() * 1e-12)
    flushing = h.underflowing("fp16")
    assert flushing and all(r.flush_fraction["fp16"] > 0.5 for r in h.rows if r.module in flushing
                            and r.phase == "backward")
    assert h.underflowing("bf16") == []


def test_headroom_leaves_the_model_untouched() -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    headroom(model, torch.randn(8, 16), loss_fn=lambda o, b: o.pow(2).mean())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_unknown_format_is_rejected() -> None:
    h = headroom(_mlp(), torch.randn(2, 16), loss_fn=lambda o, b: o.pow(2).mean())
    with pytest.raises(ValueError, match="expected one of fp16, bf16, e4m3, e5m2"):
        h.predicted_failures("fp12")


def _overflowing_spec(*, steps: int = 1, scaler: bool = False) -> object:
    """An MLP whose first Linear reaches ~9e4 in forward (fp16 overflows there), with an AdamW step."""
    from ampdoctor.precision import make_spec

    model = _mlp()
    with torch.no_grad():
        model.up.weight.mul_(40000.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    return make_spec(model, torch.randn(8, 16), precision="fp16", loss_fn=lambda o, b: o.float().pow(2).mean(),
                     optimizer=opt, scaler=sc, steps=steps)


def _findings(report: object) -> list[tuple[str, str, str, str, str]]:
    return [(f.code, f.severity, f.module, f.op, f.phase) for f in report.findings]  # type: ignore[attr-defined]


def test_check_runs_one_fp32_run_for_headroom_and_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check``'s headroom and diagnosis share the fp32 run: same headroom rows and the same findings as running
    them separately, with two runs instead of three (counted through the runner)."""
    import importlib

    from ampdoctor.diagnose import diagnose_spec, headroom_and_diagnose
    from ampdoctor.precision.headroom import shares_reference

    spec = _overflowing_spec()
    assert shares_reference(spec)
    alone_h, alone_r = headroom_spec(spec), diagnose_spec(spec)
    diagnose_mod = importlib.import_module("ampdoctor.diagnose")  # ampdoctor.diagnose is also the function
    calls: list[tuple[bool, bool]] = []
    real_run = diagnose_mod.run

    def counting_run(s, *, reference, headroom=False, **kw):  # noqa: ANN001, ANN202
        calls.append((reference, headroom))
        return real_run(s, reference=reference, headroom=headroom, **kw)

    monkeypatch.setattr(diagnose_mod, "run", counting_run)
    h, report = headroom_and_diagnose(spec)
    assert calls == [(True, True), (False, False)]
    assert h.to_dict() == alone_h.to_dict()
    assert _findings(report) == _findings(alone_r) and report.findings
    assert "up" in h.predicted_failures("fp16") and any(f.module == "up" for f in report.findings)


@pytest.mark.parametrize("kind", ["steps", "scaler"])
def test_check_runs_headroom_apart_when_the_reference_differs(kind: str) -> None:
    """Two steps, or a loss scaler (its scaled backward shifts every gradient's range): a separate headroom run."""
    from ampdoctor.diagnose import headroom_and_diagnose
    from ampdoctor.precision.headroom import shares_reference

    spec = _overflowing_spec(steps=2) if kind == "steps" else _overflowing_spec(scaler=True)
    assert not shares_reference(spec)
    h, _ = headroom_and_diagnose(spec)
    assert h.to_dict() == headroom_spec(spec).to_dict()
