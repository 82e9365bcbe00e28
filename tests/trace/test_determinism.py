"""Observation is exact and deterministic: a freed tensor's reused memory never lends its record to a new one."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn

import ampdoctor


class Reuse(nn.Module):
    """The allocator's reuse, made deterministic: a second storage over a freed one's memory, changed unseen."""

    def forward(self, x: torch.Tensor, mem: np.ndarray) -> torch.Tensor:
        buf = torch.from_numpy(mem)
        torch.mul(x, 1000.0, out=buf)  # recorded: absmax 1000
        del buf  # its storage is freed; the memory stays
        mem[:] = 0.0  # changed where no trace sees it (as a new allocation's contents are)
        fresh = torch.from_numpy(mem)  # another storage at the same data pointer, same geometry
        return fresh + 1.0


def test_new_storage_at_a_recorded_tensors_address_gets_its_own_statistics() -> None:
    m = Reuse()
    with ampdoctor.trace(m, full=True) as t:
        out = m(torch.ones(4), np.zeros(4, dtype=np.float32))
    recs = t.result().records
    (mul,) = [r for r in recs if r.op.startswith("aten.mul")]
    (add,) = [r for r in recs if r.op.startswith("aten.add")]
    assert mul.stats["absmax"] == 1000.0 and float(out.max()) == 1.0
    assert add.inputs and mul.index not in add.inputs  # before: linked to the dead storage's record
    (lift,) = [recs[i] for i in add.inputs]  # from_numpy's lift_fresh of the new storage, seen as a leaf
    assert lift.stats["absmax"] == 0.0 and lift.stats["n_zero"] == 4.0
    assert [recs[i].kind for i in lift.inputs] == ["input"] and mul.index not in lift.inputs


def _step_records(model: nn.Module, x: torch.Tensor) -> list[tuple[object, ...]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ampdoctor.trace(model, opt, full=True) as t:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return [(r.op, r.module, r.phase, r.kind, r.inputs, r.row, r.dtype, r.shape,
             tuple((k, v) for k, v in sorted(r.stats.items()) if not math.isnan(v)))
            for r in t.result().records]


def test_two_traces_of_the_same_train_step_are_identical() -> None:
    torch.manual_seed(0)  # 36 parameters: AdamW makes 36 fresh step counters where backward scalars were freed
    base = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())])
    x = torch.randn(4, 8)
    first = _step_records(copy.deepcopy(base), x)
    junk = [torch.randn(()) for _ in range(32)]  # a different heap between the runs
    second = _step_records(copy.deepcopy(base), x)
    del junk
    assert first == second
    opt_lifts = [r for r in first if r[0] == "aten.lift_fresh.default" and r[2] == "optimizer"]
    assert opt_lifts and all(dict(r[8])["absmax"] == 0.0 for r in opt_lifts)  # AdamW's fresh step counters
