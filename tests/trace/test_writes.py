"""The write log's cheap paths count exactly what the whole exact re-run counts.

On the CPU a float32 write is re-run only where it left elements unchanged (none, or those gathered for a
point-wise op); each case here runs the same write through that path and through the whole re-run (``defer=False``,
the accelerator path) and compares every count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from ampdoctor.trace._writes import WRITE_FIELDS, OldValues, PendingWrite

aten = torch.ops.aten


def _stats(defer: bool, make: Callable[[], tuple[object, tuple, dict]], exact_needed: bool = False
           ) -> dict[str, float]:
    torch.manual_seed(0)  # the same tensors for both paths
    func, args, kwargs = make()
    t = args[0]
    pending = PendingWrite(func, args, kwargs, [t], defer=defer)
    func(*args, **kwargs)
    row = pending.rows(exact_needed)[0]
    values = row if isinstance(row, list) else row.tolist()
    return dict(zip(WRITE_FIELDS, values))


def _adam_like(dtype: torch.dtype, lr: float) -> Callable[[], tuple[object, tuple, dict]]:
    """``p.addcdiv_(m, d, value=-lr)``: zero rows of ``m`` (no update) and tiny updates against large weights."""
    def make() -> tuple[object, tuple, dict]:
        g = torch.Generator().manual_seed(0)
        p = (torch.randn(64, 32, generator=g) * 4).to(dtype)
        m = torch.randn(64, 32, generator=g).to(dtype)
        m[:8] = 0
        d = torch.rand(32, generator=g).to(dtype) + 0.5  # broadcast along rows
        return aten.addcdiv_.default, (p, m, d), {"value": -lr}
    return make


CASES = {
    "addcdiv-some-lost": _adam_like(torch.float32, 3e-7),
    "addcdiv-none-lost": _adam_like(torch.float32, 1e-3),
    "addcdiv-fp64": _adam_like(torch.float64, 1e-15),
    "mul-rounds-to-one": lambda: (aten.mul_.Scalar, (torch.randn(300) * 100, 1 - 2.0 ** -25), {}),  # all lost
    "add-tiny": lambda: (aten.add_.Tensor, (torch.randn(300) * 10, torch.randn(300) * 1e-6), {}),
    "lerp-zero-weights": lambda: (aten.lerp_.Scalar, (torch.cat([torch.zeros(5), torch.randn(50)]),
                                                      torch.randn(55), 1e-9), {}),
    "index_put-not-pointwise": lambda: (aten.index_put_.default,
                                        (torch.randn(20), (torch.tensor([1, 3, 5]),), torch.randn(3)), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_deferred_write_counts_equal_the_whole_exact_rerun(name: str) -> None:
    fast, whole = _stats(True, CASES[name]), _stats(False, CASES[name])
    assert {k: fast[k] for k in ("numel", "moving", "lost", "changed", "applied")} == \
        {k: whole[k] for k in ("numel", "moving", "lost", "changed", "applied")}
    assert whole["changed"] < whole["numel"] or name.endswith("none-lost") or name.startswith("index")
    if name in ("addcdiv-some-lost", "add-tiny"):
        assert 0 < whole["lost"] < whole["moving"]  # the case exercises the gathered re-run
    if name.startswith("index"):
        assert fast["intended"] == whole["intended"]  # not point-wise: re-run whole
    else:
        assert math.isnan(fast["intended"]) and math.isfinite(whole["intended"])  # the cheap path ran


def test_sixteen_bit_and_loop_code_writes_keep_their_exact_update() -> None:
    for make, needed in ((_adam_like(torch.bfloat16, 1e-4), False), (_adam_like(torch.float32, 1e-3), True)):
        fast, whole = _stats(True, make, needed), _stats(False, make, needed)
        assert math.isfinite(fast["intended"]) and fast == whole


def test_a_nonfinite_update_takes_the_whole_rerun() -> None:
    def make() -> tuple[object, tuple, dict]:
        p = torch.randn(10)
        return aten.add_.Tensor, (p, torch.tensor([math.inf] + [0.0] * 9)), {}
    fast, whole = _stats(True, make), _stats(False, make)
    assert fast["changed"] == whole["changed"] == 1 and not math.isfinite(fast["applied"]) and fast["moving"] == 1


def test_an_unmeasured_write_copies_nothing_and_keeps_no_tensor_row() -> None:
    """An unmeasured write (``WriteLog.measure`` said no) takes no old-value copy and its row is a host list of NaN:
    thousands of small row tensors made between an optimizer step's transients pin the holes those leave in the C
    heap (at 750M parameters ~0.8 parameter-sizes of peak RSS in the reference run, bench/results/scale.md)."""
    func, args, kwargs = _adam_like(torch.float32, 1e-3)()
    p = args[0]
    before = p.clone()
    pending = PendingWrite(func, args, kwargs, [p], defer=True, measure=False)
    assert pending.old == [None]
    func(*args, **kwargs)
    rows = pending.rows(False)
    assert len(rows) == 1 and isinstance(rows[0], list) and len(rows[0]) == len(WRITE_FIELDS)
    assert all(math.isnan(v) for v in rows[0])
    assert not torch.equal(p, before)  # the write itself ran untouched


def test_a_large_write_sums_applied_in_float32_chunks_within_float32_rounding() -> None:
    """Above ``_SUM_CHUNK`` elements the applied total is summed per float32 chunk (a float64 sum of float32 costs
    ~25x more on CPU): the counts stay exact and the total within float32 rounding of the whole re-run's."""
    def make() -> tuple[object, tuple, dict]:
        g = torch.Generator().manual_seed(1)
        p = torch.randn(300, 700, generator=g) * 4
        m = torch.randn(300, 700, generator=g)
        m[:40] = 0  # unchanged rows: the gathered re-run
        return aten.addcdiv_.default, (p, m, torch.rand(700, generator=g) + 0.5), {"value": -3e-7}
    fast, whole = _stats(True, make), _stats(False, make)
    assert {k: fast[k] for k in ("numel", "moving", "lost", "changed")} == \
        {k: whole[k] for k in ("numel", "moving", "lost", "changed")}
    assert 0 < whole["lost"] < whole["moving"]
    assert fast["applied"] == pytest.approx(whole["applied"], rel=1e-6) and fast["applied"] > 0


