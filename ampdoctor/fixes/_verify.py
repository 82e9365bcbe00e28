"""Verification: re-diagnose with a fix applied, and train K steps next to an fp32 reference.

A fix is *verified* when (1) :func:`ampdoctor.diagnose` of the fixed step finds no error, (2) the loss of the first
step matches the fp32 reference within the tolerance of the dtype the step computes in, (3) every one of K training
steps stays finite and the K-step loss curve stays within tolerance of the fp32 curve, and (4) where the step's
gradients can be read, they match fp32 (norm-wise) and none that fp32 computes is lost to zero. Tolerances and
their derivation: ``docs/fixes.md`` and :data:`TOLERANCES`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ampdoctor.findings import Finding, FixProposal, Report
from ampdoctor.findings._types import _jsonable
from ampdoctor.fixes._actions import FIXES, FixContext, FixPlan, build_plan
from ampdoctor.fixes._curve import Curve, run_curve
from ampdoctor.fixes._scope import KeepFp32
from ampdoctor.fixes._tolerance import (
    PRECISION_DTYPE,
    ROUND_DTYPES,
    TOLERANCES,
    compute_dtype,
    curve_err,
    grad_errors,
    output_err,
    rel_err,
)
from ampdoctor.precision import MAX_STEPS, ScenarioError, StepSpec, load_scenario_module, saved_rng, spec_from_module

log = logging.getLogger(__name__)

#: Training steps of a verification curve.
DEFAULT_STEPS = 20


# ---------------------------------------------------------------------------------------------------------------
# results


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
        return _jsonable(d)


# ---------------------------------------------------------------------------------------------------------------
# a verification session: the broken diagnosis and the baseline curves, shared by every fix of one step


def check_args(steps: Any, policy: Any) -> None:
    """Validate ``steps`` and ``policy`` of a verification (before any scenario is loaded or run)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if steps > MAX_STEPS:
        raise ValueError(f"steps must be at most {MAX_STEPS}, got {steps}: verify a fix over a few dozen steps")
    if policy not in ("cuda", "native"):
        raise ValueError(f"invalid policy {policy!r}, expected 'cuda' or 'native'")


class Session:
    """The original step's diagnosis and its fp32/target curves, computed once and shared by several fixes."""

    def __init__(self, spec: StepSpec, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
                 report: Report | None = None) -> None:
        check_args(steps, policy)
        self.spec, self.steps, self.policy = spec, steps, policy
        self._report = report
        self._reference: Curve | None = None
        self._broken: Curve | None = None
        self._noise: dict[tuple[str, str], Curve] = {}
        self._healthy: dict[tuple[Any, ...], Curve | None] = {}

    @property
    def report(self) -> Report:
        if self._report is None:
            from ampdoctor.diagnose import diagnose_spec

            self._report = diagnose_spec(self.spec, policy=self.policy)
        return self._report

    @property
    def reference(self) -> Curve:
        if self._reference is None:
            self._reference = run_curve(self.spec, reference=True, steps=self.steps, policy=self.policy)
        return self._reference

    @property
    def broken(self) -> Curve:
        if self._broken is None:
            self._broken = run_curve(self.spec, reference=False, steps=self.steps, policy=self.policy,
                                     lr=self.reference.lr)
        return self._broken

    def noise(self, spec: StepSpec, key: str, dtype: str, lr: float | None) -> Curve | None:
        """The fp32 run of ``spec`` started from weights and inputs rounded to ``dtype`` (cached per key)."""
        rd = ROUND_DTYPES.get(dtype)
        if rd is None:
            return None
        if (key, dtype) not in self._noise:
            self._noise[(key, dtype)] = run_curve(spec, reference=True, steps=self.steps, policy=self.policy, lr=lr,
                                                  round_to=rd)
        return self._noise[(key, dtype)]

    def implicated(self) -> tuple[str, ...]:
        """The modules of the diagnosis's error findings (those the healthy run keeps in float32)."""
        names = {n for n, _ in self.spec.model.named_modules() if n}
        return tuple(dict.fromkeys(f.module for f in self.report.findings
                                   if f.severity == "error" and f.module in names))

    def healthy(self, fixed_spec: StepSpec, dtype: str, lr: float | None) -> Curve | None:
        """The healthy run in the fixed step's precision: the step (with the fix's precision and scaler, without
        its transforms) with the implicated modules in float32. None when nothing is implicated or the step
        computes in float32 (cached per precision and scaler)."""
        mods = self.implicated()
        if not mods or dtype == "float32":
            return None
        key = (fixed_spec.precision, id(fixed_spec.scaler), mods)
        if key not in self._healthy:
            spec = replace(fixed_spec, transforms=tuple(self.spec.transforms) + (KeepFp32(mods),))
            self._healthy[key] = run_curve(spec, reference=False, steps=self.steps, policy=self.policy, lr=lr)
        return self._healthy[key]

    def context(self, module: str = "") -> FixContext:
        s = self.spec
        return FixContext.of(s.model, s.precision, module, s.scaler, s.train_step)

    def verify(self, plan: FixPlan, targets: tuple[str, ...] = ()) -> Verification:
        """Verify one plan; ``targets`` are the ``code@module`` labels of the findings it was proposed for (a fix
        that leaves one of them reported is not verified)."""
        return _verify_plan(self, plan, targets)


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
    """The step with the plan's transforms added and its step changes (precision, scaler) made."""
    changes = dict(plan.spec_changes)
    bad = sorted(set(changes) - {"precision", "scaler"})
    if bad:
        raise ValueError(f"fix {plan.id!r} changes unsupported step fields {bad}")
    return replace(spec, transforms=tuple(spec.transforms) + tuple(plan.transforms), **changes)


