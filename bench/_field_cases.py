"""Field cases: tiny reproductions of publicly reported mixed-precision failures from outside this repository.

Each case is one registered builder (``@case(name, ...)``) taking ``bad`` (the reported failure) or not (its
healthy twin: the same model and step with magnitudes that fit) and returning ``diagnose`` keyword arguments.
``expect`` is what a demanding user expects of ``findings[0]``: ``(code, module, op, phase)``. Magnitudes are the
ones the reports describe (logits ~10 for a saturated sigmoid, activations ~4e4 in a VAE decoder, positions up
to 511). Registering a name twice raises (``_field_registry``); round 4's cases are in ``_field_cases_r4`` and
registered here too. Used by ``tests/field`` and ``bench/field.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _field_registry import CASES as CASES  # re-exported: tests and bench/field.py read CASES here
from _field_registry import Case as Case
from _field_registry import case, seeded
from torch import nn

_gen = seeded


# ------------------------------------------------------------------ 1. Mamba-style mixer: hand-written softplus
class Mixer(nn.Module):
    """A selective-state-space mixer: ``dt = log(1 + exp(dt_proj(h)))`` written by hand, ``dA = exp(dt * A)``."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.dt_proj = nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1))
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, z = self.in_proj(x).chunk(2, -1)
        dt = torch.log(1 + torch.exp(self.dt_proj(h)))  # softplus without the x > 20 shortcut
        d_a = torch.exp(dt[..., None] * -torch.exp(self.A_log))
        y = (d_a * h[..., None]).sum(-1) * dt
        return self.out_proj(y * F.silu(z))


class SSM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.mixer = Mixer()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.embed(x)))


def mean_square(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


@case("mamba-softplus-exp", "https://github.com/openvinotoolkit/openvino/pull/31654 ([GPU] Fix nan values in "
      "SoftPlus: exp(x) overflows fp16 for x > 11.09); unslothai/unsloth-zoo#211 (Falcon-H1 mamba fp16 NaN)",
      ("overflow", "mixer", "aten.exp.default", "forward"))
def mamba_softplus(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = SSM()
    with torch.no_grad():
        m.mixer.dt_proj.bias.fill_(14.0 if bad else 2.0)  # dt pre-activations ~14: exp(14) = 1.2e6 > 65504
    return {"model": m, "batch": torch.randn(2, 6, 8, generator=_gen(1)), "precision": "fp16",
            "loss_fn": mean_square}


# ------------------------------------------------------------------ 2. EfficientViT ReLU linear attention
class LiteMLA(nn.Module):
    """EfficientViT's ReLU linear attention: ``(v^T k) q`` summed over all N tokens, ``/ (k-sum . q + eps)``."""

    def __init__(self, d: int = 16, eps: float = 1e-15) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = F.relu(q), F.relu(k)
        v = F.pad(v, (0, 1), value=1.0)
        vk = torch.matmul(v.transpose(1, 2), k)  # (B, d+1, d): a sum over the N tokens
        out = torch.matmul(vk, q.transpose(1, 2))
        out = out[:, :-1] / (out[:, -1:] + self.eps)
        return self.proj(out.transpose(1, 2))


class LinearViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.attn = LiteMLA()
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.stem(x)).mean(1))


_VIT_Y = torch.randint(0, 10, (2,), generator=_gen(2))


def vit_ce(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out.float(), _VIT_Y)


@case("efficientvit-linear-attention", "https://github.com/mit-han-lab/efficientvit/issues/110 (FP16 training "
      "NaN after removing qkv.float() in relu_linear_att)", ("overflow", "attn", "aten.bmm.default", "forward"))
def efficientvit(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = LinearViT()
    with torch.no_grad():
        m.stem.weight.mul_(12.0 if bad else 1.0)  # token features ~10: v^T k over 512 tokens ~1.6e5
    return {"model": m, "batch": torch.randn(2, 512, 8, generator=_gen(1)), "precision": "fp16-amp",
            "loss_fn": vit_ce, "scaler": torch.amp.GradScaler("cpu")}


# ------------------------------------------------------------------ 3. NT-Xent loss: F.normalize's eps in fp16
class Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(8, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.backbone(x)))


def ntxent(out: torch.Tensor, batch: Any, tau: float = 0.5) -> torch.Tensor:
    z = F.normalize(out, dim=1)  # denominator clamp_min(eps=1e-12): 0 in fp16
    sim = z @ z.t() / tau
    return sim.float().logsumexp(1).mean()


