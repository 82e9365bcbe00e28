"""A verification session: the original step's diagnosis and its baseline curves (fp32, target, rounded-start
fp32, the healthy run), computed once and shared by every fix verified against that step."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ampdoctor.findings import Report
from ampdoctor.fixes._actions import FixContext, FixPlan
from ampdoctor.fixes._curve import Curve, run_curve
from ampdoctor.fixes._scope import KeepFp32
from ampdoctor.fixes._tolerance import ROUND_DTYPES
from ampdoctor.fixes._verdict import Verification, verify_plan
from ampdoctor.precision import MAX_STEPS, StepSpec

#: Training steps of a verification curve.
DEFAULT_STEPS = 20


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
        return verify_plan(self, plan, targets)

