"""A new user serves a Qwen2-style model in fp8 (delayed scaling, amax history) and one generated token makes an
outlier: ``diagnose_generate(precision="fp8", fp8_recipe=...)``.

The model: channel 5 of every token embedding is 0 except for one token's, and layer 0's input norm multiplies
channel 5 by 100 (a norm weight that grew on a channel most tokens never use). The token is the one the fp32
reference generates at decode step 3, so it is first fed at step 4: there layer 0's q/k/v projections see an input
~5x the amax history of steps 0-3. The delayed scale clips it (the cached k/v of that position are wrong), the logits
of step 4 drift (50% relative error) and step 5's token flips. The truth is computable without fp8: layer 0's
projection inputs are a function of each position's token only (embedding, then norm: no fp8 layer before them).
Current (dynamic) scaling, the recipe change the finding proposes, verifies: the generation stays within noise.
"""

from __future__ import annotations

import pytest
import torch

import ampdoctor
from ampdoctor.precision import Fp8Recipe

transformers = pytest.importorskip("transformers")

C = 5
PROMPT = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
TOKENS = 7


def _build(outlier_token: int | None) -> torch.nn.Module:
    cfg = transformers.Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=64, intermediate_size=128, vocab_size=96, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight[:, C] = 0
        if outlier_token is not None:
            m.model.embed_tokens.weight[outlier_token, C] = 0.5
        m.model.layers[0].input_layernorm.weight[C] = 100.0
    return m


def _reference_tokens(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist()


@pytest.fixture(scope="module")
def case() -> tuple[torch.nn.Module, list[int]]:
    tokens = _reference_tokens(_build(None))
    assert tokens[3] not in PROMPT[0].tolist() + tokens[:3]  # first fed at decode step 4; nothing before changes
    model = _build(tokens[3])
    own = _reference_tokens(model)
    assert own[:4] == tokens[:4]                             # the same generation up to the outlier token
    return model, own


def _truth(model: torch.nn.Module, tokens: list[int]) -> tuple[float, float, int]:
    """q_proj's input at decode step 4 (position 9): its amax, the amax history of steps 0-3 (positions 0-8), and
    the values a delayed e4m3 scale from that history clips."""
    seen: list[torch.Tensor] = []
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0][0]))
    with torch.no_grad():
        model(torch.cat([PROMPT, torch.tensor([tokens])], dim=1))
    h.remove()
    x = seen[0]
    history, now = float(x[:9].abs().max()), x[9]
    return float(now.abs().max()), history, int((now.abs() * (448.0 / history) > 464.0).sum())


def test_fp8_generation_names_the_projection_whose_delayed_scale_clips_and_the_step(case):
    model, tokens = case
    amax, history, clipped = _truth(model, tokens)
    assert amax / history > 4 and clipped >= 1                # the truth: a 5x jump over the history at step 4
    report = ampdoctor.diagnose_generate(model, PROMPT, precision="fp8", max_new_tokens=TOKENS,
                                         fp8_recipe=Fp8Recipe(scaling="delayed", amax_history_len=16))
    first = report.summary["generation"]["first_failure"]
    assert first["decode_step"] == 5 and first["target_token"] != first["ref_token"]
    assert report.summary["fp8_recipe"]["amax_history_len"] == 16    # the user's recipe, not the default
    warn = [f for f in report.findings if f.code == "fp8-scale" and f.severity == "warning"]
    assert warn, [(f.code, f.module, f.title) for f in report.findings]
    f = warn[0]                                                # the earliest: step 4, layer 0's first projection
    assert (f.module, f.op, f.phase, f.step) == ("model.layers.0.self_attn.q_proj", "aten.linear.default",
                                                 "forward", 4)
    assert f.evidence["decode_step"] == 4 and f.evidence["position"] == 9 and f.evidence["roles_losing"] == ["input"]
    sat = f.evidence["roles"]["input"]["first_saturated"]
    assert sat["step"] == 4 and sat["amax"] == pytest.approx(amax, rel=1e-5)
    assert sat["amax_history"] == pytest.approx(history, rel=1e-5) and sat["saturated"] == clipped
    assert {g.module for g in warn if g.step == 4} >= {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}
    # the proposed recipe change verifies: current scaling keeps every step within rounding noise
    dynamic = next(p for p in f.fixes if p.id == "fp8_recipe" and p.params["scaling"] == "dynamic")
    fixed = ampdoctor.diagnose_generate(model, PROMPT, precision="fp8", max_new_tokens=TOKENS,
                                        fp8_recipe=Fp8Recipe(**dynamic.params))
    assert fixed.summary["generation"]["first_failure"] is None
    assert not [g for g in fixed.findings if g.severity != "info"]


def test_without_the_outlier_token_fp8_generation_is_clean():
    model = _build(None)
    report = ampdoctor.diagnose_generate(model, PROMPT, precision="fp8", max_new_tokens=TOKENS,
                                         fp8_recipe=Fp8Recipe(scaling="delayed", amax_history_len=16))
    assert report.summary["generation"]["first_failure"] is None
    assert not [f for f in report.findings if f.severity != "info"]


def test_a_recipe_of_another_format_is_refused_before_anything_runs():
    with pytest.raises(ampdoctor.precision.ScenarioError, match="format 'e5m2' but precision 'fp8'"):
        ampdoctor.diagnose_generate(_build(None), PROMPT, precision="fp8", fp8_recipe=Fp8Recipe(format="e5m2"))
    with pytest.raises(ampdoctor.precision.ScenarioError, match="fp8_recipe is given but precision is 'fp16'"):
        ampdoctor.diagnose_generate(_build(None), PROMPT, precision="fp16", fp8_recipe=Fp8Recipe())
