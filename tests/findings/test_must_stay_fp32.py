"""``must-stay-fp32``: parts a model needs in float32 -- modules it declares fp32, rotary frequency buffers, norm
statistics -- running in fp16/bf16."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.findings._fp32_rules import declared_root

FP16_MAX = 65504.0


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(16, 32)
        self.wo = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wi(x)))


class Declared(nn.Module):
    """A T5-like block whose ``wo`` the model declares float32, as Hugging Face models do."""

    _keep_in_fp32_modules = ["wo"]

    def __init__(self, wo_scale: float = 1.0) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.ff = FeedForward()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.ff.wo.weight.mul_(wo_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.norm(h + self.ff(h)))


class Undeclared(Declared):
    _keep_in_fp32_modules = None


def mean_loss(out, batch):  # noqa: ANN001, ANN201
    return out.float().mean()


def inputs() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def test_entries_match_whole_name_components():
    name = "encoder.block.0.layer.1.DenseReluDense.wo"
    assert declared_root(["wo"], name) == name
    assert declared_root(["wo"], name + ".lora_A") == name
    assert declared_root(["wo"], "embeddings.word_embeddings") is None
    assert declared_root(["indexer.weights_proj"], "layers.3.indexer.weights_proj") == "layers.3.indexer.weights_proj"
    assert declared_root(["qformer"], "qformer.encoder.layer.0") == "qformer"


def test_declared_module_that_overflows_is_the_root_cause():
    torch.manual_seed(0)
    model = Declared(wo_scale=3e5)  # bf16-pretrained-like magnitudes: the output exceeds fp16's max
    report = ampdoctor.diagnose(model, inputs(), precision="fp16-amp", loss_fn=mean_loss)
    f = report.findings[0]
    over = next(x for x in report.findings if x.code == "overflow")
    assert (f.code, f.severity, f.module, f.phase) == ("must-stay-fp32", "error", "ff.wo", "forward")
    assert (f.op, f.phase) == (over.op, over.phase) and over.module == "ff.wo"
    assert f.evidence["matched_entry"] == "wo" and f.evidence["ran_in"] == "float16"
    with torch.no_grad():
        ref = model.ff(model.embed(inputs())).abs().max().item()
    assert f.evidence["ref_absmax"] == pytest.approx(ref, rel=1e-4) and ref > FP16_MAX
    assert "_keep_in_fp32_modules" in f.explanation and "from_pretrained" in f.explanation
    assert f.fixes[0].id == "keep_fp32" and f.fixes[0].params == {"modules": ["ff.wo"]}


def test_declared_module_in_half_without_failure_is_a_warning():
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Declared(), inputs(), precision="fp16-amp", loss_fn=mean_loss)
    assert report.ok
    fs = [f for f in report.findings if f.code == "must-stay-fp32"]
    assert len(fs) == 1
    f = fs[0]
    assert (f.severity, f.module, f.phase) == ("warning", "ff.wo", "forward")
    assert f.evidence["format_max"] == FP16_MAX and f.evidence["headroom"] > 1
    assert f.evidence["modules"] == ["ff.wo"]


class StrictlyDeclared(Declared):
    _keep_in_fp32_modules = None
    _keep_in_fp32_modules_strict = ["wo"]


def test_plain_declaration_is_about_fp16_only_strict_also_covers_bf16():
    # transformers keeps _keep_in_fp32_modules in fp32 only for fp16; the _strict list also for bf16
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Declared(), inputs(), precision="bf16-amp", loss_fn=mean_loss)
    assert "must-stay-fp32" not in report.codes()
    torch.manual_seed(0)
    report = ampdoctor.diagnose(StrictlyDeclared(), inputs(), precision="bf16-amp", loss_fn=mean_loss)
    f = next(f for f in report.findings if f.code == "must-stay-fp32")
    assert (f.severity, f.module, f.phase) == ("warning", "ff.wo", "forward")
    assert f.evidence["declared_by"] == "_keep_in_fp32_modules_strict" and f.evidence["ran_in"] == "bfloat16"
    assert not any(x.id == "switch_precision" for x in f.fixes)  # bf16 is what it runs in already


def test_undeclared_model_gets_no_declaration_finding():
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Undeclared(), inputs(), precision="fp16-amp", loss_fn=mean_loss)
    assert "must-stay-fp32" not in report.codes()


def _tiny_llama():  # noqa: ANN202
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(5, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids, "position_ids": torch.arange(2000, 2016)[None]}


def test_rope_frequencies_cast_to_bf16():
    model, batch = _tiny_llama()
    report = ampdoctor.diagnose(model, batch, precision="bf16")
    f = next(f for f in report.findings if f.code == "must-stay-fp32")
    # positions near 2000: the angle can move by 8 rad, so cos is meaningless -- an error, not drift
    assert (f.severity, f.module, f.phase) == ("error", "model.rotary_emb", "forward")
    ev = f.evidence
    assert ev["buffer"] == "model.rotary_emb.inv_freq" and ev["buffer_dtype"] == "bfloat16"
    assert ev["integers_exact_up_to"] == 256  # 8 significant bits
    assert ev["max_angle"] == pytest.approx(2015.0)  # largest position * the unit frequency inv_freq[0] = 1
    assert ev["angle_error_bound"] == pytest.approx(2015.0 * 2.0**-8)
    # ground truth: cos of the angles with bf16-rounded frequencies vs fp32 ones
    inv = model.model.rotary_emb.inv_freq
    pos = torch.arange(2000, 2016).float()[:, None]
    err = ((pos * inv.bfloat16().float()).cos() - (pos * inv).cos()).abs().max().item()
    assert err > 0.01
    assert any(x.id == "switch_precision" for x in f.fixes)
    assert "precision-loss" not in report.codes()  # the downstream deviation is inherited from the buffer


def test_rope_frequencies_stay_fp32_under_autocast():
    model, batch = _tiny_llama()
    report = ampdoctor.diagnose(model, batch, precision="bf16-amp")
    assert "must-stay-fp32" not in report.codes()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, upcast: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.upcast else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class NormNet(nn.Module):
    def __init__(self, upcast: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.norm = RMSNorm(32, upcast)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def test_norm_statistics_in_fp16_are_flagged():
    torch.manual_seed(0)
    model = NormNet(upcast=False)
    report = ampdoctor.diagnose(model, inputs(), precision="fp16", loss_fn=mean_loss)
    f = next(f for f in report.findings if f.code == "must-stay-fp32")
    assert (f.severity, f.module, f.op, f.phase) == ("warning", "norm", "aten.pow.Tensor_Scalar", "forward")
    assert f.evidence["statistic_ops"] == ["aten.mean.dim", "aten.pow.Tensor_Scalar"]
    assert f.evidence["scale_op"] == "aten.rsqrt.default"
    with torch.no_grad():
        sq = model.proj(inputs()).pow(2).abs().max().item()
    assert f.evidence["ref_absmax"] == pytest.approx(sq, rel=1e-4)
    assert f.evidence["headroom"] == pytest.approx(FP16_MAX / sq, rel=1e-4)
    assert "x.float().pow(2)" in f.fixes[0].snippet


def test_norm_statistics_upcast_to_fp32_are_fine():
    torch.manual_seed(0)
    report = ampdoctor.diagnose(NormNet(upcast=True), inputs(), precision="fp16", loss_fn=mean_loss)
    assert "must-stay-fp32" not in report.codes()
