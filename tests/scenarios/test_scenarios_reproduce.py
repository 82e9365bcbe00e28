"""Every built-in scenario really shows its failure (or its health) when run by hand -- no ampdoctor diagnosis.

A scenario is run as its ``precision`` says: ``"fp16"`` -> deepcopy + ``.half()`` + floating batch tensors cast to
fp16; ``"fp16-amp"`` -> ``torch.autocast("cpu", torch.float16)`` around forward + loss and the scenario's
GradScaler around backward/step.  Failing scenarios must fail that way and (except the non-finite input, whose
point is that it is not a precision problem) be finite in fp32; healthy ones must give a finite loss and a finite
gradient for every parameter.
"""

from __future__ import annotations

import copy
import math
import runpy
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampdoctor import CODES
from ampdoctor.findings._types import PHASES
from ampdoctor.scenarios import BUILTIN, DEMO, list_scenarios, load_scenario

NEEDS_TRANSFORMERS = {"t5_fp16_amp_ff_overflow", "bert_unused_pooler", "healthy_t5_fp16_amp",
                      "healthy_bert_fp16_masks"}
PRECISIONS = (None, "fp16", "bf16", "fp16-amp", "bf16-amp", "fp8")
FP16_MAX = 65504.0


def _load(name: str):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    return load_scenario(name)


# ---------------------------------------------------------------------------------------------------------------
# running a scenario by hand


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj


def _call(model: nn.Module, batch: Any) -> Any:
    if batch is None:
        return model()
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


@dataclass
class Step:
    model: nn.Module
    batch: Any
    loss: float | None = None
    error: Exception | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    scale_before: float | None = None
    scale_after: float | None = None

    @property
    def step_skipped(self) -> bool:
        return self.scale_after is not None and self.scale_after < self.scale_before


def run_by_hand(spec: dict[str, Any], precision: str | None = "spec") -> Step:
    """One forward + loss + backward (+ GradScaler step for fp16-amp) of a scenario, as its precision says."""
    precision = spec.get("precision") if precision == "spec" else precision
    model, batch = spec["model"], spec.get("batch")
    amp_dtype = None
    if precision in ("fp16", "bf16"):
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        model, batch = copy.deepcopy(model).to(dtype), _cast(batch, dtype)
    elif precision in ("fp16-amp", "bf16-amp"):
        amp_dtype = torch.float16 if precision == "fp16-amp" else torch.bfloat16
    elif precision is not None:
        raise ValueError(f"precision {precision!r} is not used by the built-in scenarios")
    scaler = spec.get("scaler") if amp_dtype is torch.float16 else None
    step = Step(model=model, batch=batch)
    try:
        with torch.autocast("cpu", dtype=amp_dtype or torch.float16, enabled=amp_dtype is not None):
            out = _call(model, batch)
            loss = spec["loss_fn"](out, batch) if spec.get("loss_fn") else out.loss
        step.loss = loss.item()
        if scaler is not None:
            step.scale_before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(spec["optimizer"])
            scaler.update()
            step.scale_after = scaler.get_scale()
        else:
            loss.backward()
    except RuntimeError as e:
        step.error = e
    step.grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return step


def _all_grads_finite(step: Step) -> bool:
    return all(g is not None and bool(torch.isfinite(g).all()) for g in step.grads.values())


