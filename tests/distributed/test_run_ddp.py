"""``ampdoctor run`` on a DDP training script (gloo, 2 ranks) whose rank 1 alone gets unnormalised data from step 2
(x 1e5: autocast's fp16 cast overflows in the first Linear; DDP's all-reduce gives rank 0 the inf gradients too, and
GradScaler skips the steps on both ranks). The runner must watch the DDP wrapper, not the inner module holding the
same parameters (it chose between them by gc order), so the ranks' agreement is on; rank 1's replay names the
Linear and its cast, and no rank hangs. The steps GradScaler skipped reach no optimizer hook, so the ranks exchange
their table after them: rank 0's report names rank 1 as the origin, with rank 1's finding, first."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed._run_workers import run_ddp_script
from tests.distributed._workers import launch

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def test_run_watches_the_ddp_wrapper_and_rank1_names_the_overflowing_linear() -> None:
    r0, r1 = launch(run_ddp_script, 2, timeout=240.0)
    assert [r0["rank"], r1["rank"]] == [0, 1] and r0["world_size"] == r1["world_size"] == 2
    assert r0["script"] == r1["script"] == {"status": "completed"}
    code, severity, module, op, phase = r1["findings"][0]
    assert (code, severity, module, op) == ("overflow", "error", "0", "aten._to_copy.default"), r1["findings"]
    assert "forward" in phase
    assert any(f[0] == "loss-scale-collapse" and f[1] == "error" for f in r0["findings"]), r0["findings"]
    # rank 0's own data never overflowed: its root cause is rank 1's finding (not its own replay's warning)
    assert r0["origin_rank"] == r1["origin_rank"] == 1, (r0["origin"], r1["origin"])
    assert r0["root_cause"][:4] == ("overflow", "0", "aten._to_copy.default", 1), r0["root_cause"]
    assert "rank 1" in r0["root_cause"][4] and "rank 0's own values stayed finite" in r0["root_cause"][4]
    # the step where rank 1's data first overflowed (its first skipped step, 2), not the step its replay ran (4),
    # on both ranks
    assert r0["origin"]["step"] == r1["origin"]["step"] == 2 and r0["root_cause"][5] == 2, r0["root_cause"]
    assert "at step 2" in r0["root_cause"][4], r0["root_cause"][4]
    code0, sev0, module0, op0 = r0["findings"][0][:4]
    assert (code0, sev0, module0, op0) == ("overflow", "error", "0", "aten._to_copy.default"), r0["findings"]
    assert not any(e["rank"] == 0 and e["local"] for e in r0["events"]), r0["events"]
    # the cost: one exchange per optimizer step (steps 0, 1) and one after each skipped step seen at a forward
    # (steps 2..4; step 5's skip is seen only at exit, where no collective is issued)
    assert r0["rank_exchanges"] == r1["rank_exchanges"] == 5