def _labels(report: Report) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f"{f.code}@{f.module or '<root>'}" for f in report.findings))


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


def _verify_plan(session: Session, plan: FixPlan, targets: tuple[str, ...] = ()) -> Verification:
    from ampdoctor.diagnose import DiagnosisError, diagnose_spec

    spec = session.spec
    fixed_spec = apply_plan(spec, plan)
    fixed_report: Report | None
    diag_error = ""
    try:
        fixed_report = diagnose_spec(fixed_spec, policy=session.policy)
    except (DiagnosisError, ScenarioError, RuntimeError, ValueError) as e:
        fixed_report, diag_error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    ref, ref_spec, ref_key = session.reference, spec, "original"
    reference_kind = "fp32"
    ref_orig_loss = ref.losses[0] if ref.losses else None
    if not _finite_curve(ref):
        fixed_ref = run_curve(fixed_spec, reference=True, steps=session.steps, policy=session.policy)
        if _finite_curve(fixed_ref):
            ref, ref_spec, ref_key = fixed_ref, fixed_spec, f"fixed:{plan.id}:{plan.params!r}"
            reference_kind = "fp32 with the fix (the original step is not finite in fp32 either)"
    broken = session.broken
    fixed = run_curve(fixed_spec, reference=False, steps=session.steps, policy=session.policy, lr=ref.lr)
    dtype = compute_dtype(fixed_spec.precision, fixed_report if fixed_report is not None else session.report)
    noise = _noise_of(session.noise(ref_spec, ref_key, dtype, ref.lr), ref)
    healthy = _healthy_of(session.healthy(fixed_spec, dtype, ref.lr), ref, broken) if ref_key == "original" else None
    tol = TOLERANCES.get(dtype, TOLERANCES["float16"]).scaled(noise, healthy)

    loss_ref = ref.losses[0] if ref.losses else None
    loss_fixed = fixed.losses[0] if fixed.losses else None
    first = rel_err(loss_fixed, loss_ref)
    over = curve_err(fixed.losses, ref.losses) if fixed.trained else first
    over_broken = curve_err(broken.losses, session.reference.losses) if broken.trained else None
    g_err, g_lost = grad_errors(fixed.grads, ref.grads)
    gb_err, gb_lost = grad_errors(broken.grads, session.reference.grads)
    o_err = output_err(fixed.outputs, ref.outputs)
    ob_err = output_err(broken.outputs, session.reference.outputs)
    remaining = tuple(f"{f.code}@{f.module or '<root>'}" for f in (fixed_report.findings if fixed_report else ())
                      if f.severity == "error")
    steps = session.steps if fixed.trained else 1
    need = min(steps, ref.finite_steps) if fixed.trained else 1

    reasons: list[str] = []
    if fixed_report is None:
        reasons.append(f"the fixed step could not be diagnosed ({diag_error})")
    elif not fixed_report.ok:
        reasons.append(f"the fixed step still has error findings: {', '.join(remaining)}")
    still = [t for t in targets if fixed_report is not None and t in _labels(fixed_report)]
    if still:
        reasons.append(f"the finding it was proposed for is still reported: {', '.join(still)}")
    requested = plan.spec_changes.get("precision")
    old = compute_dtype(spec.precision, session.report)
    if requested in PRECISION_DTYPE and fixed_report is not None and PRECISION_DTYPE[requested] != old \
            and old != "float32":
        forward = {str(layer.get("dtype", "")) for layer in fixed_report.layers if layer.get("phase") == "forward"}
        if old in forward:
            reasons.append(f"the precision switch to {requested} did not take effect: forward ops still run in {old} "
                           "(the step casts or autocasts by itself: change the dtype there)")
    if fixed.exc:
        reasons.append(f"the fixed run raised {fixed.exc}")
    if fixed.forward_only:
        if not _finite_curve(fixed):
            reasons.append("the fixed output is not finite")
        if o_err is None:
            reasons.append("no finite fp32 output to compare with")
        elif o_err > tol["output"]:
            reasons.append(f"output relative error {o_err:.3g} > tolerance {tol['output']:.3g} ({dtype})")
    else:
        if fixed.finite_steps < need:
            reasons.append(f"only {fixed.finite_steps}/{steps} steps finite (fp32: {ref.finite_steps})")
        if first is None:
            reasons.append("no finite fp32 loss to compare with")
        elif first > tol["loss"]:
            reasons.append(f"first-step loss relative error {first:.3g} > tolerance {tol['loss']:.3g} ({dtype})")
        if over is not None and fixed.trained and over > tol["curve"] and fixed.finite_steps >= need:
            reasons.append(f"{steps}-step loss curve relative error {over:.3g} > tolerance {tol['curve']:.3g}")
        if g_err is not None and g_err > tol["grad"]:
            reasons.append(f"gradient relative error {g_err:.3g} > tolerance {tol['grad']:.3g}")
        if g_lost is not None and g_lost > tol["lost"]:
            reasons.append(f"{g_lost:.1%} of the gradient elements fp32 computes are exactly 0 (tolerance "
                           f"{tol['lost']:.1%})")
    verified = not reasons
    extra: dict[str, Any] = {}
    if fixed.clamped:
        extra["clamped_values"] = fixed.clamped
    if "fix" in reference_kind and ref_orig_loss is not None:
        extra["loss_fp32_original"] = ref_orig_loss
    if fixed.optimizer:
        extra["optimizer"] = fixed.optimizer
    if broken.exc:
        extra["broken_exception"] = broken.exc
    if fixed.exc:
        extra["fixed_exception"] = fixed.exc
    return Verification(
        fix_id=plan.id, params=dict(plan.params), verified=verified,
        reason="all checks passed" if verified else "; ".join(reasons), description=plan.description, dtype=dtype,
        tolerance=tol, reference=reference_kind, steps=steps, trained=fixed.trained,
        loss_fp32=loss_ref, loss_broken=broken.losses[0] if broken.losses else None, loss_fixed=loss_fixed,
        max_rel_err_first_step=first, max_rel_err_curve=over, steps_finite=_finite_count(fixed, steps),
        steps_finite_broken=_finite_count(broken, steps), max_rel_err_curve_broken=over_broken,
        grad_rel_err=g_err, grad_rel_err_broken=gb_err,
        grad_lost_fraction=g_lost, grad_lost_fraction_broken=gb_lost, output_rel_err=o_err,
        output_rel_err_broken=ob_err, report_ok=None if fixed_report is None else fixed_report.ok,
        remaining=remaining, findings_before=_labels(session.report),
        findings_after=_labels(fixed_report) if fixed_report is not None else (), extra=extra,
        curve_fp32=tuple(ref.losses), curve_broken=tuple(broken.losses),
        curve_fixed=tuple(fixed.losses))


