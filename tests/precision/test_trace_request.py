"""The statistics each run leaves out (``ampdoctor.trace.Request``) are ones no reader reads.

The diagnosis's fp32 reference is traced with ``REFERENCE`` (no subnormal or at-max counts), a run read only by
``headroom`` / ``check``'s quick pass with ``HEADROOM_ONLY`` (no norm, subnormal or at-limit counts): those fields
read NaN. Every test runs the same thing twice, once with the declared requests and once with every run asking for
everything (``FULL``), and asserts identical reports: a finding, headroom or triage that starts reading a dropped
field sees NaN instead of a number and changes its output (or raises), and the test fails. The read audit behind
the requests: ``bench/trace_reads.py``, table in ``bench/results/trace_overhead.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.precision import load_scenario_module, make_spec, spec_from_module
from ampdoctor.precision._step import saved_rng
from ampdoctor.precision.headroom import headroom_spec
from ampdoctor.trace import FULL, HEADROOM_ONLY, REFERENCE, Request, trace

_runner = importlib.import_module("ampdoctor.precision._runner")
_headroom = importlib.import_module("ampdoctor.precision.headroom")
_diagnose = importlib.import_module("ampdoctor.diagnose")

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "cases"
#: one case per reader of a count the requests touch: subnormal inputs (underflow), a bounded op at its limit
#: (saturation), values at a format's max (fp8 casts), an fp16 optimizer, a T5 overflow with T5's mask sentinels
CASES = ("fp16_gradient_underflow_no_loss_scaling", "bert_pooler_tanh_saturation_fp16_amp",
         "fp8_lora_zero_amax_scale_nan", "adam_fp16_params_eps_underflow", "t5_amp_wo_overflow")


def _everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run asks for every statistic (what the trace computed before the requests)."""
    monkeypatch.setattr(_runner, "REFERENCE", FULL)
    monkeypatch.setattr(_runner, "REFERENCE_HEADROOM", FULL)
    monkeypatch.setattr(_headroom, "HEADROOM_ONLY", FULL)
    monkeypatch.setattr(_diagnose, "reference_request", lambda precision: FULL)  # check's fp32 run


def _report(rep: Any) -> str:
    d = rep.to_dict()
    d["summary"].pop("elapsed_s", None)
    return json.dumps(d, sort_keys=True, default=str)


def _case(name: str) -> Path:
    path = SHARED / f"{name}.py"
    if not path.is_file():
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"{path} is missing: CI runs the shared cases")
        pytest.skip(f"{path} is missing")
    return path