class _Hooks:
    """Record facts from forward hooks; removes every hook on exit."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self._handles: list[Any] = []

    def on(self, module: nn.Module, name: str, fn) -> None:
        self._handles.append(module.register_forward_hook(lambda m, a, o: self.seen.update({name: fn(a, o)})))

    def __enter__(self) -> _Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()


def _absmax(t: torch.Tensor) -> float:
    return t.detach().float().abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# registry and contract


def test_registry_lists_every_scenario_and_the_demo() -> None:
    assert list_scenarios() == list(BUILTIN)
    assert len(BUILTIN) == 9
    assert set(DEMO) == {"t5_fp16_amp_ff_overflow", "bert_unused_pooler"} and set(DEMO) <= set(BUILTIN)
    assert all(mod == f"ampdoctor.scenarios.{name}" for name, mod in BUILTIN.items())


def test_load_scenario_rejects_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'nope'; expected one of: t5_fp16_amp_ff_overflow, "):
        load_scenario("nope")
    with pytest.raises(TypeError, match="must be a str, not int"):
        load_scenario(3)  # type: ignore[arg-type]


def test_load_scenario_names_the_extra_when_transformers_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, BUILTIN["bert_unused_pooler"], raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)     # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"needs the optional dependency 'transformers': pip install ampdoctor\[hf\]"):
        load_scenario("bert_unused_pooler")


@pytest.mark.parametrize("name", list(BUILTIN))
def test_scenario_follows_the_contract(name: str) -> None:
    module = _load(name)
    assert module.__name__ == BUILTIN[name]
    expect = module.EXPECT
    if expect.get("healthy"):
        assert expect == {"healthy": True}
    else:
        assert set(expect) == {"codes", "module", "phase"}
        assert expect["codes"] and set(expect["codes"]) <= set(CODES)
        assert expect["phase"] in PHASES
    for section in ("Real-world", "Mechanism", "Reproduction", "Known fixes", "EXPECT"):
        assert section in module.__doc__
    spec = module.make()
    assert isinstance(spec["model"], nn.Module)
    assert spec.get("precision") in PRECISIONS
    assert set(spec) <= {"model", "batch", "loss_fn", "precision", "optimizer", "scaler", "train_step", "steps"}
    if not expect.get("healthy"):
        assert expect["module"] in dict(spec["model"].named_modules())


@pytest.mark.parametrize("name", list(BUILTIN))
def test_make_is_deterministic_and_leaves_the_global_rng_alone(name: str) -> None:
    module = _load(name)
    rng = torch.get_rng_state()
    a, b = module.make(), module.make()
    assert torch.equal(torch.get_rng_state(), rng)
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a["batch"].keys() == b["batch"].keys()      # every built-in batch is a dict of tensors
    for key, value in a["batch"].items():
        torch.testing.assert_close(value, b["batch"][key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(BUILTIN))
def test_main_block_reproduces(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    _load(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # "found in sys.modules" -- the module is imported above
        runpy.run_module(BUILTIN[name], run_name="__main__")
    out = capsys.readouterr().out
    assert ("HEALTHY:" if name.startswith("healthy_") else "REPRODUCED:") in out
    assert "NOT " not in out


@pytest.mark.parametrize("name", [n for n in BUILTIN if not n.startswith("healthy_") and n != "nonfinite_input"])
def test_failing_scenario_is_finite_in_fp32(name: str) -> None:
    step = run_by_hand(_load(name).make(), precision=None)
    assert step.error is None and math.isfinite(step.loss)
    grads = {n: g for n, g in step.grads.items() if g is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())


# ---------------------------------------------------------------------------------------------------------------
# the demo scenarios


def test_t5_fp16_amp_wo_overflows_and_the_fp32_residual_skips_the_clamp() -> None:
    module = _load("t5_fp16_amp_ff_overflow")
    spec = module.make()
    model = spec["model"]
    ff = model.encoder.block[0].layer[1].DenseReluDense
    before = model.lm_head.weight.detach().clone()
    with _Hooks() as hooks:
        hooks.on(ff.wi_0, "wi_0", lambda a, o: _absmax(o))
        hooks.on(ff.wo, "wo_in", lambda a, o: _absmax(a[0]))
        hooks.on(ff.wo, "wo", lambda a, o: (o.dtype, _absmax(o)))
        hooks.on(model.encoder.block[0], "block0", lambda a, o: (o[0].dtype, bool(torch.isinf(o[0]).any())))
        with torch.no_grad():
            ref_loss = model(**spec["batch"]).loss.item()
        fp32 = dict(hooks.seen)
        step = run_by_hand(spec)
        fp16 = dict(hooks.seen)
    # the weights fit fp16; gelu_new's pow(x, 3) and the gated product stay finite: the overflow is wo's output
    assert max(_absmax(p) for p in ff.parameters()) < 400
    assert fp16["wi_0"] < 40 and fp16["wo_in"] < 1000
    assert fp32["wo"][0] == torch.float32 and 1e5 < fp32["wo"][1] < 2e5 and not fp32["block0"][1]
    assert fp16["wo"] == (torch.float16, math.inf)
    assert fp16["block0"] == (torch.float32, True)         # fp32 residual add: the dtype == fp16 clamp is skipped
    assert math.isnan(step.loss)
    assert step.step_skipped and step.scale_after == 32768.0 and torch.equal(before, model.lm_head.weight)
    assert math.isfinite(ref_loss)
    bf16 = run_by_hand(module.make(), precision="bf16-amp")
    assert math.isfinite(bf16.loss) and abs(bf16.loss - ref_loss) < 0.05


def test_bert_unused_pooler_gets_no_gradient() -> None:
    spec = _load("bert_unused_pooler").make()
    step = run_by_hand(spec)
    assert math.isfinite(step.loss)
    assert [n for n, g in step.grads.items() if g is None] == ["pooler.dense.weight", "pooler.dense.bias"]
    assert all(torch.isfinite(g).all() for n, g in step.grads.items() if not n.startswith("pooler."))
    assert not step.step_skipped and step.scale_after == 65536.0    # numerically healthy: the only cause
    with pytest.raises(AttributeError):     # what a flattening fp16 master-weight optimizer does with the grads
        torch.cat([g.reshape(-1) for g in step.grads.values()])
    ref = run_by_hand(_load("bert_unused_pooler").make(), precision=None)
    assert [n for n, g in ref.grads.items() if g is None] == ["pooler.dense.weight", "pooler.dense.bias"]


# ---------------------------------------------------------------------------------------------------------------
# the other failing scenarios


def test_fully_masked_row_is_nan_only_in_fp16() -> None:
    spec = _load("fully_masked_row").make()
    assert spec["batch"]["history_mask"].sum(1).tolist() == [6, 3, 0, 2]
    step = run_by_hand(spec)
    with _Hooks() as hooks, torch.no_grad():    # look inside the fp16 copy the step ran
        attn = step.model.history_attention
        hooks.on(attn, "nan_users", lambda a, o: torch.isnan(o).any(-1).nonzero().flatten().tolist())
        hooks.on(attn.key, "keys", lambda a, o: bool(torch.isfinite(o).all()))
        _call(step.model, step.batch)
    assert math.isnan(step.loss)
    assert hooks.seen == {"nan_users": [2], "keys": True}   # finite inputs; only the cold-start user's row is NaN
    assert all(bool(torch.isnan(g).any()) for g in step.grads.values())
    mask16 = (1.0 - spec["batch"]["history_mask"].to(torch.float16)) * -1e9
    assert torch.isneginf(mask16[2]).all() and not torch.isinf(mask16[0]).any()


def test_mask_constant_fp16_raises_inside_the_attention_forward() -> None:
    spec = _load("mask_constant_fp16").make()
    model16 = copy.deepcopy(spec["model"]).half()
    entered, finished = [], []
    attn = model16.blocks[0].attn
    handles = [attn.register_forward_pre_hook(lambda m, a: entered.append(a[0].dtype)),
               attn.register_forward_hook(lambda m, a, o: finished.append(True))]
    try:     # the fp16 copy carrying the hooks, run as it is
        step = run_by_hand({**spec, "model": model16, "precision": None})
    finally:
        for h in handles:
            h.remove()
    assert isinstance(step.error, RuntimeError)
    assert "value cannot be converted to type c10::Half without overflow" in str(step.error)
    assert entered == [torch.float16] and finished == []
    assert isinstance(run_by_hand(_load("mask_constant_fp16").make()).error, RuntimeError)


def test_nonfinite_input_is_nan_in_every_precision() -> None:
    module = _load("nonfinite_input")
    spec = module.make()
    x = spec["batch"]["features"]
    assert torch.isnan(x[:, 4]).all() and torch.isfinite(x[:, [0, 1, 2, 3, 5]]).all()
    step = run_by_hand(spec)
    assert math.isnan(step.loss) and step.step_skipped and step.scale_after == 32768.0
    ref = run_by_hand(module.make(), precision=None)     # not a precision problem: fp32 is NaN too
    assert math.isnan(ref.loss) and not any(bool(torch.isfinite(g).any()) for g in ref.grads.values())
    # no operation of the model creates the NaN: with the column repaired, fp16-amp is finite
    fixed = module.make()
    fixed["batch"] = {"features": x.nan_to_num(0.0)}
    assert math.isfinite(run_by_hand(fixed).loss)


def test_mlp_fp16_overflow_starts_at_the_hidden_linear() -> None:
    spec = _load("mlp_fp16_overflow").make()
    assert _absmax(spec["batch"]["readings"]) < FP16_MAX
    with _Hooks() as hooks:
        hooks.on(spec["model"].input_proj, "input_proj", lambda a, o: _absmax(o))
        hooks.on(spec["model"].hidden, "hidden", lambda a, o: _absmax(o))
        with torch.no_grad():
            ref = spec["loss_fn"](spec["model"](**spec["batch"]), spec["batch"])
        fp32 = dict(hooks.seen)
    step = run_by_hand(spec)
    with _Hooks() as hooks, torch.no_grad():
        hooks.on(step.model.input_proj, "input_proj", lambda a, o: (o.dtype, _absmax(o)))
        hooks.on(step.model.hidden, "hidden", lambda a, o: (o.dtype, int(torch.isinf(o).sum())))
        hooks.on(step.model.head, "head_nan", lambda a, o: int(torch.isnan(o).sum()))
        _call(step.model, step.batch)
        seen = dict(hooks.seen)
    assert math.isfinite(ref.item()) and fp32["input_proj"] < FP16_MAX < fp32["hidden"] < 2e5
    assert seen["input_proj"][0] == torch.float16 and seen["input_proj"][1] < FP16_MAX
    assert seen["hidden"][0] == torch.float16 and seen["hidden"][1] > 0
    assert seen["head_nan"] > 0 and math.isnan(step.loss)


# ---------------------------------------------------------------------------------------------------------------
# healthy controls


@pytest.mark.parametrize("name", [n for n in BUILTIN if n.startswith("healthy_")])
def test_healthy_scenario_is_finite_with_a_gradient_everywhere(name: str) -> None:
    module = _load(name)
    step = run_by_hand(module.make())
    ref = run_by_hand(module.make(), precision=None)
    assert step.error is None and math.isfinite(step.loss)
    assert _all_grads_finite(step)
    assert abs(step.loss - ref.loss) < 1e-2 * max(1.0, abs(ref.loss))
    if step.scale_before is not None:
        assert not step.step_skipped and step.scale_after == 65536.0


class _NegInfLogs(TorchDispatchMode):
    """Counts aten.log outputs that contain -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.log and torch.isneginf(out).any():
            self.count += 1
        return out


