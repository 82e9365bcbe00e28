"""``KeyedSamples`` above a cheap trace: the outputs asked for by key get the values the full tier samples at the
same positions, the cheap trace's records are those it makes alone (the gathers are not recorded), and the step's
results are bitwise those of an unobserved step."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.trace import KeyedSamples, record_keys, trace


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 300), nn.GELU(), nn.Linear(300, 4))


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = torch.log_softmax(model(x) * 3.0, -1)
    out.sum().backward()
    return out


def test_keyed_samples_match_the_full_tiers_and_change_nothing() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = _model()
    with trace(model, full=True) as t:
        _step(model, x)
    full = t.result().records
    keys = record_keys(full)
    fwd = {keys[r.index]: r for r in full if r.index in keys and r.phase == "forward" and r.sample
           and not (r.inputs and full[r.inputs[0]].row == r.row)}  # a view shares its source's sample (not kept)
    assert len(fwd) >= 4

    plain = _model()
    expected = _step(plain, x)
    cheap_alone = _model()
    with trace(cheap_alone) as t0:
        _step(cheap_alone, x)
    alone = [(r.op, r.module, r.phase) for r in t0.result().records]

    observed = _model()
    with trace(observed) as tc, KeyedSamples(tc.mode, set(fwd)) as ks:
        got = _step(observed, x)
    records = tc.result().records
    samples = ks.result()
    assert [(r.op, r.module, r.phase) for r in records] == alone  # no gather of ours is recorded
    assert torch.equal(got, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(observed.parameters(), plain.parameters()))
    assert set(samples) == set(fwd)
    for key, r in fwd.items():
        assert samples[key] == r.sample, key  # float32 both ways: the same elements, bitwise


def test_a_failing_sample_raises_nothing_into_the_step_and_keeps_no_samples() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = _model()
    with trace(model, full=True) as t:
        _step(model, x)
    full = t.result().records
    wanted = {k for k in record_keys(full).values() if k[0] == "forward"}
    observed = _model()
    with trace(observed) as tc, KeyedSamples(tc.mode, wanted) as ks:
        def broken(t: torch.Tensor) -> None:
            raise RuntimeError("no gather")
        ks.sampler.take = broken  # type: ignore[method-assign]
        got = _step(observed, x)
    assert torch.equal(got, _step(_model(), x))
    assert ks.result() == {}  # the counts may be off after a failure: nothing is claimed as measured