@pytest.mark.parametrize("name", CASES)
def test_shared_case_report_is_the_same_without_the_dropped_fields(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(_case(name))
    declared = _report(ampdoctor.diagnose_file(path))
    _everything(monkeypatch)
    assert _report(ampdoctor.diagnose_file(path)) == declared


class _Edges(nn.Module):
    """A float32 step whose own values hold subnormals, float32's max and a tanh at its bound: the counts the
    reference drops are nonzero there, so NaN in their place is a real difference to any reader."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        with torch.no_grad():
            self.lin.weight.copy_(torch.linspace(-3, 3, 64).reshape(8, 8))
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x) * 30.0)                                   # saturated: |h| == 1
        tiny = h * 1e-39                                                     # float32 subnormals
        big = x.sign() * torch.finfo(x.dtype).max                           # at the format's max, no inf
        return h.sum() + tiny.sum() * 1e30 + (big * 0).sum()


def _edges_spec(precision: str) -> Any:
    torch.manual_seed(0)
    model = _Edges()
    batch = torch.linspace(-2, 2, 32).reshape(4, 8)
    return make_spec(model, batch, precision=precision, loss_fn=lambda out, b: out,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("precision", ["fp16-amp", "bf16", "fp16"])
def test_reference_drops_counts_that_hold_values_and_the_report_is_unchanged(
        precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _edges_spec(precision)
    with saved_rng():
        ref = _runner.run(spec, reference=True)
    recs = [r for r in ref.trace.records if r.kind == "op" and r.phase in ("forward", "backward")
            and not (r.stats["absmax"] > 0 and r.stats["min_nonzero"] == math.inf)]  # not a lite row's alias
    assert len(recs) >= 5 and all(math.isnan(r.stats["n_subnormal"]) and math.isnan(r.stats["n_at_max"]) for r in recs)
    assert all(not math.isnan(r.stats["norm"]) and not math.isnan(r.stats["n_at_limit"]) for r in recs)
    declared = _report(_diagnose.diagnose_spec(spec))
    _everything(monkeypatch)
    with saved_rng():
        full_ref = _runner.run(_edges_spec(precision), reference=True)
    full = [r.stats for r in full_ref.trace.records if r.kind == "op" and r.phase in ("forward", "backward")]
    assert any(s["n_subnormal"] > 0 for s in full) and any(s["n_at_max"] > 0 for s in full)
    assert any(s["n_at_limit"] > 0 for s in full)
    assert _report(_diagnose.diagnose_spec(_edges_spec(precision))) == declared


def _headroom_json(h: Any) -> str:
    return json.dumps([dataclasses.asdict(r) for r in h.rows], sort_keys=True, default=str) + repr(h.notes)


def test_headroom_and_quick_check_are_the_same_without_norms_and_rare_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(_case("t5_gated_ff_product_overflow_fp16"))
    spec = spec_from_module(load_scenario_module(path))
    amp = dataclasses.replace(spec, precision="bf16-amp")
    h = _headroom_json(headroom_spec(spec))
    quick = _diagnose.headroom_and_check(amp)
    q = (_headroom_json(quick.headroom), quick.triage.to_dict(), quick.report and _report(quick.report))
    _everything(monkeypatch)
    assert _headroom_json(headroom_spec(spec_from_module(load_scenario_module(path)))) == h
    again = _diagnose.headroom_and_check(dataclasses.replace(spec_from_module(load_scenario_module(path)),
                                                             precision="bf16-amp"))
    assert (_headroom_json(again.headroom), again.triage.to_dict(), again.report and _report(again.report)) == q


def test_request_fields_read_nan_and_the_rest_is_bitwise_full() -> None:
    x = torch.linspace(-2, 2, 32).reshape(4, 8)
    rows = {}
    for req in (FULL, REFERENCE, HEADROOM_ONLY):
        model = _Edges()  # the same weights, no gradient yet
        with trace(model, full=True, request=req) as t:
            model(x).backward()
        rows[req] = [dict(r.stats, kind=r.kind) for r in t.result().records]
    dropped = {REFERENCE: {"n_subnormal", "n_at_max"}, HEADROOM_ONLY: {"norm", "n_subnormal", "n_at_limit"}}
    for req, fields in dropped.items():
        assert len(rows[req]) == len(rows[FULL])
        for full, got in zip(rows[FULL], rows[req]):
            for k, v in full.items():  # a dropped field is NaN, or a lite row's 0 (parameters: no counts at all)
                assert got[k] == v or (k in fields and math.isnan(got[k])), (k, full, got)
        for k in fields:
            assert sum(math.isnan(g[k]) for g in rows[req]) >= 10, k
    with pytest.raises(TypeError, match="Request"):
        trace(model, full=True, request="full")  # type: ignore[arg-type]
    assert Request() == FULL


def test_headroom_samples_cover_every_integer_bound_triage_reads() -> None:
    """``HEADROOM_ONLY`` samples only outputs beyond |max| ``samples_above``: triage reads a sample only beyond the
    largest integer its formats hold exactly, so the bound may not exceed the smallest of those."""
    from ampdoctor.precision.triage import QUICK
    from ampdoctor.trace import unit_roundoff

    assert 0 < HEADROOM_ONLY.samples_above <= min(1.0 / unit_roundoff(d) for d in QUICK.values())
    assert FULL.samples_above == 0 and REFERENCE.samples_above == 0


def test_checks_fp32_run_is_headroom_only_with_the_samples_the_guard_step_compares() -> None:
    """``check``'s fp32 run asks ``HEADROOM_ONLY`` with a lower sample bound: the rounding sites of a large
    sin/cos/softmax argument the guard step measures (``triage.reference_request``) are sampled too."""
    from ampdoctor.precision.triage import QUICK, reference_request

    for p in QUICK:
        req = reference_request(p)
        assert dataclasses.replace(req, samples_above=HEADROOM_ONLY.samples_above) == HEADROOM_ONLY
        assert 0 < req.samples_above < HEADROOM_ONLY.samples_above
