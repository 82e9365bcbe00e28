"""Field cases, round 7: unseen families -- a SmolLM3 decoder whose rotary ``inv_freq`` buffer the model-wide bf16
cast rounds (long positions), a GRPO policy step whose per-token log-probabilities and k3 KL estimator run in
bf16, a speculative-decoding draft head distilled with a KL loss in bf16 (the log-probabilities' difference
cancels), an inpainting net's partial convolutions in fp16 (the mask ratio's eps 1e-8 is 0; the 1e-6 that the
code's own comment suggests makes 1 / 1e-6 overflow). Registered into ``_field_registry.CASES`` (read it as
``_field_cases.CASES``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _field_registry import case, seeded
from torch import nn

_gen = seeded


# ---------------------------------------------------------------- rotary inv_freq rounded by the model's bf16 cast
def _smollm3(fp32_inv_freq: bool) -> nn.Module:
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    cfg = SmolLM3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=4096,
                        no_rope_layers=[1], tie_word_embeddings=False,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    m = SmolLM3ForCausalLM(cfg)
    m.eval()
    if fp32_inv_freq:  # InternLM#238's fix: inv_freq a plain float32 attribute, not a buffer the cast reaches
        rot = m.model.rotary_emb
        inv = rot.inv_freq.detach().clone()
        del rot._buffers["inv_freq"]
        rot.inv_freq = inv
    return m


@case("rope-inv-freq-buffer-bf16", "https://github.com/huggingface/transformers/issues/29496 (Precision issues in "
      "Mistral rotary embeddings: in bf16 training the inv_freq buffer is bf16 and the cos/sin tables of long "
      "positions are wrong; other code bases force inv_freq to float32); NVIDIA/Megatron-LM#744 (model.to(bfloat16) "
      "casts RotaryEmbedding.inv_freq); Modalities/modalities#462 (a 2**-9 relative error on a frequency becomes an "
      "O(1) phase error at long context: 2.5 rad at 2048); InternLM/InternLM#238 (inv_freq as a class attribute)",
      ("must-stay-fp32", "model.rotary_emb", "aten._to_copy.default", "forward"))
def rope_inv_freq(bad: bool) -> dict[str, Any]:
    ids = torch.randint(0, 128, (1, 1536), generator=_gen(70))
    return {"model": _smollm3(fp32_inv_freq=not bad), "batch": {"input_ids": ids}, "precision": "bf16",
            "loss_fn": lambda out, b: F.cross_entropy(out.logits[0, :-1].float(), b["input_ids"][0, 1:])}


# ---------------------------------------------------------------- GRPO: per-token log-probs and the k3 KL in bf16
class TinyPolicy(nn.Module):
    """A small causal policy LM: embedding, one GRU-free MLP mixer, the LM head (vocab 4096)."""

    def __init__(self, vocab: int = 4096, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, **rollout: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.lm_head(h + self.mix(h))


def grpo_loss(fp32_logps: bool, beta: float = 0.04) -> Any:
    """TRL's GRPO loss with the k3 KL estimator ``exp(ref - logp) - (ref - logp) - 1`` (per token, masked mean).
    ``fp32_logps``: the log-probabilities from float32 logits and the estimator through ``expm1`` (the fix)."""

    def loss(logits: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, ref, adv = b["completion_ids"], b["ref_logps"], b["advantages"]
        lg = logits[:, :-1].float() if fp32_logps else logits[:, :-1]
        logps = torch.log_softmax(lg, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        if fp32_logps:
            ref = ref.float()
        d = ref - logps
        kl = torch.expm1(d) - d if fp32_logps else torch.exp(d) - d - 1
        ratio = torch.exp(logps - logps.detach())
        per_token = -(ratio * adv[:, None] - beta * kl)
        return per_token.float().mean()

    return loss


@case("grpo-logps-k3-kl-bf16", "https://github.com/PrimeIntellect-ai/prime-rl/pull/568 (Fix ratio bf16 "
      "accumulation: the policy's per-token log-probabilities and their ratios in bf16); "
      "huggingface/transformers#31267 (bf16 logprobs differ from the fp32 ones far more than fp16's); "
      "unslothai/unsloth-zoo#1240 (the GRPO k3 KL exp(d) - d - 1 cancels for nearby policy and reference; use "
      "expm1); TRL's per_token_kl = exp(ref - logp) - (ref - logp) - 1",
      ("precision-loss", "", "aten.sub.Tensor", "forward"))
def grpo_kl(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(71)
    m = TinyPolicy()
    ids = torch.randint(0, 4096, (8, 64), generator=g)
    with torch.no_grad():  # the reference policy: the same weights a few updates ago (log-ratios ~ 1e-2)
        ref_m = TinyPolicy()
        ref_m.load_state_dict(m.state_dict())
        for p in ref_m.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
        ref = torch.log_softmax(ref_m(ids)[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0])  # groups with equal rewards: advantage 0
    return {"model": m, "batch": {"input_ids": ids, "completion_ids": ids, "ref_logps": ref, "advantages": adv},
            "precision": "bf16", "loss_fn": grpo_loss(fp32_logps=not bad)}


# ---------------------------------------------------------------- a draft head distilled with a KL loss in bf16
class DraftHead(nn.Module):
    """An EAGLE-style speculative-decoding draft: a one-layer predictor over the verifier's hidden states and an
    LM head initialised from the verifier's (vocab 8192)."""

    def __init__(self, d: int = 64, vocab: int = 8192) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, hidden: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden + self.fc(hidden))


