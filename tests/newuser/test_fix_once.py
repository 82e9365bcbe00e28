"""A fix that two findings propose (keep_fp32 over both overflowing branches) is verified once, not once per order.

Found on a new user's fp8 Llama: ``ampdoctor fix`` listed and re-ran the same merged keep_fp32 three times, its
module list in three orders (3x the verification time). Here two parallel fp16-amp linears overflow (weights x3e4,
inputs x10: |out| ~1e6 > 65504); the healthy twin has nothing to verify.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
import ampdoctor.fixes._verify as verify_module
from ampdoctor.precision import make_spec


class TwoBranches(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        with torch.no_grad():
            self.a.weight.mul_(scale)
            self.b.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x).clamp(-10, 10) + self.b(x).clamp(-10, 10))


def _run(scale: float, monkeypatch: pytest.MonkeyPatch) -> tuple[ampdoctor.Report, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    original = verify_module.Session.verify

    def counting(self: Any, plan: Any, targets: tuple[str, ...] = ()) -> Any:
        calls.append(dict(plan.params))
        return original(self, plan, targets)

    monkeypatch.setattr(verify_module.Session, "verify", counting)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 10
    spec = make_spec(TwoBranches(scale), x, precision="fp16-amp", loss_fn=lambda out, b: out.float().mean())
    return ampdoctor.diagnose_and_fix(spec, steps=2), calls


def test_the_merged_keep_fp32_is_verified_once(monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls = _run(3e4, monkeypatch)
    assert [(f.code, f.module) for f in report.findings[:2]] == [("overflow", "a"), ("overflow", "b")]
    keeps = [c for c in calls if "modules" in c]
    assert len(keeps) == 1 and sorted(keeps[0]["modules"]) == ["a", "b"]
    proposed = [p for f in report.findings[:2] for p in f.fixes if p.id == "keep_fp32"]
    assert len(proposed) == 2 and all(p.verified for p in proposed)
    assert proposed[0].params == proposed[1].params          # both findings show the one verified fix


def test_healthy_twin_has_nothing_to_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls = _run(1.0, monkeypatch)
    assert report.ok and not report.findings and not calls
