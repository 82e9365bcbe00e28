"""What a diagnosis runs: a validated :class:`StepSpec`, from arguments or from a scenario file."""

from __future__ import annotations

import ast
import collections.abc
import importlib.util
import inspect
import os
import sys
import types
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import ScenarioError
from ampdoctor.precision._distributed import copy_limitation
from ampdoctor.precision.fp8 import Fp8Recipe

#: Precisions a step can run in. ``None`` runs the step as given (it may cast or autocast itself).
PRECISIONS: tuple[str | None, ...] = (None, "fp16", "bf16", "fp16-amp", "bf16-amp", "fp8", "fp8-e4m3", "fp8-e5m2")
#: Upper bound on ``steps``: every step's op records stay in memory until the analysis (memory grows linearly with
#: steps), so a diagnosis of more steps would exhaust memory instead of finishing. Failures that need more steps
#: to appear are the watch's job (``ampdoctor.watch``), which keeps a bounded window.
MAX_STEPS = 1000


@dataclass(frozen=True)
class StepSpec:
    """A validated description of the step(s) to diagnose. Field meanings follow the scenario contract."""

    model: nn.Module
    batch: Any = None
    precision: str | None = None
    loss_fn: Any = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: Any = None
    train_step: Any = None
    steps: int = 1
    source: str = ""
    #: callables ``fn(model, optimizer, scaler)`` applied to the run's copies after the precision cast, in the
    #: reference and the target run alike (how :mod:`ampdoctor.fixes` applies a fix without editing source)
    transforms: tuple[Any, ...] = ()
    #: the :class:`~ampdoctor.precision.fp8.Fp8Recipe` of an fp8 precision's target run; ``None``: ``Fp8Recipe()``
    #: in the precision's format
    fp8_recipe: Fp8Recipe | None = None


#: The fp8 format each fp8 precision runs in.
FP8_FORMATS: dict[str, str] = {"fp8": "hybrid", "fp8-e4m3": "e4m3", "fp8-e5m2": "e5m2"}


def _check_fp8_recipe(recipe: Any, precision: str | None) -> None:
    """An :class:`Fp8Recipe` for an fp8 precision of its own format."""
    if recipe is None:
        return
    if not isinstance(recipe, Fp8Recipe):
        raise ScenarioError(
            f"fp8_recipe must be an ampdoctor.precision.Fp8Recipe, got {type(recipe).__name__}; e.g. "
            "fp8_recipe=Fp8Recipe(scaling='delayed', amax_history_len=16, margin=0) (the fields of Transformer "
            "Engine's DelayedScaling)")
    if precision not in FP8_FORMATS:
        raise ScenarioError(
            f"fp8_recipe is given but precision is {precision!r}; a recipe applies to an fp8 run: pass "
            f"precision={_fp8_precision(recipe.format)!r}")
    if FP8_FORMATS[precision] != recipe.format:
        raise ScenarioError(
            f"fp8_recipe has format {recipe.format!r} but precision {precision!r} runs {FP8_FORMATS[precision]!r}; "
            f"pass precision={_fp8_precision(recipe.format)!r} for this recipe")


def _fp8_precision(fmt: str) -> str:
    return next(p for p, f in FP8_FORMATS.items() if f == fmt)


def _check_batch_binds(model: nn.Module, batch: Any) -> None:
    inner = getattr(model, "module", None)
    target: Any = inner if isinstance(inner, nn.Module) else model
    try:
        sig = inspect.signature(target.forward)
    except (TypeError, ValueError):
        return
    try:
        if isinstance(batch, dict):
            sig.bind(**batch)
        elif isinstance(batch, (tuple, list)):
            sig.bind(*batch)
        elif batch is not None:
            sig.bind(batch)
    except TypeError as e:
        if isinstance(batch, dict):
            kind = "dict (passed as model(**batch))"
        elif isinstance(batch, (tuple, list)):
            kind = "tuple/list (passed as model(*batch))"
        else:
            kind = "single value (model(batch))"
        raise ScenarioError(
            f"the batch does not fit {type(target).__name__}.forward{sig}: {e}. The batch is a {kind}; "
            "pass the inputs the model's forward takes (a dict of keyword arguments, a tuple of positional ones, "
            "or one tensor)"
        ) from None