# ---------------------------------------------------------------------------------------------------------------
# public entry points


def resolve_spec(scenario: Any) -> StepSpec:
    """A :class:`StepSpec` from a spec, a scenario file path, a built-in scenario name or a module with make()."""
    if isinstance(scenario, StepSpec):
        return scenario
    if isinstance(scenario, (str, os.PathLike)):
        path = os.fspath(scenario)
        with saved_rng():  # importing the file and make() draw random numbers: not from the caller's stream
            if os.path.isfile(path):
                return spec_from_module(load_scenario_module(path), source=path)
            from ampdoctor.scenarios import BUILTIN, load_scenario

            if path in BUILTIN:
                mod = load_scenario(path)
                return spec_from_module(mod, source=getattr(mod, "__file__", path) or path)
        raise ScenarioError(f"scenario {path!r} is neither a file nor a built-in scenario ({', '.join(BUILTIN)})")
    if callable(getattr(scenario, "make", None)):
        with saved_rng():
            return spec_from_module(scenario, source=getattr(scenario, "__file__", "") or "")
    raise TypeError(f"scenario must be a StepSpec, a scenario file path, a built-in scenario name or a module with "
                    f"make(), got {type(scenario).__name__}")


def _same_scope(a: FixProposal, b: FixProposal) -> bool:
    lists = ("modules", "module", "parameters")
    return a.id == b.id and {k: v for k, v in a.params.items() if k not in lists} == {
        k: v for k, v in b.params.items() if k not in lists}