def test_healthy_t5_computes_the_benign_log_zero_and_small_ff_outputs() -> None:
    spec = _load("healthy_t5_fp16_amp").make()
    with _Hooks() as hooks, _NegInfLogs() as logs:
        hooks.on(spec["model"].encoder.block[0].layer[1].DenseReluDense.wo, "wo", lambda a, o: (o.dtype, _absmax(o)))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            loss = spec["model"](**spec["batch"]).loss
    assert logs.count >= 2                       # encoder and decoder relative-position bucketing take log(0)
    assert math.isfinite(loss.item())
    assert hooks.seen["wo"][0] == torch.float16 and hooks.seen["wo"][1] < 10


def test_healthy_bert_uses_the_fp16_minimum_as_mask_value() -> None:
    spec = _load("healthy_bert_fp16_masks").make()
    model16 = copy.deepcopy(spec["model"]).half()
    masks = []
    handle = model16.encoder.layer[0].attention.self.register_forward_pre_hook(
        lambda m, a, k: masks.append(k["attention_mask"]), with_kwargs=True)
    try:
        _call(model16, spec["batch"])
    finally:
        handle.remove()
    assert masks[0].dtype == torch.float16
    assert sorted(masks[0].unique().tolist()) == [-FP16_MAX, 0.0]
    assert (masks[0] == -FP16_MAX).sum().item() == 8 * (3 + 5)    # 8 queries x padded keys of rows 1 and 2


def test_healthy_partial_mask_has_neg_inf_but_a_real_key_in_every_row() -> None:
    spec = _load("healthy_partial_neg_inf_mask").make()
    mask = spec["batch"]["attention_mask"]
    assert mask.sum(1).min().item() >= 1 and (mask == 0).any()
    model16 = copy.deepcopy(spec["model"]).half()
    biases = []
    handle = model16.layers[0].register_forward_hook(lambda m, a, o: biases.append(a[1]))
    try:
        _call(model16, spec["batch"])
    finally:
        handle.remove()
    assert biases[0].dtype == torch.float16 and torch.isneginf(biases[0]).sum().item() == (mask == 0).sum().item()
