"""The watch's parts on their own: GradScaler's private state in one place, typed readback, the detector
registry, typed options, construction-time errors, hooks that never travel with a copy of the model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from ampdoctor.watch import WatchOptions, watch
from ampdoctor.watch._detectors import detector
from ampdoctor.watch._record import GradNorms, LossValue, Readback, StepRecord
from ampdoctor.watch._scaler import GradScalerView, _internals


def _step(model: nn.Module, opt: torch.optim.Optimizer, sc: torch.amp.GradScaler, x: torch.Tensor) -> None:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()


def test_gradscaler_internals_the_watch_relies_on() -> None:
    """Pins, for this torch version, every private GradScaler attribute read by ``_scaler._internals``."""
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    view = GradScalerView(sc)
    assert view.scale_copy() is None                 # no scale() yet
    token0 = view.token()
    _step(m, opt, sc, torch.randn(2, 4))
    inner = _internals(sc)
    assert isinstance(inner.scale, torch.Tensor) and inner.device == "cpu"
    assert view.token() is not token0                 # update() rebinds the per-optimizer states
    assert float(view.scale_copy()) == float(sc.get_scale())
    # a skipped step: STEPPED reached in the scaler iteration, the optimizer's step never ran
    token1 = view.token()
    sc.scale(m(torch.full((2, 4), float("inf"))).sum()).backward()
    sc.step(opt)
    assert view.stepped_in(view.token(), opt)
    sc.update()
    assert view.token() is not token1
    assert float(view.scale_before_backoff()) == 2.0 ** 10
    assert view.backoff_factor == 0.5


def test_readback_reads_every_pending_value_once() -> None:
    rb = Readback()
    rec = StepRecord(3)
    rb.add(LossValue(torch.tensor([2.5]), rec))
    rb.add(GradNorms(torch.tensor([1.0, float("inf")]), rec, ("a", "b")))
    out = rb.read()
    assert [(type(p).__name__, v) for p, v in out] == [("LossValue", [2.5]), ("GradNorms", [1.0, float("inf")])]
    assert len(rb) == 0 and rb.read() == []


def test_detector_names_are_unique() -> None:
    with pytest.raises(ValueError, match="already registered"):
        detector("loss", object)(lambda e, s: [])


def test_typed_options_reject_typos_at_construction(tmp_path) -> None:
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'warn', 'raise', 'skip', 'replay'"):
        watch(m, on_anomaly="rasie")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="locate must be a bool"):
        WatchOptions(locate="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collapse_skip_rate"):
        WatchOptions(collapse_skip_rate=1.5)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        watch(m, reproducer_dir=f / "sub")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="not writable"):
            watch(m, tensorboard=ro / "tb")


def test_watch_used_without_with_is_a_clear_error() -> None:
    m = nn.Linear(2, 2)
    w = watch(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="with ampdoctor.watch"):
        w.step(torch.tensor(1.0))


def test_a_copy_of_a_watched_model_carries_no_watch() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with watch(m, opt, tensorboard=None) as w:
        clone = copy.deepcopy(m)
        hooks = [h for mod in clone.modules() for h in mod._forward_pre_hooks.values()]
        assert hooks and all(getattr(h, "_ampdoctor_hook", False) for h in hooks)
        assert all(h.fn.__self__ is w._tracker for h in hooks)   # shared, not a copied watch
    assert not any(mod._forward_pre_hooks for mod in m.modules())


def test_diagnose_of_a_watched_model_runs_without_the_watch(tmp_path) -> None:
    import ampdoctor

    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with watch(m, opt, tensorboard=tmp_path / "tb") as w:
        r = ampdoctor.diagnose(m, x, precision="bf16-amp", optimizer=opt)
        assert r.precision == "bf16-amp"
        assert w._tracker.n_steps == 0 and w._tracker.it.call is None     # the copy's steps never reached it
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    assert w.report().summary["steps"] == 1