def merged_params(report: Report, proposal: FixProposal) -> dict[str, Any]:
    """``proposal.params`` with the module/parameter lists of every finding that proposes the same fix merged in
    (two fully masked softmaxes in two layers need one safe_mask over both)."""
    params = dict(proposal.params)
    for key in ("modules", "parameters"):
        if key not in params:
            continue
        names = list(params[key])
        for f in report.findings:
            for p in f.fixes:
                if _same_scope(p, proposal):
                    names += [n for n in p.params.get(key, []) if n not in names]
        params[key] = names
    return params


def targets_of(report: Report, proposal: FixProposal) -> tuple[str, ...]:
    """``code@module`` of every finding that proposes this fix (its module lists merged): what it must cure."""
    return tuple(dict.fromkeys(f"{f.code}@{f.module or '<root>'}" for f in report.findings
                               if any(_same_scope(p, proposal) for p in f.fixes)))


def _finding_of(report: Report, proposal: FixProposal) -> Finding | None:
    return next((f for f in report.findings if any(p is proposal for p in f.fixes)), None) or next(
        (f for f in report.findings if any(p == proposal for p in f.fixes)), None)


def _proposal_for(report: Report, which: str) -> tuple[FixProposal, Finding]:
    for f in report.findings:
        for p in f.fixes:
            if p.id == which:
                return p, f
    proposed = sorted({p.id for f in report.findings for p in f.fixes if p.id})
    raise ValueError(f"no finding proposes fix {which!r}; proposed fixes: {', '.join(proposed) or 'none'} "
                     f"(registered: {', '.join(sorted(FIXES))})")


