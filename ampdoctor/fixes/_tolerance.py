"""How far a correct run may be from fp32: tolerances per compute dtype, and the error measures they bound.

The rule and the measurements behind the numbers: ``docs/fixes.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampdoctor.findings import Report
from ampdoctor.trace import HALF_DTYPES, dtype_name

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

    def scaled(self, noise: dict[str, float | None],
               healthy: dict[str, float | None] | None = None) -> dict[str, Any]:
        """The bounds for one step: each floor, raised to ``FACTOR`` x the measured rounding noise and to
        ``HEALTHY_FACTOR`` x the error of the healthy run in the same precision, where those are larger.

        ``healthy`` is None when no healthy run could be measured; its ``grad``/``lost`` may be inf (the healthy
        run's GradScaler skipped step 0: its gradients are not finite either, and the gradient bound is then
        off). The healthy term never raises a bound above :data:`HEALTHY_CAP` (a relative error).
        """
        out: dict[str, Any] = {"dtype": self.dtype, "u": self.u, "lost": self.lost, "factor": FACTOR,
                               "healthy_factor": HEALTHY_FACTOR}
        for key in ("loss", "curve", "grad", "output", "lost"):
            bound = self.lost if key == "lost" else getattr(self, key) * self.u
            n = noise.get(key)
            if n is not None and math.isfinite(n):
                bound = max(bound, FACTOR * n)
            h = (healthy or {}).get(key)
            if h is not None and not math.isnan(h):
                cap = math.inf if key in ("grad", "lost") and math.isinf(h) else HEALTHY_CAP
                bound = max(bound, min(HEALTHY_FACTOR * h, cap))
            out[key] = bound
        out["noise"] = dict(noise)
        out["healthy"] = dict(healthy) if healthy is not None else None
        return out


#: Multiple of a step's own rounding noise (the fp32 run started from weights and inputs rounded to the dtype)
#: that a correct run may reach: twice the largest ratio measured on healthy models (3.9, docs/fixes.md).
FACTOR = 8.0
#: Multiple of the error of the *healthy run in the same precision* (the step with the modules the diagnosis
#: implicates kept in float32, see docs/fixes.md) that a correct fix may reach. Measured by
#: ``bench/calibrate_verification.py`` (results in ``bench/results/calibration.md``).
HEALTHY_FACTOR = 2.0
#: The healthy term never allows more than this relative error (loss, curve, output): past it, a run is not
#: "the same training" as fp32, however the healthy run behaves.
HEALTHY_CAP = 0.05
#: Floors in units of u. Largest errors measured on 8 healthy models (docs/fixes.md): first-step loss 1.84u,
#: 20-step AMP curve 0.58u, gradients 11.7u, forward outputs 1.38u.
TOLERANCES: dict[str, Tolerance] = {
    "float16": Tolerance("float16", 2.0 ** -11, loss=8, curve=8, grad=16, output=8),
    "bfloat16": Tolerance("bfloat16", 2.0 ** -8, loss=8, curve=8, grad=16, output=8),
    "float8_e4m3fn": Tolerance("float8_e4m3fn", 2.0 ** -4, loss=8, curve=8, grad=16, output=8),
    "float8_e5m2": Tolerance("float8_e5m2", 2.0 ** -3, loss=8, curve=8, grad=16, output=8),
    "float32": Tolerance("float32", 2.0 ** -24, loss=64, curve=256, grad=512, output=64),
}
ROUND_DTYPES = {dtype_name(d): d for d in HALF_DTYPES}
PRECISION_DTYPE = {"fp16": "float16", "fp16-amp": "float16", "bf16": "bfloat16", "bf16-amp": "bfloat16",
                    "fp8": "float8_e4m3fn", "fp8-e4m3": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2"}
_LOWEST_FIRST = ("float8_e5m2", "float8_e4m3fn", "bfloat16", "float16")


def compute_dtype(precision: str | None, report: Report | None) -> str:
    """The dtype a step computes in: its precision's, else the coarsest one its traced ops used (else float32)."""
    if precision in PRECISION_DTYPE:
        return PRECISION_DTYPE[precision]
    seen = {row.dtype for row in (report.layer_stats if report is not None else ())}
    return next((d for d in _LOWEST_FIRST if d in seen), "float32")


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




__all__ = ["FACTOR", "HEALTHY_CAP", "HEALTHY_FACTOR", "PRECISION_DTYPE", "ROUND_DTYPES", "TOLERANCES", "Tolerance",
           "compute_dtype", "curve_err",
           "grad_errors", "output_err", "rel_err"]
