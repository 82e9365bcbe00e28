"""The six core codes, each from its own tiny failing model, with numbers checked against theory; and healthy
controls (T5 under fp16 autocast, BERT with fp16 padding masks, partially masked ``-inf`` attention) that must
come out ``ok`` with their benign non-finite origins classified as harmless.

Expected numbers are recomputed here from the same weights in float32 / float16 (never copied from a run of
ampdoctor): fp16's largest finite value is 65504.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampdoctor

FP16_MAX = 65504.0


def mean_loss(out, batch):  # noqa: ANN001, ANN201 - the scenario contract's loss_fn(output, batch)
    return out.float().mean()


def by_code(report: ampdoctor.Report, code: str) -> list[ampdoctor.Finding]:
    return [f for f in report.findings if f.code == code]


def origins(report: ampdoctor.Report, op: str) -> list[dict]:
    return [o for o in report.summary["origins"] if o["op"] == op]


def assert_clean_run(report: ampdoctor.Report) -> None:
    assert "exception" not in report.summary, report.summary.get("exception")
    losses = report.summary["loss_target"]
    assert losses and all(v is not None and math.isfinite(v) for v in losses), losses


# ---------------------------------------------------------------------------------------------------- overflow
class Encoder(nn.Module):
    """inp -> relu -> big -> LayerNorm -> out. ``big`` carries bf16-pretrained-like weights (x8000)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.big = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.big(torch.relu(self.inp(x)))))


@pytest.fixture(scope="module")
def encoder_case():
    torch.manual_seed(0)
    model = Encoder()
    with torch.no_grad():
        model.big.weight.mul_(8000.0)
    x = torch.randn(4, 8) * 10
    with torch.no_grad():
        ref_big = model.big(torch.relu(model.inp(x)))
        half = copy.deepcopy(model).half()
        big16 = half.big(torch.relu(half.inp(x.half())))
        norm16 = half.norm(big16)
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=mean_loss)
    return report, ref_big, big16, norm16


def test_overflow_names_module_op_and_ratio(encoder_case):
    report, ref_big, big16, _ = encoder_case
    ref_absmax = float(ref_big.abs().max())
    assert ref_absmax > FP16_MAX  # the fault is real: fp32 exceeds the fp16 range
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("overflow", "big", "aten.addmm.default", "forward",
                                                              "error")
    ev = f.evidence
    assert ev["format_max"] == FP16_MAX
    assert ev["dtype"] == "float16"
    assert ev["ref_absmax"] == pytest.approx(ref_absmax, rel=1e-6)
    assert ev["ratio_to_max"] == pytest.approx(ref_absmax / FP16_MAX, rel=1e-6)
    assert ev["ratio_to_max"] > 1.0
    assert ev["n_inf"] == int(torch.isinf(big16).sum()) > 0
    assert (ev["first_nan"]["module"], ev["first_nan"]["op"]) == ("norm", "aten.native_layer_norm.default")
    chain = report.summary["chain"]
    assert [(c["what"], c["module"]) for c in chain] == [("origin", "big"), ("first NaN", "norm"), ("loss", "")]
    assert not report.ok


def test_overflow_fixes_keep_fp32_and_bf16(encoder_case):
    f = encoder_case[0].findings[0]
    fixes = {x.id: x for x in f.fixes}
    assert fixes["keep_fp32"].params == {"modules": ["big"]}
    assert "run `big` in float32" in fixes["keep_fp32"].title
    assert fixes["switch_precision"].params == {"precision": "bf16-amp"}
    assert "bfloat16" in fixes["switch_precision"].title


# ------------------------------------------------------------------------------------------------ nan-from-inf
def test_nan_from_inf_points_back_to_the_overflow(encoder_case):
    report, _, big16, norm16 = encoder_case
    (f,) = by_code(report, "nan-from-inf")
    assert (f.module, f.op, f.phase, f.severity) == ("norm", "aten.native_layer_norm.default", "forward", "error")
    assert f.evidence["n_nan"] == int(torch.isnan(norm16).sum()) > 0
    assert f.evidence["inf_inputs"] == int(torch.isinf(big16).sum())
    assert f.evidence["origin"]["module"] == "big"
    assert f.evidence["origin"]["op"] == "aten.addmm.default"
    assert "Fix the origin" in f.explanation
    assert report.codes().index("overflow") < report.codes().index("nan-from-inf")


