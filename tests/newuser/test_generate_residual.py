"""fp16 generation of a GPT-2 whose residual stream passes 65504 only at later positions (a new user's case).

Each block's MLP writes +1.5e4 into residual channel 0; positions >= 10 start 2.5e4 higher (their position
embedding), so after ``h.2``'s MLP residual add channel 0 holds 7e4 there (fp32) -- inf in fp16 -- and stays at
5.5e4 or below everywhere before. With a 6-token prompt, decode step k feeds position 5 + k: the first failing step
is 5, at position 10, op ``aten.add.Tensor`` inside ``transformer.h.2`` (the block's own residual add). The healthy
twin (no position offset) stays below 4.5e4 at every position and must be clean.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ampdoctor
from ampdoctor.precision import ScenarioError


def _gpt2(late_growth: bool) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=2, n_positions=64, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()
    with torch.no_grad():
        for block in m.transformer.h:
            block.mlp.c_proj.bias[0] = 1.5e4
        if late_growth:
            m.transformer.wpe.weight[10:, 0] = 2.5e4
    return m


def _prompt() -> torch.Tensor:
    return torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))


def test_truth_residual_passes_fp16_max_only_from_position_10() -> None:
    with torch.no_grad():
        hs = _gpt2(True)(torch.randint(0, 100, (1, 16)), output_hidden_states=True).hidden_states
    # hidden_states[2] is h.1's output (hidden_states[3] is after ln_f): h.2's MLP adds 1.5e4 more to channel 0
    assert hs[2][0, :10, 0].abs().max() < 3.1e4 and hs[2][0, 10:, 0].abs().max() > 5.4e4
    assert float(hs[2][0, 10:, 0].abs().max()) + 1.5e4 > 65504 > float(hs[2][0, :10, 0].abs().max()) + 1.5e4


def test_generation_names_the_decode_step_position_and_residual_add() -> None:
    report = ampdoctor.diagnose_generate(_gpt2(True), _prompt(), precision="fp16", max_new_tokens=8)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("overflow", "transformer.h.2", "aten.add.Tensor", "forward")
    assert (f.evidence["decode_step"], f.evidence["position"], f.evidence["cache"]) == (5, 10, "none")
    assert f.step == 5 and "decode step 5" in f.explanation and ", step 0)" not in f.explanation
    assert report.summary["generation"]["first_failure"]["decode_step"] == 5


def test_healthy_twin_generates_clean() -> None:
    report = ampdoctor.diagnose_generate(_gpt2(False), _prompt(), precision="fp16", max_new_tokens=8)
    assert report.ok and not [f for f in report.findings if f.severity != "info"]


def test_fp8_generation_runs_the_users_recipe_and_other_precisions_are_refused() -> None:
    model = _gpt2(False)   # (fp8 generation is emulated now: tests/newuser/test_fp8_generate.py)
    report = ampdoctor.diagnose_generate(model, _prompt(), precision="fp8", max_new_tokens=2,
                                         fp8_recipe=ampdoctor.precision.Fp8Recipe(scaling="dynamic"))
    assert report.precision == "fp8" and report.summary["fp8_recipe"]["scaling"] == "dynamic"
    with pytest.raises(ScenarioError, match="invalid precision 'int8' for a generation"):
        ampdoctor.diagnose_generate(model, _prompt(), precision="int8", max_new_tokens=2)
