"""Field cases, round 5: unseen families -- a Wan-style DiT's timestep and a mass-spectrum encoder's m/z cast to
bf16 before a sinusoidal embedding, rotary angles at a 65536 offset under autocast, BLOOM's ALiBi tensor in bf16,
a detector's box areas in fp16, a graph-attention edge softmax without the max, a long-audio feature normalizer,
an RWKV-style recurrent state in bf16. Registered into ``_field_registry.CASES`` (read it as
``_field_cases.CASES``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from _field_registry import case, seeded
from torch import nn

_gen = seeded


def sinusoidal_1d(dim: int, position: torch.Tensor) -> torch.Tensor:
    """Wan's ``sinusoidal_embedding_1d``: angles in float64, the result cast back to ``position``'s dtype."""
    freqs = torch.pow(10000, -torch.arange(dim // 2, dtype=torch.float64, device=position.device).div(dim // 2))
    ang = torch.outer(position.double(), freqs)
    return torch.cat([ang.cos(), ang.sin()], 1).to(position.dtype)


class TinyWanDiT(nn.Module):
    """A DiT denoiser conditioned on a flow-matching timestep in [0, 1000]: a sinusoidal embedding, an MLP, adaLN
    modulation of one block. The scheduler's float timesteps are a plain tensor (DiffSynth's FlowMatchScheduler),
    indexed by the sampled timestep id. ``t_fp32``: the timestep stays float32 through the sinusoid (the fix)."""

    def __init__(self, t_fp32: bool, d: int = 32, freq_dim: int = 64) -> None:
        super().__init__()
        self.t_fp32, self.freq_dim = t_fp32, freq_dim
        self.timesteps = torch.linspace(1000.0, 0.0, 1001)[:-1] - 1.6103  # shifted schedule: 998.39, ...
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Linear(d, 2 * d)
        self.patch = nn.Linear(16, d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 16)

    def forward(self, x: torch.Tensor, timestep_id: torch.Tensor) -> torch.Tensor:
        dtype = self.patch.weight.dtype
        t = self.timesteps.to(x.device)[timestep_id]
        if self.t_fp32:  # DiffSynth-Studio#1025: keep the timestep float32, cast the embedding
            e = sinusoidal_1d(self.freq_dim, t).to(dtype)
        else:  # the pipeline's ``timestep.to(dtype=self.torch_dtype)`` before the embedding
            e = sinusoidal_1d(self.freq_dim, t.to(dtype))
        shift, scale = self.time_projection(F.silu(self.time_embedding(e))).chunk(2, -1)
        h = self.patch(x)
        h = h + self.mlp(self.norm(h) * (1 + scale[:, None]) + shift[:, None])
        return self.head(h)


@case("wan-dit-timestep-bf16", "https://github.com/modelscope/DiffSynth-Studio/pull/1025 (Fix sinusoidal_embedding "
      "for bf16: the Wan DiT casts the timestep, in [0, 1000], to bf16 before sinusoidal_embedding_1d: 998.39 -> "
      "1000, a different time embedding; keep the timestep float32)",
      ("precision-loss", "", "aten._to_copy.default", "forward"))
def wan_timestep(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(50)
    ids = torch.randint(0, 1000, (8,), generator=g)
    batch = {"x": torch.randn(8, 8, 16, generator=g), "timestep_id": ids}
    return {"model": TinyWanDiT(t_fp32=not bad), "batch": batch, "precision": "bf16",
            "loss_fn": lambda out, b: F.mse_loss(out.float(), b["x"].float())}



def timestep_embedding(t: torch.Tensor, dim: int = 64, max_period: float = 10000.0) -> torch.Tensor:
    """diffusers' ``get_timestep_embedding``: the sinusoid in float32 (``timesteps[:, None].float() * freqs``)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