def verify(proposal: FixProposal | str, scenario: Any, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
           report: Report | None = None) -> Verification:
    """Apply one fix to a step, re-diagnose it and train ``steps`` steps next to fp32; return the numbers.

    >>> from ampdoctor.fixes import verify
    >>> v = verify("switch_precision", "t5_fp16_amp_ff_overflow")      # doctest: +SKIP
    >>> v.verified, v.loss_fp32, v.loss_broken, v.loss_fixed          # doctest: +SKIP
    (True, 4.87, nan, 4.87)

    ``proposal`` is a fix id (the first proposal with that id in the step's diagnosis) or a
    :class:`FixProposal`: its ``params`` are used as given, unless ``report`` (the diagnosis it came from) is
    passed, in which case module/parameter lists of the same fix proposed by other findings are merged in and the
    diagnosis is not run again. ``scenario`` is a :class:`StepSpec`, a scenario file, a built-in scenario name
    or a module with ``make()``. Everything runs on copies; the caller's objects and RNG state are left as they
    were. Cost: two diagnoses (original, fixed) and four or five untraced ``steps``-step runs (fp32, rounded-start
    fp32, original target, fixed target); one host sync per step and run.
    """
    check_args(steps, policy)
    spec = resolve_spec(scenario)
    session = Session(spec, steps=steps, policy=policy, report=report)
    finding: Finding | None = None
    if isinstance(proposal, str):
        proposal, finding = _proposal_for(session.report, proposal)
    elif isinstance(proposal, FixProposal):
        finding = _finding_of(report, proposal) if report is not None else None
    else:
        raise TypeError(f"proposal must be a FixProposal or a fix id (str), got {type(proposal).__name__}")
    if not proposal.id:
        raise ValueError(f"fix {proposal.title!r} is advice without an automatic action (no id); it cannot be "
                         "verified automatically")
    params = merged_params(session.report, proposal) if finding is not None else dict(proposal.params)
    plan = build_plan(proposal.id, params, session.context(finding.module if finding is not None else ""))
    return session.verify(plan, targets_of(session.report, proposal) if finding is not None else ())


def diagnose_and_fix(spec: Any, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
                     until_verified: bool = False) -> Report:
    """Diagnose a step and verify every fix the findings propose; fixes are annotated and ordered verified-first.

    >>> report = diagnose_and_fix("t5_fp16_amp_ff_overflow")          # doctest: +SKIP
    >>> [(p.id, p.verified) for p in report.findings[0].fixes]       # doctest: +SKIP
    [('keep_fp32', True), ('switch_precision', True)]

    Each proposal with an id gets ``verified`` True/False and ``verification`` (see :class:`Verification`); its
    ``params`` become the merged ones that were verified (so :func:`ampdoctor.fixes.fix` applies exactly that).
    Within a finding: verified fixes first, then advice without an action, then fixes that failed. A fix
    proposed by several findings is verified once. ``spec``: as ``scenario`` of :func:`verify`.
    ``until_verified=True`` stops at the first verified fix (findings in report order, fixes in proposal order);
    the fixes after it keep ``verified=None`` -- enough for ``fix(model, report)`` and much cheaper.
    """
    if not isinstance(until_verified, bool):
        raise TypeError(f"until_verified must be a bool, got {type(until_verified).__name__}")
    check_args(steps, policy)
    spec = resolve_spec(spec)
    session = Session(spec, steps=steps, policy=policy)
    report = session.report
    done: dict[tuple[str, str], tuple[dict[str, Any], Verification | None, str]] = {}
    findings = []
    for f in report.findings:
        fixes = []
        for p in f.fixes:
            if not p.id or p.id not in FIXES:
                fixes.append(p)
                continue
            params = merged_params(report, p)
            key = (p.id, repr(sorted(params.items())))
            if key not in done and until_verified and any(v is not None and v.verified for _, v, _ in done.values()):
                fixes.append(p)
                continue
            if key not in done:
                try:
                    plan = build_plan(p.id, params, session.context(f.module))
                    done[key] = (plan.params, session.verify(plan, targets_of(report, p)), "")
                except (ValueError, TypeError) as e:
                    done[key] = (params, None, f"{type(e).__name__}: {e}")
            used, v, err = done[key]
            if v is None:
                fixes.append(replace(p, verified=False, verification={"verified": False, "reason": err}))
            else:
                fixes.append(replace(p, params=dict(used), verified=v.verified, verification=v.to_dict()))
        order = {True: 0, None: 1, False: 2}
        fixes.sort(key=lambda x: order[x.verified])
        findings.append(replace(f, fixes=tuple(fixes)))
    return replace(report, findings=tuple(findings))


__all__ = ["DEFAULT_STEPS", "Session", "Verification", "apply_plan", "diagnose_and_fix",
           "merged_params", "resolve_spec", "verify"]