def check_steps(steps: Any) -> int:
    """``steps`` as a validated int in ``1..MAX_STEPS``; raises :class:`ScenarioError` saying what to pass."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ScenarioError(f"steps must be a positive int, got {steps!r}")
    if steps > MAX_STEPS:
        raise ScenarioError(
            f"steps must be at most {MAX_STEPS}, got {steps}: a diagnosis keeps every step's trace in memory. "
            "Diagnose the few steps around the failure (save the model and batch just before it), or watch the "
            "whole run with ampdoctor.watch(...)")
    return steps


def _quantized(model: nn.Module) -> bool:
    """The model holds quantized weights (``torch.ao.quantization``): packed or quantized tensors in its state."""
    try:
        state = model.state_dict()
    except Exception:  # noqa: BLE001 - a state_dict hook failing is not this check's business
        return False
    stack: list[Any] = list(state.values())
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor) and v.is_quantized:
            return True
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, torch.ScriptObject):
            return True  # packed quantized parameters (LinearPackedParams and the like)
    return False


def _check_batch_values(batch: Any) -> None:
    """Reject batches that cannot be run several times on copies: generators/iterators, and no data at all."""
    stack: list[tuple[Any, int]] = [(batch, 0)]
    tensors: list[torch.Tensor] = []
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, (types.GeneratorType, collections.abc.Iterator)) or (
                depth == 0 and type(obj).__name__ == "DataLoader"):
            raise ScenarioError(
                f"the batch holds a {type(obj).__name__} ({'the batch itself' if depth == 0 else 'inside it'}); "
                "ampdoctor runs the step several times on copies, so pass materialised inputs, e.g. "
                "batch = next(iter(loader)) or list(generator)")
        elif depth < 6 and isinstance(obj, (tuple, list)):
            stack.extend((o, depth + 1) for o in obj)
        elif depth < 6 and isinstance(obj, dict):
            stack.extend((o, depth + 1) for o in obj.values())
    for t in tensors:
        if t.is_meta:
            raise ScenarioError("the batch holds meta tensors (no data); pass real tensors")
    if tensors and all(t.numel() == 0 for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors[:3])
        raise ScenarioError(f"the batch is empty (its tensors have no elements: {shapes}); pass at least one sample")


def _check_model(model: Any) -> None:
    """A module the runner can copy and trace op by op."""
    if not isinstance(model, nn.Module):
        raise ScenarioError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; pass the model object itself "
            "(a scenario's make() must return {'model': <nn.Module>, ...})"
        )
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise ScenarioError(
            "model is a torch.compile()d module; compiled graphs hide the individual ops. Pass the original module "
            "(model._orig_mod) to diagnose it"
        )
    why = copy_limitation(model)
    if why is not None:
        raise ScenarioError(why)


def _check_weights(model: nn.Module) -> None:
    """Weights with data, some of them floating-point."""
    params = list(model.parameters()) + list(model.buffers())
    if any(p.is_meta for p in params):
        raise ScenarioError(
            "model has parameters or buffers on the meta device (no data to run); materialise the weights first, "
            "e.g. model.to_empty(device='cpu') then load_state_dict(...), or build it outside `init_empty_weights()`"
        )
    if (params and not any(p.is_floating_point() for p in params)) or _quantized(model):
        raise ScenarioError(
            "model has no floating-point parameters or buffers (int-only or quantized); mixed-precision diagnosis "
            "needs a floating-point model (diagnose the float model before quantization)"
        )


def _check_optimizer(model: nn.Module, optimizer: Any, *, trains_itself: bool) -> None:
    """An optimizer over this model's parameters that trains something (unless a train_step does its own)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ScenarioError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    own = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ScenarioError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of this model; build the "
            "optimizer from model.parameters() of the model you pass"
        )
    if not trains_itself and not any(p.requires_grad for g in optimizer.param_groups for p in g["params"]):
        raise ScenarioError(
            "an optimizer was given but none of its parameters requires grad (model.requires_grad_(False)?), so "
            "no step would train anything; unfreeze the parameters you train, or pass no optimizer for a "
            "forward-only diagnosis"
        )


