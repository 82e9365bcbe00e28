"""Publicly reported mixed-precision failures from outside this repository, run the way a user would
(``ampdoctor.diagnose(model, batch, precision=..., loss_fn=...)``). Each case's source (issue / PR) is in its
registration in ``bench/_field_cases.py``. ``findings[0]`` must name the expected code, module, op and phase; the
numbers its evidence quotes are recomputed here independently in fp32/fp16; the healthy twin (same model, the
magnitudes that fit) must have no error finding and nothing of that code at that module.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import _field_cases_r7
import pytest
import torch
from _field_cases import CASES

import ampdoctor

_REPORTS: dict[tuple[str, bool], tuple[dict[str, Any], ampdoctor.Report]] = {}


def _diagnose(name: str, bad: bool) -> tuple[dict[str, Any], ampdoctor.Report]:
    if (name, bad) not in _REPORTS:
        spec = CASES[name].build(bad)
        _REPORTS[name, bad] = (spec, ampdoctor.diagnose(**spec))
    return _REPORTS[name, bad]


def _describe(r: ampdoctor.Report) -> str:
    return "; ".join(f"{f.code} {f.module!r} {f.op} {f.phase} ({f.severity})" for f in r.findings[:5]) or "none"


@pytest.mark.parametrize("name", list(CASES))
def test_root_cause_is_named(name: str) -> None:
    _, report = _diagnose(name, True)
    assert report.findings, f"{name}: no finding"
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == CASES[name].expect, _describe(report)
    assert f.severity == "error" and not report.ok, _describe(report)


@pytest.mark.parametrize("name", list(CASES))
def test_healthy_twin_stays_clean(name: str) -> None:
    _, report = _diagnose(name, False)
    code, module, _, _ = CASES[name].expect
    assert not [f for f in report.findings if f.severity == "error"], _describe(report)
    assert not [f for f in report.findings if f.code == code and f.module == module], _describe(report)


# ------------------------------------------------------------------ the numbers each explanation quotes
def _fp32_forward(spec: dict[str, Any], module: torch.nn.Module, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``fn(module_inputs, module_output)`` captured from the fp32 model's forward."""
    got: list[torch.Tensor] = []
    h = module.register_forward_hook(lambda m, a, o: got.append(fn(a, o)))
    try:
        with torch.no_grad():
            b = spec["batch"]
            spec["model"](**b) if isinstance(b, dict) else spec["model"](b)
    finally:
        h.remove()
    return got[0]


def test_mamba_softplus_numbers() -> None:
    spec, report = _diagnose("mamba-softplus-exp", True)
    ev = report.findings[0].evidence
    m = spec["model"].mixer
    pre = _fp32_forward(spec, m.dt_proj, lambda a, o: o)
    assert ev["ref_absmax"] == pytest.approx(math.exp(pre.max().item()), rel=1e-3)  # exp(dt) in fp32
    assert ev["ref_absmax"] > ev["format_max"] == 65504.0 and math.log(65504) < pre.min().item()


def test_efficientvit_numbers() -> None:
    spec, report = _diagnose("efficientvit-linear-attention", True)
    ev = report.findings[0].evidence

    def products(a: Any, o: Any) -> torch.Tensor:
        q, k, v = spec["model"].attn.qkv(a[0]).chunk(3, -1)
        v = torch.nn.functional.pad(v, (0, 1), value=1.0)
        vk = torch.matmul(v.transpose(1, 2), torch.relu(k))  # sums over the 512 tokens
        out = torch.matmul(vk, torch.relu(q).transpose(1, 2))
        return torch.stack([vk.abs().max(), out.abs().max()])

    vk_max, out_max = _fp32_forward(spec, spec["model"].attn, products).tolist()
    assert vk_max < 65504 < out_max  # v^T k fits fp16; (v^T k) q does not
    assert ev["ref_absmax"] == pytest.approx(out_max, rel=2e-3)


