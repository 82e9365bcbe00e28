"""Verification: re-diagnose with a fix applied, and train K steps next to an fp32 reference.

A fix is *verified* when (1) :func:`ampdoctor.diagnose` of the fixed step finds no error, (2) the loss of the first
step matches the fp32 reference within the tolerance of the dtype the step computes in, (3) every one of K training
steps stays finite and the K-step loss curve stays within tolerance of the fp32 curve, and (4) where the step's
gradients can be read, they match fp32 (norm-wise) and none that fp32 computes is lost to zero. Tolerances and
their derivation: ``docs/fixes.md`` and :data:`TOLERANCES`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ampdoctor.findings import Finding, FixProposal, Report
from ampdoctor.findings._types import _jsonable
from ampdoctor.fixes._actions import FIXES, FixContext, FixPlan, _ClampHook, build_plan, map_tensors, scopes_of
from ampdoctor.precision import ScenarioError, StepSpec, load_scenario_module, spec_from_module
from ampdoctor.precision._runner import (
    LOW_DTYPES,
    _bind_train_step,
    _cast_batch,
    _device_of,
    _fp8_context,
    _NoAutocast,
    _precision_context,
    call_model,
    copy_objects,
    default_loss,
    saved_rng,
)
from ampdoctor.trace import iter_tensors

log = logging.getLogger(__name__)

#: Training steps of a verification curve.
DEFAULT_STEPS = 20
#: Relative size of the first SGD update when a scenario has no optimizer of its own (see ``_sgd_lr``).
SGD_STEP = 1e-3


# ---------------------------------------------------------------------------------------------------------------
# tolerances


@dataclass(frozen=True)
class Tolerance:
    """How far a correct run computing in ``dtype`` may be from fp32: ``floor * u`` or ``FACTOR`` times the noise
    of this very computation, whichever is larger (``docs/fixes.md`` has the measurements).

    ``u`` is the dtype's unit roundoff; the floors are multiples of it (``loss``/``curve``/``output`` relative
    errors, ``grad`` the norm-wise relative gradient error); ``lost`` is the largest fraction of significant
    gradient elements that may be exactly zero where fp32's are not.
    """

    dtype: str
    u: float
    loss: float
    curve: float
    grad: float
    output: float
    lost: float = 1e-2

    def scaled(self, noise: dict[str, float | None]) -> dict[str, Any]:
        """The bounds for one step: each floor, raised to ``FACTOR`` x the measured noise where that is larger."""
        out: dict[str, Any] = {"dtype": self.dtype, "u": self.u, "lost": self.lost, "factor": FACTOR}
        for key in ("loss", "curve", "grad", "output"):
            floor = getattr(self, key) * self.u
            n = noise.get(key)
            out[key] = max(floor, FACTOR * n) if n is not None and math.isfinite(n) else floor
        out["noise"] = dict(noise)
        return out


#: Multiple of a step's own rounding noise (the fp32 run started from weights and inputs rounded to the dtype)
#: that a correct run may reach: twice the largest ratio measured on healthy models (3.9, docs/fixes.md).
FACTOR = 8.0
#: Floors in units of u. Largest errors measured on 8 healthy models (docs/fixes.md): first-step loss 1.84u,
#: 20-step AMP curve 0.58u, gradients 11.7u, forward outputs 1.38u.
TOLERANCES: dict[str, Tolerance] = {
    "float16": Tolerance("float16", 2.0 ** -11, loss=8, curve=8, grad=16, output=8),
    "bfloat16": Tolerance("bfloat16", 2.0 ** -8, loss=8, curve=8, grad=16, output=8),
    "float8_e4m3fn": Tolerance("float8_e4m3fn", 2.0 ** -4, loss=8, curve=8, grad=16, output=8),
    "float8_e5m2": Tolerance("float8_e5m2", 2.0 ** -3, loss=8, curve=8, grad=16, output=8),
    "float32": Tolerance("float32", 2.0 ** -24, loss=64, curve=256, grad=512, output=64),
}
_ROUND_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_PRECISION_DTYPE = {"fp16": "float16", "fp16-amp": "float16", "bf16": "bfloat16", "bf16-amp": "bfloat16",
                    "fp8": "float8_e4m3fn", "fp8-e4m3": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2"}
_LOWEST_FIRST = ("float8_e5m2", "float8_e4m3fn", "bfloat16", "float16")


def compute_dtype(precision: str | None, report: Report | None) -> str:
    """The dtype a step computes in: its precision's, else the coarsest one its traced ops used (else float32)."""
    if precision in _PRECISION_DTYPE:
        return _PRECISION_DTYPE[precision]
    seen = {str(layer.get("dtype", "")) for layer in (report.layers if report is not None else ())}
    return next((d for d in _LOWEST_FIRST if d in seen), "float32")


