"""Lineage of non-finite values: origins (made from finite inputs), descendants, absorption and the first NaN."""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.trace import is_nonfinite


def traced(model: nn.Module, *args: torch.Tensor):  # noqa: ANN201
    with ampdoctor.trace(model, full=True) as t:
        out = model(*args)
    res = t.result()
    return res, res.lineage(), out


def one(records, op: str, module: str | None = None):  # noqa: ANN001, ANN201
    (r,) = [r for r in records if r.op == op and (module is None or r.module == module)]
    return r


class Bucket(nn.Module):
    """T5-style relative-position bucketing: log of the offsets, the log(0) = -inf entry discarded by where."""

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        rel = torch.log(d.float())
        return torch.where(d == 0, 0.0, rel)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bucket = Bucket()
        self.lin = nn.Linear(4, 4)

    def forward(self, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b = self.bucket(d)
        y = self.lin(x) * 1e5  # fp16: |y| > 65504 -> inf
        return b.sum() + (y - y).sum()  # inf - inf = NaN


def test_benign_origin_absorbed_and_harmful_origin_with_first_nan():
    torch.manual_seed(0)
    model = Net().half()
    d, x = torch.tensor([0, 1, 2, 3]), torch.randn(2, 4).half()
    res, lin, out = traced(model, d, x)
    recs = res.records
    log, where = one(recs, "aten.log.default"), one(recs, "aten.where.self")
    mul, sub = one(recs, "aten.mul.Tensor"), one(recs, "aten.sub.Tensor")
    with torch.no_grad():
        y = model.lin(x) * 1e5
    assert lin.origins == [log.index, mul.index]
    # log(0) = -inf, exactly one entry; discarded by where: absorbed, no descendant, no NaN
    assert (log.stats["n_neginf"], log.stats["n_posinf"], log.stats["n_nan"]) == (1, 0, 0)
    assert lin.descendants[log.index] == []
    assert where.index in lin.absorbed[log.index]
    assert log.index not in lin.first_nan
    # the overflow: inf counts exactly those of the same fp16 product; NaN first at inf - inf
    assert mul.stats["n_posinf"] == int((y == math.inf).sum())
    assert mul.stats["n_neginf"] == int((y == -math.inf).sum())
    assert lin.first_nan[mul.index] == sub.index
    assert sub.stats["n_nan"] == int(torch.isinf(y).sum())
    assert lin.descendants[mul.index][0] == sub.index
    assert recs[lin.descendants[mul.index][-1]].op == "aten.add.Tensor"  # the output carries it
    assert lin.carried[sub.index] == frozenset({mul.index})
    assert math.isnan(out.item())


def test_partially_masked_softmax_absorbs_neg_inf():
    class Masked(nn.Module):
        def forward(self, s, keep):  # noqa: ANN001, ANN202
            return s.masked_fill(~keep, float("-inf")).softmax(-1)

    s = torch.randn(2, 3, 4)
    keep = torch.tensor([[True, True, False, False], [True, False, False, False]])[:, None, :].expand(2, 3, 4)
    res, lin, out = traced(Masked(), s, keep)
    fill, soft = one(res.records, "aten.masked_fill.Scalar"), one(res.records, "aten._softmax.default")
    assert lin.origins == [fill.index]
    assert fill.stats["n_neginf"] == int((~keep).sum()) == 15
    assert lin.absorbed[fill.index] == [soft.index]
    assert lin.descendants[fill.index] == []
    assert soft.stats["n_zero"] == 15 and not is_nonfinite(soft)
    assert torch.isfinite(out).all()


def test_fully_masked_row_turns_neg_inf_into_nan():
    class Masked(nn.Module):
        def forward(self, s, keep):  # noqa: ANN001, ANN202
            return s.masked_fill(~keep, float("-inf")).softmax(-1)

    s = torch.randn(2, 4)
    keep = torch.tensor([[True, False, True, False], [False, False, False, False]])
    res, lin, _ = traced(Masked(), s, keep)
    fill, soft = one(res.records, "aten.masked_fill.Scalar"), one(res.records, "aten._softmax.default")
    assert lin.origins == [fill.index]
    assert lin.first_nan[fill.index] == soft.index
    assert soft.stats["n_nan"] == 4  # the one fully masked row of length 4


def test_write_through_another_view_is_seen():
    """``buf[0].fill_(inf)`` changes ``buf`` behind its producer's back; the next reader of ``buf`` gets fresh
    statistics linked to the write, so the inf is traced to the fill."""

    class ViewWrite(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN202
            buf = x.clone()
            buf[0].fill_(math.inf)
            return buf.sum(0)

    res, lin, out = traced(ViewWrite(), torch.randn(3, 2))
    recs = res.records
    fill, view = [r for r in recs if r.op == "aten.fill_.Scalar"]  # the fill, then the re-read of ``buf``
    assert view.kind == "op" and view.index > fill.index
    total = one(recs, "aten.sum.dim_IntList")
    assert lin.origins == [fill.index]
    assert fill.index in view.inputs and view.stats["n_posinf"] == 2
    assert total.inputs == (view.index,)
    assert lin.descendants[fill.index] == [view.index, total.index]
    assert torch.isinf(out).all()


def test_nonfinite_input_is_an_origin_of_kind_input():
    class Lin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.fc(x)

    x = torch.tensor([[1.0, math.nan, 0.0]])
    res, lin, _ = traced(Lin(), x)
    (origin,) = lin.origins
    r = res.records[origin]
    assert (r.kind, r.op, r.module, r.shape) == ("input", "", "fc", (1, 3))
    assert r.stats["n_nan"] == 1
    addmm = one(res.records, "aten.addmm.default")
    assert lin.first_nan[origin] == origin and addmm.index in lin.descendants[origin]