# ---------------------------------------------------------------------------------------------- masked-row-nan
class MaskedAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.attn = MaskedAttention()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(x), mask))


def test_masked_row_nan_counts_fully_masked_rows():
    model = AttnNet()
    x = torch.randn(3, 5, 8)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, :] = False  # an all-padding sequence: every key masked
    mask[2, 3:] = False  # ordinary padding: rows keep keys
    report = ampdoctor.diagnose(model, {"x": x, "mask": mask}, precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("masked-row-nan", "attn", "aten._softmax.default",
                                                              "forward", "error")
    heads, t = model.attn.heads, x.shape[1]
    full_rows = int((~mask).all(-1).sum())
    assert f.evidence["nan_rows"] == full_rows * heads * t == 10
    assert f.evidence["row_length"] == t
    assert f.evidence["neginf_inputs"] == int((~mask).sum()) * heads * t
    assert f.evidence["mask_origin"]["op"] == "aten.masked_fill.Scalar"
    assert f.evidence["mask_origin"]["module"] == "attn"
    assert f.evidence["mask_literal"] == -math.inf
    snippets = " ".join(x.snippet for x in f.fixes)
    assert "torch.finfo(scores.dtype).min" in snippets
    assert "scaled_dot_product_attention" in snippets


def test_partially_masked_neg_inf_attention_is_healthy():
    model = AttnNet()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 1:] = False
    mask[2, 3:] = False  # every row keeps at least one key
    report = ampdoctor.diagnose(model, {"x": torch.randn(3, 5, 8), "mask": mask}, precision="fp16",
                                loss_fn=mean_loss)
    assert report.ok, [f.code for f in report.findings]
    assert_clean_run(report)
    fills = origins(report, "aten.masked_fill.Scalar")
    assert fills and all(o["harmful"] is False and o["module"] == "attn" for o in fills), fills


# ------------------------------------------------------------------------------------- constant-out-of-range
class FillBlock(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.how == "masked_fill":
            return h.masked_fill(h < 0, -1e9)  # raises in fp16
        h[h < 0] = -1e9  # stores -inf silently in fp16
        return h


class FillNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.block = FillBlock(how)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_constant_out_of_range_masked_fill_raises():
    report = ampdoctor.diagnose(FillNet("masked_fill"), torch.randn(4, 8), precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("constant-out-of-range", "block",
                                                              "aten.masked_fill.Scalar", "forward", "error")
    assert f.evidence["constants"] == [-1e9]
    assert f.evidence["format_max"] == FP16_MAX
    assert "without overflow" in f.evidence["message"]
    assert any("torch.finfo(x.dtype).min" in x.snippet for x in f.fixes)
    assert report.summary["exception"]["type"] == "RuntimeError"


def test_constant_out_of_range_index_assignment_silent_inf():
    """``h[h < 0] = -1e9`` on fp16 stores -inf without an error; the -inf reaches the loss through ``head``."""
    model = FillNet("index")
    x = torch.randn(4, 8)
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    got = [(g.code, g.module, g.op, g.phase) for g in report.findings]
    assert (f.code, f.module, f.op, f.phase) == ("constant-out-of-range", "block", "aten.index_put_.default",
                                                 "forward"), got
    assert f.evidence["format_max"] == FP16_MAX
    assert any("torch.finfo(x.dtype).min" in x.snippet for x in f.fixes)


# --------------------------------------------------------------------------------------------- nonfinite-input
def _mlp() -> nn.Module:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 8), act=nn.ReLU(), fc2=nn.Linear(8, 1)))


