"""``diagnose_generate`` in fp8 reports the GEMMs the fp8 emulation did not quantise (``summary["fp8_unquantised"]``,
and the warning) the way :func:`ampdoctor.diagnose` does: transformers' GPT-2 multiplies by its ``Conv1D`` weights
in an ``addmm`` outside ``F.linear``; a model of ``nn.Linear`` layers (Qwen2) lists none. Asserted both when no
decode step fails (the prefill is traced for it) and when one does (the failing step's trace)."""

from __future__ import annotations

import logging

import pytest
import torch

import ampdoctor

transformers = pytest.importorskip("transformers")
PROMPT = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _qwen2() -> torch.nn.Module:
    cfg = transformers.Qwen2Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=32,
                                   intermediate_size=64, vocab_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


BLOCKS = {f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def test_gpt2_generation_lists_its_conv1d_gemms_as_not_quantised(caplog):
    with caplog.at_level(logging.WARNING):
        report = ampdoctor.diagnose_generate(_gpt2(), PROMPT, precision="fp8", max_new_tokens=3)
    gemms = report.summary["fp8_unquantised"]
    assert {(g["module"], g["op"]) for g in gemms} == {(m, "aten.addmm.default") for m in BLOCKS}
    assert {g["weight"] for g in gemms} == {f"{m}.weight" for m in BLOCKS}
    assert "transformer.h.0.attn.c_attn" in caplog.text and "F.linear" in caplog.text


def test_a_failing_decode_step_reports_them_from_its_own_trace():
    model = _gpt2()
    with torch.no_grad():  # one outlier channel the head ignores sets the head input's fp8 scale: the other
        model.transformer.ln_f.weight[0] = 1e7  # channels flush to 0 in e4m3, the logits are lost, a token flips
        model.lm_head.weight[:, 0] = 0.0
    report = ampdoctor.diagnose_generate(model, PROMPT, precision="fp8", max_new_tokens=3)
    assert report.summary["generation"]["first_failure"] is not None
    assert {g["module"] for g in report.summary["fp8_unquantised"]} == BLOCKS


def test_linear_layers_leave_nothing_unquantised():
    report = ampdoctor.diagnose_generate(_qwen2(), PROMPT, precision="fp8", max_new_tokens=3)
    assert report.summary["fp8_unquantised"] == []
