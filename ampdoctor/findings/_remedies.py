"""Mechanism-specific remedies: one registered entry per numerical mechanism (not per model), with its snippet.

A rule that detects a mechanism from its evidence (an op kind, a dtype, a literal) proposes the remedy with
:func:`propose`; the snippet lives here once. ``fix_id`` names the automatic application registered in
:mod:`ampdoctor.fixes` (``None``: a source change only). ``ampdoctor explain CODE`` lists the remedies of a code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ampdoctor.findings._types import FixProposal


@dataclass(frozen=True)
class Remedy:
    """A fix for one mechanism: ``code`` that detects it, what it is, the code to write, its automatic fix id."""

    id: str
    code: str
    mechanism: str
    title: str
    snippet: str
    fix_id: str | None = None


#: remedy id -> :class:`Remedy`, filled by :func:`register_remedy` (one entry per id)
REMEDIES: dict[str, Remedy] = {}


def register_remedy(remedy: Remedy) -> Remedy:
    if remedy.id in REMEDIES:
        raise ValueError(f"a remedy {remedy.id!r} is already registered ({REMEDIES[remedy.id]})")
    REMEDIES[remedy.id] = remedy
    return remedy


def remedies_for(code: str) -> list[Remedy]:
    """The remedies a rule for ``code`` proposes, in registration order."""
    return [r for r in REMEDIES.values() if r.code == code]


def propose(remedy_id: str, **params: Any) -> FixProposal:
    """The :class:`FixProposal` of a registered remedy; ``params`` go to its automatic fix (ignored without one)."""
    r = REMEDIES[remedy_id]
    return FixProposal(r.title, r.snippet, id=r.fix_id or "", params=dict(params) if r.fix_id else {})


register_remedy(Remedy(
    "log-softmax", "underflow", "log of a softmax whose small probabilities flushed to 0 (log(0) = -inf)",
    "compute log-probabilities in one op: log_softmax never forms the 0",
    "logp = torch.log_softmax(logits, dim=-1)   # instead of torch.log(torch.softmax(logits, dim=-1))\n"
    "loss = F.cross_entropy(logits, target)     # or the loss in one op, from the logits",
    fix_id="log_softmax"))
register_remedy(Remedy(
    "mask-finfo-min", "constant-out-of-range",
    "a mask/fill literal (-1e9, fp32's finfo.min, -inf) beyond the low dtype's range is stored as -inf",
    "use the dtype's own limit for the mask value (finite in every dtype)",
    "x = x.masked_fill(mask, torch.finfo(x.dtype).min)   # instead of -1e9 / float32's finfo.min\n"
    "# additive form: x = x + (1.0 - keep.to(x.dtype)) * torch.finfo(x.dtype).min",
    fix_id="safe_mask"))
register_remedy(Remedy(
    "dtype-eps", "constant-out-of-range", "an eps literal that is 0 in the low dtype (1e-10 in fp16): x + eps == x",
    "use an eps the dtype can hold, from the dtype itself (or compute the normalisation in float32)",
    "eps = max(eps, torch.finfo(x.dtype).tiny)   # 6.1e-05 in fp16, 1.2e-38 in bf16\n"
    "y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)\n"
    "# or: y = (x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)",
    fix_id="dtype_eps"))
register_remedy(Remedy(
    "scale-q", "overflow", "attention scores q @ k^T overflow before the 1/sqrt(d) scale is applied",
    "scale q by 1/sqrt(d) before the matmul (the scores then never exceed the range the softmax sees)",
    "q = q * q.shape[-1] ** -0.5                  # before the matmul, not on its result\n"
    "scores = q @ k.transpose(-2, -1)"))
register_remedy(Remedy(
    "sdpa", "overflow", "attention scores q @ k^T overflow before the 1/sqrt(d) scale is applied",
    "use F.scaled_dot_product_attention (it scales before the product; fused kernels accumulate in float32)",
    "out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # replaces softmax(q @ k^T / sqrt(d)) @ v"))
register_remedy(Remedy(
    "fp32-reduction", "overflow", "a reduction (sum, var, pow(2).mean) of low-precision values exceeds the range",
    "run the reduction in float32 (inputs upcast), cast back after normalizing",
    "total = torch.sum(x, dim, dtype=torch.float32)           # or x.float().sum(dim)\n"
    "variance = x.float().pow(2).mean(-1, keepdim=True)       # instead of x.pow(2).mean(...) in fp16\n"
    "y = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)",
    fix_id="upcast_op"))

register_remedy(Remedy(
    "fp32-master", "low-precision-params",
    "fp16/bf16 parameters updated in place: updates below half a unit in the last place round away (and fp16 "
    "AdamW's eps 1e-8 is 0)",
    "keep float32 master weights and optimizer state; compute in low precision with autocast",
    "model = model.float()                                  # instead of model.half() / .to(torch.bfloat16)\n"
    "with torch.autocast(device_type, dtype=torch.float16):  # low-precision compute, fp32 weights and updates\n"
    "    loss = model(**batch).loss",
    fix_id="fp32_master"))
register_remedy(Remedy(
    "unscale-before-clip", "loss-scaling-misuse",
    "gradients clipped (or their norm thresholded) while still multiplied by the loss scale",
    "unscale the gradients before clipping, then step through the scaler",
    "scaler.scale(loss).backward()\n"
    "scaler.unscale_(optimizer)                              # first: the grads are now in their true units\n"
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
    "scaler.step(optimizer); scaler.update()"))
register_remedy(Remedy(
    "fp32-buffer", "must-stay-fp32",
    "a buffer (frequencies, statistics, a table) cast to the low dtype with the model loses the resolution its "
    "consumers need",
    "keep the buffer in float32 after the model cast (and compute what reads it in float32)",
    "model = model.half()\n"
    "for name, buf in model.named_buffers():   # restore the fp32 values of the buffers the report names\n"
    "    if name in KEEP_FP32: buf.data = original[name].float()",
    fix_id="keep_fp32_buffers"))
register_remedy(Remedy(
    "fp8-amax-floor", "fp8-scale",
    "an fp8 scale from amax 0 (scale = fmax / 0 = inf, 0 * inf = NaN) or from a stale amax history",
    "floor the amax behind the scale and recompute the scale from the current amax",
    "amax = torch.clamp(x.abs().amax(), min=torch.finfo(torch.float32).tiny)\n"
    "scale = torch.finfo(torch.float8_e4m3fn).max / amax",
    fix_id="fp8_amax_floor"))


__all__ = ["REMEDIES", "Remedy", "propose", "register_remedy", "remedies_for"]