def test_nonfinite_input_in_the_batch():
    x = torch.randn(4, 8)
    x[0, 1] = math.nan
    x[2, 3] = math.inf
    report = ampdoctor.diagnose(_mlp(), x, precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("nonfinite-input", "", "", "forward", "error")
    assert {k: f.evidence[k] for k in ("n_nan", "n_inf", "numel", "shape")} == {
        "n_nan": 1, "n_inf": 1, "numel": 32, "shape": [4, 8]}
    assert "No precision setting fixes this" in f.explanation
    assert any("drop or repair" in x.title for x in f.fixes)
    assert not by_code(report, "overflow")


def test_nonfinite_parameter_is_a_setup_problem():
    model = _mlp()
    with torch.no_grad():
        model.fc2.weight[0, 3] = math.nan
    report = ampdoctor.diagnose(model, torch.randn(4, 8), precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("nonfinite-input", "fc2", "", "setup", "error")
    assert f.evidence["parameter"] == "fc2.weight"
    assert (f.evidence["n_nan"], f.evidence["n_inf"], f.evidence["numel"]) == (1, 0, 8)


# ------------------------------------------------------------------------------------------- unused-parameters
class Pooled(nn.Module):
    """Returns the loss on token states and a pooled output the loss never uses (BERT's pooler pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.enc(x)
        return {"loss": self.head(h).mean(), "pooled": torch.tanh(self.pooler(h))}


def test_unused_parameters_grad_none():
    model = Pooled()
    report = ampdoctor.diagnose(model, torch.randn(4, 8), precision="fp16")
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("unused-parameters", "pooler", "", "backward",
                                                              "warning")
    assert f.evidence["parameters"] == ["pooler.weight", "pooler.bias"]
    assert f.evidence["count"] == 2
    assert f.evidence["of_trainable"] == sum(1 for p in model.parameters() if p.requires_grad) == 6
    fixes = {x.id: x for x in f.fixes if x.id}
    assert fixes["exclude_unused"].params == {"parameters": ["pooler.weight", "pooler.bias"]}
    assert "requires_grad_(False)" in fixes["exclude_unused"].snippet
    assert any("find_unused_parameters=True" in x.snippet for x in f.fixes)
    assert report.ok  # a warning, not an error: nothing crashed and no DDP wrapper


def test_unused_parameters_missing_from_optimizer():
    model = Pooled()
    opt = torch.optim.SGD([*model.enc.parameters(), *model.pooler.parameters()], lr=0.1)
    report = ampdoctor.diagnose(model, torch.randn(4, 8), precision="fp16", optimizer=opt)
    missing = [f for f in by_code(report, "unused-parameters") if f.phase == "optimizer"]
    assert [(f.module, f.evidence["parameters"]) for f in missing] == [("head", ["head.weight", "head.bias"])]
    assert "add_param_group" in missing[0].fixes[0].snippet


# ------------------------------------------------------------------------------------ attribution of the blame
class Squash(nn.Module):
    """Inline ``tanh(h ** 3)`` (GELU-tanh-like) followed by a child Linear. Forward: h**3 overflows fp16 for
    |h| > 40.3 and tanh absorbs it; backward (PowBackward0: 3 * h**2) overflows for |h| > 147.8."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(torch.tanh(h.pow(3)))


class Cube(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h.pow(3))


class CubeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = Cube()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


def _pow_backward_expectations(fc: nn.Linear, x: torch.Tensor) -> tuple[float, int]:
    with torch.no_grad():
        h = fc(x)
        h16 = copy.deepcopy(fc).half()(x.half())
    assert 147.8 < float(h.abs().max()) < 255.9  # backward overflows at 3*h^2, h^2 itself still fits
    return 3 * float(h.pow(2).max()), int(torch.isinf(h16.pow(2) * 3).sum())


@pytest.mark.parametrize("layout", ["module-output", "inline-before-child"])
def test_backward_overflow_of_inline_pow_names_the_module(layout):
    torch.manual_seed(0)
    if layout == "module-output":  # the module's output is the inline math itself (GELU's pattern)
        model = CubeNet()
        owner, fc = "act", model.fc
    else:  # the inline math feeds a child module before leaving the parent
        model = nn.Sequential(OrderedDict(block=Squash()))
        owner, fc = "block", model.block.fc
    x = torch.randn(4, 8) * 150
    ref_absmax, n_inf = _pow_backward_expectations(fc, x)
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    got = [(g.code, g.module, g.op, g.phase, g.evidence.get("autograd_node")) for g in report.findings]
    assert (f.code, f.module, f.phase) == ("overflow", owner, "backward"), got
    assert f.evidence["autograd_node"] == "PowBackward0"
    assert f.op == "aten.mul.Scalar"
    assert f.evidence["ref_absmax"] == pytest.approx(ref_absmax, rel=1e-5)
    assert f.evidence["n_inf"] == n_inf > 0
    assert "the forward value fits, its derivative does not" in f.explanation
    # the forward h**3 overflow is absorbed by tanh (tanh(inf) = 1 = tanh of the fp32 value): a benign origin
    fwd = [o for o in origins(report, "aten.pow.Tensor_Scalar") if o["phase"] == "forward"]
    assert fwd and all(o["harmful"] is False and o["module"] == owner for o in fwd), fwd


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32, bias=False)
        self.b = nn.Linear(16, 32, bias=False)
        self.out = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x) * self.b(x))  # the product is the parent's own code