# ---------------------------------------------------------------------------------------------------------------
# the K-step curve (untraced)


@dataclass
class Curve:
    """Losses of K steps of one run, and what step 0 left behind (gradients or outputs)."""

    losses: list[float | None] = field(default_factory=list)
    grads: dict[str, torch.Tensor | None] | None = None
    outputs: list[torch.Tensor] | None = None
    forward_only: bool = False
    trained: bool = False
    exc: str = ""
    lr: float | None = None
    optimizer: str = ""
    clamped: int = 0

    @property
    def finite_steps(self) -> int:
        n = 0
        for v in self.losses:
            if v is None or not math.isfinite(v):
                break
            n += 1
        return n


def _prepare(spec: StepSpec, reference: bool, round_to: torch.dtype | None = None) -> tuple[nn.Module, Any, Any, Any]:
    """Copies of the step's objects cast as the runner casts them, with the spec's transforms applied.

    ``round_to`` (reference only): round the floating parameters, buffers and batch tensors to that dtype and back,
    so the fp32 run starts from exactly what a run in that dtype starts from.
    """
    model, opt, scaler = copy_objects(spec)
    batch = copy.deepcopy(spec.batch)
    if reference:
        if any(t.is_floating_point() and t.dtype != torch.float32
               for t in list(model.parameters()) + list(model.buffers())):
            model.to(torch.float32)
            if opt is not None:
                for st in opt.state.values():
                    for k, v in list(st.items()):
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                            st[k] = v.to(torch.float32)
        batch = _cast_batch(batch, torch.float32, only_low=True)
        if round_to is not None:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    if t.is_floating_point():
                        t.copy_(t.to(round_to).to(t.dtype))
            batch = map_tensors(batch, lambda t: t.to(round_to).to(t.dtype) if t.is_floating_point() else t)
    elif spec.precision in LOW_DTYPES:
        model.to(LOW_DTYPES[spec.precision])
        batch = _cast_batch(batch, LOW_DTYPES[spec.precision])
    for transform in spec.transforms:
        transform(model, opt, scaler)
    return model, opt, scaler, batch


def _sgd_lr(model: nn.Module, loss: float, evaluate: Any) -> float:
    """A learning rate for a step that has no optimizer: backtracking (Armijo) on the fp32 reference.

    Starts from the rate whose update moves the weights by ``SGD_STEP`` of their norm and divides it by 4 until
    the update lowers the loss by at least half of what the gradient predicts (at most 12 tries). ``evaluate()``
    runs the forward on the current weights and returns the loss (the caller's RNG state is restored around it).
    Host syncs: one per try.
    """
    ps = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in ps if p.grad is not None]
    if not ps or not math.isfinite(loss):
        return SGD_STEP
    w = float(torch.stack([p.detach().float().norm() for p in ps]).norm())
    g2 = float(torch.stack([g.detach().float().norm() for g in grads]).norm() ** 2)
    if not (math.isfinite(w) and math.isfinite(g2)) or g2 == 0.0 or w == 0.0:
        return SGD_STEP
    lr = SGD_STEP * w / math.sqrt(g2)
    saved = [p.detach().clone() for p in ps]
    try:
        for _ in range(12):
            with torch.no_grad():
                for p, p0, g in zip(ps, saved, grads):
                    p.copy_(p0 - lr * g.to(p0.dtype))
            trial = evaluate()
            if trial is not None and math.isfinite(trial) and trial <= loss - 0.5 * lr * g2:
                break
            lr /= 4.0
    finally:
        with torch.no_grad():
            for p, p0 in zip(ps, saved):
                p.copy_(p0)
    return lr


