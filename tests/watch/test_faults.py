"""Fault isolation, the audit's list (reliability review, "Counts" and R3/R12/R21): realistic faults and
internal failures injected into each part of the watch. For each: at most one warning, the user's training
bitwise identical to an unwatched twin, and a pending ``raise``/``skip`` decision still carried out.

(Covered in test_robustness.py: 10,000 anomalous steps, failed reproducer write/payload, broken TensorBoard
writer, failing framework sink, report-building failure, sparse gradients, cyclic batch, param group added.)"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ampdoctor.watch import AnomalyError, _reproducer, watch
from tests.watch._loops import loop as _loop
from tests.watch._loops import net as _net


def _state(m: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in m.state_dict().values() if isinstance(t, torch.Tensor)]
    for s in opt.state.values():
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bitwise (NaN equals NaN with the same bits)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def _no_hooks(m: nn.Module, opt: torch.optim.Optimizer) -> bool:
    return (not any(mod._forward_pre_hooks for mod in m.modules())
            and not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in m.parameters())
            and not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected")


# ---------------------------------------------------------------------------------------------- injected failures
def _inject(where: str, monkeypatch: pytest.MonkeyPatch, w: Any) -> None:
    """Make one internal part of an entered watch ``w`` raise."""
    from ampdoctor.watch import _record, _steps

    t = w._tracker
    if where == "forward-pre-hook":
        monkeypatch.setattr(_steps, "rng_state", _boom)
    elif where == "grad-hook":
        class BrokenSet(set):
            def add(self, item: Any) -> None:
                raise RuntimeError("injected")
        t.it.seen = BrokenSet()
    elif where == "optimizer-pre-hook":
        monkeypatch.setattr(t, "before_update", _boom)
    elif where == "optimizer-post-hook":
        monkeypatch.setattr(t, "close", _boom)
    elif where == "readback":
        monkeypatch.setattr(_record.Readback, "read", _boom)
    elif where == "detector":
        monkeypatch.setattr(_steps, "run_detectors", _boom)
    else:
        raise AssertionError(where)


HOOK_FAULTS = ["forward-pre-hook", "grad-hook", "optimizer-pre-hook", "optimizer-post-hook", "readback", "detector"]


@pytest.mark.parametrize("where", HOOK_FAULTS)
def test_an_internal_failure_changes_nothing_and_warns_once(where, monkeypatch, caplog) -> None:
    m0, o0 = _net()
    l0 = _loop(m0, o0, 5)
    m1, o1 = _net()
    with watch(m1, o1) as w:
        _inject(where, monkeypatch, w)
        l1 = _loop(m1, o1, 5, w=w)          # never propagates (backward() included)
        w.report()
    assert l0 == l1 and _same(_state(m0, o0), _state(m1, o1))
    assert w.disabled is not None and "injected" in w.disabled
    assert len([s for s in _warnings(caplog) if "injected" in s]) == 1
    assert _no_hooks(m1, o1)


def _variant_loop(variant: str, m: nn.Module, opt: torch.optim.Optimizer, scaler: Any, n: int,
                  bad: int | None = None) -> list[float]:
    """Training loops through the other hook paths: ``optimizer.step(closure)`` and GradScaler."""
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(n):
        x = torch.randn(3, 4, generator=g)
        if i == bad:
            x[0, 0] = math.inf

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            return loss
        if variant == "closure":
            loss = opt.step(closure)
        else:
            loss = closure()
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("variant, where", [("closure", "before_update"), ("scaler", "token"),
                                            ("scaler", "inner-forward-hook")])
def test_other_hook_paths_are_isolated(variant, where, monkeypatch, caplog) -> None:
    from ampdoctor.watch._scaler import GradScalerView

    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], Any]:
        m, opt = _net()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if variant == "scaler" else None
        if not watched:
            return _variant_loop(variant, m, opt, scaler, 5), _state(m, opt), None
        with watch(m, opt, scaler) as w:
            if where == "before_update":
                monkeypatch.setattr(w._tracker, "before_update", _boom)
            elif where == "token":
                monkeypatch.setattr(GradScalerView, "token", _boom)
            else:
                class BrokenDict(dict):
                    def __getitem__(self, key: Any) -> Any:
                        raise RuntimeError("injected")
                w._tracker.autocast = BrokenDict()
            losses = _variant_loop(variant, m, opt, scaler, 5)
        return losses, _state(m, opt), w

    l0, s0, _ = run(False)
    l1, s1, w = run(True)
    assert l0 == l1 and _same(s0, s1)
    assert w.disabled is not None and "injected" in w.disabled
    assert len([s for s in _warnings(caplog) if "injected" in s]) == 1


@pytest.mark.parametrize("on_anomaly", ["raise", "skip"])
def test_closure_and_scaler_paths_keep_the_decision_when_the_replay_fails(on_anomaly, monkeypatch) -> None:
    monkeypatch.setattr(_reproducer, "replay_payload", _boom)
    m, opt = _net()
    if on_anomaly == "raise":
        with pytest.raises(AnomalyError):
            with watch(m, opt, on_anomaly="raise"):
                _variant_loop("closure", m, opt, None, 4, bad=2)
    else:
        with watch(m, opt, on_anomaly="skip") as w:
            _variant_loop("closure", m, opt, None, 4, bad=2)
        assert w.report().summary["steps_skipped_by_watch"] == 1
    assert all(torch.isfinite(p).all() for p in m.parameters()) and _no_hooks(m, opt)


def test_a_failing_detector_is_dropped_alone(monkeypatch, caplog) -> None:
    """A detector that raises is disabled with one warning; the others (non-finite loss) keep working."""
    from ampdoctor.watch import _detectors

    event = _detectors.GradsSeen
    monkeypatch.setitem(_detectors.DETECTORS, event,
                        [("injected-spikes", _boom), *_detectors.DETECTORS[event]])
    m, opt = _net()
    with pytest.raises(AnomalyError) as ei:
        with watch(m, opt, on_anomaly="raise", locate=False) as w:
            _loop(m, opt, 5, bad=3)
    assert ei.value.step == 3 and ei.value.kind in ("nonfinite-grads", "nonfinite-loss")
    assert w.disabled is None and w.report().summary["detectors_off"] == ["injected-spikes"]
    assert len([s for s in _warnings(caplog) if "injected" in s]) == 1


@pytest.mark.parametrize("on_anomaly", ["raise", "skip"])
@pytest.mark.parametrize("where", ["replay", "payload", "copy"])
def test_a_failure_while_an_anomaly_is_pending_keeps_the_decision(where, on_anomaly, tmp_path, monkeypatch,
                                                                   caplog) -> None:
    from ampdoctor.watch import _guard

    if where == "replay":
        monkeypatch.setattr(_reproducer, "replay_payload", _boom)
    elif where == "payload":
        monkeypatch.setattr(_guard, "build_payload", _boom)
    else:
        monkeypatch.setattr(_guard, "copy_without_hooks", _boom)
    m0, o0 = _net()
    _loop(m0, o0, 5, bad=None)
    m1, o1 = _net()
    if on_anomaly == "raise":
        with pytest.raises(AnomalyError) as ei:
            with watch(m1, o1, on_anomaly="raise", locate=True):
                _loop(m1, o1, 5, bad=2)
        assert ei.value.step == 2
        assert all(torch.isfinite(p).all() for p in m1.parameters())   # raised before the NaN update
    else:
        with watch(m1, o1, on_anomaly="skip", locate=True) as w:
            _loop(m1, o1, 5, bad=2)
        assert all(torch.isfinite(p).all() for p in m1.parameters())
        assert w.report().summary["steps_skipped_by_watch"] == 1 and w.disabled is None
    assert len([s for s in _warnings(caplog) if "injected" in s]) == 1
    assert _no_hooks(m1, o1)


@pytest.mark.parametrize("which", [0, 1, -1])
def test_a_failing_hook_removal_still_removes_the_others(which, monkeypatch, caplog) -> None:
    m, opt = _net()
    with watch(m, opt) as w:
        _loop(m, opt, 1)          # coverage hooks still installed (coverage_steps=3)
        handles = w._tracker.handles + w._tracker.coverage_handles
        bad = handles[which]
        real = bad.remove

        def remove() -> None:
            real()
            raise RuntimeError("injected")
        monkeypatch.setattr(bad, "remove", remove)
    assert _no_hooks(m, opt)
    assert len([s for s in _warnings(caplog) if "injected" in s]) == 1


def test_a_failing_hook_removal_keeps_a_deferred_raise(monkeypatch) -> None:
    m, opt = _net()
    with pytest.raises(AnomalyError):
        with watch(m, opt, on_anomaly="raise", locate=False) as w:
            h = w._tracker.handles[0]
            real = h.remove

            def remove() -> None:
                real()
                raise RuntimeError("injected")
            monkeypatch.setattr(h, "remove", remove)
            _loop(m, opt, 2)
            w.step(torch.tensor(math.nan))       # read at exit: a deferred raise
    assert _no_hooks(m, opt)


@pytest.mark.parametrize("where", ["sync", "nonfinite_findings", "collapse_findings", "build_report"])
def test_report_never_raises(where, monkeypatch, caplog) -> None:
    from ampdoctor.watch import _guard, _rules

    m, opt = _net()
    with watch(m, opt) as w:
        _loop(m, opt, 3, bad=1)
        if where == "sync":
            monkeypatch.setattr(w._tracker, "sync", _boom)
        elif where == "build_report":
            monkeypatch.setattr(_guard, "build_report", _boom)
        else:
            monkeypatch.setattr(_rules, where, _boom)
        r = w.report()
    assert r.source == "watch" and "injected" in str(r.summary.get("disabled"))
    assert len([s for s in _warnings(caplog) if "injected" in s]) == 1


# ---------------------------------------------------------------------------------------------- realistic faults
def test_an_optimizer_rebuilt_mid_run_is_noticed(caplog) -> None:
    """R12: a new AdamW over the same parameters: the watch says so once and keeps checking the losses it is given
    (before, they were buffered for an optimizer step that never came)."""
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], Any]:
        m, opt = _net()
        ctx = watch(m, opt, locate=False) if watched else None
        w = ctx.__enter__() if ctx is not None else None
        losses = _loop(m, opt, 2, w=w)
        opt2 = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses += _loop(m, opt2, 3, w=w)
        state = _state(m, opt2)
        if ctx is not None:
            w.step(torch.tensor(math.nan))
            _loop(m, opt2, 1, w=w)
            ctx.__exit__(None, None, None)
        return losses, state, w

    l0, s0, _ = run(False)
    l1, s1, w = run(True)
    assert l0 == l1 and _same(s0, s1) and w.disabled is None
    assert sum("optimizer" in s and "no longer" in s for s in _warnings(caplog)) == 1
    r = w.report()
    assert r.summary["anomaly_counts"].get("nonfinite-loss") == 1     # not buffered forever
    assert r.summary["steps"] >= 5


def test_a_clamp_after_each_step_is_not_a_rebuilt_optimizer(caplog) -> None:
    m, opt = _net()
    with watch(m, opt, locate=False) as w:
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            opt.zero_grad()
            loss = m(torch.randn(3, 4, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            with torch.no_grad():
                m[0].weight.clamp_(-0.3, 0.3)     # the user's own in-place update, once per step
            w.step(loss)
    assert not any("no longer" in s for s in _warnings(caplog)) and w.report().summary["steps"] == 5


def test_model_dtype_changed_mid_run(caplog) -> None:
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], Any]:
        m, _ = _net()
        opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)   # AdamW's fp32 state refuses fp16 params
        w = None
        ctx = watch(m, opt, locate=False) if watched else None
        if ctx is not None:
            w = ctx.__enter__()
        losses = _loop(m, opt, 2, w=w)
        m.half()
        losses += _loop(m, opt, 3, w=w, dtype=torch.float16)
        losses += _loop(m, opt, 1, w=w, dtype=torch.float16, bad=0)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return losses, _state(m, opt), w
    l0, s0, _ = run(False)
    l1, s1, w = run(True)
    assert l0[:5] == l1[:5] and _same(s0, s1)
    assert w.disabled is None and w.report().summary["steps"] == 6
    assert w.report().summary["anomaly_counts"], "the inf after the dtype change went unseen"


def test_fused_adamw() -> None:
    kw = {"fused": True}
    try:
        _net(kw)
    except (RuntimeError, ValueError):   # fused not supported on this build: foreach=False
        kw = {"foreach": False}
    m0, o0 = _net(kw)
    l0 = _loop(m0, o0, 6)
    m1, o1 = _net(kw)
    with pytest.raises(AnomalyError) as ei:
        with watch(m1, o1, on_anomaly="raise") as w:
            l1 = _loop(m1, o1, 4)
            before = _state(m1, o1)
            _loop(m1, o1, 1, bad=0)
    assert l0[:4] == l1 and w.disabled is None and ei.value.step == 4
    assert _same(before, _state(m1, o1))        # raised before the fused update wrote anything


class _Extra(nn.Module):
    """A module with extra state that is no tensor (a tokenizer-like object in a state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.meta: dict[str, Any] = {"vocab": {"a": 1}, "tags": {"x", "y"}, "fn": len}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> Any:
        return self.meta

    def set_extra_state(self, state: Any) -> None:
        self.meta = state


class _Uncopyable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.lock = threading.Lock()           # deepcopy raises TypeError: cannot pickle '_thread.lock'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("on_anomaly", ["raise", "skip", "warn"])
@pytest.mark.parametrize("make", [_Extra, _Uncopyable])
def test_unusual_models_keep_the_decision(make: Callable[[], nn.Module], on_anomaly, tmp_path, caplog) -> None:
    if make is _Uncopyable:
        with pytest.raises(TypeError):
            copy.deepcopy(make())

    def run(watched: bool) -> tuple[nn.Module, list[torch.Tensor], Any]:
        torch.manual_seed(0)
        m = make()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        w = None
        ctx = watch(m, opt, on_anomaly=on_anomaly, reproducer_dir=tmp_path / str(watched)) if watched else None
        if ctx is not None:
            w = ctx.__enter__()
        try:
            for i in range(4):
                x = torch.randn(3, 4, generator=g)
                if i == 2:
                    x[0, 0] = math.inf
                opt.zero_grad()
                loss = m(x).pow(2).mean()
                loss.backward()
                opt.step()
                if w is not None:
                    w.step(loss)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return m, _state(m, opt), w

    m0, s0, _ = run(False)
    if on_anomaly == "raise":
        with pytest.raises(AnomalyError):
            run(True)
        return
    m1, s1, w = run(True)
    assert w.disabled is None
    if on_anomaly == "skip":
        assert all(torch.isfinite(p).all() for p in m1.parameters())
        assert w.report().summary["steps_skipped_by_watch"] == 1
    else:
        assert _same(s0, s1)                # NaN in both: compare bit patterns
        assert w.report().summary["anomaly_counts"]
    assert list((tmp_path / "True").iterdir()), "no reproducer written"      # the state dict is saved either way
    if make is _Uncopyable:       # the replay needs a deep copy: logged once, the decision above still happened
        assert w._policy.replay_error is not None and "pickle" in w._policy.replay_error
        assert sum("replay" in s and "failed" in s for s in _warnings(caplog)) == 1
    else:                         # extra state that is no tensor does not stop the replay
        assert w._policy.replay_error is None and w._policy.replay_report is not None