def test_inline_product_blames_the_parent_not_the_next_child():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(ff=Gated(), head=nn.Linear(16, 1)))
    with torch.no_grad():
        model.ff.a.weight.mul_(300.0)
        model.ff.b.weight.mul_(300.0)
    x = torch.randn(4, 16)
    with torch.no_grad():
        a, b = model.ff.a(x), model.ff.b(x)
    assert float(a.abs().max()) < FP16_MAX and float(b.abs().max()) < FP16_MAX  # both factors fit
    ref_absmax = float((a * b).abs().max())
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=mean_loss)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("overflow", "ff", "aten.mul.Tensor", "forward")
    assert f.evidence["ref_absmax"] == pytest.approx(ref_absmax, rel=1e-6)
    assert f.evidence["ratio_to_max"] == pytest.approx(ref_absmax / FP16_MAX, rel=1e-6)
    assert f.evidence["input_dtypes"] == ["float16", "float16"]
    # one overflow, on the parent: not on ``ff.out``, the child that first receives the inf
    assert [g.module for g in by_code(report, "overflow")] == ["ff"]
    assert f.fixes[0].params == {"modules": ["ff"]}


# ------------------------------------------------------------------------------------------- healthy controls
def test_healthy_t5_fp16_amp():
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                                d_kv=8, feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, 32, (2, 8), generator=g),
             "labels": torch.randint(1, 32, (2, 4), generator=g)}
    report = ampdoctor.diagnose(model, batch, precision="fp16-amp",
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                scaler=torch.amp.GradScaler("cpu"))
    assert report.ok, [(f.code, f.module, f.op) for f in report.findings]
    assert_clean_run(report)
    assert report.summary["loss_target"][0] == pytest.approx(report.summary["loss_reference"][0], rel=1e-2)
    logs = origins(report, "aten.log.default")
    # relative-position bucketing: log(0) = -inf for the zero offset, discarded by torch.where
    assert {o["module"] for o in logs} == {"encoder.block.0.layer.0.SelfAttention",
                                           "decoder.block.0.layer.0.SelfAttention"}
    assert all(o["harmful"] is False for o in logs)


