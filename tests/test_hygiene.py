"""No instrument leaves anything behind, whichever way its block is left, and none holds on to memory.

For ``trace``, ``diagnose`` and ``headroom``, after a normal exit and after an exception raised in the forward, in
the backward, in the optimizer step, in the loss function, and after a ``KeyboardInterrupt`` (a ``BaseException``,
not caught by ``except Exception``), these are as they were: every hook dictionary of every module, parameter and
optimizer, torch's process-wide module and optimizer hooks, the dispatch and function mode stacks, autocast
state, grad/inference/anomaly mode, default dtype, the RNG state, the instance attributes of the model and the
optimizer, and the functions an instrument could patch. Memory: 200 traced steps (each its own ``trace``)
do not accumulate records, and 2,000 steps under one ``watch`` keep no tensors.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
import weakref
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals
from torch import nn

import ampdoctor
from ampdoctor.precision import headroom
from ampdoctor.trace import OpRecord

MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                     "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")
OPTIMIZER_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                        "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                        "_optimizer_load_state_dict_post_hooks")
#: functions an instrument might be tempted to wrap; they must be the very same objects afterwards
PATCHABLE = {
    "Module.__call__": lambda: nn.Module.__call__, "Module._call_impl": lambda: nn.Module._call_impl,
    "Tensor.backward": lambda: torch.Tensor.backward, "autograd.backward": lambda: torch.autograd.backward,
    "Optimizer.zero_grad": lambda: torch.optim.Optimizer.zero_grad, "F.linear": lambda: F.linear,
    "F.layer_norm": lambda: F.layer_norm, "F.gelu": lambda: F.gelu, "torch.matmul": lambda: torch.matmul,
}


class Boom(RuntimeError):
    """The user's code failed."""


def _raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise Boom("backward")


