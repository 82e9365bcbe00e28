"""The target run's copy made over the reference's storages (``SharedCopy``) starts from bitwise the same state as a
fresh deep copy: the same records, statistics, writes, losses and findings, with AdamW + GradScaler, with buffers
(BatchNorm running statistics and its integer counter) and with an optimizer that already carries state."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.precision import SharedCopy, make_spec, run, saved_rng


def _val(v: Any) -> Any:
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def _fingerprint(res: Any) -> dict[str, Any]:
    """Everything a run hands the analysis, NaN made comparable."""
    recs = [(r.index, r.op, r.module, r.phase, r.step, r.node, str(r.dtype), r.shape, r.inputs, r.kind, r.name,
             r.scalars, r.input_dtypes, r.out_pos, tuple(map(_val, r.sample)), r.index_src,
             sorted((k, _val(v)) for k, v in r.stats.items())) for r in res.trace.records]
    writes = [(w.index, w.op, w.phase, w.module, w.owner, w.target, w.name, w.dtype, w.seq,
               sorted((k, _val(v)) for k, v in w.stats.items())) for w in res.trace.writes]
    cov = [[(p.name, p.dtype, p.grad_none, p.grad_dtype, _val(p.grad_zero)) for p in c] for c in res.coverage]
    return {"records": recs, "writes": writes, "coverage": cov, "losses": res.losses, "scales": res.scales,
            "norms": [_val(v) for v in res.grad_norms], "step_scales": res.step_scales, "marks": res.trace.marks,
            "state": res.optimizer_state_dtypes, "params": res.param_dtypes, "exc": repr(res.exc)}


class _Net(nn.Module):
    def __init__(self, bn: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("offset", torch.full((4,), 0.25))  # a plain float buffer the forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.bn(self.fc1(x)))) + self.offset


def _spec(*, bn: bool, warm: bool, scaler: bool, precision: str, steps: int = 2) -> Any:
    torch.manual_seed(0)
    model = _Net(bn)
    with torch.no_grad():
        model.fc1.weight.mul_(40.0)  # large activations: fp16 rounding and a loss scale that matter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    if warm:  # a user who ran some steps: AdamW moments, its step count and BatchNorm's statistics are not fresh
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if scaler else None
    return make_spec(model, (x,), precision=precision, optimizer=opt, scaler=sc, steps=steps,
                     loss_fn=lambda out, batch: F.cross_entropy(out, y))


CASES = [
    pytest.param(dict(bn=False, warm=False, scaler=True, precision="fp16-amp"), id="adamw-gradscaler"),
    pytest.param(dict(bn=True, warm=False, scaler=False, precision="bf16-amp"), id="batchnorm-buffers"),
    pytest.param(dict(bn=True, warm=True, scaler=True, precision="fp16-amp"), id="warm-optimizer-batchnorm"),
]


def _storages(models: Any) -> set[int]:
    """The storage addresses of a kept run's copy: its parameters, buffers and optimizer state."""
    model, opt = models[0], models[1]
    used = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    return used | {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("kw", CASES)
def test_target_run_on_the_shared_copy_is_bitwise_the_fresh_one(kw: dict[str, Any]) -> None:
    spec = _spec(**kw)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    with saved_rng():
        ref_fresh = run(spec, reference=True)
    with saved_rng():
        fresh = run(spec, reference=False)
    shared = SharedCopy(spec)
    with saved_rng():
        ref = run(spec, reference=True, hand_over=shared)
    kept = shared.addresses()
    n_state = sum(1 for st in spec.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    n_buf = sum(1 for _ in spec.model.buffers())
    assert len(kept) == len(list(spec.model.parameters())) + n_buf + n_state  # every tensor is handed over
    with saved_rng():
        target = run(spec, reference=False, reuse=shared, keep_models=True)
    assert kept <= _storages(target.models)  # the target really ran on the reference's storages
    assert len(shared) == 0  # handed over once
    target.models = None
    assert _fingerprint(ref) == _fingerprint(ref_fresh)
    assert _fingerprint(target) == _fingerprint(fresh)
    assert fresh.losses != ref.losses  # the precision did something: the comparison can fail
    assert all(torch.equal(before[k], v) for k, v in spec.model.state_dict().items())  # the user's model untouched


@pytest.mark.parametrize("kw", CASES)
def test_reference_run_on_the_targets_shared_copy_is_bitwise_the_fresh_one(kw: dict[str, Any]) -> None:
    """The diagnosis's own order: the target hands its copy over to the reference."""
    spec = _spec(**kw)
    with saved_rng():
        ref_fresh = run(spec, reference=True)
    shared = SharedCopy(spec)
    with saved_rng():
        target = run(spec, reference=False, hand_over=shared)
    kept = shared.addresses()
    assert len(kept) >= len(list(spec.model.parameters()))  # the amp target's float32 parameters are handed over
    with saved_rng():
        ref = run(spec, reference=True, reuse=shared, keep_models=True)
    assert kept <= _storages(ref.models)  # the reference really ran on the target's storages
    ref.models = None
    assert _fingerprint(ref) == _fingerprint(ref_fresh)
    assert target.losses != ref.losses


def _findings(report: Any) -> list[Any]:
    return [(f.code, f.severity, f.module, f.op, f.phase, repr(f.evidence)) for f in report.findings]


@pytest.mark.parametrize("kw", CASES[::2])
def test_findings_are_the_same_with_and_without_the_shared_copy(kw: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(**kw)
    args = dict(precision=spec.precision, optimizer=spec.optimizer, scaler=spec.scaler, loss_fn=spec.loss_fn,
                steps=spec.steps)
    shared = ampdoctor.diagnose(spec.model, spec.batch, **args)
    monkeypatch.setattr(SharedCopy, "keep", lambda self, model, optimizer: None)  # today's path: a fresh copy
    fresh = ampdoctor.diagnose(spec.model, spec.batch, **args)
    assert _findings(shared) == _findings(fresh)
    assert shared.summary["loss_target"] == fresh.summary["loss_target"]


def test_not_shared_where_the_target_casts_or_transforms() -> None:
    spec = _spec(bn=True, warm=True, scaler=False, precision="bf16")
    shared = SharedCopy(spec)
    run(spec, reference=True, hand_over=shared)
    assert len(shared) == 0 and shared.take() == {}
    spec = _spec(bn=False, warm=False, scaler=False, precision="bf16-amp")
    spec = replace(spec, transforms=(lambda m, o, s: None,))
    shared = SharedCopy(spec)
    run(spec, reference=True, hand_over=shared)
    assert len(shared) == 0
