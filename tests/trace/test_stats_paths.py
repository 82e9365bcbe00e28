"""The CPU host path of the full statistics gives the same numbers, bit for bit, as the device path.

``full_stats`` on a CPU tensor takes a host path (few float passes, counts skipped when the range proves them zero);
any other device takes the reduction path that never reads a value back. Both must agree exactly on every field, for
every kind of value a rule counts: zeros, subnormals, values at the dtype's max, bounded outputs, flush-to-zero
candidates, and on chunked (large) tensors.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from ampdoctor.trace import _stats
from ampdoctor.trace._stats import FULL_FIELDS, HEADROOM_FORMATS, Scratch, full_stats


def _device_path(t: torch.Tensor, bounded: str | None, flush: bool) -> list[float]:
    x, finfo = _stats._prepare(t)
    row = torch.stack([p.to(torch.float64) for p in _stats._device_row(x, finfo, bounded, Scratch())])
    if flush:
        row = torch.cat([row, _stats.flush_counts(t)])
    return row.tolist()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 33, 65, generator=g)
    relu = torch.relu(x)
    tiny = torch.finfo(torch.float32).tiny
    sub = x * tiny  # many subnormals
    sub[0, 0, :5] = 0
    at_max = x.clone()
    at_max[1, 2, :3] = torch.finfo(torch.float32).max
    at_max[1, 3, :2] = 0
    soft = torch.softmax(x * 40, dim=-1)  # exact 1s and exact 0s
    tanh = torch.tanh(x * 30)
    big = torch.relu(torch.randn(_stats.CPU_CHUNK * 2 + 17, generator=g))  # three chunks, zeros in each
    big[_stats.CPU_CHUNK + 5] = 1e-42
    half = (x * 1e-5).half()  # fp16 subnormals and zeros, flush candidates for every format
    # float16 takes the host path through a float32 copy with float16's limits: its max, ones, subnormals, zeros and
    # a chunked tensor (a float32 limit or an unconverted chunk would change these counts)
    half_max = torch.tanh(x * 30).half() * 65504
    half_big = big.half() * 1e-4
    half_big[3] = 65504
    # float16's subnormal boundary (the host path counts ``|x| < tiny`` from the sign of ``|x| - mid``, mid between
    # the largest subnormal and tiny): every value at it, both signs, the smallest subnormal, zeros
    f16 = torch.finfo(torch.float16)
    top_sub = f16.tiny - 2.0 ** -24
    edge = torch.tensor([f16.tiny, -f16.tiny, top_sub, -top_sub, 2.0 ** -24, -(2.0 ** -24), 0.0, -0.0, f16.tiny * 2,
                         1.0, -3.5, 2.0 ** -15] * 5, dtype=torch.float16)
    return {"fp16_edge": edge, "randn": x, "relu": relu, "subnormal": sub, "at_max": at_max, "softmax": soft,
            "tanh": tanh, "chunked": big, "fp16": half, "fp16_max": half_max, "fp16_chunked": half_big,
            "bf16": (x * 1e-30).bfloat16(), "zeros": torch.zeros(7, 9),
            "fp64": x.double() * 1e-310, "strided": x.transpose(0, 2), "e4m3": (x * 1e-3).to(torch.float8_e4m3fn)}


@pytest.mark.parametrize("name", list(_tensors()))
@pytest.mark.parametrize("bounded", [None, "abs1", "01", "1"])
@pytest.mark.parametrize("flush", [False, True])
def test_host_path_is_bitwise_the_device_path(name: str, bounded: str | None, flush: bool) -> None:
    t = _tensors()[name]
    host = full_stats(t, bounded, Scratch(), flush)
    ref = _device_path(t, bounded, flush)
    got = host if isinstance(host, list) else host.tolist()
    assert len(got) == len(FULL_FIELDS) + (len(HEADROOM_FORMATS) if flush else 0)
    assert got == ref, {f: (a, b) for f, a, b in zip(FULL_FIELDS, got, ref) if a != b}


def test_host_path_taken_and_counts_nonzero() -> None:
    """The cases above exercise the counts (a path that skipped them would also agree on all-zero counts)."""
    t = _tensors()
    rows = {k: full_stats(v, "1", Scratch(), True) for k, v in t.items()}
    field = {f: i for i, f in enumerate(FULL_FIELDS)}
    assert all(isinstance(rows[k], list) for k in ("randn", "relu", "subnormal", "chunked", "fp16", "bf16"))
    assert rows["relu"][field["n_zero"]] > 1000 and rows["chunked"][field["n_zero"]] > 100_000
    assert rows["subnormal"][field["n_subnormal"]] > 1000 and rows["chunked"][field["n_subnormal"]] == 1
    assert rows["at_max"][field["n_at_max"]] == 3 and rows["softmax"][field["n_at_limit"]] > 10
    assert sum(rows["fp16"][len(FULL_FIELDS):]) > 0 and rows["fp16"][field["n_subnormal"]] > 0  # fp8 would flush
    assert rows["fp16_max"][field["n_at_max"]] > 10 and rows["fp16_chunked"][field["n_subnormal"]] > 1000
    assert rows["fp16_chunked"][field["n_at_max"]] == 1 and isinstance(rows["fp16_max"], list)
    assert rows["zeros"][field["min_nonzero"]] == math.inf
    assert rows["fp16_edge"][field["n_subnormal"]] == 25 and rows["fp16_edge"][field["n_zero"]] == 10


def test_non_finite_falls_back_to_the_device_path() -> None:
    x = torch.randn(100)
    x[3], x[4], x[5] = math.inf, -math.inf, math.nan
    row = full_stats(x, None, Scratch())
    assert not isinstance(row, list)
    field = {f: i for i, f in enumerate(FULL_FIELDS)}
    assert [row[field[k]].item() for k in ("n_nan", "n_posinf", "n_neginf")] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_zero_ops_known_row_is_bitwise_lite_stats(dtype: torch.dtype) -> None:
    """The lite row of an all-zero op's output, known without reading it, is what ``lite_stats`` computes."""
    for t in (torch.zeros(5, 7, dtype=dtype), torch.zeros(3, dtype=dtype).expand(4, 3), -torch.zeros(6, dtype=dtype)):
        assert _stats.zeros_lite_row(t) == _stats.lite_stats(t, Scratch())
    assert _stats.zeros_lite_row(torch.zeros(0, dtype=dtype)) is None  # empty: computed as before