class FluxDenoiseStep(nn.Module):
    """One Flux denoising step, pipeline and transformer: the scheduler's timestep ``t`` (in [0, 1000], a plain
    float32 tensor) expanded and cast to the latents' dtype, divided by 1000 for the transformer, which multiplies
    it by 1000 again and embeds it; AdaLayerNormZero modulation of one MMDiT-style block. ``fp32_timestep``: the
    timestep stays float32 (diffusers#9405's suggestion, kohya-ss/musubi-tuner#729's fix)."""

    def __init__(self, fp32_timestep: bool, d: int = 32) -> None:
        super().__init__()
        self.fp32_timestep = fp32_timestep
        sig = torch.linspace(1.0, 1 / 28, 28)
        shifted = 3.0 * sig / (1 + 2.0 * sig)  # Flux's time shift (mu ~ ln 3)
        self.timesteps = shifted * 1000.0  # the scheduler's timesteps: 1000, 996.3, ...
        self.time_proj = nn.Sequential(nn.Linear(64, d), nn.SiLU(), nn.Linear(d, d))
        self.x_embedder = nn.Linear(16, d)
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.adaLN = nn.Linear(d, 3 * d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.proj_out = nn.Linear(d, 16)

    def forward(self, latents: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        t = self.timesteps.to(latents.device)[step]
        timestep = t if self.fp32_timestep else t.to(latents.dtype)  # pipeline: t.expand(b).to(latents.dtype)
        timestep = (timestep / 1000) * 1000  # pipeline passes timestep / 1000, the transformer scales it back
        temb = self.time_proj(timestep_embedding(timestep).to(self.x_embedder.weight.dtype))
        shift, scale, gate = self.adaLN(F.silu(temb)).chunk(3, -1)
        h = self.x_embedder(latents)
        h = h + gate[:, None] * self.ff(self.norm1(h) * (1 + scale[:, None]) + shift[:, None])
        return self.proj_out(h)


@case("flux-pipeline-timestep-bf16", "second family for the rounded-argument fix: "
      "https://github.com/huggingface/diffusers/issues/9405 (Potential misalignment for flux and sd3 in bf16: the "
      "pipeline's timestep.to(latents.dtype) rounds it, 750 -> 752, before the transformer's sinusoidal "
      "embedding); kohya-ss/musubi-tuner#729 (bfloat16 does not have enough precision in the range of 0-1000: "
      "timesteps in float32)", ("precision-loss", "", "aten._to_copy.default", "forward"))
def flux_timestep(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(58)
    batch = {"latents": torch.randn(4, 16, 16, generator=g), "step": torch.tensor([1, 4, 9, 14])}
    return {"model": FluxDenoiseStep(fp32_timestep=not bad), "batch": batch, "precision": "bf16",
            "loss_fn": lambda out, b: F.mse_loss(out.float(), b["latents"].float())}


class MRoPE3D(nn.Module):
    """Ideogram-style multi-axis rotary angles: image-token positions ``offset + (t, h, w)``, the frequency matmul
    ``pos @ inv_freq`` (on autocast's lower-precision list). ``no_autocast``: the matmul with autocast off (the
    fix, as transformers' RoPE modules do)."""

    def __init__(self, no_autocast: bool, d: int = 32, offset: float = 65536.0) -> None:
        super().__init__()
        self.no_autocast, self.offset = no_autocast, offset
        inv = 1.0 / (10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2)))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = (grid.float() + self.offset)[..., None]  # (tokens, 3, 1): image positions start at the offset
        with torch.autocast(grid.device.type, enabled=not self.no_autocast):
            ang = pos @ self.inv_freq[None, :].float()  # (tokens, 3, d/4)
        ang = ang.flatten(1)
        return ang.cos(), ang.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class RoPEImageAttention(nn.Module):
    def __init__(self, no_autocast: bool, d: int = 48) -> None:
        super().__init__()
        self.rope = MRoPE3D(no_autocast)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(grid)
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        att = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        return x + self.out(att @ v)


@case("mrope-offset-autocast-bf16", "https://github.com/huggingface/diffusers/pull/13922 (Ideogram4MRoPE collapses "
      "under torch.autocast: image positions 65536 + (t, h, w), the frequency matmul runs in bf16 -- spacing 512 at "
      "65536 -- so every image token gets the same rotary embedding; fix: autocast(enabled=False)); "
      "huggingface/transformers#29285 (RoPE loses precision under bf16 autocast)",
      ("precision-loss", "rope", "aten._to_copy.default", "forward"))
def mrope_offset(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    hh, ww = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    grid = torch.stack([torch.zeros_like(hh), hh, ww], -1).flatten(0, 1)  # one frame of 8 x 8 patches
    return {"model": RoPEImageAttention(no_autocast=not bad), "precision": "bf16-amp",
            "batch": {"x": torch.randn(64, 48, generator=_gen(51)), "grid": grid},
            "loss_fn": lambda out, b: out.float().pow(2).mean()}


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)])


