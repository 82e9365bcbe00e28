"""FSDP on 2 CPU ranks (gloo): what ampdoctor can observe and what it refuses, in torch's two FSDP APIs.

Both ``FullyShardedDataParallel(use_orig_params=True, device_id=cpu)`` (FSDP1) and ``fully_shard`` (FSDP2) train on
CPU with gloo. ``ampdoctor.trace`` observes a sharded step in place: ops are attributed to the wrapper's
``named_modules()`` (FSDP2 keeps the original names; FSDP1 adds ``_fsdp_wrapped_module.``), and the all-gathers and
reduce-scatters appear as ``c10d.*`` records. With rank 1's batch overflowing ``up`` in float32, rank 1's own
origin is the ``addmm`` of ``up``; rank 0 has none of its own (its inf/NaN arrive through the reduce-scatter).
``ampdoctor.diagnose`` works on deep copies, which FSDP does not allow: it raises a
:class:`~ampdoctor.precision.ScenarioError` on every rank (no collective, so nothing hangs).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed._workers import fsdp_trace, launch

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")
WORLD = 2


@pytest.fixture(scope="module")
def fsdp() -> list[dict]:
    return launch(fsdp_trace, WORLD)


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_a_sharded_step_is_traced_with_its_collectives(fsdp, kind):
    for res in fsdp:
        facts = res[kind]
        assert facts["trace_error"] is None
        assert "c10d._reduce_scatter_base_.default" in facts["collectives"]
        assert any("allgather" in op for op in facts["collectives"])


def test_fsdp2_keeps_the_original_names(fsdp):
    for res in fsdp:
        assert res["fsdp2_params"] == list(res["original_params"])
        assert res["fsdp2_modules"] == res["original_modules"]
        assert set(res["fsdp2"]["modules"]) == set(res["original_modules"])


def test_fsdp1_names_follow_the_wrappers_named_modules(fsdp):
    for res in fsdp:
        assert res["fsdp1_params"] == [f"_fsdp_wrapped_module.{n}" for n in res["original_params"]]
        assert set(res["fsdp1"]["modules"]) <= set(res["fsdp1_modules"])
        assert "_fsdp_wrapped_module.up" in res["fsdp1"]["modules"]


@pytest.mark.parametrize("kind, up", [("fsdp1", "_fsdp_wrapped_module.up"), ("fsdp2", "up")])
def test_the_overflow_is_local_on_rank_1_and_received_on_rank_0(fsdp, kind, up):
    r0, r1 = fsdp
    assert r0["up_nonfinite"] == 0 and r1["up_nonfinite"] > 0  # float32 overflow of up, on rank 1 only
    origin = {"op": "aten.addmm.default", "module": up, "phase": "forward", "kind": "op"}
    assert r0[kind]["received"] >= 1
    if kind == "fsdp2":
        assert r1[kind]["local"] == [origin]
        assert r0[kind]["local"] == []  # rank 0 computed no inf/NaN of its own
    else:
        # the first local origin is the forward addmm; FSDP1's asynchronous reduce-scatter into its flat gradient
        # buffer can, under load, show later backward `split`s of that buffer as local too (seen at load ~12)
        assert r1[kind]["local"][0] == origin
        assert all(o["phase"] == "backward" for o in r1[kind]["local"][1:])
    # FSDP1 (flat parameters) reads buffers its asynchronous all-gather fills: depending on timing, rank 0 may see
    # a value that arrived through that gather without the collective in its lineage. Not asserted, see
    # docs/distributed.md.


@pytest.mark.parametrize("kind, api", [("fsdp1", "FullyShardedDataParallel"), ("fsdp2", "fully_shard (FSDP2)")])
def test_diagnose_refuses_fsdp_saying_what_to_do(fsdp, kind, api):
    for res in fsdp:
        err = res[f"{kind}_diagnose"]
        assert err["is_scenario_error"] == "True", err
        assert err["message"].startswith(f"{api} models cannot be deep-copied")
        assert "ampdoctor.trace(...)" in err["message"] and "unwrapped model" in err["message"]


@pytest.mark.xfail(strict=True, reason="trace names parameters by storage pointer; FSDP1's parameters are views of "
                                       "one flat buffer, so the flat shard gets one parameter's name (core bug)")
def test_fsdp1_parameter_records_carry_their_own_names(fsdp):
    for res in fsdp:
        shapes = {f"_fsdp_wrapped_module.{n}": s for n, s in res["original_params"].items()}
        assert all(shapes.get(name) == shape for name, shape in res["fsdp1"]["param_records"])


def test_fsdp2_step_with_the_optimizer_is_traced(fsdp):
    """Statistics of DTensor outputs (FSDP2's sharded optimizer step) are taken on the local shard."""
    for res in fsdp:
        assert res["fsdp2_with_optimizer"]["trace_error"] is None
