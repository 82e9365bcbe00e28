"""Automatic applications of mechanism-specific remedies (:data:`ampdoctor.findings.REMEDIES`).

* ``log_softmax``: inside the named module, ``log(softmax(x, dim))`` is computed as ``log_softmax(x, dim)`` (a
  torch-function mode remembers the tensors softmax returned; ``log`` of exactly such a tensor is rewritten). The
  rewritten op never forms the probabilities that flush to 0, so no ``log(0) = -inf``, in any dtype.
* ``dtype_eps``: inside the named module, a Python literal added to (or clamped against) a low-precision tensor that
  is 0 in that dtype (``x + 1e-10`` in fp16) becomes ``torch.finfo(dtype).tiny`` with its sign.

The mask literal (``safe_mask``) and the reduction upcast (``upcast_op``) are :mod:`ampdoctor.fixes._actions`; the
QK^T remedies (scale before the matmul, SDPA) are source changes whose automatic counterpart is ``keep_fp32``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.findings import REMEDIES
from ampdoctor.fixes._actions import FixContext, FixPlan, _qual, modules_param, register_fix
from ampdoctor.fixes._scope import LOW_DTYPES, _fname, _get_module, _install_scope, _Scope
from ampdoctor.trace import Kind, Role, op_info, ops_with, ops_with_literal, torch_names

_SOFTMAX = ops_with(Kind.SOFTMAX) & ops_with(Kind.BOUNDED)
#: ops that add a literal to a tensor (or bound it from below by one): where an eps is applied (the op registry's)
_EPS_FUNCS = torch_names(ops_with_literal(Role.ADDEND) | {
    n for n in ops_with_literal(Role.BOUND) if any(lit.name == "min" for lit in op_info(n).literals)})


class _LogSoftmaxMode(TorchFunctionMode):
    """Rewrites ``log(softmax(x, dim))`` into ``log_softmax(x, dim)``; every other call runs unchanged."""

    def __init__(self) -> None:
        super().__init__()
        # id(softmax output) -> (that output, its input, dim, dtype); strong refs, dropped with the mode at module exit
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor, int, Any]] = {}
        self.rewritten = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = _fname(func)
        if name in _SOFTMAX and args and isinstance(args[0], torch.Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            out = func(*args, **kwargs)
            if isinstance(dim, int) and isinstance(out, torch.Tensor):
                self.made[id(out)] = (out, args[0], dim, kwargs.get("dtype"))
            return out
        if name == "log" and args and isinstance(args[0], torch.Tensor) and not kwargs:
            hit = self.made.get(id(args[0]))
            if hit is not None and hit[0] is args[0]:
                _, x, dim, dtype = hit
                self.rewritten += 1
                return torch.log_softmax(x, dim, dtype=dtype)
        return func(*args, **kwargs)


def _flushes(v: Any, dtype: torch.dtype) -> bool:
    if isinstance(v, bool) or not isinstance(v, float) or v == 0 or not math.isfinite(v):
        return False
    return float(torch.tensor(v, dtype=torch.float64).to(dtype)) == 0.0


class _DtypeEpsMode(TorchFunctionMode):
    """A Python literal that is 0 in the low dtype of the tensor it is added to becomes that dtype's ``tiny``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if _fname(func) not in _EPS_FUNCS:
            return func(*args, **kwargs)
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in LOW_DTYPES), None)
        if dtype is None:
            return func(*args, **kwargs)
        tiny = float(torch.finfo(dtype).tiny)

        def fit(v: Any) -> Any:
            return math.copysign(tiny, v) if _flushes(v, dtype) else v

        return func(*(fit(a) for a in args), **{k: fit(v) for k, v in kwargs.items()})


@dataclass(frozen=True)
class MechanismMode:
    """Run ``modules`` with the mode of ``kind`` (``"log_softmax"``, ``"dtype_eps"``) active, built per forward."""

    modules: tuple[str, ...]
    kind: str

    def __call__(self, model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        modes = {"log_softmax": _LogSoftmaxMode, "dtype_eps": _DtypeEpsMode}
        if self.kind not in modes:
            raise ValueError(f"unknown mechanism mode {self.kind!r}; expected one of {sorted(modes)}")
        for name in self.modules:
            m = _get_module(model, name)
            low = next((t.dtype for t in m.parameters() if t.dtype in LOW_DTYPES), None)
            _install_scope(m, _Scope(mode=modes[self.kind], model_dtype=low))


def _mechanism_plan(fix_id: str, remedy: str, params: dict[str, Any], ctx: FixContext,
                    describe: Callable[[str], str]) -> FixPlan:
    """The plan of a mechanism fix: its :class:`MechanismMode` (kind ``fix_id``) inside the named modules, the
    remedy's snippet as the code to apply, ``describe(modules as words)`` as the description."""
    mods = modules_param(params, ctx, fix_id)
    return FixPlan(fix_id, {"modules": mods}, describe(_qual(mods)), REMEDIES[remedy].snippet,
                   (MechanismMode(tuple(mods), fix_id),))


@register_fix("log_softmax", summary="compute log(softmax(x)) as log_softmax(x) inside named modules",
              params=("modules", "module"))
def log_softmax(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    return _mechanism_plan("log_softmax", "log-softmax", params, ctx, lambda where: (
        f"inside {where}, log(softmax(x, dim)) is computed as log_softmax(x, dim): the probabilities "
        "that flush to 0 are never formed (emulated by a torch-function mode; change the source as shown)"))


@register_fix("dtype_eps", summary="an eps literal that is 0 in the low dtype becomes that dtype's finfo.tiny",
              params=("modules", "module"))
def dtype_eps(params: dict[str, Any], ctx: FixContext) -> FixPlan:
    return _mechanism_plan("dtype_eps", "dtype-eps", params, ctx, lambda where: (
        f"inside {where}, a literal added in fp16/bf16 that is 0 there (1e-10 in fp16) becomes "
        "torch.finfo(dtype).tiny (6.1e-05 in fp16), so the eps keeps the value off 0 as in fp32"))


__all__ = ["MechanismMode", "dtype_eps", "log_softmax"]