class AlibiAttention(nn.Module):
    """BLOOM's attention: ``alibi = slopes * arange(keys)`` (one bias per key, softmax makes it relative) cast to the
    model's dtype, ``baddbmm(alibi, q, k^T)``, softmax. ``fp32_bias``: bias and scores added in float32 (the fix
    HabanaAI/vllm-fork#503 ships as VLLM_ALIBI_USE_FLOAT32_BIASES)."""

    def __init__(self, fp32_bias: bool, d: int = 32, heads: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)
        self.heads, self.fp32_bias = heads, fp32_bias
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4).flatten(1, 2)
        alibi = self.slopes.float()[:, None, None] * torch.arange(t, device=x.device, dtype=torch.float32)
        alibi = alibi.repeat(b, 1, 1)  # (b * heads, 1, keys)
        if self.fp32_bias:
            scores = torch.baddbmm(alibi, q.float(), k.float().transpose(1, 2), alpha=hd ** -0.5)
            probs = scores.softmax(-1).to(x.dtype)
        else:
            scores = torch.baddbmm(alibi.to(x.dtype), q, k.transpose(1, 2), alpha=hd ** -0.5)
            probs = scores.softmax(-1)
        ctx = (probs @ v).view(b, self.heads, t, hd).transpose(1, 2).reshape(b, t, d)
        return x + self.dense(ctx)


class TinyBloom(nn.Module):
    def __init__(self, fp32_bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.ln = nn.LayerNorm(32)
        self.attn = AlibiAttention(fp32_bias)
        self.lm_head = nn.Linear(32, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.attn(self.ln(self.embed(ids))))


@case("bloom-alibi-bf16", "https://github.com/huggingface/transformers/pull/17474 (BLOOM: alibi = slopes * "
      "arange(max_seq_len), then alibi.to(dtype)); HabanaAI/vllm-fork#503 (ALiBi: float32 biases 'to resolve "
      "accuracy issue on long sequences'): at key 380 with slope 0.5 the bias is 190, bf16's spacing there is 1, "
      "neighbouring keys (0.5 apart) get the same bias",
      ("precision-loss", "attn", "aten._to_copy.default", "forward"))
def bloom_alibi(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 384), generator=_gen(52))
    return {"model": TinyBloom(fp32_bias=not bad), "batch": ids, "precision": "bf16",
            "loss_fn": lambda out, batch: F.cross_entropy(out.float()[0, :-1], batch[0, 1:])}


def box_area(b: torch.Tensor) -> torch.Tensor:
    return (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])


