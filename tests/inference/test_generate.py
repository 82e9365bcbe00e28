"""diagnose_generate: the first decode step where fp16 generation goes wrong, and the op within it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.precision import ScenarioError
from ampdoctor.precision._generate import DecodeStat
from tests.inference._models import PROMPT, SPIKE_FROM, gpt2, prompt

#: the first decode step that processes position SPIKE_FROM (step 0 is the prefill of positions 0..PROMPT-1)
K = SPIKE_FROM - PROMPT + 1


def test_overflow_after_k_decode_steps_is_located_at_the_step_module_and_op() -> None:
    model = gpt2(spike=True, overflow=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    report = ampdoctor.diagnose_generate(model, prompt(), precision="fp16", max_new_tokens=10)
    assert not report.ok
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == (
        "overflow", "transformer.h.1.mlp.c_fc", "aten.addmm.default", "forward", "error")
    assert (f.evidence["decode_step"], f.evidence["position"]) == (K, SPIKE_FROM)
    assert f.evidence["cache"] == "none"  # the MLP's overflow is not what the cache stores
    gen = report.summary["generation"]
    assert gen["first_failure"]["decode_step"] == K and gen["first_failure"]["finite"] is False
    assert all(s["finite"] for s in gen["steps"][:K])  # fine before the spike positions
    assert gen["cache"] == "DynamicCache"
    assert report.summary["first_nonfinite"]["module"] == "transformer.h.1.mlp.c_fc"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_healthy_twin_generates_like_fp32() -> None:
    report = ampdoctor.diagnose_generate(gpt2(spike=True, overflow=False), prompt(), precision="fp16",
                                         max_new_tokens=10)
    assert report.ok, [f.title for f in report.findings]
    gen = report.summary["generation"]
    assert gen["first_failure"] is None
    assert all(s["finite"] and s["cache_finite"] for s in gen["steps"])
    assert all(s["logit_rel_err"] < 0.01 for s in gen["steps"])  # fp16 rounding, nothing more
    assert all(f.severity == "info" for f in report.findings)


def test_overflow_written_into_the_kv_cache_is_reported_as_a_cache_write() -> None:
    model = gpt2(spike=True, overflow=False)
    with torch.no_grad():  # layer 1's value projection reads the large channel: V overflows at the spike positions
        model.transformer.h[1].attn.c_attn.weight[0, 64:96] = 20000.0
    report = ampdoctor.diagnose_generate(model, prompt(), precision="fp16", max_new_tokens=8)
    f = report.findings[0]
    assert (f.code, f.module, f.op) == ("overflow", "transformer.h.1.attn.c_attn", "aten.addmm.default")
    assert (f.evidence["decode_step"], f.evidence["position"], f.evidence["cache"]) == (K, SPIKE_FROM, "write")
    assert report.summary["generation"]["first_failure"]["cache_finite"] is False


def test_compiled_model_has_the_root_cause_of_its_eager_twin() -> None:
    eager = ampdoctor.diagnose_generate(gpt2(spike=True, overflow=True), prompt(), precision="fp16",
                                        max_new_tokens=8)
    compiled = torch.compile(gpt2(spike=True, overflow=True))
    report = ampdoctor.diagnose_generate(compiled, prompt(), precision="fp16", max_new_tokens=8)
    a, b = eager.findings[0], report.findings[0]
    assert (a.code, a.module, a.op, a.evidence["decode_step"]) == (b.code, b.module, b.op, b.evidence["decode_step"])
    assert any("torch.compile()d" in n and "original module" in n for n in report.summary["notes"])


def test_prefill_failure_is_placed_at_its_position_within_the_prompt() -> None:
    ids = torch.arange(1, 13).reshape(1, 12)  # positions 0..11: the spike (from position 8) is inside the prompt
    report = ampdoctor.diagnose_generate(gpt2(spike=True, overflow=True), ids, precision="fp16", max_new_tokens=3)
    f = report.findings[0]
    assert (f.code, f.module, f.evidence["decode_step"], f.evidence["position"]) == (
        "overflow", "transformer.h.1.mlp.c_fc", 0, SPIKE_FROM)


def test_generation_leaves_everything_as_found(digest) -> None:  # noqa: ANN001
    model = gpt2(spike=True, overflow=True)
    before = digest(model)
    ampdoctor.diagnose_generate(model, prompt(), precision="fp16", max_new_tokens=7)  # traces the failing step
    assert digest(model) == before


class ShortLM(nn.Module):
    """Refuses sequences longer than 5 tokens (a context limit), in every precision."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > 5:
            raise IndexError("position out of range")
        return self.head(self.emb(input_ids))