def test_ntxent_eps_numbers() -> None:
    _, report = _diagnose("ntxent-normalize-eps", True)
    ev = report.findings[0].evidence
    assert ev["constant"] == pytest.approx(1e-12) and ev["constant_in_dtype"] == 0.0
    assert torch.tensor(1e-12, dtype=torch.float16).item() == 0.0


def test_batchnorm_running_var_numbers() -> None:
    spec, report = _diagnose("batchnorm-running-var-fp16", True)
    f = report.findings[0]
    stored = spec["model"].bn.running_var
    assert f.evidence["buffer"] == "bn.running_var" and f.evidence["ref_absmax"] == pytest.approx(stored.max().item())
    assert torch.isinf(stored.half()).all()  # 9e4 > 65504: every element is inf in fp16


def test_flux_ids_numbers() -> None:
    _, report = _diagnose("flux-ids-bf16", True)
    ev = report.findings[0].evidence
    assert ev["integers_exact_up_to"] == 256 and ev["ref_absmax"] == 511
    assert ev["sampled_changed"] >= 1 and "lossy_op" in ev
    for ex in ev["examples"]:  # each example is the exact bf16 rounding of an integer beyond 256
        assert ex["reference"] > 256 and ex["target"] == torch.tensor(ex["reference"]).bfloat16().item()
        assert ex["target"] != ex["reference"]


def test_sd_vae_residual_numbers() -> None:
    spec, report = _diagnose("sd-vae-decoder-residual", True)
    ev = report.findings[0].evidence
    block = spec["model"].vae.decoder.up_blocks[0].resnets[0]
    ref = _fp32_forward(spec, block, lambda a, o: o.abs().max()).item()  # (input + branch) / 1.0 in fp32
    branch = _fp32_forward(spec, block.conv2, lambda a, o: o.abs().max()).item()
    stream = _fp32_forward(spec, block, lambda a, o: a[0].abs().max()).item()
    assert ev["ref_absmax"] == pytest.approx(ref, rel=1e-3) and ref > 65504
    assert branch < 65504 and stream < 65504  # each operand fits: only the residual add overflows


def test_focal_loss_numbers() -> None:
    _, report = _diagnose("focal-loss-sigmoid-pow", True)
    f = report.findings[0]
    ev = f.evidence
    assert ev["pole_op"] == "aten.pow.Tensor_Scalar" and ev["pole"]["phase"] == "backward"  # 0.5 * 0 ** -0.5
    assert ev["pole"]["node"] == "PowBackward0" and ev["zeros_op"]["op"] == "aten.rsub.Scalar"  # 1 - p = 0
    assert ev["saturation_threshold"] == pytest.approx(math.log(2 / 2 ** -11 - 1))  # 8.317
    assert ev["input_absmax"] > ev["saturation_threshold"]
    assert torch.sigmoid(torch.tensor(ev["input_absmax"], dtype=torch.float16)).item() == 1.0
    assert torch.sigmoid(torch.tensor(ev["input_absmax"])).item() < 1.0
    assert not any(g.code == "underflow" for g in report.findings)  # 1 - p = 0 is not a value below 6e-8


def test_sse_numbers() -> None:
    spec, report = _diagnose("sse-loss-sum-fp16", True)
    ev = report.findings[0].evidence
    with torch.no_grad():
        ref = spec["loss_fn"](spec["model"](spec["batch"]), None).item()
    assert ev["ref_absmax"] == pytest.approx(ref, rel=1e-3) and ref > 65504


def test_var_layernorm_numbers() -> None:
    spec, report = _diagnose("var-layernorm-fp16", True)
    ev = report.findings[0].evidence
    ref = _fp32_forward(spec, spec["model"].ln, lambda a, o: a[0].var(-1, unbiased=False).max()).item()
    assert ev["ref_absmax"] == pytest.approx(ref, rel=1e-3) and ref > 65504


def test_infonce_numbers() -> None:
    _, report = _diagnose("infonce-exp-no-max", True)
    ev = report.findings[0].evidence
    assert ev["ref_absmax"] == pytest.approx(math.exp(1 / 0.05), rel=1e-2)  # cosine 1 on the diagonal / tau