def test_fresh_optimizer_state_rows_are_the_zero_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh AdamW's ``zeros_like`` state and a ``zero_`` of the gradients take the known row (one per such
    record, no tensor read), and it holds the numbers ``lite_stats`` would compute."""
    import ampdoctor
    from ampdoctor.trace import _mode

    known = []

    def counting(t: torch.Tensor) -> list[float] | None:
        row = _stats.zeros_lite_row(t)
        known.append(row is not None)
        return row

    monkeypatch.setattr(_mode, "zeros_lite_row", counting)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with ampdoctor.trace(model, opt, full=True) as t:
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    recs = [r for r in t.result().records if r.op in ("aten.zeros_like.default", "aten.zero_.default")]
    assert {r.op for r in recs} == {"aten.zeros_like.default", "aten.zero_.default"}
    assert known == [True] * len(recs)  # every one of them took the known row, nothing else did
    for r in recs:
        want = _stats.lite_stats(torch.zeros(r.shape, dtype=r.dtype), Scratch())
        assert list(r.stats.values()) == want, r


def test_a_statistic_that_raises_marks_the_record_unknown_and_the_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording mode's full and lite rows catch a failing statistic (an unsupported tensor): that record's
    statistics read NaN, every other record and the step's numbers are unchanged."""
    from torch import nn

    import ampdoctor
    from ampdoctor.trace import _mode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x = torch.randn(3, 4)

    def step(broken: bool) -> tuple[Any, list[torch.Tensor]]:
        m = copy.deepcopy(model)
        o = torch.optim.SGD(m.parameters(), lr=0.1, foreach=False)
        o.load_state_dict(opt.state_dict())
        with monkeypatch.context() as mp:
            if broken:
                real_full, real_lite = _mode.full_stats, _mode.lite_stats

                def full(t: torch.Tensor, *a: Any) -> Any:
                    if t.shape == (3, 1):
                        raise RuntimeError("unsupported")
                    return real_full(t, *a)

                def lite(t: torch.Tensor, *a: Any) -> Any:
                    if t.shape == (1,):
                        raise RuntimeError("unsupported")
                    return real_lite(t, *a)
                mp.setattr(_mode, "full_stats", full)
                mp.setattr(_mode, "lite_stats", lite)
            with ampdoctor.trace(m, o, full=True) as tr:
                m(x).sum().backward()
                o.step()
        return tr.result(), [p.detach().clone() for p in m.parameters()]

    good, good_params = step(False)
    bad, bad_params = step(True)
    assert all(torch.equal(a, b) for a, b in zip(good_params, bad_params))
    assert len(good.records) == len(bad.records)
    broken = [r for r in bad.records if (r.phase != "optimizer" and r.kind == "op" and tuple(r.shape) == (3, 1))
              or ((r.phase == "optimizer" or r.kind == "param") and tuple(r.shape) == (1,))]  # (lite rows)
    assert broken and any(r.phase == "optimizer" for r in broken) and any(r.phase != "optimizer" for r in broken)
    rows = {r.row for r in broken}  # a broken row reads NaN, also where an alias (``t``) shares it
    for g, b in zip(good.records, bad.records):
        if b.row in rows:
            assert all(math.isnan(v) for v in b.stats.values()), b
        else:
            assert repr(g.stats) == repr(b.stats), (g, b)