def test_a_model_that_cannot_decode_that_far_says_what_to_check(digest) -> None:  # noqa: ANN001
    model = ShortLM()
    before = digest(model)
    with pytest.raises(ScenarioError, match="decode step 3 .*even in float32.*max_new_tokens"):
        ampdoctor.diagnose_generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=6)
    assert digest(model) == before


def _stat(**kw: float) -> DecodeStat:
    base = dict(step=3, position=6, ref_token=1, target_token=2, ref_margin=0.01, target_gap=0.005,
                logit_err=0.01, logit_rms=1.0, finite=True, cache_finite=True)
    base.update(kw)
    return DecodeStat(**base)  # type: ignore[arg-type]


def test_noise_rule_separates_near_ties_from_divergence() -> None:
    assert _stat().within_noise and not _stat().failed  # margin 0.01 <= 4 x RMS error 0.01, error 1% of logits
    assert _stat(ref_margin=1.0).failed  # a clear reference choice flipped: beyond rounding
    assert _stat(logit_err=0.5).failed  # the logits are 50% off: precision loss, not rounding noise
    assert _stat(target_token=1).agrees and not _stat(target_token=1).failed
    assert _stat(finite=False, logit_err=math.inf).failed
    assert _stat(target_token=1, cache_finite=False).failed


class TieLM(nn.Module):
    """No cache (re-run on the whole sequence each step): tokens 3 and 5 have near-identical head rows, so the
    reference picks 5 over 3 by ~3.5e-4, less than fp16's rounding of the logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        with torch.no_grad():
            v = torch.randn(8)
            self.emb.weight.copy_(v + 0.05 * torch.randn(16, 8))
            self.head.weight.mul_(0.1)
            self.head.weight[3] = v
            self.head.weight[5] = v + 1e-4 * torch.randn(8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids))


def test_near_tie_flip_is_info_not_failure() -> None:
    report = ampdoctor.diagnose_generate(TieLM(), torch.tensor([[1, 2, 3]]), precision="fp16", max_new_tokens=6)
    gen = report.summary["generation"]
    assert gen["cache"] == "none"
    assert gen["reference_tokens"] == [5] * 6 and gen["target_tokens"] == [3] * 6  # every step flips ...
    assert all(s["within_noise"] and s["ref_margin"] < 1e-3 for s in gen["steps"])  # ... within rounding
    assert report.ok
    f = report.findings[0]
    assert (f.code, f.severity, f.evidence["decode_step"], f.evidence["position"]) == ("precision-loss", "info", 0, 2)


@pytest.mark.parametrize(("ids", "n", "match"), [
    (torch.zeros(2, 3, dtype=torch.long), 4, "batch 1"),
    (torch.zeros(1, 3), 4, "integer tensor"),
    (torch.zeros(1, 3, dtype=torch.long), 0, "max_new_tokens"),
])
def test_bad_input_is_refused_with_what_to_pass(ids: torch.Tensor, n: int, match: str) -> None:
    with pytest.raises(ScenarioError, match=match):
        ampdoctor.diagnose_generate(gpt2(spike=False, overflow=False), ids, max_new_tokens=n)
