"""The fp8 emulation's own bookkeeping (amax, scale, statistics, amax history) never appears in a trace of the
user's step: a traced emulated step records the user's ops only, its results and fp8 statistics are bitwise those
of the untraced step, and a zero weight quantised without an amax floor is reported at the user's layer (the
emulated GEMM, ``aten.linear.default``), not at a ``reciprocal`` inside the quantiser."""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.precision import Fp8Recipe, fp8_autocast
from ampdoctor.trace import untraced

#: ops only the quantiser runs on this model (the user's step is two linears, a square and a mean)
QUANTISER_OPS = ("aten.abs", "aten.amax", "aten.reciprocal", "aten.clamp", "aten.sort", "aten.gather",
                 "aten.square", "aten.stack", "aten.copy_", "aten.index_put", "aten.select", "aten.slice")


def _net(zero_b: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 4, bias=False))
    if zero_b:
        with torch.no_grad():
            m[1].weight.zero_()  # LoRA's B
    return m


def _step(m: nn.Module, recipe: Fp8Recipe, traced: bool) -> tuple[torch.Tensor, list, object]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with fp8_autocast(m, recipe) as fp8:
        if traced:
            with ampdoctor.trace(m, full=True) as t:
                loss = m(x).pow(2).mean()
                loss.backward()
            records = t.result().records
        else:
            loss = m(x).pow(2).mean()
            loss.backward()
            records = []
    return loss.detach(), records, fp8.stats()


def _ops(records: list) -> set[str]:
    return {r.op.rsplit(".", 1)[0] for r in records if r.kind == "op"}


def test_a_traced_fp8_step_records_no_quantiser_op_and_changes_nothing():
    for recipe in (Fp8Recipe(scaling="delayed"), Fp8Recipe(scaling="dynamic")):
        plain_loss, _, plain_stats = _step(_net(False), recipe, traced=False)
        loss, records, stats = _step(_net(False), recipe, traced=True)
        ops = _ops(records)
        assert ops, "the trace recorded nothing"
        assert not ops & set(QUANTISER_OPS), sorted(ops & set(QUANTISER_OPS))
        assert not any("float8" in str(r.dtype) for r in records)        # no fp8 cast of the quantiser either
        assert torch.equal(loss, plain_loss) and stats == plain_stats   # observation has no side effects
        assert len(stats.tensors) == 6                                  # 2 layers x (input, weight, grad_output)


def test_an_unguarded_zero_weight_is_first_nonfinite_at_the_users_layer():
    loss, records, stats = _step(_net(True), Fp8Recipe(scaling="dynamic", amax_floor=0.0), traced=True)
    assert math.isnan(float(loss))                                      # 0 * inf in the quantised zero weight
    assert "aten.reciprocal" not in _ops(records)
    first = next(r for r in records if r.kind == "op" and r.stats and
                 (r.stats.get("n_nan", 0) or r.stats.get("n_posinf", 0) or r.stats.get("n_neginf", 0)))
    assert first.module == "1" and first.phase == "forward" and first.op in ("aten.t.default", "aten.mm.default")
    weight = stats.select(module="1", role="weight")[0]
    assert weight.amax == 0 and math.isinf(weight.scale)


def test_the_report_names_the_users_op_with_an_error_and_the_floor_fixes_it():
    m = _net(True)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(m, x, loss_fn=lambda out, _: out.pow(2).mean(), precision="fp8",
                                fp8_recipe=Fp8Recipe(scaling="dynamic", amax_floor=0.0))
    top = report.findings[0]
    assert (top.code, top.severity.value, top.module, top.op, top.phase) == ("fp8-scale", "error", "1",
                                                                            "aten.linear.default", "forward")
    assert top.evidence["inf_scale_tensors"] >= 1 and top.evidence["role"] == "weight"
    assert any(f.id == "fp8_recipe" and f.params["amax_floor"] == 1e-12 for f in top.fixes)
    assert not any(f.op.startswith("aten.reciprocal") for f in report.findings)


def test_untraced_does_nothing_outside_a_trace_and_nests():
    with untraced():
        with untraced():
            y = torch.ones(3) * 2
    assert torch.equal(y, torch.full((3,), 2.0))
    m = nn.Linear(2, 2)
    with ampdoctor.trace(m, full=True) as t:
        with untraced():
            with untraced():
                torch.ones(2).reciprocal()
            torch.ones(2).reciprocal()
        torch.ones(2).sqrt()
    ops = _ops(t.result().records)
    assert "aten.sqrt" in ops and "aten.reciprocal" not in ops