def test_bert_tagger_numbers() -> None:
    _, report = _diagnose("bert-tagger-hand-bce", True)
    ev = report.findings[0].evidence
    assert ev["pole_op"] == "aten.log.default" and ev["zeros_op"]["op"] == "aten.rsub.Scalar"  # log(1 - p)
    assert ev["input_absmax"] > ev["saturation_threshold"]


def test_cumsum_positions_numbers() -> None:
    _, report = _diagnose("cumsum-positions-bf16", True)
    ev = report.findings[0].evidence
    assert ev["integers_exact_up_to"] == 256 and ev["ref_absmax"] == 600  # mask.cumsum(-1): 1..600
    assert all(torch.tensor(x["reference"]).bfloat16().item() == x["target"] for x in ev["examples"])


def test_rotary_arange_numbers() -> None:
    _, report = _diagnose("rotary-arange-type-as-bf16", True)
    ev = report.findings[0].evidence
    assert ev["integers_exact_up_to"] == 256 and ev["ref_absmax"] == 1023  # arange(1024)
    assert all(torch.tensor(x["reference"]).bfloat16().item() == x["target"] for x in ev["examples"])
    assert "lossy_op" in ev and ev["lossy_op"]["op"] in ("aten.cos.default", "aten.sin.default")


def test_clip_logit_scale_numbers() -> None:
    spec, report = _diagnose("clip-logit-scale-exp-fp16", True)
    ev = report.findings[0].evidence
    scale = spec["model"].logit_scale.item()
    assert ev["ref_absmax"] == pytest.approx(math.exp(scale), rel=1e-3) and math.exp(scale) > 65504
    assert torch.tensor(scale).half().exp().isinf().item()  # exp(12) in fp16; CLIP's clamp ln(100) gives 100
    healthy, _ = _diagnose("clip-logit-scale-exp-fp16", False)
    assert math.exp(healthy["model"].logit_scale.item()) == pytest.approx(100.0)


