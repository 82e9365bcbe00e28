"""The verdict on one fix: the fixed step re-diagnosed and trained next to the reference, its errors measured
against tolerances scaled to the step's own rounding noise, and every failed check named in the reason.

A fix is *verified* when (1) :func:`ampdoctor.diagnose` of the fixed step finds no error, (2) the loss of the first
step matches the fp32 reference within the tolerance of the dtype the step computes in, (3) every one of K training
steps stays finite and the K-step loss curve stays within tolerance of the fp32 curve, and (4) where the step's
gradients can be read, they match fp32 (norm-wise) and none that fp32 computes is lost to zero. Tolerances and
their derivation: ``docs/fixes.md`` and :data:`TOLERANCES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ampdoctor.findings import Report, jsonable
from ampdoctor.fixes._actions import FixPlan
from ampdoctor.fixes._curve import Curve, run_curve
from ampdoctor.fixes._tolerance import (
    PRECISION_DTYPE,
    TOLERANCES,
    compute_dtype,
    curve_err,
    grad_errors,
    output_err,
    rel_err,
)
from ampdoctor.precision import ScenarioError, StepSpec

if TYPE_CHECKING:
    from ampdoctor.fixes._session import Session


@dataclass(frozen=True)
class Verification:
    """The numbers behind one fix's verdict. ``to_dict()`` is what :attr:`FixProposal.verification` holds.

    ``loss_fp32`` is the reference's first loss (the fp32 run of the original step, or of the fixed step when the
    original fails in fp32 too: ``reference`` says which), ``loss_broken`` the original target's, ``loss_fixed``
    the fixed target's; ``max_rel_err_first_step`` / ``max_rel_err_curve`` compare fixed with the reference on
    step 0 and over all ``steps``; ``steps_finite`` counts steps before the first non-finite (or failed) one.
    ``findings_before`` / ``findings_after`` list ``code@module`` of every finding of the original and the fixed
    diagnosis (``remaining``: the errors left).
    """

    fix_id: str
    params: dict[str, Any]
    verified: bool
    reason: str
    description: str
    dtype: str
    tolerance: dict[str, Any]
    reference: str
    steps: int
    trained: bool
    loss_fp32: float | None
    loss_broken: float | None
    loss_fixed: float | None
    max_rel_err_first_step: float | None
    max_rel_err_curve: float | None
    steps_finite: int
    steps_finite_broken: int | None
    max_rel_err_curve_broken: float | None = None
    grad_rel_err: float | None = None
    grad_rel_err_broken: float | None = None
    grad_lost_fraction: float | None = None
    grad_lost_fraction_broken: float | None = None
    output_rel_err: float | None = None
    output_rel_err_broken: float | None = None
    report_ok: bool | None = None
    remaining: tuple[str, ...] = ()
    findings_before: tuple[str, ...] = ()
    findings_after: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    curve_fp32: tuple[float | None, ...] = ()
    curve_broken: tuple[float | None, ...] = ()
    curve_fixed: tuple[float | None, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("remaining", "findings_before", "findings_after"):
            d[k] = list(d[k])
        for k in ("curve_fp32", "curve_broken", "curve_fixed"):
            d[k] = list(d[k])
        return jsonable(d)



def _finite_count(c: Curve, steps: int) -> int:
    """Steps before the first non-finite loss (forward-only: 1 when every output is finite)."""
    if c.forward_only:
        return 1 if _finite_curve(c) else 0
    return min(c.finite_steps, steps)


def _finite_curve(c: Curve) -> bool:
    ok_loss = all(v is not None and math.isfinite(v) for v in c.losses) and bool(c.losses)
    if c.forward_only:
        return not c.exc and all(bool(torch.isfinite(t).all()) for t in (c.outputs or []))
    return ok_loss and not c.exc and len(c.losses) > 0


def apply_plan(spec: StepSpec, plan: FixPlan) -> StepSpec:
    """The step with the plan's transforms added and its step changes (precision, scaler, fp8 recipe) made."""
    changes = dict(plan.spec_changes)
    bad = sorted(set(changes) - {"precision", "scaler", "fp8_recipe"})
    if bad:
        raise ValueError(f"fix {plan.id!r} changes unsupported step fields {bad}")
    return replace(spec, transforms=tuple(spec.transforms) + tuple(plan.transforms), **changes)


