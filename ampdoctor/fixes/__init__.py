"""Fixes: apply a finding's remedy to a model without editing its source, and verify that it works.

>>> import ampdoctor
>>> from ampdoctor.fixes import diagnose_and_fix, fix
>>> report = diagnose_and_fix("t5_fp16_amp_ff_overflow")                # doctest: +SKIP
>>> [(p.id, p.verified) for p in report.findings[0].fixes]             # doctest: +SKIP
[('keep_fp32', True), ('switch_precision', True)]
>>> result = fix(model, report)                                         # doctest: +SKIP
>>> result.applied                                                      # doctest: +SKIP
['run `encoder.block.0.layer.1.DenseReluDense.wo` in float32: autocast disabled inside, ...']

Every fix is a registered action (:data:`FIXES`, one per id, see ``docs/fixes.md``) that turns a
:class:`~ampdoctor.FixProposal`'s ``params`` into transforms of a run's copies (forward hooks, torch-function
modes scoped to named modules, parameter dtypes, optimizer groups) and step changes (precision, GradScaler).
:func:`verify` re-diagnoses the fixed step and trains K steps next to fp32; :func:`fix` applies a fix to a copy of
your model (or to the model itself with ``inplace=True``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import NoFixError
from ampdoctor.findings import Finding, FixProposal, Report
from ampdoctor.fixes._actions import FIXES, FixAction, FixContext, FixPlan, build_plan, register_fix
from ampdoctor.fixes._mechanisms import MechanismMode
from ampdoctor.fixes._policy import Fp32Policy, minimal_fp32_policy
from ampdoctor.fixes._session import DEFAULT_STEPS
from ampdoctor.fixes._tolerance import TOLERANCES, Tolerance
from ampdoctor.fixes._verdict import Verification, apply_plan
from ampdoctor.fixes._verify import diagnose_and_fix, merged_params, verify
from ampdoctor.precision import LOW_DTYPES

_WHOLE = LOW_DTYPES


@dataclass(frozen=True)
class FixResult:
    """What :func:`fix` did.

    ``model`` is the fixed model (a copy unless ``inplace=True``), prepared for ``precision`` (cast to fp16/bf16
    when that is a whole-model precision, float32 otherwise); ``applied`` describes each change made to it;
    ``training_changes`` are what the training loop must change itself (code snippets, and objects such as a
    configured ``GradScaler``); ``snippet`` is the fix written as source code to paste. :meth:`remove` undoes the
    fix on ``model`` (hooks, dtypes, ``requires_grad``, replaced attributes), e.g. after ``inplace=True``.
    """

    model: nn.Module
    applied: list[str]
    training_changes: list[Any]
    proposal: FixProposal
    precision: str | None = None
    snippet: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    undo: _Undo | None = None

    def remove(self) -> None:
        """Undo the fix on :attr:`model`: its forward hooks go, parameters and buffers get back their dtype and
        ``requires_grad``, attributes it set on modules are deleted. Idempotent."""
        if self.undo is not None:
            self.undo.restore(self.model)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_SIDE = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class _Undo:
    """What a model looked like before a fix: hook ids, tensor dtypes and flags, instance attributes."""

    def __init__(self, model: nn.Module) -> None:
        self.hooks = {name: {d: set(getattr(m, d)) for d in _HOOK_DICTS} for name, m in model.named_modules()}
        self.attrs = {name: set(vars(m)) for name, m in model.named_modules()}
        # references, not copies: a parameter the fix does not cast costs nothing; one it casts keeps its original
        # tensor, so remove() restores it exactly (an fp32 -> fp16 -> fp32 round trip would not)
        self.params = {n: (p.data, p.requires_grad) for n, p in model.named_parameters()}
        self.buffers = {n: b for n, b in model.named_buffers()}

    def restore(self, model: nn.Module) -> None:
        for name, m in model.named_modules():
            for d in _HOOK_DICTS:
                for hid in set(getattr(m, d)) - self.hooks.get(name, {}).get(d, set()):
                    getattr(m, d).pop(hid, None)
                    for side in _HOOK_SIDE:
                        getattr(m, side).pop(hid, None)
            for attr in set(vars(m)) - self.attrs.get(name, set(vars(m))):
                delattr(m, attr)
        with torch.no_grad():
            for n, p in model.named_parameters():
                data, req = self.params.get(n, (p.data, p.requires_grad))
                if p.dtype != data.dtype:
                    p.data = data
                p.requires_grad_(req)
            for n, b in list(model.named_buffers()):
                if n in self.buffers and b.dtype != self.buffers[n].dtype:
                    owner, _, leaf = n.rpartition(".")
                    model.get_submodule(owner)._buffers[leaf] = self.buffers[n]


def _candidates(report: Report) -> list[tuple[FixProposal, Finding]]:
    return [(p, f) for f in report.findings for p in f.fixes if p.id in FIXES]


def best_fix(report: Report) -> tuple[FixProposal, Finding]:
    """The fix :func:`fix` applies for ``which="best"``: the first verified one (findings in report order), or,
    when the report was not verified, the first applicable fix of the most important finding."""
    cands = _candidates(report)
    if not cands:
        raise NoFixError("the report proposes no fix that can be applied automatically; "
                         + ("it has no findings" if not report.findings else
                            "see each finding's advice (fixes without an id) for manual changes"))
    if any(p.verified is not None for p, _ in cands):
        for p, f in cands:
            if p.verified:
                return p, f
        tried = "; ".join(f"{p.id}: {p.verification.get('reason', 'not verified')}" for p, _ in cands)
        raise NoFixError(f"no proposed fix was verified ({tried}); pass which=<id> to apply one anyway")
    return cands[0]


def _select(report: Report, which: Any) -> tuple[FixProposal, Finding | None]:
    if isinstance(which, FixProposal):
        f = next((f for f in report.findings if any(p == which for p in f.fixes)), None)
        return which, f
    if not isinstance(which, str):
        raise TypeError(f"which must be 'best', a fix id or a FixProposal, got {type(which).__name__}")
    if which == "best":
        return best_fix(report)
    if which not in FIXES:
        raise ValueError(f"invalid fix {which!r}; expected 'best' or one of: {', '.join(sorted(FIXES))}")
    for p, f in _candidates(report):
        if p.id == which:
            return p, f
    proposed = sorted({p.id for p, _ in _candidates(report)})
    raise NoFixError(f"the report proposes no {which!r} fix; proposed: {', '.join(proposed) or 'none'}")


def fix(model: nn.Module, report: Report, *, which: Any = "best", inplace: bool = False) -> FixResult:
    """Apply a fix proposed in ``report`` to ``model``; returns a :class:`FixResult`.

    >>> result = fix(model, ampdoctor.diagnose(model, batch, precision="fp16-amp"))   # doctest: +SKIP
    >>> fixed = result.model; result.applied                                          # doctest: +SKIP

    ``which``: ``"best"`` (the first verified fix of a :func:`diagnose_and_fix` report, else the first applicable
    fix of the root cause), a fix id, or one of the report's :class:`FixProposal` objects. The model is deep-copied
    unless ``inplace=True``: then hooks are installed on your modules and parameters changed for good. Loop-level
    changes (optimizer groups, GradScaler settings, autocast dtype) cannot be made to a model: they are returned in
    ``training_changes``. Raises before changing anything when the fix or its parameters do not fit the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(report, Report):
        raise TypeError(f"report must be an ampdoctor Report (from ampdoctor.diagnose), got {type(report).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    proposal, finding = _select(report, which)
    params = merged_params(report, proposal) if finding is not None else dict(proposal.params)
    ctx = FixContext.of(model, report.precision, finding.module if finding is not None else "")
    plan = build_plan(proposal.id, params, ctx)
    _check_names(model, plan)
    target = model if inplace else copy.deepcopy(model)
    undo = _Undo(target)
    precision = plan.spec_changes.get("precision", report.precision)
    applied: list[str] = []
    if precision in _WHOLE:
        dt = _WHOLE[precision]
        if any(p.is_floating_point() and p.dtype != dt for p in target.parameters()):
            target.to(dt)
            applied.append(f"cast the model to {str(dt).replace('torch.', '')} (precision {precision!r})")
    for transform in plan.transforms:
        transform(target, None, None)
    applied.append(plan.description)
    changes = list(plan.training_changes)
    return FixResult(target, applied, changes, proposal, precision, plan.snippet, dict(plan.params), undo)


def _check_names(model: nn.Module, plan: FixPlan) -> None:
    modules = dict(model.named_modules())
    missing = [m for m in plan.params.get("modules", []) if m not in modules]
    if missing:
        raise ValueError(f"fix {plan.id!r} names module(s) {missing} that the model does not have; the report was "
                         "made for another model (module names come from model.named_modules())")
    names = dict(model.named_parameters())
    missing = [n for n in plan.params.get("parameters", []) if n not in names]
    if missing:
        raise ValueError(f"fix {plan.id!r} names parameter(s) {missing} that the model does not have; the report "
                         "was made for another model")


__all__ = [
    "DEFAULT_STEPS",
    "FIXES",
    "TOLERANCES",
    "FixAction",
    "FixContext",
    "FixPlan",
    "FixResult",
    "MechanismMode",
    "Fp32Policy",
    "NoFixError",
    "minimal_fp32_policy",
    "Tolerance",
    "Verification",
    "apply_plan",
    "best_fix",
    "build_plan",
    "diagnose_and_fix",
    "fix",
    "register_fix",
    "verify",
]
