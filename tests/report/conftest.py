"""Reports built by hand in the shape ``ampdoctor.diagnose`` / ``ampdoctor.watch`` fill, for the renderer tests.

The numbers follow the scenario files in shared/cases (tiny T5 with a x8e4 ``wo`` weight under fp16 autocast,
DDP BERT with an unused pooler, GPT-2 MLP with gelu_new under GradScaler) and the format limits
(fp16 max 65504, smallest normal 2**-14, smallest subnormal 2**-24).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from ampdoctor import Finding, FixProposal, Report

SNAPSHOTS = Path(__file__).with_name("snapshots")
INF, NAN = math.inf, math.nan

T5_WO = "encoder.block.0.layer.1.DenseReluDense.wo"


def _layer(depth, module, op, dtype, ref, target, *, phase="forward", min_nonzero=None, flush=0.0, rel=None,
           nonfinite=0):
    return {
        "module": module,
        "depth": depth,
        "phase": phase,
        "op": op,
        "dtype": dtype,
        "ref_absmax": ref,
        "target_absmax": target,
        "min_nonzero": min_nonzero,
        "flush_fraction": flush,
        "rel_error": rel,
        "nonfinite": nonfinite,
    }


def t5_report() -> Report:
    """T5 v1.1-style gated-gelu under fp16 autocast: ``wo`` output 1.05e5 > 65504 -> inf -> NaN in the next norm."""
    overflow = Finding(
        code="overflow",
        severity="error",
        module=T5_WO,
        op="aten.mm.default",
        phase="forward",
        title=f"fp16 matmul output overflows to inf in {T5_WO}",
        explanation=(
            "Under fp16 autocast this Linear runs in float16. Its fp32 reference output reaches |max| 1.05e+05, "
            "1.6x the fp16 maximum 65504, so the float16 result is inf. The residual stream stays float32 (fp32 "
            "master weights), so T5's `hidden_states.dtype == torch.float16` clamp never runs and the inf reaches "
            "encoder.block.1.layer.0.layer_norm, where inf * rsqrt(inf) = NaN."
        ),
        evidence={
            "ref_absmax": 1.05e5,
            "target_absmax": INF,
            "fp16_max": 65504.0,
            "ratio": 1.6,
            "dtype": "float16",
            "nonfinite_elements": 37,
        },
        fixes=(
            FixProposal(
                title="Use bf16 autocast instead of fp16 (same exponent range as fp32)",
                snippet='with torch.autocast("cuda", dtype=torch.bfloat16):\n    loss = model(**batch).loss',
                id="precision",
                params={"precision": "bf16-amp"},
                verified=True,
                verification={"loss_fp32": 3.4721, "loss_fixed": 3.4752, "max_rel_err": 0.0089, "steps_finite": 1},
            ),
            FixProposal(
                title="Run encoder.block.0.layer.1 (T5LayerFF) with autocast disabled",
                snippet="ampdoctor.fixes.apply(model, 'autocast_off', modules=['encoder.block.0.layer.1'])",
                id="autocast_off",
                params={"modules": ["encoder.block.0.layer.1"]},
                verified=True,
                verification={"loss_fp32": 3.4721, "loss_fixed": 3.4721, "max_rel_err": 2.1e-6, "steps_finite": 1},
            ),
            FixProposal(
                title="Lower GradScaler init_scale",
                snippet='torch.amp.GradScaler("cuda", init_scale=1024)',
                id="scaler_init",
                params={"init_scale": 1024.0},
                verified=False,
                verification={"loss_fp32": 3.4721, "loss_fixed": NAN, "max_rel_err": NAN, "steps_finite": 0},
            ),
            FixProposal(title="Clamp the feed-forward output to +-64504 whatever its dtype", snippet=""),
        ),
    )
    keep_fp32 = Finding(
        code="must-stay-fp32",
        severity="warning",
        module=T5_WO,
        op="aten.mm.default",
        phase="setup",
        title="_keep_in_fp32_modules=['wo'] does not apply under autocast",
        explanation=(
            "T5 lists `wo` in _keep_in_fp32_modules, which only from_pretrained(..., dtype=torch.float16) honours; "
            "autocast still runs its matmul in float16."
        ),
        evidence={"keep_in_fp32_modules": ["wo"], "runs_in": "float16"},
    )
    layers = [
        _layer(0, "shared", "aten.embedding.default", "float32", 3.41, 3.41, rel=0.0),
        _layer(1, "encoder.block.0.layer.0.layer_norm", "aten.mul.Tensor", "float32", 4.02, 4.02, rel=0.0),
        _layer(2, "encoder.block.0.layer.0.SelfAttention.q", "aten.mm.default", "float16", 6.87, 6.871, rel=4.1e-4),
        _layer(3, "encoder.block.0.layer.0.SelfAttention.k", "aten.mm.default", "float16", 7.12, 7.117, rel=3.8e-4),
        _layer(4, "encoder.block.0.layer.0.SelfAttention.v", "aten.mm.default", "float16", 5.35, 5.352, rel=3.9e-4),
        _layer(5, "encoder.block.0.layer.0.SelfAttention", "aten.bmm.default", "float16", 61.2, 61.19, rel=5.2e-4,
               nonfinite=0),
        _layer(6, "encoder.block.0.layer.0.SelfAttention.o", "aten.mm.default", "float16", 9.8, 9.797, rel=4.4e-4),
        _layer(7, "encoder.block.0.layer.1.layer_norm", "aten.mul.Tensor", "float32", 3.97, 3.97, rel=1.2e-6),
        _layer(8, "encoder.block.0.layer.1.DenseReluDense.wi_0", "aten.mm.default", "float16", 8.44, 8.438, rel=4.0e-4),
        _layer(9, "encoder.block.0.layer.1.DenseReluDense.act", "aten.gelu.default", "float16", 8.44, 8.438,
               min_nonzero=3.1e-6, flush=0.0123, rel=6.3e-4),
        _layer(10, "encoder.block.0.layer.1.DenseReluDense.wi_1", "aten.mm.default", "float16", 7.91, 7.906,
               rel=4.2e-4),
        _layer(11, T5_WO, "aten.mm.default", "float16", 1.05e5, INF, rel=INF, nonfinite=37),
        _layer(12, "encoder.block.0.layer.1", "aten.add.Tensor", "float32", 1.05e5, INF, rel=INF, nonfinite=37),
        _layer(13, "encoder.block.1.layer.0.layer_norm", "aten.mul.Tensor", "float32", 4.05, NAN, rel=NAN,
               nonfinite=256),
        _layer(14, "encoder.block.1.layer.0.SelfAttention.q", "aten.mm.default", "float16", 7.33, NAN, rel=NAN,
               nonfinite=256),
        _layer(15, "encoder.final_layer_norm", "aten.mul.Tensor", "float32", 3.88, NAN, rel=NAN, nonfinite=256),
        _layer(16, "decoder.block.0.layer.1.EncDecAttention", "aten.bmm.default", "float16", 48.6, NAN, rel=NAN,
               nonfinite=128),
        _layer(17, "lm_head", "aten.mm.default", "float16", 21.7, NAN, rel=NAN, nonfinite=256),
        _layer(17, "lm_head", "aten.mm.default", "float16", 0.0312, NAN, phase="backward", min_nonzero=2.4e-9,
               flush=0.031, rel=NAN, nonfinite=512),
        _layer(11, T5_WO, "aten.mm.default", "float16", 412.0, NAN, phase="backward", rel=NAN, nonfinite=512),
    ]
    summary = {
        "precision": "fp16-amp",
        "steps": 1,
        "loss_target": [NAN],
        "loss_reference": [3.4721],
        # T5's relative-position bucketing computes log(0) = -inf and discards it: first non-finite, not the cause
        "first_nonfinite": {"op": "aten.log.default", "module": "encoder.block.0.layer.0.SelfAttention",
                            "phase": "forward", "step": 0, "index": 14},
        "first_nan": {"op": "aten.mul.Tensor", "module": "encoder.block.1.layer.0.layer_norm", "phase": "forward",
                      "step": 0, "index": 131},
        "chain": [
            {"op": "aten.mm.default", "module": T5_WO, "phase": "forward",
             "what": "float16 result |max| 1.05e+05 > 65504 becomes inf (origin)"},
            {"op": "aten.add.Tensor", "module": "encoder.block.0.layer.1", "phase": "forward",
             "what": "fp32 residual add carries inf; the fp16-only clamp is skipped"},
            {"op": "aten.mul.Tensor", "module": "encoder.block.1.layer.0.layer_norm", "phase": "forward",
             "what": "inf * rsqrt(inf) = NaN (first NaN)"},
            {"op": "aten.nll_loss_forward.default", "module": "", "phase": "forward", "what": "loss is NaN"},
        ],
        "scales": [32768.0],
        "skipped_steps": 1,
        "device": "cpu",
        "torch_version": "2.13.0+cpu",
        "elapsed_s": 0.84,
    }
    return Report(findings=(overflow, keep_fp32), precision="fp16-amp", summary=summary, layers=tuple(layers),
                  source="t5_amp_wo_overflow.py")


def bert_report() -> Report:
    """DDP BertModel whose loss ignores the pooler: its parameters never get a gradient, step 2 raises."""
    unused = Finding(
        code="unused-parameters",
        severity="error",
        module="module.pooler.dense",
        op="",
        phase="backward",
        step=0,
        title="2 parameters of module.pooler.dense never receive a gradient",
        explanation=(
            "The loss is built from last_hidden_state only, so module.pooler.dense is outside the autograd graph and "
            "its .grad stays None. DistributedDataParallel(find_unused_parameters=False) waits for their gradients "
            "and step 2 raises \"Expected to have finished reduction in the prior iteration\"."
        ),
        evidence={
            "parameters": ["module.pooler.dense.weight", "module.pooler.dense.bias"],
            "numel": 272,
            "grad": "None",
            "find_unused_parameters": False,
            "failed_step": 1,
        },
        fixes=(
            FixProposal(
                title="Build the model without the pooler",
                snippet="model = BertModel(config, add_pooling_layer=False)",
                id="drop_module",
                params={"module": "module.pooler"},
                verified=True,
                verification={"steps_finite": 2},
            ),
            FixProposal(
                title="Let DDP find unused parameters",
                snippet="DistributedDataParallel(model, find_unused_parameters=True)",
                id="",
            ),
        ),
    )
    layers = [
        _layer(0, "module.embeddings.word_embeddings", "aten.embedding.default", "float32", None, 0.0912),
        _layer(1, "module.embeddings.LayerNorm", "aten.native_layer_norm.default", "float32", None, 3.12),
        _layer(2, "module.encoder.layer.0.attention.self.query", "aten.addmm.default", "float32", None, 1.07),
        _layer(3, "module.encoder.layer.0.attention.self", "aten._softmax.default", "float32", None, 0.998),
        _layer(4, "module.encoder.layer.0.intermediate.dense", "aten.addmm.default", "float32", None, 1.64),
        _layer(5, "module.encoder.layer.0.output.LayerNorm", "aten.native_layer_norm.default", "float32", None, 3.05),
    ]
    summary = {"precision": None, "steps": 2, "loss_target": [0.9981], "device": "cpu", "torch_version": "2.13.0+cpu",
               "elapsed_s": 0.31}
    return Report(findings=(unused,), precision=None, summary=summary, layers=tuple(layers),
                  source="ddp_unused_bert_pooler.py")


def healthy_report() -> Report:
    """A small MLP under bf16 autocast: finite, within 0.03% of fp32, nothing to report."""
    layers = [
        _layer(0, "0", "aten.addmm.default", "bfloat16", 4.71, 4.719, rel=2.9e-3),
        _layer(1, "1", "aten.relu.default", "bfloat16", 4.71, 4.719, flush=0.0, rel=2.9e-3),
        _layer(2, "2", "aten.addmm.default", "bfloat16", 2.26, 2.25, rel=3.4e-3),
        _layer(2, "2", "aten.mm.default", "bfloat16", 0.118, 0.1182, phase="backward", min_nonzero=1.9e-7,
               rel=3.1e-3),
    ]
    summary = {"precision": "bf16-amp", "steps": 1, "loss_target": [2.3032], "loss_reference": [2.3026],
               "device": "cpu", "torch_version": "2.13.0+cpu", "elapsed_s": 0.05}
    return Report(findings=(), precision="bf16-amp", summary=summary, layers=tuple(layers), source="")


def watch_report() -> Report:
    """ampdoctor.watch over 10 steps of a GPT-2 MLP (gelu_new) under fp16 autocast + GradScaler: every step skipped."""
    scales = [65536.0 / 2 ** (i + 1) for i in range(10)]  # 32768 ... 64: halved after every skipped step
    collapse = Finding(
        code="loss-scale-collapse",
        severity="error",
        module="mlp.act",
        op="aten.pow.Tensor_Scalar",
        phase="backward",
        step=0,
        title="GradScaler skipped all 10 steps; loss scale 65536 -> 64",
        explanation=(
            "Every step produced non-finite gradients, first in the backward of mlp.act (gelu_new's pow(x, 3)), so "
            "scaler.step() skipped every optimizer step and scaler.update() halved the scale each time. The weights "
            "never changed although the loss is finite."
        ),
        evidence={"initial_scale": 65536.0, "final_scale": 64.0, "skipped_steps": 10, "steps": 10},
        fixes=(
            FixProposal(
                title="Use bf16 autocast (no loss scaling needed)",
                snippet='with torch.autocast("cuda", dtype=torch.bfloat16):',
                id="precision",
                params={"precision": "bf16-amp"},
                verified=True,
                verification={"loss_fp32": 0.01214, "loss_fixed": 0.01215, "max_rel_err": 0.0031, "steps_finite": 10},
            ),
        ),
    )
    overflow = Finding(
        code="overflow",
        severity="error",
        module="mlp.act",
        op="aten.pow.Tensor_Scalar",
        phase="backward",
        title="backward of pow(x, 3) overflows fp16 in mlp.act",
        explanation=(
            "gelu_new's backward computes 3 * x**2; with pre-activations up to 212 the fp32 value is 1.35e+05, "
            "above the fp16 maximum 65504, so it is inf, and 0 * inf = NaN in the gradient."
        ),
        evidence={"ref_absmax": 1.35e5, "fp16_max": 65504.0, "ratio": 2.06, "input_absmax": 212.0},
    )
    layers = [
        _layer(0, "mlp.c_fc", "aten.addmm.default", "float16", 212.3, 212.25, rel=4.6e-4),
        _layer(1, "mlp.act", "aten.pow.Tensor_Scalar", "float16", 9.57e6, INF, rel=INF, nonfinite=9),
        _layer(2, "mlp.c_proj", "aten.addmm.default", "float16", 2.12, 2.121, rel=5.0e-4),
        _layer(3, "head", "aten.addmm.default", "float16", 0.021, 0.02101, min_nonzero=7.2e-5, flush=0.0, rel=6.1e-4),
        _layer(3, "head", "aten.mm.default", "float16", 3.1e-3, 3.1e-3, phase="backward", min_nonzero=4.1e-8,
               flush=0.25, rel=2.2e-3),
        _layer(1, "mlp.act", "aten.pow.Tensor_Scalar", "float16", 1.35e5, INF, phase="backward", rel=INF, nonfinite=9),
        _layer(0, "mlp.c_fc", "aten.mm.default", "float16", 0.88, NAN, phase="backward", rel=NAN, nonfinite=1024),
    ]
    summary = {
        "precision": None,
        "steps": 10,
        "loss_target": [0.01214] * 10,
        "first_nonfinite": {"op": "aten.pow.Tensor_Scalar", "module": "mlp.act", "phase": "forward", "step": 0,
                            "index": 5},
        "first_nan": {"op": "aten.mul.Tensor", "module": "mlp.act", "phase": "backward", "step": 0, "index": 31},
        "chain": [
            {"op": "aten.pow.Tensor_Scalar", "module": "mlp.act", "phase": "backward",
             "what": "3 * x**2 = 1.35e+05 > 65504 becomes inf (origin)"},
            {"op": "aten.mul.Tensor", "module": "mlp.act", "phase": "backward", "what": "0 * inf = NaN (first NaN)"},
            {"op": "aten.mm.default", "module": "mlp.c_fc", "phase": "backward",
             "what": "NaN in mlp.c_fc.weight.grad; GradScaler skips the step"},
        ],
        "scales": scales,
        "skipped_steps": 10,
        "device": "cpu",
        "torch_version": "2.13.0+cpu",
        "elapsed_s": 1.92,
    }
    return Report(findings=(collapse, overflow), precision=None, summary=summary, layers=tuple(layers),
                  source="watch")


REPORTS = {"t5": t5_report, "bert": bert_report, "healthy": healthy_report, "watch": watch_report}


@pytest.fixture(params=sorted(REPORTS))
def any_report(request) -> tuple[str, Report]:
    return request.param, REPORTS[request.param]()


@pytest.fixture
def t5() -> Report:
    return t5_report()


@pytest.fixture
def bert() -> Report:
    return bert_report()


@pytest.fixture
def healthy() -> Report:
    return healthy_report()


@pytest.fixture
def watch() -> Report:
    return watch_report()


def check_snapshot(name: str, text: str) -> None:
    """Compare ``text`` with tests/report/snapshots/``name``; ``UPDATE_SNAPSHOTS=1`` rewrites the file."""
    path = SNAPSHOTS / name
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"snapshot {path} is missing: run with UPDATE_SNAPSHOTS=1 to create it, then review it")
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"rendering differs from {path}; if the change is intended, rerun with UPDATE_SNAPSHOTS=1"