def _one_pass_var(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return (x * x).mean(dims, keepdim=True) - x.mean(dims, keepdim=True) ** 2


@pytest.mark.parametrize("name,module,dims,dtype", [
    ("diff-of-squares-layernorm-fp16-amp", "norm", (-1,), torch.float16),
    ("diff-of-squares-batchnorm-bf16", "bn", (0, 2, 3), torch.bfloat16),
])
def test_diff_of_squares_numbers(name: str, module: str, dims: tuple[int, ...], dtype: torch.dtype) -> None:
    spec, report = _diagnose(name, True)
    ev = report.findings[0].evidence
    x = _fp32_forward(spec, getattr(spec["model"], module), lambda a, o: a[0])
    var32 = _one_pass_var(x, dims)
    var_low = _one_pass_var(x.to(dtype), dims).float()  # the same formula on the rounded activations
    u = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    assert ev["ref_absmax"] == pytest.approx(var32.abs().max().item(), rel=1e-2)  # the true variance
    assert ev["operand_absmax"] == pytest.approx((x * x).mean(dims).max().item(), rel=1e-2)  # E[x^2]
    assert ev["operand_absmax"] * u >= ev["ref_absmax"] and ev["unit_roundoff"] == u  # every bit cancels
    assert ((var_low - var32).abs() / var32).max().item() >= 0.5  # ground truth: some variance is noise
    assert ev["own_error"] >= 0.5 and ev["output_deviation"] >= 0.05
    assert "rounding noise" in report.findings[0].explanation


def test_ema_bf16_numbers() -> None:
    spec, report = _diagnose("ema-weights-bf16", True)
    f = report.findings[0]
    assert f.evidence["fraction_lost"] == 1.0 and f.evidence["fraction_lost_fp32"] == 0.0
    m, name = spec["model"], f.evidence["parameter"]
    assert name.startswith("ema.")
    e, p = m.get_parameter(name), m.get_parameter("net." + name[4:])
    e0, w0 = e.detach().clone(), p.detach().clone()
    spec["train_step"](m, spec["batch"])  # one step as the case runs it (on the case's own copy)
    step = 1e-4 * (e0.float() - p.detach().float())  # the exact EMA update
    assert not torch.equal(p.detach(), w0)  # the net itself moves in bf16
    assert torch.equal(e.detach(), e0) and (step != 0).any()  # the EMA does not
    e = e0
    assert torch.equal((e.float() - step).bfloat16(), e) and (step != 0).any()  # the EMA step rounds away
    assert any(x.snippet and "float()" in x.snippet for x in f.fixes)
    assert f.evidence["update_factor"] == pytest.approx(1e-4) and f.evidence["update_factor_op"] == "aten.mul.Tensor"
    assert "decay = 0.9999" in f.explanation and 1e-4 < 2.0**-7  # 1 - decay below bf16's spacing at 1.0


@pytest.mark.parametrize("name,schedule,ts", [
    ("ddpm-alphas-cumprod-cast-bf16", "alphas_cumprod", torch.arange(0, 48, 3)),
    ("flow-match-sigmas-bf16", "sigmas", torch.arange(0, 32, 2)),
])
def test_rounded_schedule_numbers(name: str, schedule: str, ts: torch.Tensor) -> None:
    spec, report = _diagnose(name, True)
    f = report.findings[0]
    ev = f.evidence
    s = getattr(spec["model"], schedule).float()[ts]  # the schedule values the batch's timesteps pick
    exact, low = 1 - s, 1 - s.bfloat16().float()  # 1 - x from fp32 vs from the bf16-rounded x
    assert ev["ref_absmax"] == pytest.approx(exact.abs().max().item(), rel=1e-3)
    assert ev["zeros_created"] == int(((low == 0) & (exact != 0)).sum()) >= 1  # e.g. 0.99915 -> 1.0
    assert ev["operand_absmax"] / ev["ref_absmax"] >= 16 and ev["elementwise"]["max"] > 0.25
    assert ev["rounded_operand"]["op"] in ("aten._to_copy.default", "<leaf>")
    assert "exactly 0" in f.explanation and any("float32" in x.title for x in f.fixes)


def test_clip_half_adam_eps_numbers() -> None:
    spec, report = _diagnose("clip-half-adam-eps", True)
    f = report.findings[0]
    ev = f.evidence
    assert ev["optimizer"] == "Adam" and ev["eps"] == 1e-8 and ev["eps_in_dtype"] == 0.0
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0 and torch.tensor(1e-4).half().item() > 0
    assert "eps=1e-08 is 0 in float16" in f.title and "NaN" in f.title
    assert any("eps=1e-4" in (x.snippet or "") for x in f.fixes)


def test_ssm_exp_cumsum_numbers() -> None:
    spec, report = _diagnose("ssm-exp-cumsum-fp16", True)
    ev = report.findings[0].evidence
    mixer = spec["model"].mixer

    def decay(a: Any, o: Any) -> torch.Tensor:
        dt = torch.nn.functional.softplus(mixer.dt_proj(a[0]))
        return torch.exp(torch.cumsum(dt * -torch.exp(mixer.A_log), 1))

    d = _fp32_forward(spec, mixer, decay)
    below = int((d < 2.0**-25).sum())  # rounds to 0 in fp16 (half the smallest subnormal)
    assert below > 0 and d.min().item() == pytest.approx(ev["ref_min_nonzero"], rel=1e-2)
    assert ev["pole_op"] == "aten.div.Tensor" and ev["n_flushed"] == pytest.approx(below, abs=below * 0.1 + 2)


def test_hand_groupnorm_numbers() -> None:
    spec, report = _diagnose("hand-groupnorm-fp16", True)
    ev = report.findings[0].evidence

    def squares(a: Any, o: Any) -> torch.Tensor:
        xg = a[0].reshape(a[0].shape[0], 8, -1)
        return (xg - xg.mean(-1, keepdim=True)).pow(2)

    sq = _fp32_forward(spec, spec["model"].norm, squares)
    assert ev["ref_absmax"] == pytest.approx(sq.max().item(), rel=1e-2)
    assert ev["n_inf"] == pytest.approx(int((sq > 65520).sum()), abs=20)  # rounds to inf in fp16 above 65520


def test_weight_norms_numbers() -> None:
    spec, report = _diagnose("hand-weight-norm-fp16", True)
    ev = report.findings[0].evidence
    v = spec["model"].proj.v.detach()
    assert v.abs().max().item() < 65504 and ev["ref_absmax"] == pytest.approx(v.norm(dim=1).max().item(), rel=1e-3)
    assert ev["n_inf"] == int((v.norm(dim=1) > 65520).sum())
    spec, report = _diagnose("spectral-norm-power-iteration-fp16", True)
    ev = report.findings[0].evidence
    p = spec["model"].proj.parametrizations.weight[0]
    w = spec["model"].proj.parametrizations.weight.original.detach()
    assert ev["ref_absmax"] == pytest.approx((w @ p._v).norm().item(), rel=1e-2)  # ||W v|| of the power iteration


# ------------------------------------------------------------------ round 4
def test_moe_router_ties_numbers() -> None:
    spec, report = _diagnose("moe-router-probs-bf16-topk", True)
    f = report.findings[0]
    ev = f.evidence
    m, x = spec["model"], spec["batch"]
    with torch.no_grad():  # the router's choice, recomputed: fp32 vs the bf16 model on the bf16-cast batch
        h = m.inp(x).flatten(0, 1)
        ref = m.moe.gate(h).softmax(-1).topk(2, -1).indices.sort(-1).values
        mb = copy.deepcopy(m).bfloat16()
        probs = mb.moe.gate(mb.inp(x.bfloat16()).flatten(0, 1)).softmax(-1)
        low = probs.topk(2, -1).indices.sort(-1).values
        top3 = probs.topk(3, -1).values
    changed = int((ref != low).any(-1).sum())
    assert ev["decisions_changed"] == changed and ev["rows"] == 128 and changed / 128 >= 0.05
    assert ev["decision_op"] == "aten.topk.default" and ev["decision_module"] == "moe"
    assert ev["ties_created"] > 0 and int((top3[:, 1] == top3[:, 2]).sum()) > 0  # bf16 probabilities tie
    assert ev["indexed_by"] > 0  # the chosen experts select the tokens each expert computes
    assert "different computation" in f.explanation


def test_vq_codebook_numbers() -> None:
    spec, report = _diagnose("vq-codebook-argmin-bf16-amp", True)
    ev = report.findings[0].evidence
    m, x = spec["model"], spec["batch"]
    with torch.no_grad():
        z = m.enc(x)
        e = m.vq.codebook.weight
        ref = torch.cdist(z, e).argmin(1)
        with torch.autocast("cpu", torch.bfloat16):  # CPU autocast runs the same ops in bf16 (mm, linear)
            zb = m.enc(x)
            low = (zb.float().pow(2).sum(1, keepdim=True) - 2 * zb @ e.t() + e.pow(2).sum(1)).argmin(1)
    assert ev["decision_op"] == "aten.argmin.default" and ev["indexed_by"] > 0
    assert ev["decisions_changed"] >= 0.05 * 128 and int((ref != low).sum()) >= 0.05 * 128
    _, healthy = _diagnose("vq-codebook-argmin-bf16-amp", False)
    assert not [f for f in healthy.findings if "decisions_changed" in f.evidence]  # float32 distances: same codes


def test_rmsnorm_no_upcast_numbers() -> None:
    spec, report = _diagnose("rmsnorm-no-upcast-fp16", True)
    ev = report.findings[0].evidence
    x = _fp32_forward(spec, spec["model"].norm, lambda a, o: a[0])
    assert ev["ref_absmax"] == pytest.approx(x.pow(2).max().item(), rel=1e-3) and x.abs().max() < 65504
    assert ev["n_inf"] == int((x.pow(2) > 65520).sum())  # each square above fp16's max is inf


def test_label_smoothing_numbers() -> None:
    spec, report = _diagnose("label-smoothing-sum-fp16", True)
    ev = report.findings[0].evidence
    with torch.no_grad():
        s = -torch.log_softmax(spec["model"](spec["batch"]), -1).sum(-1)  # the smoothing term over 8192 tokens
    assert ev["ref_absmax"] == pytest.approx(s.max().item(), rel=1e-3) and s.min() > 65504
    assert ev["n_inf"] == s.numel()


def test_attention_logit_growth_numbers() -> None:
    spec, report = _diagnose("attention-logit-growth-fp16", True)
    ev = report.findings[0].evidence

    def logits(a: Any, o: Any) -> torch.Tensor:
        q, k, _ = spec["model"].attn.qkv(a[0]).chunk(3, -1)
        return torch.stack([(q @ k.transpose(-2, -1)).abs().max(), torch.cat([q, k]).abs().max()])

    qk, qk_max = _fp32_forward(spec, spec["model"].attn, logits).tolist()
    assert ev["ref_absmax"] == pytest.approx(qk, rel=1e-3) and qk > 65504 > qk_max  # q and k fit, q.k does not


def test_layerscale_numbers() -> None:
    spec, report = _diagnose("layerscale-1e-6-pure-fp16", True)
    ev = report.findings[0].evidence
    gamma = spec["model"].blocks[1].gamma
    assert gamma.dtype == torch.float16 and 0 < gamma.abs().max().item() < 2.0**-14  # subnormal in fp16
    assert ev["ref_absmax"] < 2.0**-25  # gamma * grad: below half of fp16's smallest subnormal, every value is 0


def test_vae_kl_numbers() -> None:
    spec, report = _diagnose("vae-kl-logvar-exp-fp16", True)
    ev = report.findings[0].evidence
    lv = _fp32_forward(spec, spec["model"].logvar, lambda a, o: o)
    assert ev["ref_absmax"] == pytest.approx(math.exp(lv.max().item()), rel=1e-3) and lv.max() > math.log(65504)


def test_evit_token_pruning_numbers() -> None:
    spec, report = _diagnose("evit-token-pruning-bf16", True)
    ev = report.findings[0].evidence
    m, x = spec["model"], spec["batch"]

    def kept(model: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
        h = torch.cat([model.cls.expand(inp.shape[0], -1, -1), model.patch(inp)], 1)
        p = model.prune
        s = (p.q(h[:, :1]) @ p.k(h[:, 1:]).transpose(1, 2)).squeeze(1) * h.shape[-1] ** -0.5
        return s.softmax(-1).topk(p.keep, -1).indices.sort(-1).values

    with torch.no_grad():
        ref, low = kept(m, x), kept(copy.deepcopy(m).bfloat16(), x.bfloat16())
    assert ev["decisions_changed"] == int((ref != low).any(-1).sum()) == 4  # every image keeps another token set
    assert ev["ties_created"] > 0 and ev["indexed_by"] > 0 and ev["decision_op"] == "aten.topk.default"


# ------------------------------------------------------------------ round 6
def test_mochi_fourier_numbers() -> None:
    spec, report = _diagnose("mochi-fourier-features-bf16", True)
    ev = report.findings[0].evidence
    x = spec["batch"].float() / 127.5 - 1.0
    w = torch.tensor([2.0**6, 2.0**7]) * 2 * math.pi
    x0 = x[:, :1]  # the first colour channel, at both frequencies
    h32 = w[None, :, None, None, None] * x0
    h16 = (w.bfloat16()[None, :, None, None, None] * x0.bfloat16()).float()  # the case's bf16 mul
    assert ev["argument_absmax"] == pytest.approx(2**7 * 2 * math.pi * x.abs().max().item(), rel=1e-3)  # 804 rad
    assert (h16 - h32).abs().max() >= 0.5 and ev["argument_abs_error"] >= 0.5  # half a radian of phase and more
    assert (h16.sin() - h32.sin()).abs().max() > 0.25 and ev["function_error"] > 0.25


def test_convmelspec_eps_numbers() -> None:
    spec, report = _diagnose("convmelspec-eps-fp16", True)
    f = report.findings[0]
    assert f.evidence["constant"] == 1e-8 and torch.tensor(1e-8).half().item() == 0.0 < torch.tensor(1e-5).half()
    mel = _fp32_forward(spec, spec["model"].melspec, lambda a, o: o)  # 10 log10(clamp(mel, 1e-8)) in fp32
    assert int((mel == -80.0).sum()) == f.evidence["n_zero"] > 0  # silent frames: mel power exactly 0, -80 dB
    setup = [g for g in report.findings if g.phase == "setup"]
    assert setup and all(g.severity == "warning" and g.evidence.get("negligible") for g in setup)


def test_log_semiring_numbers() -> None:
    spec, report = _diagnose("log-semiring-sum-fp16", True)
    ev = report.findings[0].evidence
    with torch.no_grad():
        w = spec["model"].arc_weights(spec["batch"]).squeeze(-1)
        s = torch.exp(w - w.max(-1, keepdim=True).values).sum(-1)
    assert ev["ref_absmax"] == pytest.approx(s.max().item(), rel=1e-2) and s.min() > 65504  # every row's sum
    assert torch.isfinite(s.log().half()).all()  # the logarithm (~11.7) fits fp16: only the sum does not


def test_waveglow_loss_sum_numbers() -> None:
    spec, report = _diagnose("waveglow-loss-sum-fp16", True)
    ev = report.findings[0].evidence
    with torch.no_grad():
        z, _ = spec["model"](spec["batch"])
    assert ev["ref_absmax"] == pytest.approx((z * z).sum().item(), rel=1e-2)
    assert (z * z).max() < 65504 < ev["ref_absmax"]  # every square fits, their sum does not


def test_convnext_channels_first_ln_numbers() -> None:
    spec, report = _diagnose("convnext-channels-first-ln-fp16", True)
    ev = report.findings[0].evidence
    x = _fp32_forward(spec, spec["model"].norm, lambda a, o: a[0])
    sq = (x - x.mean(1, keepdim=True)).pow(2)
    assert ev["ref_absmax"] == pytest.approx(sq.max().item(), rel=1e-2) and x.abs().max() < 65504
    assert ev["n_inf"] == pytest.approx(int((sq > 65520).sum()), abs=8)  # each square above fp16's max is inf
    assert not any(f.code == "underflow" and "pole_op" in f.evidence for f in report.findings)


def test_cdist_knn_numbers() -> None:
    spec, report = _diagnose("cdist-knn-support-bf16", True)
    ev = report.findings[0].evidence
    m, b = spec["model"], spec["batch"]
    with torch.no_grad():
        ref = torch.cdist(m.encoder(b["x"]), m.encoder(b["support_x"])).argmin(-1)
        mb = copy.deepcopy(m).bfloat16()
        low = torch.cdist(mb.encoder(b["x"].bfloat16()), mb.encoder(b["support_x"].bfloat16())).argmin(-1)
        direct = (m.encoder(b["x"])[:, None] - m.encoder(b["support_x"])[None]).norm(dim=-1).argmin(-1)
    assert torch.equal(ref, direct)  # the fp32 matmul path agrees with the differences
    assert ev["decision_op"] == "aten.argmin.default" and ev["indexed_by"] > 0
    assert ev["decisions_changed"] == int((ref != low).sum()) >= 0.05 * 64  # queries that take another label


# ------------------------------------------------------------------ round 7
def test_rope_inv_freq_buffer_numbers() -> None:
    spec, report = _diagnose("rope-inv-freq-buffer-bf16", True)
    ev = report.findings[0].evidence
    inv = spec["model"].model.rotary_emb.inv_freq.double()  # the float32 model's frequencies
    pos = torch.arange(spec["batch"]["input_ids"].shape[1], dtype=torch.float64)[:, None]
    err = (pos * (inv - inv.bfloat16().double())).abs().max().item()  # the angle error of the rounded buffer
    assert ev["buffer"] == "model.rotary_emb.inv_freq" and ev["buffer_dtype"] == "bfloat16"
    assert ev["max_angle"] == pytest.approx(pos.max().item() * inv.max().item())
    assert 0.5 < err <= ev["angle_error_bound"]  # 0.73 rad at position 1535: a different rotation
    twin, _ = _diagnose("rope-inv-freq-buffer-bf16", False)
    assert copy.deepcopy(twin["model"]).bfloat16().model.rotary_emb.inv_freq.dtype == torch.float32


def test_grpo_k3_kl_numbers() -> None:
    spec, report = _diagnose("grpo-logps-k3-kl-bf16", True)
    ev = report.findings[0].evidence
    m, b = spec["model"], spec["batch"]
    with torch.no_grad():
        logps = torch.log_softmax(m(b["input_ids"])[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
        d = b["ref_logps"] - logps  # the log-ratios in fp32: ~1e-2
    assert ev["ref_absmax"] == pytest.approx(d.abs().max().item(), rel=1e-2)
    assert ev["operand_absmax"] == pytest.approx(logps.abs().max().item(), rel=2e-2)  # |logp| ~ 10
    assert ev["operand_absmax"] * 2.0**-8 >= d.abs().max()  # bf16's spacing of the log-probs exceeds the ratios
    kl32 = (torch.expm1(d) - d).mean().item()
    low = (b["ref_logps"].bfloat16() - logps.bfloat16())
    kl16 = (torch.exp(low) - low - 1).float().mean().item()
    assert abs(kl16 - kl32) >= kl32 > 0  # the k3 KL in bf16 is off by its whole size (here it comes out 0.0)


def test_draft_kl_distill_numbers() -> None:
    spec, report = _diagnose("draft-kl-distill-bf16", True)
    ev = report.findings[0].evidence
    m, b = spec["model"], spec["batch"]

    def run(dtype: torch.dtype, fp32_loss: bool) -> tuple[float, torch.Tensor]:
        mm = copy.deepcopy(m).to(dtype)
        bb = {k: v.to(dtype) for k, v in b.items()}
        out = mm(**bb)
        out.retain_grad()
        loss = _field_cases_r7.kl_distill_loss(fp32_loss)(out, bb)
        loss.backward()
        return loss.item(), out.grad.double()

    (l32, g32), (l16, g16), (lt, gt) = run(torch.float32, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    rel = lambda g: ((g - g32).norm() / g32.norm()).item()  # noqa: E731
    assert l16 < 0 < l32 and abs(lt - l32) < 0.05 * l32  # the bf16 KL comes out negative; the fix keeps it
    assert rel(g16) > 0.3 and rel(gt) < 0.15  # the gradient p_draft - p_target: 47% off vs 9% (bf16 logits)
    assert ev["element_own_error"] >= 0.5 and ev["operand_absmax"] * 2.0**-8 >= ev["typical_result"]


def _hole_windows(spec: dict[str, Any]) -> int:
    """Positions whose 3x3 window holds no valid pixel (the mask ratio's 0 / 0 there)."""
    update = torch.nn.functional.conv2d(spec["batch"]["mask"], torch.ones(1, 1, 3, 3), padding=1)
    return int((update == 0).sum())


def test_partialconv_mask_ratio_numbers() -> None:
    spec, report = _diagnose("partialconv-mask-ratio-fp16", True)
    ev = report.findings[0].evidence
    assert ev["constant"] == 1e-8 and torch.tensor(1e-8).half().item() == 0.0
    assert ev["n_zero"] == _hole_windows(spec) == 2 * 14 * 14  # the 16 x 16 hole's interior, both images
    assert ev["consequence"]["op"] == "aten.reciprocal.default"


def test_partialconv_suggested_eps_numbers() -> None:
    spec, report = _diagnose("partialconv-suggested-eps-fp16", True)
    ev = report.findings[0].evidence
    assert torch.tensor(1e-6).half().item() > 0  # representable (a subnormal): the literal is not the problem
    assert ev["ref_absmax"] == pytest.approx(1e6, rel=1e-3) and ev["n_inf"] == _hole_windows(spec)  # 1 / 1e-6