@case("ntxent-normalize-eps", "https://github.com/lightly-ai/lightly/issues/1259 (NTXentLoss: F.normalize's "
      "eps 1e-12 is 0 in half precision -> division by zero -> NaN)",
      ("constant-out-of-range", "", "aten.clamp_min.default", "forward"))
def ntxent_case(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = Projector()
    with torch.no_grad():
        if bad:  # a collapsed projector: every output row exactly 0
            m.head.weight.zero_()
            m.head.bias.zero_()
    return {"model": m, "batch": torch.randn(6, 8, generator=_gen(3)), "precision": "fp16", "loss_fn": ntxent}


# ------------------------------------------------------------------ 4. BatchNorm running_var stored in fp16
class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


@case("batchnorm-running-var-fp16", "https://github.com/apple/coreai-torch/pull/54 (fp16 batch norm: a running_var "
      "above 65504 becomes inf and silently zeroes the output); NVIDIA/apex#133 keep_batchnorm_fp32",
      ("overflow", "bn", "", "setup"))
def batchnorm(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = ConvNet()
    var = 3e5 if bad else 1e3  # conv outputs of std ~550 (variance 3e5) vs ~30
    with torch.no_grad():
        m.conv.weight.mul_(math.sqrt(var))
        m.bn.running_var.fill_(var * 0.3)
    return {"model": m.eval(), "batch": torch.randn(2, 3, 8, 8, generator=_gen(4)), "precision": "fp16"}


# ------------------------------------------------------------------ 5. text/image ids cast to bf16 (Flux EmbedND)
class EmbedND(nn.Module):
    """Rotary angles from integer ids, computed in float64 as Flux does: ``ids[..., None] * omega``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.d = d

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=torch.float64, device=ids.device) / self.d))
        ang = ids.double()[..., None] * omega
        return torch.cat([ang.sin(), ang.cos()], -1).float()


class IdsTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pe = EmbedND()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.inp.weight.dtype)  # "all values passed to the transformer are cast to the train dtype"
        return self.out(self.inp(x) + self.pe(ids).to(self.inp.weight.dtype))


@case("flux-ids-bf16", "https://github.com/Nerogar/OneTrainer/issues/1177 (text ids cast to bfloat16 mix up "
      "tokens for prompts up to 512 tokens); RosettaCommons/foundry#236 (bf16 indices alias beyond 256)",
      ("precision-loss", "", "aten._to_copy.default", "forward"))
def flux_ids(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    t = 512 if bad else 200  # bf16 holds every integer only up to 256
    return {"model": IdsTransformer(), "precision": "bf16",
            "batch": {"x": torch.randn(1, t, 8, generator=_gen(5)), "ids": torch.arange(t)[None]}}


# ------------------------------------------------------------------ 6. SD VAE decoder: residual add past 65504
class VaeDecode(nn.Module):
    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample


@case("sd-vae-decoder-residual", "https://github.com/huggingface/diffusers/issues/7188 (NaN in SDXL's VAE in "
      "fp16; the fix is madebyollin/sdxl-vae-fp16-fix: internal activations too large for fp16)",
      ("overflow", "vae.decoder.up_blocks.0.resnets.0", "aten.add.Tensor", "forward"))
def sd_vae(bad: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=16)
    with torch.no_grad():  # a residual stream ~3.5e4 plus a branch ~3e4: each fits fp16, the sum does not
        d = vae.decoder
        d.conv_in.weight.mul_(3000.0)
        d.conv_in.bias.fill_(3.5e4)
        d.up_blocks[0].resnets[0].conv2.bias.fill_(3e4 if bad else 1e4)
    return {"model": VaeDecode(vae.eval()), "batch": torch.randn(1, 4, 8, 8, generator=_gen(11)),
            "precision": "fp16"}


# ------------------------------------------------------------------ 7. focal loss: sigmoid saturates, pow pole
class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.cls = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls(F.relu(self.body(x)))


_FOCAL_T = torch.ones(8, 4)


def focal(out: torch.Tensor, batch: Any, gamma: float = 0.5, alpha: float = 0.25) -> torch.Tensor:
    p = torch.sigmoid(out)
    pt = p * _FOCAL_T + (1 - p) * (1 - _FOCAL_T)
    return (-alpha * (1 - pt) ** gamma * torch.log(pt.clamp_min(1e-4))).float().mean()


@case("focal-loss-sigmoid-pow", "https://github.com/kornia/kornia/issues/918 (NaN gradients on backward with "
      "focal loss when sigmoid(prediction) equals 1 and 0 < gamma < 1)",
      ("saturation", "", "aten.sigmoid.default", "forward"))
def focal_case(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = Detector()
    with torch.no_grad():  # confident logits ~10: sigmoid(10) = 1 - 4.5e-5 is exactly 1 in fp16
        m.cls.weight.mul_(0.1)
        m.cls.bias.fill_(10.0 if bad else 3.0)
    return {"model": m, "batch": torch.randn(8, 8, generator=_gen(6)), "precision": "fp16", "loss_fn": focal}


# ------------------------------------------------------------------ 8. sum-of-squares loss in fp16
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _sse_loss(target: torch.Tensor) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def sse(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return ((out - target.to(out.dtype)) ** 2).sum()
    return sse


@case("sse-loss-sum-fp16", "https://github.com/Xilinx/brevitas/pull/1496 (a loss summed over many elements in "
      "(b)float16 overflows); tracel-ai/burn#4769 (sum before divide overflows f16 although the mean fits)",
      ("overflow", "", "aten.sum.default", "forward"))
def sse_case(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    target = (8.0 if bad else 1.0) * torch.randn(32, 64, generator=_gen(8))  # 2048 squares of ~64: 1.3e5
    return {"model": Regressor(), "batch": torch.randn(32, 8, generator=_gen(7)), "precision": "fp16",
            "loss_fn": _sse_loss(target)}


# ------------------------------------------------------------------ 9. hand-written LayerNorm with torch.var
class VarLayerNorm(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.ln = VarLayerNorm()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.fc(x)))


@case("var-layernorm-fp16", "https://github.com/pytorch/pytorch/pull/126525 (Half var_sum overflows in batchnorm "
      "statistics: use float); a hand-written LayerNorm's torch.var of activations ~300 exceeds 65504",
      ("overflow", "ln", "aten.var.correction", "forward"))
def var_ln(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = NormBlock()
    with torch.no_grad():
        m.fc.weight.mul_(600.0 if bad else 1.0)  # activations of std ~380: variance 1.4e5
    return {"model": m, "batch": torch.randn(4, 16, generator=_gen(10)), "precision": "fp16"}


# ------------------------------------------------------------------ 10. InfoNCE without max subtraction
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


def _infonce(tau: float) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        z = out / out.norm(dim=-1, keepdim=True)
        e = torch.exp(z @ z.roll(1, 0).t() / tau)  # softmax by hand, no max subtraction: exp(1 / 0.05) = 4.9e8
        return (-torch.log(e.diagonal() / e.sum(-1))).float().mean()
    return loss


@case("infonce-exp-no-max", "https://github.com/Lightning-Universe/lightning-bolts/issues/811 (SimCLR nt_xent_loss "
      "overflows on low temperatures because of e ** (1 / temperature))", ("overflow", "", "aten.exp.default",
                                                                           "forward"))
def infonce(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": Encoder(), "batch": torch.randn(8, 8, generator=_gen(9)), "precision": "fp16",
            "loss_fn": _infonce(0.05 if bad else 0.2)}


# ------------------------------------------------------------------ second families for the fixes
class Tagger(nn.Module):
    """A tiny BERT with a sigmoid multi-label head (hand-written BCE in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.tags = nn.Linear(16, 5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tags(self.bert(input_ids).last_hidden_state[:, 0])


def hand_bce(out: torch.Tensor, batch: Any) -> torch.Tensor:
    p = torch.sigmoid(out)
    t = torch.zeros_like(p)  # the confident tags are wrong: log(1 - p)
    return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).float().mean()


@case("bert-tagger-hand-bce", "second family for the saturation -> pole fix: a hand-written BCE "
      "-(t log p + (1 - t) log(1 - p)) on a sigmoid head (pytorch/pytorch#29429-style fp16 loss NaN)",
      ("saturation", "", "aten.sigmoid.default", "forward"))
def bert_tagger(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = Tagger()
    with torch.no_grad():
        m.tags.weight.mul_(0.1)
        m.tags.bias.fill_(10.0 if bad else 3.0)
    return {"model": m.train(), "batch": {"input_ids": torch.randint(1, 64, (4, 6), generator=_gen(12))},
            "precision": "fp16", "loss_fn": hand_bce}


class PaddedPositions(nn.Module):
    """Positions counted from the attention mask (``mask.cumsum(-1)``) in the model's dtype, then sinusoids."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = attention_mask.to(self.inp.weight.dtype).cumsum(-1) - 1  # left padding: positions start at 0
        freqs = torch.exp(-math.log(1e4) * torch.arange(0, 16, 2, device=x.device) / 16).float()
        ang = pos.float()[..., None] * freqs
        pe = torch.cat([ang.sin(), ang.cos()], -1).to(self.inp.weight.dtype)
        return self.out(self.inp(x) + pe)


@case("cumsum-positions-bf16", "second family for the integer-rounding fix: position ids from attention_mask.cumsum "
      "computed in bf16 (RosettaCommons/foundry#236: bf16 holds integers exactly only up to 256)",
      ("precision-loss", "", "aten.cumsum.default", "forward"))
def cumsum_positions(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    t = 600 if bad else 200
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, :20] = 0
    return {"model": PaddedPositions(), "precision": "bf16",
            "batch": {"x": torch.randn(2, t, 8, generator=_gen(13)), "attention_mask": mask}}


class RotaryArange(nn.Module):
    """GPT-NeoX-era rotary cache: positions made with ``torch.arange(T).type_as(self.inv_freq)`` -- bf16 once the
    model is cast."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[1], dtype=self.inv_freq.dtype, device=x.device)
        freqs = torch.einsum("i,j->ij", t.float(), self.inv_freq.float())
        emb = torch.cat([freqs, freqs], -1)
        return x * emb.cos().to(x.dtype) + x.roll(1, -1) * emb.sin().to(x.dtype)


class RotaryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.rot = RotaryArange()
        self.o = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.rot(self.q(x)))


@case("rotary-arange-type-as-bf16", "https://github.com/nkalyanv99/UNI-D2/pull/6 (Fix/rope cache dtype: "
      "torch.arange(...).type_as(self.inv_freq) in bf16 aliases positions above 256); EleutherAI/gpt-neox#1003",
      ("precision-loss", "rot", "aten.arange.default", "forward"))
def rotary_arange(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    t = 1024 if bad else 200
    return {"model": RotaryAttention(), "batch": torch.randn(1, t, 16, generator=_gen(14)), "precision": "bf16"}


# ------------------------------------------------------------------ CLIP: the learned logit_scale's exp in fp16
def _clip(logit_scale: float) -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16,
                                  "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1},
                     vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "image_size": 8, "patch_size": 4},
                     projection_dim=8)
    m = CLIPModel(cfg)
    with torch.no_grad():
        m.logit_scale.fill_(logit_scale)
    return m


@case("clip-logit-scale-exp-fp16", "https://github.com/openai/CLIP/pull/530 (Clamp logit_scale: unbounded, "
      "self.logit_scale.exp() overflows -> inf/NaN logits and loss); kornia/kornia#3481 (SigLip2 logit_scale)",
      ("overflow", "", "aten.exp.default", "forward"))
def clip_logit_scale(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)  # a fine-tuned temperature that grew to 12 (exp = 1.6e5) vs CLIP's clamp ln(100) = 4.61
    m = _clip(12.0 if bad else math.log(100.0))
    g = _gen(15)
    batch = {"input_ids": torch.randint(3, 64, (4, 6), generator=g),
             "pixel_values": torch.randn(4, 3, 8, 8, generator=g), "return_loss": True}
    return {"model": m, "batch": batch, "precision": "fp16"}


# ------------------------------------------------------------------ one-pass variance E[x^2] - E[x]^2
class DiffOfSquaresLayerNorm(nn.Module):
    """A hand-fused LayerNorm: one pass for mean and mean of squares, ``var = E[x^2] - E[x]^2``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var + 1e-5) * self.weight + self.bias


class PreNormBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(16, d)
        self.norm = DiffOfSquaresLayerNorm(d)
        self.ff = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.ff(self.norm(self.up(x)))))


@case("diff-of-squares-layernorm-fp16-amp", "https://github.com/NVIDIA/trt-samples-for-hackathon-cn/issues/88 "
      "(USE_DIFF_OF_SQUARES layer norm: Var[x] = E[x^2] - E[x]^2 goes negative -> rsqrt NaN / wrong output); "
      "anthonymlortiz/lcn#4 (squares < sums^2/n in float16)",
      ("precision-loss", "norm", "aten.sub.Tensor", "forward"))
def diff_of_squares_ln(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = PreNormBlock()
    with torch.no_grad():  # activations with a common offset ~60 and a spread ~0.6: E[x^2] ~ 3600, where fp16's
        m.up.bias.fill_(60.0 if bad else 0.0)  # spacing is 2 -- the variance ~0.3 rounds to 0 (no NaN: eps)
    return {"model": m, "batch": torch.randn(4, 16, generator=_gen(16)), "precision": "fp16-amp",
            "loss_fn": mean_square}


class DiffOfSquaresBatchNorm(nn.Module):
    """A hand-written training-mode BatchNorm with per-channel ``E[x^2] - E[x]^2`` over (N, H, W)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean((0, 2, 3), keepdim=True)
        var = (x * x).mean((0, 2, 3), keepdim=True) - mean * mean
        y = (x - mean) * torch.rsqrt(var + 1e-5)
        return y * self.weight[:, None, None] + self.bias[:, None, None]


class BnConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = DiffOfSquaresBatchNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


@case("diff-of-squares-batchnorm-bf16", "second family for the cancellation-noise fix: "
      "https://github.com/tenstorrent/tt-metal/issues/45968 (batch_norm training: E[x^2] - E[x]^2 in bf16 for "
      "per-channel mean ~5, std ~0.1 -> NaN / un-normalized output)",
      ("precision-loss", "bn", "aten.sub.Tensor", "forward"))
def diff_of_squares_bn(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = BnConvNet()
    with torch.no_grad():  # per-channel mean +-5 with a spread ~0.1 (the report's magnitudes)
        m.conv.weight.mul_(0.1)
        m.conv.bias.copy_(torch.tensor([5.0, -5.0] * 4) if bad else torch.zeros(8))
    return {"model": m, "batch": torch.randn(4, 3, 8, 8, generator=_gen(17)), "precision": "bf16",
            "loss_fn": mean_square}


# ------------------------------------------------------------------ EMA of the weights kept in bf16
class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.inp(x)))


class WithEma(nn.Module):
    """A model and its exponential moving average (diffusers' EMAModel / timm's ModelEma pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Denoiser()
        self.ema = Denoiser()
        self.ema.load_state_dict(self.net.state_dict())
        self.ema.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net.inp.weight.dtype))


def _ema_step(decay: float = 0.9999, lr: float = 0.5) -> Callable[[nn.Module, Any], torch.Tensor]:
    def train_step(model: nn.Module, batch: Any) -> torch.Tensor:
        loss = (model(batch).float() - batch.float()).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.net.parameters():
                p.sub_(lr * p.grad)
                p.grad = None
            for e, p in zip(model.ema.parameters(), model.net.parameters(), strict=True):
                e.sub_((1 - decay) * (e - p.to(e.dtype)))  # diffusers' EMAModel.step
        return loss
    return train_step


@case("ema-weights-bf16", "https://github.com/d8ahazard/sd_dreambooth_extension/pull/1415 (Use float32 for EMA "
      "model: in fp16/bf16 almost all EMA weight updates are rounded to 0, the EMA never changes)",
      ("low-precision-params", "ema.out", "aten.sub_.Tensor", "optimizer"))
def ema_bf16(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = WithEma().to(torch.bfloat16)
    if not bad:
        m.ema.float()  # the fix in the PR: the EMA copy stays float32 while the model trains in bf16
    return {"model": m, "batch": torch.randn(16, 8, generator=_gen(18)), "precision": None,
            "train_step": _ema_step(), "steps": 2}


# ------------------------------------------------------------------ noise schedules cast to the latents' dtype
class NoisePredictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(9, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.inp(torch.cat([x, t[:, None].to(x.dtype) / 1000], -1))))


class DDPMTrainer(nn.Module):
    """A DDPM training step with Stable Diffusion's scaled-linear schedule; ``add_noise`` as diffusers wrote it
    before PR 9004 (the schedule cast to the sample's dtype) or after it (the noisy sample computed in float32)."""

    def __init__(self, cast_schedule: bool) -> None:
        super().__init__()
        self.unet = NoisePredictor()
        betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - betas, 0))
        self.cast_schedule = cast_schedule

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        if self.cast_schedule:
            a = self.alphas_cumprod.to(dtype=latents.dtype)[timesteps][:, None]
            noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        else:
            a = self.alphas_cumprod[timesteps][:, None]
            noisy = (a.sqrt() * latents.float() + (1 - a).sqrt() * noise.float()).to(latents.dtype)
        return self.unet(noisy, timesteps)


