"""Rank-aware ``ampdoctor.watch``: every rank's report names the rank that saw the job's first non-finite value.

Two gloo ranks (CPU), the default watch (``on_anomaly="warn"``, the in-process replay on) on the same tiny MLP on
both ranks, each with its own batches. The ranks exchange one tiny table per optimizer step
(:mod:`ampdoctor.watch._ranks`); the launcher kills the ranks after a timeout, so a desynchronised exchange fails a
test instead of hanging it. With ``ranks=False`` (or without the exchange) rank 0 would blame itself for the
inf/NaN gradients DDP's all-reduce handed it, and would know nothing of rank 1's NaN loss.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed._workers import ddp_watch_origin_rank, fsdp_watch_origin_rank, launch

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    return launch(ddp_watch_origin_rank, 2, timeout=240.0)


@pytest.fixture(scope="module")
def fsdp() -> list[dict]:
    return launch(fsdp_watch_origin_rank, 2, timeout=240.0)


def _same_story(r0: dict, r1: dict) -> None:
    """The ranks agree on what happened where: their summaries differ only in ``rank``."""
    s0, s1 = dict(r0["summary"]), dict(r1["summary"])
    assert (s0.pop("rank"), s1.pop("rank")) == (0, 1)
    assert s0 == s1
    for r in (r0, r1):
        assert r["disabled"] is None and r["all_reduce"] == 3.0
        assert r["summary"]["rank_exchanges"] == r["steps"]       # one exchange per optimizer step


@pytest.mark.parametrize("case", ["inf", "inf-no-loss"])
def test_inf_on_rank_1_only_is_named_on_rank_0(ddp, case):
    r0, r1 = (res[case] for res in ddp)
    _same_story(r0, r1)
    origin = r0["summary"]["nonfinite_origin"]
    assert r0["summary"]["origin_rank"] == 1 and origin["step"] == 1
    # rank 1's replay located the op; rank 0 is told where, and that its inf/NaN gradients were received
    assert (origin["code"], origin["module"], origin["op"]) == ("overflow", "up", "aten.addmm.default")
    first = r0["findings"][0]
    assert (first["code"], first["module"], first["op"], first["step"]) == ("overflow", "up", "aten.addmm.default", 1)
    assert first["evidence"]["origin_rank"] == 1 and first["evidence"]["received"] is True
    assert "rank 1" in first["title"] and "reaches rank 0" in first["title"]
    # rank 0's generic "non-finite gradients at step 1" finding blamed it for what it received: dropped
    assert not any(f["phase"] == "backward" and not f["module"] and f["step"] == 1 for f in r0["findings"])
    mine = r1["findings"][0]
    assert (mine["code"], mine["module"], mine["op"]) == ("overflow", "up", "aten.addmm.default")
    assert mine["evidence"]["origin_rank"] == 1 and mine["evidence"]["local"] is True


def test_rank_0_replay_of_a_received_collapse_says_it_came_from_rank_1(ddp):
    """GradScaler skips every step from 1 on (rank 1's loss is inf there) on both ranks (the all-reduced gradients
    overflow everywhere); rank 0's replay of its collapse stays finite, as it must: its note names rank 1, not
    "something the replay does not repeat" with advice to diagnose rank 0's inputs."""
    r0, r1 = (res["scaler"] for res in ddp)
    assert r0["summary"]["origin_rank"] == r1["summary"]["origin_rank"] == 1
    origin = r0["summary"]["nonfinite_origin"]
    assert (origin["step"], origin["module"], origin["op"]) == (1, "up", "aten.addmm.default"), origin
    assert r0["anomalies"] == [("loss-scale-collapse", 2)]     # skipped 0 (GradScaler calibrating), 1, 2
    note = r0["replay_note"]
    assert note.startswith("The replay of step 2 on rank 0 saw no inf/NaN, as expected") and "rank 1" in note
    assert "does not repeat" not in note
    collapse = next(f for f in r0["findings"] if f["code"] == "loss-scale-collapse")
    assert "rank 1 made the job's first non-finite value" in collapse["explanation"]
    assert "Diagnose that step with its real inputs" not in collapse["explanation"]
    assert r1["findings"][0]["evidence"]["local"] is True and r1["replay_note"] is None


def test_nan_loss_on_rank_1_only(ddp):
    r0, r1 = (res["nan-loss"] for res in ddp)
    _same_story(r0, r1)
    assert r0["anomalies"] == [] and r1["anomalies"] == [("nonfinite-loss", 1)]
    assert r0["summary"]["origin_rank"] == 1
    assert r0["summary"]["nonfinite_origin"]["kind"] == "nonfinite-loss"
    (f,) = r0["findings"]
    assert f["severity"] == "error" and f["step"] == 1 and f["evidence"]["origin_rank"] == 1
    assert f["evidence"]["received"] is False and "rank 0's own values stayed finite" in f["title"]
    assert r1["findings"][0]["evidence"]["local"] is True


def test_different_anomaly_counts_per_rank_tell_one_story(ddp):
    r0, r1 = (res["counts"] for res in ddp)
    _same_story(r0, r1)
    assert r1["anomalies"] == [("nonfinite-loss", 1), ("nonfinite-loss", 3)]
    assert r0["anomalies"] == [("nonfinite-loss", 2)]
    assert r0["summary"]["rank_own_anomalies"] == [1, 2]
    events = [(e["step"], e["rank"], e["local"], e["kind"]) for e in r0["summary"]["rank_events"]]
    assert events == [(1, 1, True, "nonfinite-loss"), (2, 0, True, "nonfinite-loss"), (3, 1, True, "nonfinite-loss")]
    assert r0["summary"]["origin_rank"] == r1["summary"]["origin_rank"] == 1
    # rank 0 keeps its own NaN loss of step 2 and is told rank 1's came first
    assert [(f["step"], f["evidence"].get("origin_rank")) for f in r0["findings"]] == [(1, 1), (2, None)]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_fsdp_full_shard_names_rank_1_with_the_original_parameter_names(fsdp, kind):
    r0, r1 = (res[kind] for res in fsdp)
    _same_story(r0, r1)
    assert r0["summary"]["origin_rank"] == 1 and r0["summary"]["nonfinite_origin"]["step"] == 1
    first = r0["findings"][0]
    assert first["evidence"]["origin_rank"] == 1 and first["evidence"]["received"] is True
    grads = next(f for f in r1["findings"] if f["phase"] == "backward" and f["step"] == 1)
    original = set(fsdp[0]["original_params"])
    assert grads["evidence"]["parameters"] and set(grads["evidence"]["parameters"]) <= original   # no FSDP prefix
    # no coverage verdict from shards (a rank's shard of a parameter can be empty): no false unused-parameters
    for r in (r0, r1):
        assert not any(f["code"] == "unused-parameters" for f in r["findings"])
