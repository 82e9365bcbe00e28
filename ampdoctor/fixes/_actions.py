"""Fix actions: one registered builder per fix id, turning a proposal's ``params`` into a :class:`FixPlan`.

A plan changes a run without editing the user's source: ``transforms`` are callables ``fn(model, optimizer,
scaler)`` applied to the run's copies after the precision cast (see :class:`ampdoctor.precision.StepSpec`),
``spec_changes`` replace fields of the step (``precision``, ``scaler``), ``training_changes`` are what the user's
loop must do that no model change can (a new optimizer group, a GradScaler).

The transforms themselves (module scopes, torch-function modes, parameter dtypes) are :mod:`ampdoctor.fixes._scope`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ampdoctor.fixes._scope import (
    FP16_CLAMP,
    OP_FAMILIES,
    ClampOutputs,
    ExcludeParameters,
    Fp32Master,
    KeepFp32,
    KeepFp32Buffers,
    ScopedMode,
    map_tensors,
    op_names,
    scopes_of,
)
from ampdoctor.precision import AMP_DTYPES, FP8_FORMATS, LOW_DTYPES, Fp8Recipe
from ampdoctor.trace import HALF_DTYPES, dtype_name

log = logging.getLogger(__name__)

_PRECISION_DTYPE = {**LOW_DTYPES, **AMP_DTYPES}


# ---------------------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class FixContext:
    """What a builder may look at: the diagnosed setting, never the data.

    ``precision``: the precision of the failing run; ``module``: the finding's module (default scope of
    module-scoped fixes); ``param_dtype``: the lowest floating dtype among the model's parameters as given
    (``"float16"`` when the user called ``.half()`` themselves).
    """

    precision: str | None = None
    module: str = ""
    device_type: str = "cpu"
    param_dtype: str = "float32"
    has_scaler: bool = False
    has_train_step: bool = False
    #: the user's model as given (read only: a builder may copy values from it, e.g. fp32 buffers)
    model: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, model: nn.Module, precision: str | None, module: str = "", scaler: Any = None,
           train_step: Any = None) -> FixContext:
        dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
        low = next((d for d in HALF_DTYPES if d in dtypes), torch.float32)
        dev = next((p.device.type for p in model.parameters()), "cpu")
        return cls(precision, module, dev, dtype_name(low), scaler is not None, train_step is not None, model)


@dataclass(frozen=True)
class FixPlan:
    """One fix, ready to apply: transforms for the run's copies, step changes, and what to tell the user."""

    id: str
    params: dict[str, Any]
    description: str
    snippet: str
    transforms: tuple[Callable[..., None], ...] = ()
    spec_changes: dict[str, Any] = field(default_factory=dict)
    training_changes: tuple[Any, ...] = ()


@dataclass(frozen=True)
class FixAction:
    """A registered fix: ``build(params, ctx) -> FixPlan``; ``params`` names the arguments it accepts."""

    id: str
    summary: str
    params: tuple[str, ...]
    build: Callable[[dict[str, Any], FixContext], FixPlan]


#: Fix id -> action. Filled by :func:`register_fix`; one action per id.
FIXES: dict[str, FixAction] = {}