def noise_mse(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(out.float(), batch["noise"].float())


@case("ddpm-alphas-cumprod-cast-bf16", "https://github.com/huggingface/diffusers/pull/9004 ([bugfix] reduce float "
      "value error when adding noise: with the schedule cast to the bf16/fp16 sample dtype it adds no noise at all "
      "for steps 0 and 2)", ("precision-loss", "", "aten.rsub.Scalar", "forward"))
def ddpm_cast(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(19)  # latents from a bf16 VAE; the low-noise timesteps (0..45) of a fine-tuning batch
    batch = {"latents": torch.randn(16, 8, generator=g).bfloat16(), "timesteps": torch.arange(0, 48, 3),
             "noise": torch.randn(16, 8, generator=g).bfloat16()}
    return {"model": DDPMTrainer(cast_schedule=bad), "batch": batch, "precision": "bf16-amp", "loss_fn": noise_mse}


class FlowMatchTrainer(nn.Module):
    """A rectified-flow step (SD3 / Flux): ``x_t = (1 - sigma) * latents + sigma * noise``, the shifted sigmas
    gathered from the schedule in the weights' dtype (sd-scripts' ``get_sigmas(..., dtype=weight_dtype)``)."""

    def __init__(self, shift: float = 3.0) -> None:
        super().__init__()
        self.net = NoisePredictor()
        s = torch.linspace(1.0, 1 / 1000, 1000)
        self.register_buffer("sigmas", shift * s / (1 + (shift - 1) * s))

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        dtype = self.net.inp.weight.dtype
        sigma = self.sigmas.to(dtype=dtype)[timesteps][:, None]
        noisy = (1.0 - sigma) * latents.to(dtype) + sigma * noise.to(dtype)
        return self.net(noisy, timesteps)


def velocity_mse(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(out.float(), (batch["noise"] - batch["latents"]).float())


@case("flow-match-sigmas-bf16", "second family for the rounded-operand fix: full-bf16 rectified-flow training "
      "whose shifted sigmas come from a schedule in the weights' dtype (kohya-ss/sd-scripts --full_bf16, "
      "get_sigmas(dtype=weight_dtype)): sigmas within 2**-9 of 1 round to 1 and (1 - sigma) * latents drops the "
      "signal", ("precision-loss", "", "aten.rsub.Scalar", "forward"))
def flow_match(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(20)  # the high-noise end that the resolution shift makes common (indices 0..30: sigma >= 0.99)
    batch = {"latents": torch.randn(16, 8, generator=g), "timesteps": torch.arange(0, 32, 2),
             "noise": torch.randn(16, 8, generator=g)}
    return {"model": FlowMatchTrainer(), "batch": batch, "precision": "bf16" if bad else "bf16-amp",
            "loss_fn": velocity_mse}


@case("clip-half-adam-eps", "https://github.com/openai/CLIP/issues/40 (NaN values after a single gradient step: "
      "clip.load gives fp16 weights, Adam's eps 1e-8 is 0 in fp16 and grad**2 underflows -> 0/0)",
      ("low-precision-params", "text_model.embeddings.token_embedding", "aten.addcdiv_.default", "optimizer"))
def clip_half_adam(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = _clip(math.log(100.0))
    if bad:
        m = m.half()  # what clip.load returns on a GPU
    g = _gen(15)
    pixels = torch.randn(4, 3, 8, 8, generator=g)
    batch = {"input_ids": torch.randint(3, 64, (4, 6), generator=g),
             "pixel_values": pixels.half() if bad else pixels, "return_loss": True}
    return {"model": m, "batch": batch, "precision": None if bad else "fp16-amp", "steps": 2,
            "optimizer": torch.optim.Adam(m.parameters(), lr=1e-5, eps=1e-8)}


# ------------------------------------------------------------------ round 3: SSM scan, hand-written norms, LoRA
class CumsumScan(nn.Module):
    """A selective scan with two cumulative sums instead of a loop (mamba-tiny's form):
    ``h_t = exp(cs_t) * sum_s x_s dt_s / exp(cs_s)`` with ``cs = cumsum(dt * A)``, A < 0."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.dt_proj = nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.zeros(d))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(self.dt_proj(x))
        cs = torch.cumsum(dt * -torch.exp(self.A_log), 1)
        decay = torch.exp(cs)
        return self.out(torch.cumsum(x * dt / decay, 1) * decay)


class ScanNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.mixer = CumsumScan()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.embed(x)))


@case("ssm-exp-cumsum-fp16", "https://github.com/MzeroMiko/mamba-mini/issues/6 (SelectiveScanEasy forward NaN: "
      "dtBus / rAts where rAts = exp(cumsum(dt * A)) is 0); johnma2006/mamba-minimal#18 (the two-cumsum scan)",
      ("underflow", "mixer", "aten.exp.default", "forward"))
def ssm_exp_cumsum(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = ScanNet()
    with torch.no_grad():  # A = -1: the cumulative log-decay reaches -22 over 32 steps, exp(-22) < 2**-24
        m.mixer.A_log.fill_(0.0 if bad else -2.5)
    return {"model": m, "batch": torch.randn(2, 32, 8, generator=_gen(21)), "precision": "fp16",
            "loss_fn": mean_square}


class HandGroupNorm(nn.Module):
    """GroupNorm written out: ``var = mean((x - mean)**2)`` per group, squared in the input's dtype."""

    def __init__(self, groups: int = 8, channels: int = 32, eps: float = 1e-6) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        xg = x.reshape(b, self.groups, -1)
        mean = xg.mean(-1, keepdim=True)
        var = (xg - mean).pow(2).mean(-1, keepdim=True)
        xg = (xg - mean) / torch.sqrt(var + self.eps)
        return xg.reshape(b, c, h, w) * self.weight[:, None, None] + self.bias[:, None, None]


class ConvNormDecoder(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, 32, 3, padding=1)
        self.norm = norm
        self.conv_out = nn.Conv2d(32, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm(self.conv_in(x))))


def conv_norm_decoder(bad: bool, norm: nn.Module) -> dict[str, Any]:
    torch.manual_seed(0)
    m = ConvNormDecoder(norm)
    with torch.no_grad():  # conv activations ~6e3 (a VAE decoder's mid block): squares ~3e7 > 65504
        m.conv_in.weight.mul_(3000.0 if bad else 1.0)
    return {"model": m, "batch": torch.randn(2, 4, 8, 8, generator=_gen(22)), "precision": "fp16",
            "loss_fn": mean_square}


@case("hand-groupnorm-fp16", "https://github.com/neuroneural/brainchop-cli/pull/56 (fp16 GroupNorm: the "
      "per-element square runs in f16, conv outputs > 256 overflow to inf before the accumulation); "
      "keras-team/keras#22666 (GroupNormalization NaN under mixed_float16)",
      ("overflow", "norm", "aten.pow.Tensor_Scalar", "forward"))
def hand_groupnorm(bad: bool) -> dict[str, Any]:
    return conv_norm_decoder(bad, HandGroupNorm())


class HandWeightNorm(nn.Module):
    """``w = g * v / ||v||`` per output row, written out (a re-implemented weight norm), in the weights' dtype."""

    def __init__(self, n_in: int = 64, n_out: int = 64) -> None:
        super().__init__()
        lin = nn.Linear(n_in, n_out)
        self.v = nn.Parameter(lin.weight.detach().clone())
        self.g = nn.Parameter(lin.weight.detach().norm(dim=1, keepdim=True))
        self.bias = nn.Parameter(lin.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True), self.bias)


class NormedProjNet(nn.Module):
    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.proj = proj
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.leaky_relu(self.proj(F.leaky_relu(self.inp(x)))))


@case("hand-weight-norm-fp16", "https://github.com/apache/mxnet/issues/11403 (L2 norm of an fp16 array goes to "
      "NaN: the squared sum is out of range); facebookresearch/fairscale#263 (grad norm 5000**2 overflows fp16); "
      "weight norm's v grows during training (its gradient is orthogonal to v)",
      ("overflow", "proj", "aten.linalg_vector_norm.default", "forward"))
def hand_weight_norm(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = NormedProjNet(HandWeightNorm())
    with torch.no_grad():  # |v| entries up to 1.9e4 (fit fp16), row norms ~9e4 (do not)
        m.proj.v.mul_(1.5e5 if bad else 1.0)
    return {"model": m, "batch": torch.randn(4, 16, generator=_gen(23)), "precision": "fp16",
            "loss_fn": mean_square}


@case("spectral-norm-power-iteration-fp16", "torch.nn.utils.parametrizations.spectral_norm in fp16: the power "
      "iteration's normalize(W v) takes the norm of W v in fp16 (apache/mxnet#11403: fp16 L2 norm out of range; "
      "NVIDIA/apex#181: spectral_norm under amp)",
      ("overflow", "proj.parametrizations.weight.0", "aten.linalg_vector_norm.default", "forward"))
def spectral_norm_fp16(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = NormedProjNet(nn.utils.parametrizations.spectral_norm(nn.Linear(64, 64)))
    with torch.no_grad():  # an unnormalized weight of entries ~1e4: ||W v|| ~ 1e5 > 65504
        m.proj.parametrizations.weight.original.mul_(1.5e5 if bad else 1.0)
    return {"model": m, "batch": torch.randn(4, 16, generator=_gen(23)), "precision": "fp16",
            "loss_fn": mean_square}


class LoRALinear(nn.Module):
    """peft's form: a frozen base plus ``B(A(x)) * alpha / r``, B zero-initialized."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


class LoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32).requires_grad_(False)
        self.q = LoRALinear(nn.Linear(32, 32))
        self.head = nn.Linear(32, 4).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.q(F.gelu(self.inp(x.to(self.inp.weight.dtype))))))


@case("lora-fp16-adapters-adam", "https://github.com/kohya-ss/sd-scripts/issues/1914 (LoRA with full_fp16: "
      "training runs but the result has no effect); huggingface/diffusers#6119 (fp16 LoRA training: the adapter "
      "parameters must be float32, cast_training_params)",
      ("low-precision-params", "q.lora_A", "aten.addcdiv_.default", "optimizer"))
def lora_fp16(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = LoRANet().half()  # the base loaded in fp16
    if not bad:
        m.q.lora_A.float()  # the fix: trainable adapter weights in float32, the step under autocast
        m.q.lora_B.float()
    params = [p for p in m.parameters() if p.requires_grad]
    return {"model": m, "batch": torch.randn(8, 16, generator=_gen(24)).half(),
            "precision": None if bad else "fp16-amp", "steps": 2, "loss_fn": mean_square,
            "optimizer": torch.optim.AdamW(params, lr=1e-4)}


# ------------------------------------------------------------------ reentrant checkpoint behind frozen inputs
class CkptBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class CheckpointedLM(nn.Module):
    """Token embeddings frozen (adapter-style fine-tuning), each block under ``torch.utils.checkpoint``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32).requires_grad_(False)
        self.blocks = nn.ModuleList([CkptBlock(), CkptBlock()])
        self.head = nn.Linear(32, 100)
        self.use_reentrant = use_reentrant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def token_ce(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), batch.flatten())


@case("checkpoint-reentrant-frozen-embeddings", "https://github.com/huggingface/transformers/issues/21381 "
      "(gradient checkpointing with frozen embeddings: the checkpointed blocks get no gradient; fix with "
      "use_reentrant=False); mlfoundations/open_clip#573 ('None of the inputs have requires_grad=True')",
      ("unused-parameters", "blocks.0.fc1", "", "backward"))
def checkpoint_reentrant(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = CheckpointedLM(use_reentrant=bad)
    return {"model": m, "batch": torch.randint(0, 100, (4, 8), generator=_gen(25)), "precision": "fp16-amp",
            "loss_fn": token_ce, "scaler": torch.amp.GradScaler("cpu"),
            "optimizer": torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)}


class CheckpointedViT(nn.Module):
    """A ViT whose patch embedding is locked (LiT / open_clip's locked image tower stem), the blocks run through
    ``checkpoint_sequential``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 4, stride=4).requires_grad_(False)
        self.blocks = nn.Sequential(CkptBlock(), CkptBlock(), CkptBlock())
        self.head = nn.Linear(32, 10)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.utils.checkpoint.checkpoint_sequential(self.blocks, 3, h, use_reentrant=self.use_reentrant)
        return self.head(h.mean(1))


@case("vit-locked-stem-checkpoint-sequential", "second family for the gradient-cut fix: a ViT with a locked patch "
      "embedding and checkpoint_sequential(use_reentrant=True) (open_clip's --lock-image / grad-checkpointing, "
      "mlfoundations/open_clip#573)", ("unused-parameters", "blocks.0.fc1", "", "backward"))
def vit_checkpoint_sequential(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = CheckpointedViT(use_reentrant=bad)
    g = _gen(26)
    # default CUDA-policy emulation: the twin's non-reentrant recompute in backward re-enters autocast, which the
    # runner's step-wide emulation scope follows (it raised CheckpointError before: precision/_contexts.py)
    return {"model": m, "batch": torch.randn(4, 3, 16, 16, generator=g), "precision": "bf16-amp",
            "loss_fn": lambda out, batch: out.float().logsumexp(-1).mean(),
            "optimizer": torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)}


import _field_cases_r4  # noqa: E402, F401 - registers round 4's cases after these (keeps CASES' order)
import _field_cases_r5  # noqa: E402, F401 - round 5's cases, after round 4's
import _field_cases_r6  # noqa: E402, F401 - round 6's cases, after round 5's
import _field_cases_r7  # noqa: E402, F401 - round 7's cases, after round 6's