def _labels(report: Report, problems_only: bool = False) -> tuple[str, ...]:
    """``code@module`` of the report's findings (``problems_only``: without ``info`` ones, which need no fix)."""
    return tuple(dict.fromkeys(f"{f.code}@{f.module or '<root>'}" for f in report.findings
                               if not problems_only or f.severity != "info"))


def _healthy_of(healthy: Curve | None, ref: Curve, broken: Curve) -> dict[str, float | None] | None:
    """Errors of the healthy run against the reference, or None when it is not healthy: not finite, or no closer
    to fp32 than the broken run (then it says nothing about what this precision may deviate by)."""
    if healthy is None or not _finite_curve(healthy):
        return None
    h = _noise_of(healthy, ref)
    lost = grad_errors(healthy.grads, ref.grads)[1]
    if healthy.grads is not None and h["grad"] is not None and math.isinf(h["grad"]):
        lost = math.inf  # the healthy run's scaler skipped step 0: its gradients are not finite, as is legitimate
    h["lost"] = lost
    if _finite_curve(broken) and broken.trained and h["curve"] is not None:
        b = curve_err(broken.losses, ref.losses)
        if b is not None and not h["curve"] < b:
            return None
    return h


def _noise_of(noise: Curve | None, ref: Curve) -> dict[str, float | None]:
    """Errors of the rounded-start fp32 run against the reference: the step's own rounding noise."""
    if noise is None or not _finite_curve(noise):
        return {"loss": None, "curve": None, "grad": None, "output": None}
    return {"loss": rel_err(noise.losses[0] if noise.losses else None, ref.losses[0] if ref.losses else None),
            "curve": curve_err(noise.losses, ref.losses) if noise.trained else None,
            "grad": grad_errors(noise.grads, ref.grads)[0], "output": output_err(noise.outputs, ref.outputs)}



@dataclass(frozen=True)
class _Measured:
    """The fixed (and broken) run's errors against the reference; None where there is nothing to compare."""

    steps: int  # the steps the verdict covers: the session's, or 1 for a forward-only step
    need: int  # the finite steps the fixed run must reach (as many as the reference has, at most ``steps``)
    first: float | None
    over: float | None
    over_broken: float | None
    grad: float | None
    grad_lost: float | None
    grad_broken: float | None
    grad_lost_broken: float | None
    output: float | None
    output_broken: float | None


def _measure(fixed: Curve, broken: Curve, ref: Curve, original_ref: Curve, steps: int) -> _Measured:
    """``fixed`` against ``ref`` (the reference the verdict uses), ``broken`` against the original step's fp32."""
    first = rel_err(fixed.losses[0] if fixed.losses else None, ref.losses[0] if ref.losses else None)
    g_err, g_lost = grad_errors(fixed.grads, ref.grads)
    gb_err, gb_lost = grad_errors(broken.grads, original_ref.grads)
    return _Measured(
        steps=steps if fixed.trained else 1, need=min(steps, ref.finite_steps) if fixed.trained else 1,
        first=first, over=curve_err(fixed.losses, ref.losses) if fixed.trained else first,
        over_broken=curve_err(broken.losses, original_ref.losses) if broken.trained else None,
        grad=g_err, grad_lost=g_lost, grad_broken=gb_err, grad_lost_broken=gb_lost,
        output=output_err(fixed.outputs, ref.outputs), output_broken=output_err(broken.outputs, original_ref.outputs))