def run_curve(spec: StepSpec, *, reference: bool, steps: int, policy: str = "cuda", lr: float | None = None,
              round_to: torch.dtype | None = None) -> Curve:
    """Run ``steps`` steps of ``spec`` on copies (fp32 reference or target precision) without tracing.

    With no optimizer and no ``train_step``, plain SGD is added so the curve trains; its learning rate is ``lr``
    or, when ``None``, found by backtracking on this run (:func:`_sgd_lr`; pass the reference's to the others).
    ``round_to`` (reference only) starts from weights and inputs rounded to that dtype. A forward-only step runs
    once. Step 0's gradients are kept, unscaled. Host syncs: one per step (the loss).
    """
    model, opt, scaler, batch = _prepare(spec, reference, round_to)
    device = _device_of(model)
    precision = None if reference else spec.precision
    amp = contextlib.nullcontext() if reference else _precision_context(precision, device, policy)
    no_autocast = _NoAutocast(device.type) if reference else contextlib.nullcontext()
    fp8 = contextlib.nullcontext() if reference else _fp8_context(precision, model)
    kw = _bind_train_step(spec.train_step, opt, scaler) if spec.train_step is not None else {}
    curve = Curve(trained=True, optimizer=type(opt).__name__ if opt is not None else "")
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        with saved_rng(), no_autocast, fp8:
            for step in range(steps):
                if spec.train_step is not None:
                    with amp:
                        loss = spec.train_step(model, batch, **kw)
                    curve.losses.append(_value(loss))
                    continue
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                with amp:
                    out = call_model(model, batch)
                    loss = spec.loss_fn(out, batch) if spec.loss_fn is not None else default_loss(out)
                if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                    curve.forward_only, curve.trained = True, False
                    curve.outputs = [t.detach().float().clone() for t in iter_tensors(out) if t.is_floating_point()]
                    curve.losses.append(_value(loss))
                    break
                curve.losses.append(_value(loss))
                (scaler.scale(loss) if scaler is not None else loss).backward()
                if opt is None:
                    if lr is None:

                        def evaluate() -> float | None:
                            with saved_rng(), torch.no_grad(), amp:
                                o = call_model(model, batch)
                                return _value(spec.loss_fn(o, batch) if spec.loss_fn is not None else default_loss(o))

                        lr = _sgd_lr(model, curve.losses[-1] if curve.losses[-1] is not None else math.nan, evaluate)
                    curve.lr = lr
                    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=curve.lr)
                    curve.optimizer = f"SGD(lr={curve.lr:.3g}) (added: the step has no optimizer)"
                if step == 0:
                    if scaler is not None and scaler.is_enabled():
                        scaler.unscale_(opt)
                    curve.grads = {names.get(id(p), ""): None if p.grad is None else p.grad.detach().float().clone()
                                   for p in model.parameters() if p.requires_grad}
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
    except Exception as e:  # a crash is a result: the steps after it count as not finite
        curve.exc = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        log.info("verification run (%s) raised: %s", "reference" if reference else "target", curve.exc)
    curve.clamped = sum(h.clamped for h in scopes_of(model, _ClampHook))
    return curve


def _value(loss: Any) -> float | None:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return float(loss.detach().float())
    return None


# ---------------------------------------------------------------------------------------------------------------
# comparisons


def rel_err(x: float | None, ref: float | None) -> float | None:
    """``|x - ref| / |ref|``; inf when ``x`` is not finite, None when there is nothing to compare."""
    if x is None or ref is None or not math.isfinite(ref):
        return None
    if not math.isfinite(x):
        return math.inf
    return abs(x - ref) / max(abs(ref), 1e-30)


