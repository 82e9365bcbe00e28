"""``check``'s quick pass decides a large sin/cos/softmax argument from the errors it MEASURES in the guard step
(element samples at the positions the float32 run sampled), not from a bound on them.

Healthy: logits of |max| ~140 from a bias-free head fed by a float32 value of |max| ~10 that autocast casts to bf16
(the bench T5's shape: its wo input, |max| 8.96). The bound alone escalates -- bf16's rounding of a value that large
could carry half the logits' error -- but the measured error of that cast is a fraction of it: the quick pass
answers, and the full diagnosis agrees (no error). Failing twin: a timestep-like value of |max| ~600 made by a
bf16 GEMM that adds a bias (an offset) before its ``sin``: measured off by radians, it escalates and the full
diagnosis reports ``precision-loss`` there."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampdoctor.diagnose import headroom_and_check
from ampdoctor.precision import make_spec
from ampdoctor.precision._runner import run
from ampdoctor.precision.triage import guard_step, reference_request


class _Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.head = nn.Linear(32, 256, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(30.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.up(x).float() * 4.5  # float32 (|max| ~10): autocast casts it to bf16 for the head
        return torch.log_softmax(self.head(g), -1)


class _Phase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)
        with torch.no_grad():
            self.t.bias.fill_(600.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.sin(self.t(x).float()))  # the bf16 GEMM's output, rounded at 600, into sin


def _spec(model: nn.Module) -> Any:
    torch.manual_seed(1)
    return make_spec(model, torch.randn(16, 8), loss_fn=lambda o, b: o.float().pow(2).mean(),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16-amp")


def _model(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _measured_and_bound_only(spec: Any) -> tuple[list[str], list[str]]:
    """The guard step's argument reasons from its measured errors, and from the bound alone (no samples)."""
    from ampdoctor.precision._rounded_args import argument_reasons  # the decision itself, both ways

    ref = run(spec, reference=True, headroom=True, request=reference_request("bf16-amp"))
    measured, _ = guard_step(spec, ref)
    tgt = run(spec, reference=False)
    bound = argument_reasons(ref.trace, tgt.trace.records, torch.bfloat16, "bf16", {})
    return [r for r in measured if "absolute error" in r], bound


def test_large_logits_whose_measured_rounding_sites_are_small_take_the_quick_pass() -> None:
    measured, bound = _measured_and_bound_only(_spec(_model(_Logits)))
    assert bound and "log_softmax" in bound[0], bound  # the bound alone would run the full diagnosis
    assert measured == []
    quick = headroom_and_check(_spec(_model(_Logits)))
    assert not quick.triage.full and quick.report is None, quick.triage.reasons
    full = headroom_and_check(_spec(_model(_Logits)), full=True)
    assert full.report is not None and not [f for f in full.report.findings if f.severity == "error"]


def test_a_phase_measured_lost_runs_the_full_diagnosis_which_reports_it() -> None:
    res = headroom_and_check(_spec(_model(_Phase)))
    assert res.triage.full and any("aten.sin.default" in r and "measured off by" in r for r in res.triage.reasons), \
        res.triage.reasons
    assert res.report is not None
    errs = [f for f in res.report.findings if f.severity == "error"]
    assert errs and errs[0].code == "precision-loss" and errs[0].module == "t" and errs[0].phase == "forward", errs
