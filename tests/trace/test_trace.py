"""``ampdoctor.trace``: statistics checked against the formats' known limits, the cheap tier, and host syncs.

Limits used (IEEE / OCP definitions): fp16 max 65504, smallest normal 2**-14, smallest subnormal 2**-24;
bf16 max (2 - 2**-7) * 2**127, smallest normal 2**-126, smallest subnormal 2**-133; e4m3fn max 448, smallest
normal 2**-6, smallest subnormal 2**-9; e5m2 max 57344, smallest normal 2**-14, smallest subnormal 2**-16.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.trace import CHEAP_FIELDS, FULL_FIELDS, _stats, dtype_limits

INF, NAN = math.inf, math.nan
AMPDOCTOR_DIR = os.path.dirname(os.path.abspath(ampdoctor.__file__))


class Times(nn.Module):
    """Returns ``x * 1`` so the traced op's output holds exactly the input values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1


def traced_output(x: torch.Tensor, *, full: bool = True) -> ampdoctor.trace.OpRecord:  # type: ignore[name-defined]
    m = Times()
    with ampdoctor.trace(m, full=full) as t:
        m(x)
    res = t.result()
    (rec,) = [r for r in res.records if r.op == "aten.mul.Tensor"]
    return rec


@pytest.mark.parametrize(
    ("dtype", "limits"),
    [
        (torch.float16, (65504.0, 2.0**-14, 2.0**-24)),
        (torch.bfloat16, ((2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133)),
        (torch.float32, ((2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149)),
        (torch.float8_e4m3fn, (448.0, 2.0**-6, 2.0**-9)),
        (torch.float8_e5m2, (57344.0, 2.0**-14, 2.0**-16)),
    ],
)
def test_dtype_limits_match_the_format_definitions(dtype, limits):
    assert dtype_limits(dtype) == limits


def test_full_statistics_fp16_exact():
    vals = [65504.0, -65504.0, 2.0**-24, 2.0**-14, 0.0, -0.0, INF, -INF, NAN, 1.0]
    x = torch.tensor(vals, dtype=torch.float16)
    assert x[2].item() == 2.0**-24  # the smallest subnormal is representable, not flushed
    s = traced_output(x).stats
    assert set(s) == set(FULL_FIELDS)
    assert s["absmax"] == 65504.0  # over finite values only
    assert s["min_nonzero"] == 2.0**-24
    assert s["n_subnormal"] == 1  # 2**-24 is subnormal, 2**-14 is the smallest normal and is not
    assert s["n_zero"] == 2  # +0 and -0
    assert (s["n_nan"], s["n_posinf"], s["n_neginf"]) == (1, 1, 1)
    assert s["n_at_max"] == 2  # +-65504
    assert s["numel"] == 10
    finite = [v for v in vals if math.isfinite(v)]
    assert s["norm"] == pytest.approx(math.sqrt(sum(v * v for v in finite)), rel=1e-6)
    assert s["n_at_limit"] == 0  # mul is not a bounded op


def test_full_statistics_bf16_subnormal_and_max():
    fmax, tiny, sub = dtype_limits(torch.bfloat16)
    x = torch.tensor([fmax, -sub, tiny, 3 * sub, 0.0, 1.5], dtype=torch.bfloat16)
    assert x[1].item() == -sub
    s = traced_output(x).stats
    assert s["absmax"] == fmax
    assert s["min_nonzero"] == sub
    assert s["n_subnormal"] == 2  # -2**-133 and 3 * 2**-133; 2**-126 is normal
    assert s["n_at_max"] == 1
    assert (s["n_zero"], s["n_nan"], s["n_posinf"], s["n_neginf"]) == (1, 0, 0, 0)


def test_full_statistics_fp8_e4m3():
    x = torch.tensor([448.0, -448.0, 2.0**-9, 2.0**-6, 0.0])  # all exactly representable in e4m3fn

    class ToFp8(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN202
            return x.to(torch.float8_e4m3fn)

    m = ToFp8()
    with ampdoctor.trace(m, full=True) as t:
        m(x)
    (rec,) = [r for r in t.result().records if r.dtype == torch.float8_e4m3fn]
    s = rec.stats
    assert (s["absmax"], s["min_nonzero"], s["n_subnormal"], s["n_at_max"], s["n_zero"]) == (
        448.0, 2.0**-9, 1, 2, 1)


def test_empty_tensor_statistics():
    s = traced_output(torch.zeros(0, 3, dtype=torch.float16)).stats
    assert s["numel"] == 0 and s["absmax"] == 0 and s["min_nonzero"] == INF
    assert s["n_nan"] == s["n_posinf"] == s["n_neginf"] == s["n_zero"] == 0


def test_bounded_op_counts_outputs_at_the_bound():
    """fp16 tanh returns exactly +-1.0 for |x| >= 4.506 (the spacing below 1 is 2**-11)."""

    class Tanh(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN202
            return torch.tanh(x)

    x = torch.tensor([-10.0, -4.6, -1.0, 0.0, 0.5, 4.6, 9.0], dtype=torch.float16)
    m = Tanh()
    with ampdoctor.trace(m, full=True) as t:
        y = m(x)
    (rec,) = [r for r in t.result().records if r.op == "aten.tanh.default"]
    assert rec.stats["n_at_limit"] == int((y.abs() == 1).sum()) == 4


def test_cheap_tier_is_min_and_max():
    x = torch.tensor([-3.5, 65504.0, 2.0**-24, -65504.0], dtype=torch.float16)
    rec = traced_output(x, full=False)
    assert set(rec.stats) == set(CHEAP_FIELDS) == {"min", "max"}
    assert (rec.stats["min"], rec.stats["max"]) == (-65504.0, 65504.0)
    assert rec.inputs == ()  # no lineage in the cheap tier


def test_cheap_tier_still_sees_inf_and_nan():
    m = Times()
    xs = [torch.tensor(v, dtype=torch.float16) for v in ([1.0, 2.0], [1.0, -INF], [NAN, 2.0])]
    with ampdoctor.trace(m) as t:  # the default tier is the cheap one
        for x in xs:
            m(x)
    res = t.result()
    assert not res.full
    muls = [r for r in res.records if r.op == "aten.mul.Tensor"]
    assert len(muls) == 3
    assert muls[1].stats == {"min": -INF, "max": 1.0}
    assert res.first_nonfinite is muls[1]
    assert res.first_nan is muls[2]
    with pytest.raises(ValueError, match="full=True"):
        res.lineage()


def test_full_tier_first_nonfinite_and_first_nan():
    m = Times()
    xs = [torch.tensor(v) for v in ([1.0, 2.0], [INF, 2.0], [NAN, 2.0])]
    with ampdoctor.trace(m, full=True) as t:
        for x in xs:
            m(x)
    res = t.result()
    assert res.full
    assert res.first_nonfinite.stats["n_posinf"] == 1
    assert res.first_nan.stats["n_nan"] == 1
    assert res.first_nonfinite.index < res.first_nan.index


def test_only_floating_outputs_are_recorded():
    class ArgMax(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN202
            return x.argmax(-1), x > 0, x.sum()

    m = ArgMax()
    x = torch.randn(3, 4)
    with ampdoctor.trace(m, full=True) as t:
        m(x)
    ops = [r.op for r in t.result().records if r.kind == "op"]
    assert ops == ["aten.sum.default"]


def test_trace_rejects_a_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ampdoctor.trace(lambda x: x)


# ------------------------------------------------------------------------------------------------ host syncs
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads (``.item()``, ``.tolist()``, ``bool(t)``, ...) made from ampdoctor's own code."""
    calls: list[str] = []
    for name in SYNC_METHODS:
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, __orig=orig, __name=name, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            f = sys._getframe(1)
            if os.path.abspath(f.f_code.co_filename).startswith(AMPDOCTOR_DIR):
                calls.append(f"{__name} from {os.path.basename(f.f_code.co_filename)}:{f.f_lineno}")
            return __orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return calls


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("full", [False, True])
def test_no_host_read_during_the_step_and_one_per_result(host_reads, full, monkeypatch):
    monkeypatch.setattr(_stats, "HOST_DEVICES", frozenset())  # as on an accelerator: CPU takes the device path
    model, opt = _model()
    x = torch.randn(4, 8)
    with ampdoctor.trace(model, opt, full=full) as t:
        _step(model, opt, x)
        _step(model, opt, x)
    assert host_reads == []  # no sync per op or per module
    res = t.result()
    assert len(host_reads) == 1, host_reads  # one device-to-host read for all records
    assert len(res.records) > (60 if full else 40) and all(r.stats for r in res.records)  # cheap tier: no views
    again = t.result()  # nothing new to read: no further sync
    assert len(host_reads) == 1 and len(again.records) == len(res.records)


def test_cpu_host_path_reads_only_in_the_statistics(host_reads):
    """On CPU (no device to sync with) the full tier's statistics read their few values back as they go; nothing
    else does, and the records' statistics are the ones the device path gives."""
    torch.manual_seed(0)
    model, opt = _model()
    x = torch.randn(4, 8)
    with ampdoctor.trace(model, opt, full=True) as t:
        _step(model, opt, x)
    # the statistics, and the write log deciding which writes need their exact re-run (trace._writes)
    assert host_reads and all(r.split(" from ")[1].startswith(("_stats.py", "_writes.py")) for r in host_reads), \
        host_reads
    host = [r.stats for r in t.result().records]
    _stats_off = pytest.MonkeyPatch()
    _stats_off.setattr(_stats, "HOST_DEVICES", frozenset())
    try:
        torch.manual_seed(0)
        model2, opt2 = _model()
        with ampdoctor.trace(model2, opt2, full=True) as t2:
            _step(model2, opt2, x)
        device = [r.stats for r in t2.result().records]
    finally:
        _stats_off.undo()
    assert host == device


@pytest.mark.parametrize("full", [False, True])
def test_result_per_step_inside_the_block(host_reads, full, monkeypatch):
    """Reading once per step while the trace stays active: one read each, and the read itself is not traced."""
    monkeypatch.setattr(_stats, "HOST_DEVICES", frozenset())  # as on an accelerator
    model, opt = _model()
    x = torch.randn(4, 8)
    with ampdoctor.trace(model, opt, full=full) as t:
        _step(model, opt, x)
        n1 = len(t.result().records)
        assert len(host_reads) == 1, host_reads
        _step(model, opt, x)
        res = t.result()
        assert len(host_reads) == 2, host_reads
    ops = [r.op for r in res.records if r.kind == "op"]
    first = [r.op for r in res.records[:n1] if r.kind == "op"]
    assert ops == first + first  # the same step twice: the same ops, none added by the reads
    assert all(r.stats for r in res.records)
