"""Faults injected by mechanism into a zoo model, at a module chosen at random (seeded).

A mechanism is one registered entry (``@mechanism(name, precision=..., codes=...)``): a function that takes the
model, a :class:`Probe` of its fp32 step and a ``random.Random`` and returns the :class:`Injection` (the
qualified name of the module it damaged, plus optional overrides of the step). Registering a name twice
raises. Faults change the module's class to a subclass with one extra line of numerics (deep copies keep it),
add a submodule, a buffer or cast parameters; they never touch names the rules could read.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

FP16_MAX = 65504.0


@dataclass(frozen=True)
class Probe:
    """One fp32 forward/backward of the healthy model: per module that ran, its output's shape, dtype and |max|,
    and whether its own weight got a nonzero gradient (its output reaches the loss); plus, from one forward under
    fp16 autocast, which modules' outputs autocast computes in fp16 (a fault injected into a module whose output
    autocast keeps in float32 -- a norm that autocast runs in fp32 -- is no fault in an autocast run)."""

    out_shape: dict[str, tuple[int, ...]]
    out_absmax: dict[str, float]
    weight_grad: dict[str, bool]
    ran: tuple[str, ...]
    low_under_amp: frozenset[str] | None = None  # None: the autocast forward failed, no filter


@dataclass(frozen=True)
class Injection:
    module: str
    overrides: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Mechanism:
    name: str
    precision: str
    codes: tuple[str, ...]  # acceptable root-cause codes
    inject: Callable[[nn.Module, Probe, random.Random], Injection]


MECHANISMS: dict[str, Mechanism] = {}


def mechanism(name: str, *, precision: str, codes: tuple[str, ...]) -> Callable[..., Any]:
    def deco(fn: Callable[[nn.Module, Probe, random.Random], Injection]) -> Callable[..., Any]:
        if name in MECHANISMS:
            raise ValueError(f"zoo mechanism {name!r} is already registered")
        MECHANISMS[name] = Mechanism(name, precision, codes, fn)
        return fn
    return deco


def is_weighted_leaf(m: nn.Module) -> bool:
    """A Linear/Conv-like leaf: a weight of rank >= 2 that is not a lookup table (embeddings)."""
    w = getattr(m, "weight", None)
    return (isinstance(w, nn.Parameter) and w.dim() >= 2 and not isinstance(m, nn.Embedding)
            and not any(True for _ in m.children()))


def probe(model: nn.Module, batch: Any, loss_of: Callable[[Any], torch.Tensor]) -> Probe:
    """Run one fp32 step on ``model`` itself (the caller passes a throw-away copy)."""
    shapes: dict[str, tuple[int, ...]] = {}
    amax: dict[str, float] = {}
    ran: list[str] = []
    handles = []
    for name, m in model.named_modules():
        if not name:
            continue

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if name not in shapes:
                ran.append(name)
                t = out if isinstance(out, torch.Tensor) else None
                shapes[name] = tuple(t.shape) if t is not None else ()
                amax[name] = float(t.detach().abs().max()) if t is not None and t.numel() and \
                    t.is_floating_point() else 0.0
        handles.append(m.register_forward_hook(hook))
    try:
        loss_of(model).backward()
    finally:
        for h in handles:
            h.remove()
    grads = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, nn.Parameter):
            grads[name] = w.grad is not None and bool(w.grad.abs().sum() > 0)
    return Probe(shapes, amax, grads, tuple(ran), _low_under_amp(model, loss_of))


def _low_under_amp(model: nn.Module, loss_of: Callable[[Any], torch.Tensor]) -> frozenset[str] | None:
    """Modules whose output is fp16 in one forward under fp16 autocast (CPU)."""
    low: set[str] = set()
    handles = []
    for name, m in model.named_modules():
        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if isinstance(out, torch.Tensor) and out.dtype == torch.float16:
                low.add(name)
        if name:
            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            loss_of(model)
    except Exception:  # noqa: BLE001 - a family whose autocast forward fails: no filter
        return None
    finally:
        for h in handles:
            h.remove()
    return frozenset(low)


def _pick(rng: random.Random, names: list[str], what: str) -> str:
    if not names:
        raise LookupError(f"no module fit for {what}")
    return rng.choice(sorted(names))


def _linear_candidates(model: nn.Module, p: Probe) -> list[str]:
    mods = dict(model.named_modules())
    owned = dict(model.named_parameters())  # a tied weight is listed once, under its first owner
    return [n for n in p.ran if is_weighted_leaf(mods[n]) and p.weight_grad.get(n) and p.out_shape.get(n)
            and p.out_absmax.get(n, 0.0) > 0 and f"{n}.weight" in owned
            and (p.low_under_amp is None or n in p.low_under_amp)]


def _subclass(m: nn.Module, extra: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    """Give ``m`` a subclass of its own class whose forward applies ``extra`` to the output."""
    base = type(m)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return extra(self, base.forward(self, *args, **kwargs))

    m.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})


# must-stay-fp32 is the overflow finding itself when the overflowing module is one the model declares fp32-only
# (UMT5's DenseReluDense.wo in _keep_in_fp32_modules): same module, op and phase, with the declaration as the fix
@mechanism("weight-scale", precision="fp16-amp", codes=("overflow", "must-stay-fp32"))
def weight_scale(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """Scale one Linear/Conv weight so its output lands 4x past fp16's max (bf16-pretrained magnitudes)."""
    mods = dict(model.named_modules())
    cands = [n for n in _linear_candidates(model, p)
             if float(mods[n].weight.abs().max()) * 4 * FP16_MAX / p.out_absmax[n] < FP16_MAX]
    name = _pick(rng, cands, "weight-scale")
    factor = 4 * FP16_MAX / p.out_absmax[name]
    with torch.no_grad():
        mods[name].weight.mul_(factor)
        b = getattr(mods[name], "bias", None)
        if isinstance(b, torch.Tensor):
            b.mul_(factor)
    return Injection(name, note=f"weight x{factor:.3g}")