class Net(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear; ``fail`` makes its forward raise, interrupt, or arm a backward error."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(OrderedDict(fc=nn.Linear(4, 8), act=nn.GELU()))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        self.fail = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.fail == "forward":
            raise Boom("forward")
        if self.fail == "interrupt":
            raise KeyboardInterrupt
        if self.fail == "backward":
            h.register_hook(_raise_in_backward)
        return self.head(self.norm(h))


class FailingSGD(torch.optim.SGD):
    """SGD whose step raises when its param group says ``fail`` (a group entry survives the copies diagnose makes;
    an instance attribute would not: an optimizer deep-copies through its state dict)."""

    def step(self, closure: Any = None) -> Any:  # noqa: ANN401
        if self.param_groups[0].get("fail"):
            raise Boom("optimizer")
        return super().step(closure)


def square_mean(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def failing_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    raise Boom("loss")


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything an instrument could leave behind, as comparable values."""
    s: dict[str, Any] = {}
    for name, mod in model.named_modules():
        s[f"{name}:type"] = type(mod)
        s[f"{name}:attrs"] = sorted(vars(mod))
        for attr in MODULE_HOOK_DICTS:
            s[f"{name}.{attr}"] = len(getattr(mod, attr))
    for name, p in model.named_parameters():
        s[f"{name}:tensor_hooks"] = len(p._backward_hooks or {})
        s[f"{name}:post_accumulate_hooks"] = len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        s[f"{name}:type"] = type(p)
    s["optimizer:attrs"] = sorted(vars(opt))
    for attr in OPTIMIZER_HOOK_DICTS:
        s[f"optimizer.{attr}"] = len(getattr(opt, attr))
    for attr in dir(module_globals):
        if attr.startswith("_global_") and isinstance(getattr(module_globals, attr), dict):
            s[f"torch.nn.modules.module.{attr}"] = len(getattr(module_globals, attr))
    for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        s[f"torch.optim.optimizer.{attr}"] = len(getattr(optimizer_globals, attr))
    s["dispatch_modes"] = torch._C._len_torch_dispatch_stack()
    s["function_modes"] = torch._C._len_torch_function_stack()
    s["autocast_cpu"] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    s["autocast_cache"] = torch.is_autocast_cache_enabled()
    s["grad_enabled"] = torch.is_grad_enabled()
    s["inference_mode"] = torch.is_inference_mode_enabled()
    s["anomaly_mode"] = torch.is_anomaly_enabled()
    s["default_dtype"] = torch.get_default_dtype()
    s["rng"] = torch.get_rng_state().tolist()
    for name, get in PATCHABLE.items():
        s[f"patched:{name}"] = id(get())
    s["patched:optimizer.step"] = id(type(opt).step)
    return s


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    keys = set(before) | set(after)
    return {k: (before.get(k), after.get(k)) for k in sorted(keys) if before.get(k) != after.get(k)}


@pytest.fixture
def setup() -> tuple[Net, FailingSGD, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = FailingSGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["fail"] = False
    x = torch.randn(6, 4)
    square_mean(model(x), x).backward()  # torch adds some attributes lazily on a first step: take it untraced
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, x


def _arm(model: Net, opt: FailingSGD, where: str) -> Any:
    """Make the step fail ``where``; returns the loss function to use."""
    model.fail = where if where in ("forward", "backward", "interrupt") else ""
    opt.param_groups[0]["fail"] = where == "optimizer"
    return failing_loss if where == "loss" else square_mean


WHERE = ("none", "forward", "backward", "optimizer", "loss", "interrupt")


@pytest.mark.parametrize("full", [False, True], ids=["cheap", "full"])
@pytest.mark.parametrize("where", WHERE)
def test_trace_leaves_nothing_behind(setup, where, full):
    model, opt, x = setup
    before = snapshot(model, opt)
    loss_fn = _arm(model, opt, where)
    expected = {"none": None, "interrupt": KeyboardInterrupt}.get(where, Boom)
    raised = None
    try:
        with ampdoctor.trace(model, opt, full=full) as t:
            loss_fn(model(x), x).backward()
            opt.step()
    except BaseException as e:  # noqa: BLE001 - the test checks which one
        raised = type(e)
    assert raised is expected
    if where == "none":
        assert len(t.result().records) > 20
    opt.zero_grad(set_to_none=True)
    model.fail = ""
    opt.param_groups[0]["fail"] = False
    assert diff(before, snapshot(model, opt)) == {}
    assert torch.isfinite(model(x)).all()  # the model still runs, with no stale module stack


@pytest.mark.parametrize("where", WHERE)
def test_diagnose_leaves_nothing_behind(setup, where):
    model, opt, x = setup
    before = snapshot(model, opt)
    loss_fn = _arm(model, opt, where)
    outcome: Any = None
    try:
        outcome = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=loss_fn, optimizer=opt, steps=2)
    except BaseException as e:  # noqa: BLE001 - the test checks which one
        outcome = e
    if where == "none":
        assert isinstance(outcome, ampdoctor.Report) and outcome.summary["steps"] == 2
    elif where == "interrupt":
        assert isinstance(outcome, KeyboardInterrupt)  # not swallowed as a crash of the step
    else:
        assert isinstance(outcome, ampdoctor.AmpDoctorError), outcome
        assert where in str(outcome)  # the user's own error message is passed on
    model.fail = ""
    opt.param_groups[0]["fail"] = False
    assert diff(before, snapshot(model, opt)) == {}


@pytest.mark.parametrize("where", ("none", "forward", "backward", "loss", "interrupt"))
def test_headroom_leaves_nothing_behind(setup, where):
    model, opt, x = setup
    before = snapshot(model, opt)
    loss_fn = _arm(model, opt, where)
    outcome: Any = None
    try:
        outcome = headroom(model, x, loss_fn=loss_fn)
    except BaseException as e:  # noqa: BLE001 - the test checks which one
        outcome = e
    if where == "interrupt":
        assert isinstance(outcome, KeyboardInterrupt)
    elif where in ("forward", "loss"):
        assert isinstance(outcome, ampdoctor.AmpDoctorError) and where in str(outcome)
    else:  # a failing backward is reported in the notes of the forward's headroom
        assert outcome.rows and ("backward" in " ".join(outcome.notes)) == (where == "backward")
    model.fail = ""
    assert diff(before, snapshot(model, opt)) == {}


# ---------------------------------------------------------------------------------------------- memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live(kind: type) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, kind))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS read from /proc (Linux)")
def test_repeated_traces_release_their_records():
    """200 steps, each in its own trace (both tiers): a dropped Trace frees its records; memory stays flat."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    dead: list[bool] = []

    def traced_step(i: int) -> int:
        with ampdoctor.trace(model, opt, full=i % 2 == 0) as t:
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
        n = len(t.result().records)
        ref = weakref.ref(t)
        del t
        dead.append(ref() is None)  # no reference cycle keeps a finished trace alive
        return n

    tracemalloc.start()  # from the start: caches that churn (torch's dispatch and autograd) then net out
    try:
        for i in range(120):  # caches settle over the first ~100 steps
            traced_step(i)
        gc.collect()
        rss0 = _rss_bytes()
        mid = tracemalloc.take_snapshot()
        n = sum(traced_step(i) for i in range(120, 200))
        gc.collect()
        end = tracemalloc.take_snapshot()
        rss1 = _rss_bytes()
    finally:
        tracemalloc.stop()
    growth = sum(s.size_diff for s in end.compare_to(mid, "filename"))
    assert n > 80 * 20  # every step was recorded...
    assert len(dead) == 200 and all(dead) and _live(OpRecord) == 0  # ...and every record was released
    # one leaked step keeps > 20 records with their statistics (> 10 KiB): 80 steps stay far under 64 KiB
    assert growth < 64 * 1024, growth
    assert rss1 - rss0 < 16 * 2**20, rss1 - rss0


def test_watch_keeps_no_tensors_over_2000_steps():
    """A long watched loop keeps one small per-step record (no tensor, no graph) and nothing else."""
    import ampdoctor.watch as watch  # our own module: an import error is a failure, not a skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    with watch(model, opt) as w:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            w.step(loss)

        for _ in range(300):
            step()
        gc.collect()
        tensors0 = _live(torch.Tensor)
        tracemalloc.start()
        try:
            mid = tracemalloc.take_snapshot()
            for _ in range(1700):
                step()
            gc.collect()
            end = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        tensors1 = _live(torch.Tensor)
    growth = sum(s.size_diff for s in end.compare_to(mid, "filename"))
    assert w.disabled is None and w.report().summary["steps"] == 2000
    assert tensors1 - tensors0 <= 2, (tensors0, tensors1)  # the last step's loss/inputs at most
    # the per-step history (a StepRecord of floats, capped by the watch) is all that grows: < 512 B a step
    assert growth < 1700 * 512, growth