def test_old_values_live_in_reused_buffers_given_back_after_the_rows() -> None:
    """Two writes in a row borrow the same old-value buffer (no fresh allocation per write), and a write whose
    elements all changed is done after one pass: nothing left to lose, even where its update overflowed."""
    buffers = OldValues()
    ptrs = []
    for value in (1.0, math.inf):
        p = torch.randn(4096)
        func, args = aten.add_.Scalar, (p, value)
        pending = PendingWrite(func, args, {}, [p], defer=True, buffers=buffers)
        ptrs.append(pending.old[0].untyped_storage().data_ptr())
        func(*args)
        row = pending.rows(False)[0]
        assert isinstance(row, list) and row[:4] == [4096.0, 4096.0, 0.0, 4096.0] and math.isnan(row[4])
        assert pending.old == [None]
    assert ptrs[0] == ptrs[1]
    assert math.isinf(row[5])


@pytest.mark.parametrize("factor", [1 - 2.0 ** -25, 0.5])
def test_a_foreach_write_borrows_one_buffer_and_counts_as_the_whole_rerun(factor: float) -> None:
    """A multi-tensor write (``_foreach_mul_``) keeps its tensors' old values as views into one borrowed buffer per
    dtype: its rows equal the whole re-run's, whether every element changed (0.5) or none did (all updates lost)."""
    def rows(defer: bool) -> list[list[float]]:
        ts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10 for n in (10, 300, 7)]
        func, args = aten._foreach_mul_.Scalar, (ts, factor)
        pending = PendingWrite(func, args, {}, ts, defer=defer, buffers=OldValues())
        if defer:
            assert len({o.untyped_storage().data_ptr() for o in pending.old}) == 1
        func(*args)
        return [r if isinstance(r, list) else r.tolist() for r in pending.rows(False)]
    fast, whole = rows(True), rows(False)
    for f, w in zip(fast, whole):
        assert f[:4] == w[:4] and f[5] == pytest.approx(w[5], rel=1e-12)
    assert [r[2] for r in whole] == ([10.0, 300.0, 7.0] if factor != 0.5 else [0.0, 0.0, 0.0])