def _diagnose_fixed(spec: StepSpec, policy: str) -> tuple[Report | None, str]:
    """The fixed step's diagnosis, or None and why it could not be diagnosed."""
    from ampdoctor.diagnose import DiagnosisError, diagnose_spec

    try:
        return diagnose_spec(spec, policy=policy), ""
    except (DiagnosisError, ScenarioError, RuntimeError, ValueError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _reference_for(session: Session, fixed_spec: StepSpec, plan: FixPlan) -> tuple[Curve, StepSpec, str, str]:
    """``(curve, its step, its noise cache key, what it is)``: the original step's fp32 run, or the fixed step's
    when the original is not finite in fp32 either."""
    ref = session.reference
    if not _finite_curve(ref):
        fixed_ref = run_curve(fixed_spec, reference=True, steps=session.steps, policy=session.policy)
        if _finite_curve(fixed_ref):
            return (fixed_ref, fixed_spec, f"fixed:{plan.id}:{plan.params!r}",
                    "fp32 with the fix (the original step is not finite in fp32 either)")
    return ref, session.spec, "original", "fp32"


def _diagnosis_reasons(session: Session, plan: FixPlan, fixed_report: Report | None, diag_error: str,
                       remaining: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """What the fixed step's diagnosis says against the fix: errors left, its own findings still reported, a
    precision switch that did not take effect."""
    reasons: list[str] = []
    if fixed_report is None:
        reasons.append(f"the fixed step could not be diagnosed ({diag_error})")
    elif not fixed_report.ok:
        reasons.append(f"the fixed step still has error findings: {', '.join(remaining)}")
    # an info finding left at the same module (a harmless few flushed values) is not the problem the fix was for
    still = [t for t in targets if fixed_report is not None and t in _labels(fixed_report, problems_only=True)]
    if still:
        reasons.append(f"the finding it was proposed for is still reported: {', '.join(still)}")
    requested = plan.spec_changes.get("precision")
    old = compute_dtype(session.spec.precision, session.report)
    if requested in PRECISION_DTYPE and fixed_report is not None and PRECISION_DTYPE[requested] != old \
            and old != "float32":
        forward = {row.dtype for row in fixed_report.layer_stats if row.phase == "forward"}
        if old in forward:
            reasons.append(f"the precision switch to {requested} did not take effect: forward ops still run in {old} "
                           "(the step casts or autocasts by itself: change the dtype there)")
    return reasons


def _run_reasons(fixed: Curve, ref: Curve, m: _Measured, tol: dict[str, Any], dtype: str) -> list[str]:
    """What the fixed run's numbers say against the fix: an exception, non-finite steps, errors over tolerance."""
    reasons = [f"the fixed run raised {fixed.exc}"] if fixed.exc else []
    if fixed.forward_only:
        if not _finite_curve(fixed):
            reasons.append("the fixed output is not finite")
        if m.output is None:
            reasons.append("no finite fp32 output to compare with")
        elif m.output > tol["output"]:
            reasons.append(f"output relative error {m.output:.3g} > tolerance {tol['output']:.3g} ({dtype})")
        return reasons
    if fixed.finite_steps < m.need:
        reasons.append(f"only {fixed.finite_steps}/{m.steps} steps finite (fp32: {ref.finite_steps})")
    if m.first is None:
        reasons.append("no finite fp32 loss to compare with")
    elif m.first > tol["loss"]:
        reasons.append(f"first-step loss relative error {m.first:.3g} > tolerance {tol['loss']:.3g} ({dtype})")
    if m.over is not None and fixed.trained and m.over > tol["curve"] and fixed.finite_steps >= m.need:
        reasons.append(f"{m.steps}-step loss curve relative error {m.over:.3g} > tolerance {tol['curve']:.3g}")
    if m.grad is not None and m.grad > tol["grad"]:
        reasons.append(f"gradient relative error {m.grad:.3g} > tolerance {tol['grad']:.3g}")
    if m.grad_lost is not None and m.grad_lost > tol["lost"]:
        reasons.append(f"{m.grad_lost:.1%} of the gradient elements fp32 computes are exactly 0 (tolerance "
                       f"{tol['lost']:.1%})")
    return reasons


def _extra(fixed: Curve, broken: Curve, reference_kind: str, original_ref: Curve) -> dict[str, Any]:
    """Facts of the runs a reader may need: clamped values, the original fp32 loss, the optimizer, exceptions."""
    extra: dict[str, Any] = {}
    if fixed.clamped:
        extra["clamped_values"] = fixed.clamped
    if "fix" in reference_kind and original_ref.losses and original_ref.losses[0] is not None:
        extra["loss_fp32_original"] = original_ref.losses[0]
    if fixed.optimizer:
        extra["optimizer"] = fixed.optimizer
    if broken.exc:
        extra["broken_exception"] = broken.exc
    if fixed.exc:
        extra["fixed_exception"] = fixed.exc
    return extra


def verify_plan(session: Session, plan: FixPlan, targets: tuple[str, ...] = ()) -> Verification:
    """Verify one plan against the session's step: diagnose the fixed step, train it next to the reference, scale
    the tolerances to the step's rounding noise (and the healthy run's error), and name every failed check."""
    fixed_spec = apply_plan(session.spec, plan)
    fixed_report, diag_error = _diagnose_fixed(fixed_spec, session.policy)
    ref, ref_spec, ref_key, reference_kind = _reference_for(session, fixed_spec, plan)
    broken = session.broken
    fixed = run_curve(fixed_spec, reference=False, steps=session.steps, policy=session.policy, lr=ref.lr)
    dtype = compute_dtype(fixed_spec.precision, fixed_report if fixed_report is not None else session.report)
    noise = _noise_of(session.noise(ref_spec, ref_key, dtype, ref.lr), ref)
    healthy = _healthy_of(session.healthy(fixed_spec, dtype, ref.lr), ref, broken) if ref_key == "original" else None
    tol = TOLERANCES.get(dtype, TOLERANCES["float16"]).scaled(noise, healthy)
    m = _measure(fixed, broken, ref, session.reference, session.steps)
    remaining = tuple(f"{f.code}@{f.module or '<root>'}" for f in (fixed_report.findings if fixed_report else ())
                      if f.severity == "error")
    reasons = [*_diagnosis_reasons(session, plan, fixed_report, diag_error, remaining, targets),
               *_run_reasons(fixed, ref, m, tol, dtype)]
    return Verification(
        fix_id=plan.id, params=dict(plan.params), verified=not reasons,
        reason="; ".join(reasons) or "all checks passed", description=plan.description, dtype=dtype,
        tolerance=tol, reference=reference_kind, steps=m.steps, trained=fixed.trained,
        loss_fp32=ref.losses[0] if ref.losses else None, loss_broken=broken.losses[0] if broken.losses else None,
        loss_fixed=fixed.losses[0] if fixed.losses else None, max_rel_err_first_step=m.first,
        max_rel_err_curve=m.over, steps_finite=_finite_count(fixed, m.steps),
        steps_finite_broken=_finite_count(broken, m.steps), max_rel_err_curve_broken=m.over_broken,
        grad_rel_err=m.grad, grad_rel_err_broken=m.grad_broken, grad_lost_fraction=m.grad_lost,
        grad_lost_fraction_broken=m.grad_lost_broken, output_rel_err=m.output, output_rel_err_broken=m.output_broken,
        report_ok=None if fixed_report is None else fixed_report.ok, remaining=remaining,
        findings_before=_labels(session.report),
        findings_after=_labels(fixed_report) if fixed_report is not None else (),
        extra=_extra(fixed, broken, reference_kind, session.reference), curve_fp32=tuple(ref.losses),
        curve_broken=tuple(broken.losses), curve_fixed=tuple(fixed.losses))


__all__ = ["Verification", "apply_plan", "verify_plan"]