def test_healthy_bert_fp16_padding_mask_loss_on_pooler():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    model = transformers.BertModel(cfg)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (3, 8), generator=g)
    am = torch.ones(3, 8, dtype=torch.long)
    am[1, 5:] = 0
    am[2, 2:] = 0  # padding: the eager path adds torch.finfo(float16).min to masked scores

    def pooler_loss(out, batch):  # noqa: ANN001, ANN202
        return out.pooler_output.float().pow(2).mean()

    report = ampdoctor.diagnose(model, {"input_ids": ids, "attention_mask": am}, precision="fp16",
                                loss_fn=pooler_loss)
    assert report.ok, [(f.code, f.module, f.op) for f in report.findings]
    assert_clean_run(report)
    assert not by_code(report, "unused-parameters")  # the loss uses the pooler: every parameter gets a grad
    # the masked scores sit exactly at fp16's max magnitude (finfo.min added), finite and harmless
    (scores,) = [r for r in report.layers
                 if r["module"] == "encoder.layer.0.attention.self" and r["phase"] == "forward"]
    assert (scores["target_absmax"], scores["nonfinite"]) == (FP16_MAX, 0)
    assert all(o["harmful"] is False for o in report.summary["origins"]), report.summary["origins"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mid_training_low_precision_with_adamw_state(precision):
    """A model diagnosed mid-training: AdamW already holds fp32 moments. Casting the (copied) model to the
    target dtype must keep the optimizer consistent (no crash), and the diagnosis is the true mechanism of
    pure low-precision AdamW: fp16 eps=1e-8 rounds to 0 so the update divides by zero (inf weights); bf16
    LayerNorm weights at 1.0 have an ulp of 2**-7, so AdamW's ~1e-3 updates round away."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(8, 16), norm=nn.LayerNorm(16), head=nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(6, 8)
    mean_loss(model(x), x).backward()
    opt.step()
    report = ampdoctor.diagnose(model, x, precision=precision, loss_fn=mean_loss, optimizer=opt)
    assert "exception" not in report.summary
    root = report.findings[0]
    assert (root.code, root.phase) == ("low-precision-params", "optimizer")
    if precision == "bf16":
        assert root.module == "norm" and root.evidence["fraction_lost"] == 1.0
    else:
        assert root.op == "aten.addcdiv_.default" and root.evidence["eps_in_dtype"] == 0.0
        # and the literal itself, at the add_ that should have kept the denominator off 0 (after its setup cause)
        lits = [f for f in report.findings if f.code == "constant-out-of-range"]
        assert lits and {(f.op, f.phase, f.evidence["constant"]) for f in lits} == {
            ("aten.add_.Tensor", "optimizer", 1e-8)}
    assert {f.code for f in report.findings} <= {"low-precision-params", "overflow", "constant-out-of-range"}


class _SoftcapHead(nn.Module):
    """Logits soft-capped in the root module's own code (gemma2-style: ``tanh(x / c) * c``), so the backward of
    that ``mul`` runs at the root, next to the loss's ``scaler.scale(loss)`` ``mul``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.body(x)))
        return torch.tanh(logits / 30.0) * 30.0


def _diagnose_softcap(loss_factor: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    m = _SoftcapHead()
    with torch.no_grad():
        m.head.weight.mul_(40.0)                      # logits reach the cap: d(loss)/d(logits) ~ 2 * 30 per element

    def loss_fn(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).sum() * loss_factor  # out.float() is a cast only the fp16 run makes

    return ampdoctor.diagnose(m, torch.randn(8, 16), precision="fp16-amp", loss_fn=loss_fn,
                              optimizer=torch.optim.SGD(m.parameters(), lr=1e-3), scaler=torch.amp.GradScaler("cpu"))


def test_loss_scale_calibration_overflow_at_root_code_is_not_an_error() -> None:
    """GradScaler's first scale (65536) pushes the gradient into the fp16 logits past fp16's max while the unscaled
    gradient (~60) fits: calibration (info with the scale: its first step), never an error. The backward cast of
    ``out.float()`` has no reference twin (no cast in fp32), and the root's soft-cap ``mul`` sits next to
    ``scaler.scale(loss)``'s: both need the reference aligned and the cast judged by its own input."""
    report = _diagnose_softcap(1.0)
    over = [f for f in report.findings if f.code == "overflow"]
    assert over, report.codes()                       # the scaled backward really overflows fp16
    assert all(f.severity == "info" and f.phase == "backward" and f.evidence.get("loss_scale") == 65536.0
               for f in over), [(f.severity, f.module, f.op, f.evidence.get("loss_scale")) for f in over]
    assert over[0].evidence["unscaled_absmax"] < 65504
    assert not [f for f in report.findings if f.severity == "error"], [(f.code, f.module, f.op)
                                                                         for f in report.findings]


def test_gradient_past_fp16_even_unscaled_is_an_error() -> None:
    """The twin: the loss is 4000x larger, so the gradient into the fp16 logits is past 65504 without any scale."""
    f = _diagnose_softcap(4000.0).findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == ("overflow", "error", "", "aten._to_copy.default",
                                                             "backward"), (f.code, f.severity, f.module, f.op)