def kl_distill_loss(fp32: bool) -> Any:
    """speculators' ``kl_div`` loss: KL(target || draft) over the vocabulary, from the logits' dtype (the bug) or
    from float32 copies (vllm-project/speculators#788's fix)."""

    def loss(logits: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        t = b["target_logits"]
        if fp32:
            logits, t = logits.float(), t.float()
        return F.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(t, -1), reduction="batchmean",
                        log_target=True).float()

    return loss


@case("draft-kl-distill-bf16", "https://github.com/vllm-project/speculators/pull/788 (compute divergence losses in "
      "float32 under bf16 training: the kl_div gradient with respect to the draft logits is p_draft - p_target, a "
      "catastrophic cancellation in bf16 for a well-trained draft -- 9-19% gradient error at acceptance 0.95-0.98, "
      "~0.15% in float32)", ("precision-loss", "", "aten.sub.Tensor", "forward"))
def draft_kl(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(72)
    m = DraftHead()
    hidden = torch.randn(16, 64, generator=g)
    with torch.no_grad():  # a well-trained draft: logits up to ~4, within ~0.05 of the verifier's
        m.lm_head.weight.normal_(0, 0.1, generator=g)
        m.fc.weight.mul_(0.01)
        m.fc.bias.zero_()
        target = m(hidden, hidden) + 0.05 * torch.randn(16, 8192, generator=g)
    return {"model": m, "batch": {"hidden": hidden, "target_logits": target}, "precision": "bf16",
            "loss_fn": kl_distill_loss(fp32=not bad)}


# ---------------------------------------------------------------- partial convolution (inpainting) in fp16
class PartialConv2d(nn.Conv2d):
    """NVIDIA's partial convolution (partialconv's ``PartialConv2d``, used by RFR-Net and most inpainting models):
    the output is renormalised by ``mask_ratio = window / (update_mask + eps)``, zeroed where the window holds no
    valid pixel. ``fp32_ratio``: the ratio computed in float32 and cast back after the masking (the fix)."""

    def __init__(self, cin: int, cout: int, eps: float, fp32_ratio: bool) -> None:
        super().__init__(cin, cout, 3, padding=1)
        self.eps, self.fp32_ratio = eps, fp32_ratio
        self.register_buffer("mask_kernel", torch.ones(1, 1, 3, 3), persistent=False)
        self.window = float(cin * 9)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            update = F.conv2d(mask, self.mask_kernel, padding=1)
            if self.fp32_ratio:
                u32 = update.float()
                ratio = (self.window / (u32 + self.eps) * torch.clamp(u32, 0, 1)).to(x.dtype)
            else:
                ratio = self.window / (update + self.eps)
                ratio = ratio * torch.clamp(update, 0, 1)
            update = torch.clamp(update, 0, 1)
        raw = super().forward(x * mask)
        b = self.bias.view(1, -1, 1, 1)
        return ((raw - b) * ratio + b) * update, update


class InpaintNet(nn.Module):
    def __init__(self, eps: float, fp32_ratio: bool) -> None:
        super().__init__()
        self.pconv1 = PartialConv2d(3, 16, eps, fp32_ratio)
        self.pconv2 = PartialConv2d(16, 3, eps, fp32_ratio)

    def forward(self, image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, m = self.pconv1(image, mask)
        out, _ = self.pconv2(F.relu(h), m)
        return out


@case("partialconv-mask-ratio-fp16", "https://github.com/jingyuanli001/RFR-Inpainting/issues/8 (FP16 training: the "
      "model outputs -inf in the forward pass; fixed by changing partialconv2d's constant to a number within fp16's "
      "range); NVIDIA/partialconv's PartialConv2d: mask_ratio = slide_winsize / (update_mask + 1e-8), its own "
      "comment 'for mixed precision training, change 1e-8 to 1e-6' -- 1e-8 is 0 in fp16, a hole's window gives 27 / 0",
      ("constant-out-of-range", "pconv1", "aten.add.Tensor", "forward"))
def partialconv(bad: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    g = _gen(73)
    image = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    mask = torch.ones(2, 1, 32, 32)
    mask[:, :, 8:24, 10:26] = 0  # the hole to inpaint
    target = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    return {"model": InpaintNet(eps=1e-8, fp32_ratio=not bad), "batch": {"image": image * mask, "mask": mask},
            "precision": "fp16", "loss_fn": lambda out, b: (out.float() - target).abs().mean()}


@case("partialconv-suggested-eps-fp16", "https://github.com/NVIDIA/partialconv (PartialConv2d's own comment: 'for "
      "mixed precision training, change 1e-8 to 1e-6'): 1e-6 is representable in fp16 (a subnormal), but a hole's "
      "window gives 1 / (0 + 1e-6) = 1e6, beyond fp16's 65504, and inf * 0 = NaN; jingyuanli001/RFR-Inpainting#8",
      ("overflow", "pconv1", "aten.reciprocal.default", "forward"))
def partialconv_suggested(bad: bool) -> dict[str, Any]:
    spec = partialconv(bad)
    spec["model"] = InpaintNet(eps=1e-6, fp32_ratio=not bad)
    return spec