def make_spec(
    model: Any,
    batch: Any = None,
    *,
    precision: str | None = None,
    loss_fn: Any = None,
    optimizer: Any = None,
    scaler: Any = None,
    train_step: Any = None,
    steps: int = 1,
    source: str = "",
    fp8_recipe: Any = None,
) -> StepSpec:
    """Validate user input; raises :class:`ScenarioError` (or TypeError) saying what to do. Changes nothing.

    The checks run in this order (the first problem is the one reported): the model, the precision, the model's
    weights, the fp8 recipe, the callables, the optimizer, the scaler, the steps, the batch."""
    _check_model(model)
    if precision not in PRECISIONS:
        allowed = ", ".join(repr(p) for p in PRECISIONS)
        raise ScenarioError(f"invalid precision {precision!r}, expected one of {allowed}")
    _check_weights(model)
    _check_fp8_recipe(fp8_recipe, precision)
    if loss_fn is not None and not callable(loss_fn):
        raise ScenarioError(f"loss_fn must be callable as loss_fn(output, batch) -> scalar Tensor, got {loss_fn!r}")
    if train_step is not None and not callable(train_step):
        raise ScenarioError(f"train_step must be callable as train_step(model, batch), got {train_step!r}")
    if optimizer is not None:
        _check_optimizer(model, optimizer, trains_itself=train_step is not None)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ScenarioError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    check_steps(steps)
    if isinstance(batch, dict) and not batch:
        raise ScenarioError("the batch is an empty dict; pass the model's inputs (e.g. {'input_ids': ids})")
    if isinstance(batch, (tuple, list)) and not batch:
        raise ScenarioError("the batch is an empty tuple/list; pass the model's positional inputs")
    _check_batch_values(batch)
    if train_step is None:
        _check_batch_binds(model, batch)
    return StepSpec(model, batch, precision, loss_fn, optimizer, scaler, train_step, steps, source,
                    fp8_recipe=fp8_recipe)


def _defines_make(path: str) -> bool | None:
    """Whether the file binds ``make`` at module level, read without running it (None: cannot tell)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return None  # importing it gives the precise error
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == "make":
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name).split(".")[0] == "make":
                    return None if alias.name == "*" else True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == "make" for t in targets for n in ast.walk(t)):
                return True
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for fld in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, fld, []) or []:
                    stack.extend(child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child])
    return False


def _no_make(path: str) -> ScenarioError:
    return ScenarioError(
        f"scenario {path!r} defines no make(); a scenario file must define make() returning "
        "{'model': ..., 'batch': ..., ...}. To watch a plain training script instead, run "
        f"`ampdoctor run -- python {path}`"
    )


def _exit_message(e: SystemExit, where: str) -> ScenarioError:
    return ScenarioError(
        f"the scenario called sys.exit({e.code!r}) {where}; guard script code with `if __name__ == '__main__':` so "
        "that importing the file only defines make()"
    )


def load_scenario_module(path: str) -> Any:
    """Import a scenario file as a fresh module (not added to ``sys.modules``).

    A file that binds no ``make`` at module level is refused before it runs (a plain training script would run
    its whole loop); ``sys.exit`` while importing is a :class:`ScenarioError`, not an exit.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ScenarioError(f"scenario path must be a string or path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ScenarioError(f"scenario file not found: {path!r}; pass the path of a .py file that defines make()")
    name = f"_ampdoctor_scenario_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ScenarioError(f"cannot import {path!r} as Python; a scenario is a .py file that defines make()")
    if _defines_make(path) is False:
        raise _no_make(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling need the module registered while it loads
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        raise _exit_message(e, "while importing") from None
    except Exception as e:
        raise ScenarioError(f"importing scenario {path!r} failed: {type(e).__name__}: {e}; run it with "
                            f"`python {path}` to see the traceback and fix the file") from e
    finally:
        sys.modules.pop(name, None)
    if not callable(getattr(module, "make", None)):
        raise _no_make(path)
    return module


_SPEC_KEYS = ("model", "batch", "loss_fn", "precision", "optimizer", "scaler", "train_step", "steps", "fp8_recipe")


def spec_from_module(module: Any, source: str = "", **overrides: Any) -> StepSpec:
    """Call ``module.make()`` and validate what it returns; ``overrides`` replace its keys."""
    try:
        made = module.make()
    except SystemExit as e:
        raise _exit_message(e, "in make()") from None
    except Exception as e:
        where = source or getattr(module, "__file__", "") or repr(module)
        raise ScenarioError(f"make() of scenario {where!r} raised {type(e).__name__}: {e}; call make() yourself "
                            f"(python -c \"import runpy; runpy.run_path({where!r})['make']()\") to see the "
                            "traceback and fix make()") from e
    if not isinstance(made, dict) or "model" not in made:
        raise ScenarioError(
            f"make() of {source!r} must return a dict with at least 'model', got {type(made).__name__}"
        )
    unknown = sorted(set(made) - set(_SPEC_KEYS))
    if unknown:
        raise ScenarioError(f"make() returned unknown keys {unknown}; allowed keys are {list(_SPEC_KEYS)}")
    bad = sorted(set(overrides) - set(_SPEC_KEYS))
    if bad:
        raise ScenarioError(f"unknown override(s) {bad}; allowed: {list(_SPEC_KEYS)}")
    kw = {k: made[k] for k in _SPEC_KEYS if k in made}
    kw.update({k: v for k, v in overrides.items()})
    model = kw.pop("model")
    batch = kw.pop("batch", None)
    return make_spec(model, batch, source=source, **kw)

