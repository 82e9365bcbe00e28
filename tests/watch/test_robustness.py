"""Fault isolation and bounded memory: an internal failure never changes the user's results or drops their
raise/skip decision; a run with an anomaly on every step keeps a bounded window plus counters."""

from __future__ import annotations

import logging
import math
import tracemalloc

import pytest
import torch
from torch import nn

from ampdoctor.watch import AnomalyError, _reproducer, watch
from tests.watch._loops import loop as _loop
from tests.watch._loops import net as _net


def test_ten_thousand_anomalous_steps_keep_memory_bounded(monkeypatch) -> None:
    """Bound: at most 2 * MAX_RECORDS step records (4096 by default, ~200 B each) plus windows of 32 anomalies
    and spikes and per-kind counters. With the window at 256 records, 5,000 more anomalous steps after 5,000
    must not grow memory by more than the window."""
    from ampdoctor.watch import _steps

    monkeypatch.setattr(_steps, "MAX_RECORDS", 256)
    m = nn.Linear(2, 1)
    nan = torch.tensor(math.nan)
    logging.getLogger("ampdoctor.watch").setLevel(logging.ERROR)
    try:
        with watch(m, locate=False, coverage_steps=0) as w:
            for _ in range(5000):
                w.step(nan)
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(5000):
                w.step(nan)
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
    finally:
        logging.getLogger("ampdoctor.watch").setLevel(logging.NOTSET)
    r = w.report()
    assert r.summary["steps"] == 10_000 and r.summary["anomaly_counts"] == {"nonfinite-loss": 10_000}
    assert len(r.summary["anomalies"]) <= 32 and len(w._tracker.records) <= 2 * 256
    assert grown < 200_000, grown            # unbounded, this was ~0.38 KB per anomalous step (1.9 MB here)


def _fails(*args, **kwargs):
    raise OSError("injected: disk full")


@pytest.mark.parametrize("where", ["payload", "save"])
def test_a_failed_reproducer_still_raises(tmp_path, monkeypatch, where) -> None:
    if where == "payload":
        import importlib

        monkeypatch.setattr(importlib.import_module("ampdoctor.watch._guard"), "build_payload", _fails)
    else:
        monkeypatch.setattr(_reproducer, "save_reproducer", _fails)
    m, opt = _net()
    before = None
    with pytest.raises(AnomalyError) as ei:
        with watch(m, opt, on_anomaly="raise", reproducer_dir=tmp_path):
            g = torch.Generator().manual_seed(1)
            for i in range(4):
                x = torch.randn(3, 4, generator=g)
                if i == 2:
                    x[0, 0] = math.inf
                    before = {k: v.clone() for k, v in m.state_dict().items()}
                opt.zero_grad()
                m(x).pow(2).mean().backward()
                opt.step()
    assert ei.value.step == 2 and ei.value.reproducer is None
    assert before is not None and all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert not any(mod._forward_pre_hooks for mod in m.modules())


def test_a_failed_reproducer_still_skips(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_reproducer, "save_reproducer", _fails)
    m, opt = _net()
    with watch(m, opt, on_anomaly="skip", reproducer_dir=tmp_path, locate=False) as w:
        _loop(m, opt, 5, bad=2)
    assert all(torch.isfinite(p).all() for p in m.parameters())    # the NaN step never reached the weights
    assert w.report().summary["steps_skipped_by_watch"] == 1


def test_a_broken_tensorboard_writer_changes_nothing(tmp_path, caplog) -> None:
    class Broken:
        def add_scalar(self, *a, **k):
            raise RuntimeError("injected: writer")

        def close(self):
            raise RuntimeError("injected: close")

    m0, o0 = _net()
    l0 = _loop(m0, o0, 6)
    m1, o1 = _net()
    with watch(m1, o1, tensorboard=tmp_path / "tb") as w:
        w._sinks._tb.close()
        w._sinks._tb = Broken()
        l1 = _loop(m1, o1, 6)
    assert l0 == l1 and w.disabled is None
    assert sum("TensorBoard writer failed" in r.getMessage() for r in caplog.records) == 1


def test_a_failing_framework_sink_is_dropped_once(caplog) -> None:
    m, opt = _net()
    with watch(m, opt) as w:
        w.add_scalar_sink(_fails)
        _loop(m, opt, 4)
    assert w.disabled is None and w.report().summary["steps"] == 4
    assert sum("framework logger failed" in r.getMessage() for r in caplog.records) == 1


def test_report_building_failure_returns_a_report(monkeypatch) -> None:
    from ampdoctor.watch import _rules

    m, opt = _net()
    with watch(m, opt) as w:
        _loop(m, opt, 3)
    monkeypatch.setattr(_rules, "coverage_findings", _fails)
    r = w.report()
    assert r.findings == () and "injected" in r.summary["disabled"]


def test_sparse_gradients_are_checked() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with watch(emb, opt, locate=False) as w:
        for i in range(4):
            opt.zero_grad()
            out = emb(torch.tensor([1, 2, 3]))
            (out.sum() * (math.inf if i == 2 else 1.0)).backward()
            opt.step()
    r = w.report()
    assert w.disabled is None and r.summary["anomaly_counts"].get("nonfinite-grads") == 1


def test_cyclic_batch_and_param_group_added_mid_run(tmp_path) -> None:
    from ampdoctor.watch import load_reproducer

    m, opt = _net()
    extra = nn.Linear(1, 1)
    with watch(m, opt, locate=False, reproducer_dir=tmp_path) as w:
        for i in range(4):
            batch: list = [torch.randn(3, 4)]
            batch.append(batch)                   # a cyclic container the reproducer must not recurse into
            if i == 3:
                batch[0][0, 0] = math.inf
            w.observe_batch(batch)
            if i == 2:
                opt.add_param_group({"params": list(extra.parameters())})
            opt.zero_grad()
            (m(batch[0]).sum() + extra(torch.ones(1)).sum()).backward()
            opt.step()
    assert w.disabled is None and w.report().summary["steps"] == 4
    rep = load_reproducer(next(tmp_path.iterdir()))
    assert rep["batch"][1] is None and rep["dropped"] == ["batch[1]: cycle"]
    params = w._tracker.params
    assert "optimizer.param_groups[1][0]" in params.opt_names     # the group added at step 2 was re-read
