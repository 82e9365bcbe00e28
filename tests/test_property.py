"""Properties over random small models: tracing never changes a result bit, diagnosing never crashes.

Hypothesis draws MLPs (widths 2..16, depth 1..3, ReLU/GELU/tanh/sigmoid, with or without LayerNorm) and
single-head attention blocks (boolean masks drawn per element, fully masked rows included, optional LayerNorm),
weights scaled up to 1e3x and inputs up to 1e4x (so fp16 overflows happen), in every precision: None, fp16, bf16
and the two autocasts. For each:

* a training step (forward, backward, SGD step) under ``ampdoctor.trace`` (either tier) gives bitwise the outputs,
  gradients and updated weights of the same step without it, from the same seed, and the trace raises nothing;
* ``ampdoctor.diagnose`` returns a :class:`~ampdoctor.Report` (it never raises on valid input) whose findings
  have a known code, severity and phase, name a module of the model (or ``""``) and an op in aten-overload form
  (or ``""``), and whose JSON document holds no bare inf/NaN.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.findings._types import PHASES, SEVERITIES

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PRECISIONS = (None, "fp16", "bf16", "fp16-amp", "bf16-amp")
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
AMP = {"fp16-amp": torch.float16, "bf16-amp": torch.bfloat16}
#: ``namespace.op.overload`` as the trace names ops (``aten.pow.Tensor_Scalar``)
OP_FORM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")


class Attention(nn.Module):
    """Single-head attention with a boolean keep-mask: masked scores are set to -inf before the softmax, so a
    fully masked row is NaN in every precision (the documented ``masked-row-nan`` case)."""

    def __init__(self, dim: int, norm: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.scale = dim ** -0.5

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        return self.norm(x + self.out(scores.softmax(-1) @ v))


@st.composite
def configs(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["mlp", "attention"]))
    cfg: dict[str, Any] = {
        "kind": kind,
        "norm": draw(st.booleans()),
        "precision": draw(st.sampled_from(PRECISIONS)),
        "weight_scale": draw(st.sampled_from([1.0, 30.0, 1e3])),
        "input_scale": draw(st.sampled_from([1.0, 1e2, 1e4])),
        "seed": draw(st.integers(0, 2**16)),
        "batch": draw(st.integers(1, 3)),
    }
    if kind == "mlp":
        depth = draw(st.integers(1, 3))
        cfg["widths"] = [draw(st.integers(2, 16)) for _ in range(depth + 1)]
        cfg["activation"] = draw(st.sampled_from(sorted(ACTIVATIONS)))
    else:
        cfg["dim"] = draw(st.integers(2, 16))
        seq = draw(st.integers(1, 5))
        cfg["mask"] = [[[draw(st.booleans()) for _ in range(seq)] for _ in range(seq)] for _ in range(cfg["batch"])]
    return cfg


def build(cfg: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The model (float32, weights scaled) and its batch, from ``cfg``'s seed."""
    g = torch.Generator().manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    if cfg["kind"] == "mlp":
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        w = cfg["widths"]
        for i, (a, b) in enumerate(zip(w, w[1:])):
            layers[f"fc{i}"] = nn.Linear(a, b)
            if cfg["norm"]:
                layers[f"norm{i}"] = nn.LayerNorm(b)
            layers[f"act{i}"] = ACTIVATIONS[cfg["activation"]]()
        model: nn.Module = nn.Sequential(layers)
        batch: Any = torch.randn(cfg["batch"], w[0], generator=g) * cfg["input_scale"]
    else:
        model = Attention(cfg["dim"], cfg["norm"])
        seq = len(cfg["mask"][0])
        x = torch.randn(cfg["batch"], seq, cfg["dim"], generator=g) * cfg["input_scale"]
        batch = (x, torch.tensor(cfg["mask"], dtype=torch.bool))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.mul_(cfg["weight_scale"])
    return model.train(), batch


def loss_of(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _call(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def train_step(model: nn.Module, batch: Any, precision: str | None, trace_full: bool | None) -> dict[str, Any]:
    """One SGD step in ``precision`` (cast or autocast done here, as a user would); under ``trace`` when
    ``trace_full`` is not None. Returns every result as tensors."""
    if precision in LOW:
        model.to(LOW[precision])
        batch = tuple(t.to(LOW[precision]) if t.is_floating_point() else t for t in batch) if isinstance(
            batch, tuple) else batch.to(LOW[precision])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    amp = torch.autocast("cpu", dtype=AMP[precision]) if precision in AMP else contextlib.nullcontext()
    tr = ampdoctor.trace(model, opt, full=trace_full) if trace_full is not None else contextlib.nullcontext()
    torch.manual_seed(1)
    with tr:
        with amp:
            out = _call(model, batch)
            loss = loss_of(out, batch)
        loss.backward()
        opt.step()
    if trace_full is not None:
        assert tr.result().records  # the trace saw the step
    return {"out": out.detach(), "loss": loss.detach(), "rng": torch.get_rng_state(),
            **{f"grad:{n}": p.grad for n, p in model.named_parameters()},
            **{f"param:{n}": p.detach() for n, p in model.named_parameters()}}


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(cfg=configs(), full=st.booleans())
def test_trace_never_changes_a_result_bit(cfg, full):
    model, batch = build(cfg)
    twin = copy.deepcopy(model)
    plain = train_step(model, copy.deepcopy(batch), cfg["precision"], None)
    traced = train_step(twin, copy.deepcopy(batch), cfg["precision"], full)
    assert plain.keys() == traced.keys()
    changed = [k for k in plain if not bitwise_equal(plain[k], traced[k])]
    assert changed == [], f"{cfg}: trace changed {changed}"


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(cfg=configs())
def test_diagnose_returns_a_valid_report(cfg):
    model, batch = build(cfg)
    report = ampdoctor.diagnose(model, batch, precision=cfg["precision"], loss_fn=loss_of,
                                optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
    assert isinstance(report, ampdoctor.Report) and report.precision == cfg["precision"]
    modules = {name for name, _ in model.named_modules()}
    for f in report.findings:
        assert f.code in ampdoctor.CODES and f.severity in SEVERITIES and f.phase in PHASES, f
        assert f.module in modules, (f.code, f.module)
        assert f.op == "" or OP_FORM.match(f.op), (f.code, f.op)
        assert isinstance(f.title, str) and f.title and isinstance(f.explanation, str) and f.explanation
    assert report.ok == all(f.severity != "error" for f in report.findings)
    doc = json.dumps(report.to_dict(), allow_nan=False)  # inf/NaN are written as strings
    assert json.loads(doc)["findings"] == [f.to_dict() for f in report.findings]
    losses = report.summary["loss_target"]
    if losses and losses[0] is not None and not math.isfinite(losses[0]):
        # a non-finite loss is always explained by an error finding
        assert not report.ok, (cfg, report.codes())