def curve_err(xs: list[float | None], refs: list[float | None]) -> float | None:
    errs = [e for e in (rel_err(x, r) for x, r in zip(xs, refs)) if e is not None]
    if len(xs) < len(refs):
        return math.inf
    return max(errs) if errs else None


def grad_errors(got: dict[str, torch.Tensor | None] | None,
                ref: dict[str, torch.Tensor | None] | None) -> tuple[float | None, float | None]:
    """Global relative error ``||g - g_ref|| / ||g_ref||`` and the fraction of significant reference gradient
    elements (``|g_ref| > 1e-3 * rms`` of their parameter's gradient) that are exactly 0 (or missing) in ``got``."""
    if got is None or ref is None:
        return None, None
    num, den = [], []
    lost, sig = [], []
    for name, r in ref.items():
        if r is None:
            continue
        g = got.get(name)
        if g is None or g.shape != r.shape:
            g = torch.zeros_like(r)
        num.append((g - r).norm() ** 2)
        den.append(r.norm() ** 2)
        rms = r.pow(2).mean().sqrt()
        significant = r.abs() > 1e-3 * rms
        sig.append(significant.sum())
        lost.append((significant & (g == 0)).sum())
    if not den:
        return None, None
    n, d = float(torch.stack(num).sum()), float(torch.stack(den).sum())
    s, lo = float(torch.stack(sig).sum()), float(torch.stack(lost).sum())
    err = math.sqrt(n / d) if d > 0 else (0.0 if n == 0 else math.inf)
    if not math.isfinite(n):
        err = math.inf
    return err, (lo / s if s > 0 else 0.0)


def output_err(got: list[torch.Tensor] | None, ref: list[torch.Tensor] | None) -> float | None:
    if got is None or ref is None or not ref:
        return None
    if len(got) != len(ref) or any(a.shape != b.shape for a, b in zip(got, ref)):
        return math.inf
    n = float(sum(((a - b).norm() ** 2 for a, b in zip(got, ref)), torch.tensor(0.0)))
    d = float(sum((b.norm() ** 2 for b in ref), torch.tensor(0.0)))
    if not math.isfinite(n):
        return math.inf
    return math.sqrt(n / d) if d > 0 else (0.0 if n == 0 else math.inf)


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


class Session:
    """The original step's diagnosis and its fp32/target curves, computed once and shared by several fixes."""

    def __init__(self, spec: StepSpec, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
                 report: Report | None = None) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if policy not in ("cuda", "native"):
            raise ValueError(f"invalid policy {policy!r}, expected 'cuda' or 'native'")
        self.spec, self.steps, self.policy = spec, steps, policy
        self._report = report
        self._reference: Curve | None = None
        self._broken: Curve | None = None
        self._noise: dict[tuple[str, str], Curve] = {}

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
        rd = _ROUND_DTYPES.get(dtype)
        if rd is None:
            return None
        if (key, dtype) not in self._noise:
            self._noise[(key, dtype)] = run_curve(spec, reference=True, steps=self.steps, policy=self.policy, lr=lr,
                                                  round_to=rd)
        return self._noise[(key, dtype)]

    def context(self, module: str = "") -> FixContext:
        s = self.spec
        return FixContext.of(s.model, s.precision, module, s.scaler, s.train_step)

    def verify(self, plan: FixPlan) -> Verification:
        return _verify_plan(self, plan)


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


def _noise_of(noise: Curve | None, ref: Curve) -> dict[str, float | None]:
    """Errors of the rounded-start fp32 run against the reference: the step's own rounding noise."""
    if noise is None or not _finite_curve(noise):
        return {"loss": None, "curve": None, "grad": None, "output": None}
    return {"loss": rel_err(noise.losses[0] if noise.losses else None, ref.losses[0] if ref.losses else None),
            "curve": curve_err(noise.losses, ref.losses) if noise.trained else None,
            "grad": grad_errors(noise.grads, ref.grads)[0], "output": output_err(noise.outputs, ref.outputs)}


