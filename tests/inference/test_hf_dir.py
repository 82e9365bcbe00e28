"""``ampdoctor diagnose --hf DIR``: checkpoints saved with save_pretrained (tiny configs) and the real MiniLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ampdoctor.cli import main
from ampdoctor.integrations.hf_checkpoint import CheckpointError, diagnose_checkpoint, load_for_inference
from tests.conftest import minilm_dir
from tests.inference._models import SPIKE_FROM, gpt2, prompt


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gpt2_overflow")
    gpt2(spike=True, overflow=True).save_pretrained(d)
    return d


def test_minilm_is_healthy_in_fp16_inference(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code, text = _cli("diagnose", "--hf", minilm_dir(), "--text", "The quick brown fox jumps over the lazy dog",
                      "--json", str(out))
    assert code == 0, text
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["precision"] == "fp16" and rep["summary"]["forward_only"]
    assert [f for f in rep["findings"] if f["severity"] != "info"] == []
    ck = rep["summary"]["checkpoint"]
    assert (ck["task"], ck["architecture"], ck["tokens"]) == ("embeddings", "BertModel", "checkpoint")
    assert ck["input_shape"] == [1, 11]  # [CLS] + 9 words + [SEP]: the checkpoint's own tokenizer ran
    assert "model.half()" in ck["casting"]["half"] and "autocast" in ck["casting"]["autocast"]


def test_generation_overflow_via_cli(gpt2_dir: Path, tmp_path: Path) -> None:
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(prompt()[0].tolist()))
    out = tmp_path / "g.json"
    code, text = _cli("diagnose", "--hf", str(gpt2_dir), "--input-ids", str(ids), "--max-new-tokens", "8",
                      "--json", str(out))
    assert code == 1, text
    f = json.loads(out.read_text())["findings"][0]
    assert (f["code"], f["module"], f["op"]) == ("overflow", "transformer.h.1.mlp.c_fc", "aten.addmm.default")
    assert f["evidence"]["position"] == SPIKE_FROM


def test_long_context_headroom_curve_climbs_past_fp16_max_at_the_spike(gpt2_dir: Path) -> None:
    ckpt = load_for_inference(str(gpt2_dir), seq_len=16)
    assert ckpt.tokenizer == "synthetic" and ckpt.input_ids.shape == (1, 16)
    rep = diagnose_checkpoint(ckpt, precision="fp16", positions=True)
    curve = rep.summary["positions"]
    assert curve["format_max"] == 65504.0 and curve["seq_len"] == 16
    for b in curve["buckets"]:
        late = b["start"] >= SPIKE_FROM
        assert b["target_nonfinite"] == late, b
        assert (b["margin_bits"] < 0) == late, b  # the fp32 |max| itself passes 65504 exactly there
    assert rep.findings[0].module == "transformer.h.1.mlp.c_fc"


def test_keep_in_fp32_modules_are_honoured_like_from_pretrained(tmp_path: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0)
    T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    ckpt = load_for_inference(str(tmp_path), seq_len=6)
    assert ckpt.task == "seq2seq"
    loaded = T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float16)
    kept = {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}
    assert kept and set(ckpt.keep_fp32["fp16"]) == kept  # the same plan as from_pretrained(dtype=fp16)
    rep = diagnose_checkpoint(ckpt, precision="fp16")
    ck = rep.summary["checkpoint"]
    assert set(ck["kept_fp32_in_target"]) == kept
    assert "including the" in ck["casting"]["half"]  # what .half() would do instead


def test_not_a_checkpoint_says_what_to_pass(tmp_path: Path) -> None:
    code, text = _cli("diagnose", "--hf", str(tmp_path))
    assert code == 2 and "no config.json" in text and "save_pretrained" in text


def test_text_without_tokenizer_says_what_to_pass(gpt2_dir: Path) -> None:
    code, text = _cli("diagnose", "--hf", str(gpt2_dir), "--text", "hello")
    assert code == 2 and "--input-ids FILE" in text and "tokenizer" in text


def test_unsupported_architecture_says_what_to_pass(tmp_path: Path, gpt2_dir: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["X"]}))
    code, text = _cli("diagnose", "--hf", str(tmp_path))
    assert code == 2 and "no-such-model" in text and "scenario file" in text, text
    with pytest.raises(CheckpointError, match="--task"):
        load_for_inference(str(gpt2_dir), task="seq2seq")  # a decoder has no seq2seq head


def test_scenario_only_options_are_refused_without_hf() -> None:
    code, text = _cli("diagnose", "x.py", "--max-new-tokens", "3")
    assert code == 2 and "--hf DIR" in text


def test_seq2seq_generation_decodes_with_the_encoder_decoder_cache(tmp_path: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    out = tmp_path / "r.json"
    code, text = _cli("diagnose", "--hf", str(tmp_path), "--seq-len", "6", "--max-new-tokens", "4", "--json",
                      str(out))
    assert code == 0, text
    gen = json.loads(out.read_text())["summary"]["generation"]
    assert gen["cache"] == "EncoderDecoderCache" and gen["prompt_len"] == 1  # the decoder's start token
    assert [s["position"] for s in gen["steps"]] == [0, 1, 2, 3]  # decoder positions
    assert all(s["finite"] and s["logit_rel_err"] < 0.01 for s in gen["steps"])