def _add_literal_mask(self: nn.Module, y: torch.Tensor) -> torch.Tensor:
    keep = (torch.arange(y.shape[-1], device=y.device) % 4 != 0).to(y.dtype)
    return y + (1.0 - keep) * -1e9  # the classic additive mask, written with a literal fp16 cannot hold


@mechanism("mask-literal", precision="fp16-amp", codes=("constant-out-of-range",))
def mask_literal(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """An additive mask ``(1 - keep) * -1e9`` added to a Linear/Conv output (fp16 under autocast)."""
    name = _pick(rng, _linear_candidates(model, p), "mask-literal")
    _subclass(dict(model.named_modules())[name], _add_literal_mask)
    return Injection(name)


def _eps_norm(self: nn.Module, y: torch.Tensor) -> torch.Tensor:
    if y.dim() >= 2:
        keep = (torch.arange(y.shape[-2], device=y.device) % 4 != 0).to(y.dtype).unsqueeze(-1)
    else:
        keep = (torch.arange(y.shape[-1], device=y.device) % 4 != 0).to(y.dtype)
    y = y * keep  # padded rows are zero
    ms = (y * y).mean(-1, keepdim=True)
    return y / torch.sqrt(ms + 1e-10)  # 1e-10 is 0 in fp16 (smallest subnormal 6e-8): 0 / 0 on padded rows


@mechanism("eps-underflow", precision="fp16-amp", codes=("constant-out-of-range", "underflow"))
def eps_underflow(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """An RMS normalisation of a Linear/Conv output whose eps (1e-10) flushes to 0 in fp16; padded rows are 0."""
    name = _pick(rng, _linear_candidates(model, p), "eps-underflow")
    _subclass(dict(model.named_modules())[name], _eps_norm)
    return Injection(name)


@mechanism("unused-submodule", precision="bf16-amp", codes=("unused-parameters",))
def unused_submodule(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """A trainable submodule that forward never calls (a head left over from another task)."""
    name = _pick(rng, [n for n in p.ran if p.weight_grad.get(n, True)], "unused-submodule")
    parent = dict(model.named_modules())[name]
    parent.add_module("aux_head", nn.Linear(4, 4))
    return Injection(f"{name}.aux_head")


def _freq_modulation(self: nn.Module, y: torch.Tensor) -> torch.Tensor:
    angle = self.freq * 512.0  # positions up to 512 times per-channel frequencies, as in a rotary table
    return y * (1.0 + 0.5 * torch.cos(angle))


@mechanism("buffer-cast", precision="bf16", codes=("must-stay-fp32", "precision-loss"))
def buffer_cast(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """A float32 frequency buffer feeding cos; the whole-model bf16 cast rounds it (relative 2**-9)."""
    name = _pick(rng, _linear_candidates(model, p), "buffer-cast")
    m = dict(model.named_modules())[name]
    d = p.out_shape[name][-1]
    m.register_buffer("freq", 1.0 / (10000.0 ** (torch.arange(d, dtype=torch.float32) / max(d, 1))))
    _subclass(m, _freq_modulation)
    return Injection(name)


def _stored_gain(self: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return y * (self.gain_table / 1e5).to(y.dtype)  # 1e5 / 1e5 = 1 in fp32; inf / 1e5 = inf once stored in fp16


@mechanism("buffer-overflow", precision="fp16", codes=("overflow",))
def buffer_overflow(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """A float32 buffer holding 1e5 (past fp16's 65504), read as a gain: ``model.half()`` stores it as inf."""
    name = _pick(rng, _linear_candidates(model, p), "buffer-overflow")
    m = dict(model.named_modules())[name]
    m.register_buffer("gain_table", torch.full((p.out_shape[name][-1],), 1e5))
    _subclass(m, _stored_gain)
    return Injection(name)


def _bf16_island(self: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return y.float()


@mechanism("low-precision-update", precision="bf16-amp", codes=("low-precision-params",))
def low_precision_update(model: nn.Module, p: Probe, rng: random.Random) -> Injection:
    """One Linear/Conv keeps its weights in bf16 (no fp32 master copy); AdamW's small steps round away."""
    mods = dict(model.named_modules())
    name = _pick(rng, _linear_candidates(model, p), "low-precision-update")
    m = mods[name]
    m.to(torch.bfloat16)
    base = type(m)

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return base.forward(self, x.to(self.weight.dtype), *args, **kwargs).float()

    m.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    return Injection(name, overrides={"lr": 5e-6})