def _verify_plan(session: Session, plan: FixPlan) -> Verification:
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
    tol = TOLERANCES.get(dtype, TOLERANCES["float16"]).scaled(noise)

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
    requested = plan.spec_changes.get("precision")
    old = compute_dtype(spec.precision, session.report)
    if requested in _PRECISION_DTYPE and fixed_report is not None and _PRECISION_DTYPE[requested] != old \
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
        if os.path.isfile(path):
            return spec_from_module(load_scenario_module(path), source=path)
        from ampdoctor.scenarios import BUILTIN, load_scenario

        if path in BUILTIN:
            mod = load_scenario(path)
            return spec_from_module(mod, source=getattr(mod, "__file__", path) or path)
        raise ScenarioError(f"scenario {path!r} is neither a file nor a built-in scenario ({', '.join(BUILTIN)})")
    if callable(getattr(scenario, "make", None)):
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
    return session.verify(plan)


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
                    done[key] = (plan.params, session.verify(plan), "")
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


def _fmt(x: Any) -> Any:
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return float(f"{x:.6g}")
    return x


def before_after_table(verifications: Any) -> list[dict[str, Any]]:
    """Rows for a before/after table: one per verification (a :class:`Verification`, its ``to_dict()``, an
    annotated :class:`FixProposal`, or every annotated proposal of a :class:`Report`).

    Keys: ``fix``, ``verified``, ``loss_fp32``, ``loss_broken``, ``loss_fixed``, ``max_rel_err_first_step``,
    ``max_rel_err_curve``, ``tolerance``, ``steps_finite`` ("fixed/K"), ``steps_finite_broken``, ``reason``.
    Numbers are rounded to 6 significant digits; inf/NaN become strings.
    """
    if isinstance(verifications, Report):
        items: list[Any] = [p for f in verifications.findings for p in f.fixes if p.verified is not None]
    elif isinstance(verifications, (Verification, FixProposal, dict)):
        items = [verifications]
    else:
        items = list(verifications)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for it in items:
        if isinstance(it, Verification):
            d = it.to_dict()
        elif isinstance(it, FixProposal):
            d = dict(it.verification)
        elif isinstance(it, dict):
            d = it
        else:
            raise TypeError(f"expected Verification, FixProposal, dict or Report, got {type(it).__name__}")
        if "fix_id" not in d:
            continue
        key = repr((d["fix_id"], d.get("params")))
        if key in seen:
            continue
        seen.add(key)
        steps = d.get("steps", 0)
        tol = d.get("tolerance", {})
        rows.append({
            "fix": d["fix_id"] + (f" {d['params'].get('modules') or d['params'].get('precision') or ''}".rstrip()
                                  if isinstance(d.get("params"), dict) and d["params"] else ""),
            "verified": bool(d.get("verified")),
            "loss_fp32": _fmt(_num(d.get("loss_fp32"))),
            "loss_broken": _fmt(_num(d.get("loss_broken"))),
            "loss_fixed": _fmt(_num(d.get("loss_fixed"))),
            "max_rel_err_first_step": _fmt(_num(d.get("max_rel_err_first_step"))),
            "max_rel_err_curve": _fmt(_num(d.get("max_rel_err_curve"))),
            "tolerance": _fmt(_num(tol.get("loss"))) if isinstance(tol, dict) else None,
            "steps_finite": f"{d.get('steps_finite', 0)}/{steps}",
            "steps_finite_broken": f"{d.get('steps_finite_broken')}/{steps}",
            "reason": d.get("reason", ""),
        })
    return rows


def _num(x: Any) -> Any:
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    return x


__all__ = ["DEFAULT_STEPS", "TOLERANCES", "Curve", "Session", "Tolerance", "Verification", "apply_plan",
           "before_after_table", "compute_dtype", "diagnose_and_fix", "merged_params", "resolve_spec", "run_curve",
           "verify"]
