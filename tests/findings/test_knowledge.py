"""The model-aware knowledge registry: architecture-specific explanations and fixes attached to findings the
rules made, recognised from the classes that own the finding's module -- never changing code, module, op, phase."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.findings._knowledge import KNOWLEDGE, Mechanism, enrich, enrich_all, families_of, register
from ampdoctor.findings._types import Finding

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


def finding(code: str, module: str, op: str = "aten.mm.default", phase: str = "forward") -> Finding:
    return Finding(code, "error", module, op, phase, "title", "explanation", {"x": 1})  # type: ignore[arg-type]


def identity(f: Finding) -> tuple:
    return (f.code, f.severity, f.module, f.op, f.phase, f.step)


@pytest.fixture(scope="module")
def bert():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


def test_t5_overflow_gets_the_t5_mechanism():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=2, num_decoder_layers=1, num_heads=2,
                                d_kv=8, feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(8e4)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, 32, (2, 8), generator=g),
             "labels": torch.randint(1, 32, (2, 4), generator=g)}
    report = ampdoctor.diagnose(model, batch, precision="fp16-amp", scaler=torch.amp.GradScaler("cpu"))
    enriched = enrich_all(report.findings, model, report.precision)
    assert [identity(f) for f in enriched] == [identity(f) for f in report.findings]
    first = enriched[0]
    assert first.module == "encoder.block.0.layer.1.DenseReluDense.wo"
    assert first.evidence["known_mechanisms"] == ["t5-ff-fp32"]
    assert "PR #10956" in first.explanation and "_keep_in_fp32_modules" in first.explanation
    assert first.explanation.startswith(report.findings[0].explanation)
    assert any(x.id == "switch_precision" and x.params == {"precision": "bf16-amp"} for x in first.fixes)
    assert len({x.title for x in first.fixes}) == len(first.fixes)  # no duplicated remedy
    nan = next(f for f in enriched if f.code == "nan-from-inf")
    assert nan.module.endswith("layer_norm") and nan.evidence["known_mechanisms"] == ["t5-ff-fp32"]


def test_bert_pooler_saturation_and_a_ddp_style_wrapper(bert):
    f = finding("saturation", "bert.pooler.activation", "aten.tanh.default")
    out = enrich(f, bert, "fp16-amp")
    assert identity(out) == identity(f)
    assert out.evidence == {"x": 1, "known_mechanisms": ["bert-pooler"]}
    assert any("add_pooling_layer=False" in x.snippet for x in out.fixes)

    class Wrapper(nn.Module):  # DistributedDataParallel keeps the model as .module
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    wrapped = Wrapper(bert)
    assert "bert" in families_of(wrapped, "module.bert.pooler.dense")
    unused = enrich(finding("unused-parameters", "module.bert.pooler.dense", "", "backward"), wrapped)
    assert unused.evidence["known_mechanisms"] == ["bert-pooler"]


def test_no_match_leaves_the_finding_untouched(bert):
    f = finding("saturation", "encoder.block.0.layer.1.DenseReluDense.wo")
    assert enrich(f, bert) is f  # wrong family for the module path and code
    plain = nn.Sequential(nn.Linear(2, 2))
    assert families_of(plain, "0") == []
    g = finding("overflow", "0")
    assert enrich(g, plain) is g
    assert enrich(finding("overflow", "bert.encoder.layer.0.output.dense"), bert).evidence == {"x": 1}


def test_gpt2_attention_and_llama_rope():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                                 n_positions=32))
    f = enrich(finding("overflow", "transformer.h.0.attn", "aten.bmm.default"), gpt2, "fp16-amp")
    assert f.evidence["known_mechanisms"] == ["gpt2-upcast-attn"]
    assert any("reorder_and_upcast_attn=True" in x.snippet for x in f.fixes)
    assert enrich(finding("overflow", "transformer.h.0.mlp.c_fc"), gpt2).evidence == {"x": 1}
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    r = enrich(finding("must-stay-fp32", "model.rotary_emb", "aten._to_copy.default"), llama, "bf16")
    assert r.evidence["known_mechanisms"] == ["rope-inv-freq-fp32"]
    assert any("compute_default_rope_parameters" in x.snippet for x in r.fixes)


def test_register_rejects_duplicates_unknown_codes_and_bad_patterns():
    before = dict(KNOWLEDGE)
    with pytest.raises(ValueError, match="already registered"):
        register(KNOWLEDGE["t5-ff-fp32"])
    with pytest.raises(ValueError, match="unknown code"):
        register(Mechanism("x", "x", frozenset({"t5"}), frozenset({"no-such-code"}), "", "x"))
    with pytest.raises(ValueError, match="invalid module_pattern"):
        register(Mechanism("y", "y", frozenset({"t5"}), frozenset({"overflow"}), "(", "y"))
    assert KNOWLEDGE == before
    for m in KNOWLEDGE.values():
        assert m.explanation and m.fixes and m.families