def register_fix(fix_id: str, *, summary: str, params: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """Register ``fn(params, ctx) -> FixPlan`` as the action for ``fix_id``; a second one for the id raises."""
    if not isinstance(fix_id, str) or not fix_id:
        raise ValueError(f"fix id must be a non-empty str, got {fix_id!r}")

    def deco(fn: Callable[[dict[str, Any], FixContext], FixPlan]) -> Callable[[dict[str, Any], FixContext], FixPlan]:
        if fix_id in FIXES:
            raise ValueError(f"a fix action for {fix_id!r} is already registered ({FIXES[fix_id].build.__qualname__})")
        FIXES[fix_id] = FixAction(fix_id, summary, params, fn)
        return fn

    return deco


def build_plan(fix_id: str, params: dict[str, Any] | None, ctx: FixContext) -> FixPlan:
    """Validate ``fix_id`` and ``params`` and build the plan; raises ValueError saying what is allowed."""
    if fix_id not in FIXES:
        raise ValueError(f"unknown fix {fix_id!r}; registered fixes: {', '.join(sorted(FIXES))}")
    action = FIXES[fix_id]
    params = dict(params or {})
    unknown = sorted(set(params) - set(action.params))
    if unknown:
        raise ValueError(f"fix {fix_id!r} got unknown parameter(s) {unknown}; it accepts {list(action.params)}")
    return action.build(params, ctx)


def modules_param(params: dict[str, Any], ctx: FixContext, fix_id: str) -> list[str]:
    mods = params.get("modules")
    if mods is None and params.get("module") is not None:
        mods = [params["module"]]
    if mods is None:
        mods = [ctx.module] if ctx.module else None
    if not mods or isinstance(mods, str) or not all(isinstance(m, str) for m in mods):
        raise ValueError(f"fix {fix_id!r} needs params['modules']: a list of module names from "
                         f"model.named_modules(), got {mods!r}")
    return list(dict.fromkeys(mods))


# ---------------------------------------------------------------------------------------------------------------
# the actions


def _qual(mods: list[str]) -> str:
    return ", ".join(f"`{m or '<root>'}`" for m in mods)


@register_fix("keep_fp32", summary="run named modules in float32 (autocast off, inputs upcast, fp32 weights)",
              params=("modules", "module", "outputs"))
def keep_fp32(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = modules_param(params, ctx, "keep_fp32")
    outputs = params.get("outputs", "model dtype")
    if outputs not in ("model dtype", "float32"):
        raise ValueError(f"fix 'keep_fp32': params['outputs'] must be 'model dtype' (cast back after a whole-model "
                         f"cast, the default) or 'float32' (a module whose output is the model's), got {outputs!r}")
    whole, fp32_out = ctx.precision in ("fp16", "bf16"), outputs == "float32"
    desc = f"run {_qual(mods)} in float32: autocast disabled inside, inputs upcast to float32"
    if whole and fp32_out:
        desc += ", parameters kept float32 after the model cast, outputs left in float32 (the model's output)"
    else:
        desc += (", parameters kept float32 after the model cast, outputs cast back to the model's dtype" if whole
                 else ", outputs left in float32 for autocast to narrow where the next op runs in low precision")
    params_out: dict[str, Any] = {"modules": mods, **({"outputs": outputs} if fp32_out else {})}
    transform = KeepFp32(tuple(mods), fp32_outputs=fp32_out)
    m0 = mods[0]
    if str(ctx.precision).startswith("fp8"):  # fp8: the module's linears leave fp8 and run unquantised
        desc = f"run {_qual(mods)} outside fp8: its linears unquantised, in float32"
        return FixPlan("keep_fp32", params_out, desc,
                       "import transformer_engine.pytorch as te\n\n"
                       f"module = model.get_submodule({m0!r})\nforward = module.forward\n\n"
                       "def forward_high_precision(*args, **kwargs):\n"
                       "    with te.fp8_autocast(enabled=False):\n        return forward(*args, **kwargs)\n\n"
                       "module.forward = forward_high_precision", (transform,))
    snippet = (f"module = model.get_submodule({m0!r})\n"
               "forward = module.forward\n\n"
               "def forward_fp32(*args, **kwargs):\n"
               "    dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)\n"
               "    args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]\n"
               "    with torch.autocast(device_type, enabled=False):\n"
               "        out = forward(*args, **kwargs)\n"
               + ("    return out.to(dtype) if dtype is not None else out\n\n" if whole and not fp32_out
                  else "    return out\n\n")
               + ("module.float()  # after model.half(): keep this module's weights in fp32\n" if whole else "")
               + "module.forward = forward_fp32")
    return FixPlan("keep_fp32", params_out, desc, snippet, (transform,))


@register_fix("switch_precision", summary="train in another precision (bf16 / bf16-amp: fp32's exponent range)",
              params=("precision",))
def switch_precision(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    target = params.get("precision")
    allowed = ("bf16", "bf16-amp", "fp16-amp", "fp16")
    if target not in allowed:
        raise ValueError(f"switch_precision needs params['precision'] in {allowed}, got {target!r}")
    if target.endswith("-amp"):
        dt = "bfloat16" if target.startswith("bf16") else "float16"
        snippet = f"with torch.autocast(device_type, dtype=torch.{dt}):\n    loss = loss_fn(model(**batch), batch)"
        if dt == "bfloat16":
            snippet += "\n# bf16 has fp32's exponent range: a GradScaler is not needed"
        changes: tuple[Any, ...] = (snippet,)
    else:
        dt = "bfloat16" if target == "bf16" else "float16"
        snippet = f"model = model.to(torch.{dt})"
        changes = (snippet,)
    desc = f"run in {target} instead of {ctx.precision or 'the precision the step chose itself'}"
    if ctx.has_train_step and ctx.precision is None:
        desc += " (a train_step that enters its own torch.autocast keeps its own dtype: change it there)"
    return FixPlan("switch_precision", {"precision": target}, desc, snippet, (), {"precision": target}, changes)


@register_fix("fp8_recipe", summary="run fp8 with another recipe (a margin, current scaling, a history length)",
              params=("format", "scaling", "amax_history_len", "margin", "amax_floor"))
def fp8_recipe(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    """A step change: the fp8 run's :class:`~ampdoctor.precision.Fp8Recipe` built from ``params`` (the fields the
    finding read from the diagnosed recipe, with the change it proposes); the format defaults to the precision's."""
    if ctx.precision not in FP8_FORMATS:
        raise ValueError(f"fp8_recipe changes the recipe of an fp8 run; the diagnosed precision is {ctx.precision!r} "
                         f"(one of {', '.join(map(repr, FP8_FORMATS))} is needed)")
    fields = {"format": FP8_FORMATS[ctx.precision], **params}
    recipe = Fp8Recipe(**fields)  # ValueError naming the field for a bad value
    if recipe.format != FP8_FORMATS[ctx.precision]:
        raise ValueError(f"fp8_recipe format {recipe.format!r} does not match precision {ctx.precision!r}")
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    fmt_name = recipe.format.upper()
    if recipe.scaling == "delayed":
        te_scaling = (f"DelayedScaling(fp8_format=Format.{fmt_name}, amax_history_len={recipe.amax_history_len}, "
                      f"amax_compute_algo='max', margin={recipe.margin})")
    else:
        te_scaling = f"Float8CurrentScaling(fp8_format=Format.{fmt_name})  # the scale from each tensor's own amax"
    snippet = (f"# Transformer Engine\nrecipe = {te_scaling}\nwith te.fp8_autocast(enabled=True, fp8_recipe=recipe):\n"
               "    loss = loss_fn(model(**batch), batch)\n"
               f"# ampdoctor: diagnose(..., precision={ctx.precision!r}, fp8_recipe=Fp8Recipe({args}))")
    desc = (f"run fp8 with {recipe.scaling} scaling, margin {recipe.margin}"
            + (f", amax history {recipe.amax_history_len}" if recipe.scaling == "delayed" else ""))
    return FixPlan("fp8_recipe", fields, desc, snippet, (), {"fp8_recipe": recipe}, (snippet,))


@register_fix("clamp", summary="clamp a module's output to ±(fp16 max - 1000) whatever its dtype",
              params=("modules", "module", "bound"))
def clamp(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = modules_param(params, ctx, "clamp")
    bound = params.get("bound", FP16_CLAMP)
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (0 < bound < math.inf):
        raise ValueError(f"clamp needs a positive finite params['bound'], got {bound!r}")
    bound = float(bound)
    desc = (f"clamp the output of {_qual(mods)} to ±{bound:g} whatever its dtype (values beyond are saturated; "
            "an fp32 residual stream is clamped too, unlike T5's `if dtype == float16` guard)")
    snippet = (f"model.get_submodule({mods[0]!r}).register_forward_hook(\n"
               f"    lambda mod, args, out: out.clamp(-{bound:g}, {bound:g}))")
    return FixPlan("clamp", {"modules": mods, "bound": bound}, desc, snippet, (ClampOutputs(tuple(mods), bound),))


@register_fix("safe_mask", summary="finite, dtype-aware mask constants and a softmax that zeroes fully masked rows",
              params=("modules", "module"))
def safe_mask(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = modules_param(params, ctx, "safe_mask")
    desc = (f"inside {_qual(mods)}: mask constants below the dtype's range (-1e9 in fp16, -inf) become "
            "torch.finfo(dtype).min of the tensor they are written into, -inf entries of additive masks too, and a "
            "softmax over a fully masked (-inf) row returns 0 for that row")
    snippet = ("scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)\n"
               "probs = scores.softmax(-1).masked_fill(~allowed.any(-1, keepdim=True), 0.0)")
    return FixPlan("safe_mask", {"modules": mods}, desc, snippet, (ScopedMode(tuple(mods), "safe_mask"),))


@register_fix("upcast_op", summary="run one op family (softmax, norm, loss, exp, tanh, sigmoid) in float32 inside "
              "named modules", params=("modules", "module", "ops", "op"))
def upcast_op(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    mods = modules_param(params, ctx, "upcast_op")
    ops = params.get("ops")
    if ops is None and params.get("op") is not None:
        ops = [params["op"]]
    if not ops or isinstance(ops, str) or not all(isinstance(o, str) for o in ops):
        raise ValueError(f"upcast_op needs params['ops']: a list of op families ({', '.join(OP_FAMILIES)}) or op "
                         f"names, got {ops!r}")
    names = op_names(ops)
    desc = (f"inside {_qual(mods)}, run {', '.join(sorted(names))} in float32 (inputs upcast, autocast off); "
            "bounded results go back to the inputs' dtype, statistics stay float32")
    first = sorted(names)[0]
    snippet = f"y = torch.{first}(x.float(), ...)  # instead of torch.{first}(x, ...) in {mods[0]}"
    if "tanh" in names:
        snippet = "y = torch.tanh(x.float()).to(x.dtype)  # the backward keeps fp32's 1 - y**2"
    elif "softmax" in names:
        snippet = "probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)"
    elif "pow" in names:
        snippet = "variance = x.float().pow(2).mean(-1, keepdim=True)\nx = x * torch.rsqrt(variance + eps)"
    return FixPlan("upcast_op", {"modules": mods, "ops": list(ops)}, desc, snippet,
                   (ScopedMode(tuple(mods), "upcast", tuple(sorted(names.items()))),))


@register_fix("exclude_unused", summary="leave parameters that get no gradient out of training",
              params=("parameters",))
def exclude_unused(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    names = params.get("parameters")
    if not names or isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"exclude_unused needs params['parameters']: a list of names from model.named_parameters(), "
                         f"got {names!r}")
    names = list(dict.fromkeys(names))
    desc = (f"freeze {len(names)} parameter(s) that never get a gradient ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) and leave them out of the optimizer")
    snippet = (f"unused = {set(names)!r}\n"
               "for name, p in model.named_parameters():\n"
               "    if name in unused:\n"
               "        p.requires_grad_(False)")
    opt = ("optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=...)  "
           "# build it (and any DDP wrapper) after freezing")
    build = "or build the model without the unused module (a constructor option, or delete it before training)"
    return FixPlan("exclude_unused", {"parameters": names}, desc, snippet, (ExcludeParameters(tuple(names)),), {},
                   (opt, build))


def _scaler_snippet(init_scale: float, growth_interval: int) -> str:
    return (f"scaler = torch.amp.GradScaler(device_type, init_scale={init_scale:g}, "
            f"growth_interval={growth_interval})\n"
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()")


@register_fix("loss_scaling", summary="dynamic loss scaling (GradScaler) with fp32 master weights",
              params=("init_scale", "growth_interval"))
def loss_scaling(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    init_scale = params.get("init_scale", 2.0 ** 16)
    growth = params.get("growth_interval", 2000)
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not (0 < init_scale < math.inf):
        raise ValueError(f"loss_scaling needs a positive finite init_scale, got {init_scale!r}")
    if isinstance(growth, bool) or not isinstance(growth, int) or growth < 1:
        raise ValueError(f"loss_scaling needs a positive int growth_interval, got {growth!r}")
    scaler = torch.amp.GradScaler(ctx.device_type, init_scale=float(init_scale), growth_interval=growth)
    changes: dict[str, Any] = {"scaler": scaler}
    transforms: tuple[Any, ...] = ()
    desc = f"scale the loss with a GradScaler (init_scale {init_scale:g}, growth_interval {growth})"
    fp16_params = ctx.precision == "fp16" or (ctx.precision is None and ctx.param_dtype == "float16")
    if fp16_params:
        # GradScaler refuses fp16 gradients, and an unscaled fp16 gradient underflows again: fp32 master weights.
        changes["precision"] = "fp16-amp"
        transforms = (Fp32Master(),)
        desc += "; the parameters become float32 master weights and fp16 comes from autocast (fp16-amp)"
    elif ctx.precision in ("bf16", "bf16-amp"):
        desc += " (bf16 rarely needs it: its range is fp32's)"
    if ctx.has_train_step:
        desc += "; a train_step that builds its own GradScaler must use these settings itself"
    snippet = _scaler_snippet(float(init_scale), growth)
    return FixPlan("loss_scaling", {"init_scale": float(init_scale), "growth_interval": growth}, desc, snippet,
                   transforms, changes, (scaler, snippet))


@register_fix("grad_scaler", summary="loss_scaling under the id the underflow rules propose",
              params=("init_scale", "growth_interval"))
def grad_scaler(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    return replace(loss_scaling(params, ctx), id="grad_scaler")


@register_fix("keep_fp32_buffers", summary="keep named buffers (rotary frequencies, ...) in float32 after a model cast",
              params=("buffers", "modules", "module"))
def keep_fp32_buffers(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    model = ctx.model
    if not isinstance(model, nn.Module):
        raise ValueError("keep_fp32_buffers needs the model (FixContext.model) to copy the float32 values from")
    bufs = list(params.get("buffers") or [])
    mods = params.get("modules") or ([params["module"]] if params.get("module") else [])
    named = dict(model.named_buffers())
    for m in mods:
        prefix = f"{m}." if m else ""
        bufs += [n for n, b in named.items() if n.startswith(prefix) and b.is_floating_point() and n not in bufs]
    if not bufs:
        raise ValueError("keep_fp32_buffers needs params['buffers'] (names from model.named_buffers()) or "
                         "params['modules'] holding floating buffers")
    missing = [n for n in bufs if n not in named]
    if missing:
        raise ValueError(f"keep_fp32_buffers: the model has no buffer(s) {missing}; use names from "
                         "model.named_buffers()")
    values = tuple((n, named[n].detach().to(torch.float32).clone()) for n in bufs)
    desc = (f"keep {', '.join(bufs[:3])}{', ...' if len(bufs) > 3 else ''} in float32 after the model cast (its "
            "original values, not the rounded ones)")
    snippet = "\n".join(f"model.get_buffer({n!r}).data = fp32_values[{n!r}]  # recomputed in float32"
                        for n in bufs[:3])
    return FixPlan("keep_fp32_buffers", {"buffers": bufs}, desc, snippet, (KeepFp32Buffers(values),))


@register_fix("fp32_master", summary="float32 parameters and optimizer state + autocast instead of .half()",
              params=())
def fp32_master(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    low = _PRECISION_DTYPE.get(ctx.precision or "", None)
    if low is None:
        low = torch.bfloat16 if ctx.param_dtype == "bfloat16" else torch.float16
    target = "bf16-amp" if low == torch.bfloat16 else "fp16-amp"
    changes: dict[str, Any] = {"precision": target}
    snippet = ("model = model.float()          # fp32 master weights; the optimizer state follows them\n"
               f"with torch.autocast(device_type, dtype=torch.{dtype_name(low)}):\n"
               "    loss = loss_fn(model(x), y)")
    desc = (f"keep parameters and optimizer state in float32 and run the ops in {dtype_name(low)} under autocast "
            f"({target})")
    training: tuple[Any, ...] = (snippet,)
    if target == "fp16-amp" and not ctx.has_scaler:
        scaler = torch.amp.GradScaler(ctx.device_type)
        changes["scaler"] = scaler
        desc += ", with a GradScaler"
        snippet += "\n" + _scaler_snippet(2.0 ** 16, 2000)
        training = (snippet, scaler)
    return FixPlan("fp32_master", {}, desc, snippet, (Fp32Master(),), changes, training)


@register_fix("fp8_amax_floor", summary="floor the amax behind an fp8 scale (amax 0 -> scale 0 -> 0/0 = NaN)",
              params=("amax_floor", "modules", "module"))
def fp8_amax_floor(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    floor = params.get("amax_floor", 1e-12)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (0 < floor < math.inf):
        raise ValueError(f"fp8_amax_floor needs a positive finite amax_floor, got {floor!r}")
    mods = modules_param(params, ctx, "fp8_amax_floor")
    desc = (f"floor amax at {floor:g} before the fp8 scale is computed inside {_qual(mods)} (emulated: the results "
            "of amax/max reductions that are >= 0 and below the floor are raised to it; put the clamp in your "
            "quantisation code)")
    snippet = f"amax = x.abs().amax(dim, keepdim=True).float().clamp(min={floor:g})\nscale = amax / fp8_max"
    return FixPlan("fp8_amax_floor", {"amax_floor": float(floor), "modules": mods}, desc, snippet,
                   (ScopedMode(tuple(mods), "amax_floor", float(floor)),))


__all__ = ["FIXES", "FixAction", "FixContext", "FixPlan", "build_plan", "modules_param", "register_fix", "map_tensors",
           "scopes_of"]
