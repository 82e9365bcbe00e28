"""``ampdoctor.watch`` on both ranks of a 2-process DDP job (gloo, CPU): a NaN loss on rank 1 only.

Rank 1 alone sees the anomaly and replays the step in process (default policy and ``"replay"``). The replay runs
on the local, unwrapped module and issues no collective: both ranks finish every step, and a final
``all_reduce`` still pairs up. The launcher kills the ranks after a timeout, so a desynchronised job fails the
test instead of hanging it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed._workers import ddp_watch_agreed_decisions, ddp_watch_nan_loss_on_rank1, launch

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


@pytest.fixture(scope="module")
def nan_loss() -> list[dict]:
    return launch(ddp_watch_nan_loss_on_rank1, 2, timeout=120.0)


@pytest.mark.parametrize("policy", ["warn", "replay"])
def test_a_replay_on_one_rank_never_desynchronises_the_job(nan_loss, policy):
    r0, r1 = (res[policy] for res in nan_loss)
    for r in (r0, r1):
        assert r["steps"] == 3 and r["disabled"] is None and r["finite_weights"]
        assert r["all_reduce"] == 3.0                     # 1 + 2: both ranks reached the same collective
    assert r1["anomalies"] == [("nonfinite-loss", 1)] and r1["codes"] == ["overflow"]
    assert r1["replayed"] and r1["replay_error"] is None
    assert r0["anomalies"] == [] and not r0["replayed"]  # its loss and grads are finite
    assert r0["codes"] == ["overflow"]                   # ... but its report names rank 1's NaN (test_watch_ranks.py)


@pytest.fixture(scope="module")
def agreed() -> list[dict]:
    return launch(ddp_watch_agreed_decisions, 2, timeout=120.0)


def test_skip_is_agreed_so_the_replicas_stay_equal(agreed):
    r0, r1 = (res["skip"] for res in agreed)
    for r in (r0, r1):
        assert r["steps"] == 3 and r["error"] is None and r["disabled"] is None
        assert r["skipped_by_guard"] == 1            # rank 0 skips rank 1's bad step too
        assert r["replicas_equal"]


def test_raise_is_agreed_so_no_rank_waits(agreed):
    r0, r1 = (res["raise"] for res in agreed)
    assert r1["error"] == ("nonfinite-loss", 1) and r0["error"] == ("other-rank", 1)
    for r in (r0, r1):
        assert r["steps"] == 1 and r["replicas_equal"] and r["unchanged_by_bad_step"]


def test_a_raise_seen_after_the_last_step_is_raised_at_exit(agreed):
    r0, r1 = (res["raise-late"] for res in agreed)
    assert r1["error"] == ("nonfinite-loss", 2) and r0["error"] is None
    assert r0["steps"] == r1["steps"] == 3 and r0["replicas_equal"]
