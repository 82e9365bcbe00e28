"""``diagnose`` on every rank of a 2-process DDP job (gloo, CPU), as ``torchrun`` would run it.

* A tiny ``BertModel`` with its pooler, trained on a loss of ``last_hidden_state``: DDP's reducer raises on the
  second step on every rank; each rank's report leads with ``unused-parameters`` at ``module.pooler.dense``
  (names keep DDP's ``module.`` prefix), and nothing hangs.
* The same MLP on both ranks, rank 1's batch large enough that ``up``'s output overflows fp16 there only: rank 1
  reports the overflow at ``module.up``; DDP's gradient all-reduce hands the NaN gradients to rank 0 too, and
  rank 0's report names rank 1's overflow (one ``all_reduce`` at analysis) instead of blaming the bucket copy
  where rank 0 first sees them. Each rank's ``watch`` writes its own reproducers.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch import nn

from ampdoctor.findings._ranks import agree
from ampdoctor.precision._distributed import is_collective, own_origins, rank_info, received_origins
from tests.distributed._workers import FP16_MAX, ddp_overflow_on_rank1, ddp_unused_pooler, launch

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")
WORLD = 2


@pytest.fixture(scope="module")
def unused() -> list[dict]:
    return launch(ddp_unused_pooler, WORLD)


@pytest.fixture(scope="module")
def overflow() -> list[dict]:
    return launch(ddp_overflow_on_rank1, WORLD)


# ------------------------------------------------------------------------------------------- unused pooler
def test_the_unused_pooler_breaks_ddp_on_the_second_step(unused):
    for res in unused:
        assert res["plain_error"].startswith("Expected to have finished reduction in the prior iteration")
        assert res["pooler_grad_none"]


def test_every_rank_names_the_unused_pooler(unused):
    for rank, res in enumerate(unused):
        f = res["findings"][0]
        assert (f["code"], f["module"], f["phase"], f["severity"]) == (
            "unused-parameters", "module.pooler.dense", "backward", "error"), rank
        assert f["evidence"]["parameters"] == ["module.pooler.dense.weight", "module.pooler.dense.bias"]
        assert f["evidence"]["crash_step"] == 1  # the reducer's error, met in the diagnosed run as well
        assert "DistributedDataParallel(model, find_unused_parameters=True)" in f["fix_snippets"]
        s = res["summary"]
        assert (s["rank"], s["world_size"]) == (rank, WORLD)
        assert s["exception"]["step"] == 1 and s["nonfinite_ranks"] == []
        assert "module.pooler.dense.weight" in res["param_names"]


# -------------------------------------------------------------------------------------- overflow on rank 1
def test_the_planted_overflow_is_on_rank_1_only(overflow):
    r0, r1 = overflow
    assert r0["up_absmax_fp32"] < FP16_MAX < r1["up_absmax_fp32"]
    assert max(r0["batch_absmax"], r1["batch_absmax"]) < FP16_MAX  # the batch itself fits fp16
    assert math.isfinite(r0["summary"]["loss_target"][0])  # rank 0's own forward stays finite
    assert math.isnan(r1["summary"]["loss_target"][0])


def test_rank_1_names_its_overflow(overflow):
    f = overflow[1]["findings"][0]
    assert (f["code"], f["module"], f["op"], f["phase"], f["step"]) == (
        "overflow", "module.up", "aten.addmm.default", "forward", 0)
    s = overflow[1]["summary"]
    assert (s["rank"], s["world_size"], s["nonfinite_ranks"]) == (1, WORLD, [1])
    assert "nonfinite_received_through" not in s


def test_rank_0_is_told_the_values_came_from_rank_1(overflow):
    r0, r1 = overflow
    f = r0["findings"][0]
    key = ("code", "module", "op", "phase", "step")
    assert [f[k] for k in key] == [r1["findings"][0][k] for k in key]  # the origin on rank 1, not a local op
    assert f["severity"] == "error"
    ev = f["evidence"]
    assert (ev["origin_rank"], ev["rank"], ev["world_size"], ev["local"]) == (1, 0, WORLD, False)
    assert ev["received_through"] == "c10d.allreduce_.default"
    assert "Rank 1 of 2" in f["explanation"] and "rank 1" in f["title"]
    s = r0["summary"]
    assert (s["rank"], s["world_size"], s["nonfinite_ranks"]) == (0, WORLD, [1])
    assert s["nonfinite_origin"] == {"rank": 1, "step": 0, "phase": "forward", "module": "module.up",
                                     "op": "aten.addmm.default", "code": "overflow"}
    assert s["nonfinite_received_through"] == "c10d.allreduce_.default"
    # no other error blames an op of rank 0 (the bucket views, the collective) for the received values
    assert [x for x in r0["findings"][1:] if x["severity"] == "error"] == []
    assert all(not x["op"].startswith("c10d.") for x in r0["findings"])


def test_the_callers_ddp_model_is_untouched(overflow):
    assert all(res["grads_untouched"] for res in overflow)


def test_each_rank_writes_its_own_reproducers(overflow):
    for rank, res in enumerate(overflow):
        assert "watch_error" not in res, f"ampdoctor.watch not importable on rank {rank}: {res['watch_error']}"
        assert res["watch_disabled"] is None
        assert "step000000-nonfinite-grads.pt" in res["reproducers"], rank  # the all-reduced grads, both ranks
    assert "step000000-nonfinite-loss.pt" in overflow[1]["reproducers"]  # only rank 1's loss is NaN at step 0
    assert "step000000-nonfinite-loss.pt" not in overflow[0]["reproducers"]


def test_a_cast_after_wrapping_stops_the_all_reduce_unless_the_reducer_is_rebuilt(overflow):
    for res in overflow:
        assert res["grads_synced_after_cast"] == {"cast only": False, "resynced": True}


# ------------------------------------------------------------------------------- the mechanism, in one process
def _rec(index, op, inputs=(), kind="op", phase="backward", step=0):
    return SimpleNamespace(index=index, op=op, inputs=inputs, kind=kind, phase=phase, step=step, module="m")


@pytest.mark.parametrize("collective_looked_finite", [True, False])
def test_values_out_of_ddps_all_reduce_are_received(collective_looked_finite):
    """DDP's bucket after the all-reduce: the trace reads the collective's output before it completes, so its
    record may look finite (then the bucket views are the first non-finite records) or not (then it is)."""
    records = [_rec(0, "aten.mm.default"), _rec(1, "<view write>", (0,)), _rec(2, "c10d.allreduce_.default", (1,)),
               _rec(3, "aten.as_strided.default", (2,), phase="optimizer"),
               _rec(4, "aten.addmm.default", kind="op", phase="forward", step=1)]
    first = 3 if collective_looked_finite else 2
    assert received_origins(records, [first, 4]) == {first}
    assert own_origins(records, [first, 4]) == [4]


def test_buffer_reads_are_nobodys_origin():
    """FSDP: an untraced buffer that only feeds an all-gather, and a view of ``empty``, hold garbage, not data."""
    records = [_rec(0, "", kind="input", phase="forward"), _rec(1, "aten.split.Tensor", (0,), phase="forward"),
               _rec(2, "c10d.allgather_.default", (1,), phase="forward"),
               _rec(3, "aten.empty.memory_format", kind="alloc", phase="optimizer"),
               _rec(4, "aten.view.default", (3,), phase="optimizer"),
               _rec(5, "", kind="batch", phase="forward", step=1)]
    assert received_origins(records, [0, 4, 5]) == {0, 4}
    assert own_origins(records, [0, 4, 5]) == [5]  # the batch is this rank's own data


def test_outside_a_process_group_nothing_is_exchanged():
    assert is_collective("c10d.allreduce_.default") and is_collective("_c10d_functional.all_reduce.default")
    assert not is_collective("aten.add.Tensor") and not is_collective("<view write>")
    if not (dist.is_available() and dist.is_initialized()):
        assert rank_info() is None
    # a model without DDP/FSDP never triggers the collective, initialized process group or not
    assert agree(nn.Linear(2, 2), [], {}, [], [], ("overflow",)) is None