def giou_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torchvision's generalized_box_iou_loss before vision#3383 (no float32 upcast of the boxes)."""
    area1, area2 = box_area(pred), box_area(target)
    lt, rb = torch.max(pred[:, :2], target[:, :2]), torch.min(pred[:, 2:], target[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[:, 0] * wh[:, 1]
    union = area1 + area2 - inter
    iou = inter / union
    lti, rbi = torch.min(pred[:, :2], target[:, :2]), torch.max(pred[:, 2:], target[:, 2:])
    whi = (rbi - lti).clamp(min=0)
    area_c = whi[:, 0] * whi[:, 1]
    return (1 - (iou - (area_c - union) / area_c)).mean()


class BoxHead(nn.Module):
    """A DETR/FCOS-style box regressor: normalized (cx, cy, w, h) scaled to a 1333 x 800 image in pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.register_buffer("size", torch.tensor([1333.0, 800.0, 1333.0, 800.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.body(x).sigmoid()
        cx, cy, w, h = c.unbind(-1)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1) * self.size


_BOX_GEN = _gen(53)
_TARGET_NORM = torch.rand(16, 4, generator=_BOX_GEN) * torch.tensor([0.2, 0.2, 0.4, 0.4]) + torch.tensor(
    [0.4, 0.4, 0.4, 0.4])  # large objects: cx, cy ~ 0.5, w, h ~ 0.4-0.8 of the image


def _targets(scale: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = _TARGET_NORM.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1) * scale


@case("detr-giou-box-area-fp16", "https://github.com/pytorch/vision/pull/3383 (Fix NMS and IoU overflows for fp16: "
      "box areas (x2 - x1) * (y2 - y1) of large boxes in pixels exceed 65504, inf / inf = NaN IoU; the fix upcasts "
      "the boxes to float32); pytorch/vision#3371; facebookresearch/fvcore#114 (don't use fp16 in giou loss)",
      ("overflow", "", "aten.mul.Tensor", "forward"))
def detr_giou(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    size = torch.tensor([1333.0, 800.0, 1333.0, 800.0])

    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        tgt = _targets(size).to(out.dtype)
        return giou_loss(out, tgt) if bad else giou_loss(out.float(), tgt.float())  # vision#3383: _upcast

    return {"model": BoxHead(), "batch": torch.randn(16, 16, generator=_gen(54)), "precision": "fp16",
            "loss_fn": loss}


class EdgeSoftmaxGAT(nn.Module):
    """A GAT layer written with plain scatter ops: ``e = leaky_relu(a_src . Wh_j + a_dst . Wh_i)``, ``exp(e)``
    summed per destination with ``index_add``, messages weighted by ``exp(e) / sum``. ``stable``: the per-node max
    subtracted first (PyG's ``softmax``, the max detached; JuliaGraphs/GraphNeuralNetworks.jl#244's fix)."""

    def __init__(self, stable: bool, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)
        self.att_src = nn.Parameter(torch.randn(d) * 0.3)
        self.att_dst = nn.Parameter(torch.randn(d) * 0.3)
        self.stable = stable

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        h = self.lin(x)
        e = F.leaky_relu((h * self.att_src).sum(-1)[src] + (h * self.att_dst).sum(-1)[dst], 0.2)
        if self.stable:
            emax = torch.zeros(x.shape[0], dtype=e.dtype, device=e.device)
            emax = emax.scatter_reduce(0, dst, e.detach(), "amax", include_self=False)
            e = e - emax[dst]
        w = e.exp()
        den = torch.zeros(x.shape[0], dtype=w.dtype, device=w.device).index_add(0, dst, w)
        alpha = w / den[dst]
        return torch.zeros_like(h).index_add(0, dst, h[src] * alpha[:, None])


class TinyGAT(nn.Module):
    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.gat = EdgeSoftmaxGAT(stable)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.head(F.elu(self.gat(self.inp(x), edge_index)))


@case("gat-edge-softmax-exp-fp16", "https://github.com/JuliaGraphs/GraphNeuralNetworks.jl/issues/246 (Overflows in "
      "GATConv and GATv2Conv: the attention softmax exponentiates without subtracting the maximum, inputs of ~100 "
      "overflow; fixed in #244 with the neighbourhood max); pyg-team/pytorch_geometric#646 (half precision: fill "
      "values out of fp16's range); in fp16 exp overflows above 11.1",
      ("overflow", "gat", "aten.exp.default", "forward"))
def gat_edge_softmax(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(55)
    n, deg = 64, 8
    dst = torch.arange(n).repeat_interleave(deg)
    src = torch.randint(0, n, (n * deg,), generator=g)
    m = TinyGAT(stable=not bad)
    with torch.no_grad():  # trained attention vectors: scores e up to ~14 for the strongest edges
        m.gat.att_src.mul_(10.0)
        m.gat.att_dst.mul_(10.0)
    y = torch.randint(0, 3, (n,), generator=g)
    return {"model": m, "batch": {"x": torch.randn(n, 8, generator=g), "edge_index": torch.stack([src, dst])},
            "precision": "fp16", "loss_fn": lambda out, b: F.cross_entropy(out.float(), y)}


class FeatureNormalize(nn.Module):
    """convasr's masked per-utterance feature normalization: mean and std over the valid frames."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = mask.sum(-1, keepdim=True)
        mean = (x * mask).sum(-1, keepdim=True) / n
        var = ((x - mean) * mask).pow(2).sum(-1, keepdim=True) / n
        return (x - mean) / (var + 1e-5).sqrt()


class ConvASR(nn.Module):
    """Log-mel features (64 bins, 10 ms frames) -> normalization -> a conv encoder -> per-frame CTC-like logits.
    ``fp32_norm``: the normalization runs in float32 (convasr#73's fix)."""

    def __init__(self, fp32_norm: bool) -> None:
        super().__init__()
        self.normalize_features = FeatureNormalize()
        self.conv = nn.Conv1d(64, 32, 5, stride=4, padding=2)
        self.head = nn.Conv1d(32, 30, 1)
        self.fp32_norm = fp32_norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.fp32_norm:
            x = self.normalize_features(x.float(), mask.float()).type_as(x)
        else:
            x = self.normalize_features(x, mask.to(x.dtype))
        return self.head(F.relu(self.conv(x)))


@case("asr-long-audio-normalize-fp16", "https://github.com/vadimkantorov/convasr/pull/73 (fp16 overflow fix: "
      "long audio in fp16 inference, the masked feature normalization's sums over the frames overflow to -inf; "
      "normalize in float32)", ("overflow", "normalize_features", "aten.sum.dim_IntList", "forward"))
def asr_normalize(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    frames = 8000  # 80 s of audio at 10 ms frames; log-mel energies around -11 (log of ~1.7e-5)
    x = torch.randn(1, 64, frames, generator=_gen(56)) * 2.0 - 11.0
    mask = torch.ones(1, 1, frames)
    return {"model": ConvASR(fp32_norm=not bad), "batch": {"x": x, "mask": mask}, "precision": "fp16",
            "loss_fn": lambda out, b: out.float().logsumexp(1).mean()}



class DriftedLM(nn.Module):
    """A T5-style LM whose output logits drifted to a large common offset (no z-loss to keep log Z near 0): the
    lm_head's bias holds the offset, the vocabulary's logits differ by a few units around it."""

    def __init__(self, offset: float, vocab: int = 512, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.lm_head = nn.Linear(d, vocab)
        with torch.no_grad():
            self.lm_head.bias.fill_(offset)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.lm_head(self.ln(h + self.mlp(h)))


@case("t5x-logit-drift-bf16", "second family for the rounded-argument fix (softmax): "
      "https://github.com/huggingface/transformers/pull/18652 (T5X's z_loss: 'to keep the logits from drifting too "
      "far from zero, which can cause unacceptable roundoff errors in bfloat16'); google/flax#677 (bf16 log_softmax "
      "+ cross entropy: training collapsed; fixed by computing it in float32); logits at ~150 are spaced 1 apart in "
      "bf16, the cross entropy reads only their differences", ("precision-loss", "lm_head", "aten.addmm.default",
                                                             "forward"))
def t5x_logit_drift(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (4, 16), generator=_gen(59))
    # the twin: z-loss keeps log Z, and so the logits' common offset, near 0
    return {"model": DriftedLM(offset=150.0 if bad else 0.0), "batch": ids, "precision": "bf16",
            "loss_fn": lambda out, batch: F.cross_entropy(out.float()[:, :-1].flatten(0, 1), batch[:, 1:].flatten())}
