"""Calibrate fix verification: how far a *healthy* run in the same precision deviates from fp32, and how far the
known (community) fixes and a placebo do, on every case of ../shared/cases and the built-in demo scenarios.

For each case it runs one verification session (ampdoctor.fixes' own code paths, the shared step runner):
- the fp32 reference, the broken target run, the healthy run (the case's precision with the modules the
  diagnosis implicates kept in float32);
- every fix the diagnosis proposes, verified (``diagnose_and_fix``), with its errors against fp32;
- a placebo: a transform that wraps each implicated module's forward in a no-op wrapper.

It prints and writes ``bench/results/calibration.md``: per fix, its loss-curve and gradient errors in units of
the dtype's unit roundoff u and as a ratio to the healthy run's. ``HEALTHY_FACTOR`` in
``ampdoctor/fixes/_tolerance.py`` rests on the largest ratio a correct fix shows here.

    python bench/calibrate_verification.py [NAME_SUBSTRING ...]

Run under load (2 shared cores): the numbers are deterministic (seeded, CPU), only the wall time is noisy.
"""

from __future__ import annotations

import glob
import math
import os
import sys
import time
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
CASES_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "cases"))
BUILTIN = ("t5_fp16_amp_ff_overflow", "bert_unused_pooler")

from ampdoctor.fixes import diagnose_and_fix  # noqa: E402
from ampdoctor.fixes._actions import FixPlan  # noqa: E402
from ampdoctor.fixes._tolerance import HEALTHY_FACTOR, compute_dtype, curve_err, grad_errors  # noqa: E402
from ampdoctor.fixes._verify import Session, resolve_spec  # noqa: E402


def _placebo(modules: tuple[str, ...]) -> FixPlan:
    def wrap(model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        for name in modules:
            m = model.get_submodule(name)
            inner = m.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                return _inner(*args, **kwargs)

            m.forward = forward  # type: ignore[method-assign]

    return FixPlan("placebo", {"modules": list(modules)}, "a no-op forward wrapper", "", (wrap,))


def _u(x: Any, u: float) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return "inf" if math.isinf(x) else f"{x / u:.1f}u"


def _ratio(x: Any, h: Any) -> str:
    if not isinstance(x, float) or not isinstance(h, float) or h <= 0 or math.isinf(h):
        return "-"
    return "inf" if math.isinf(x) else f"{x / h:.2f}"


def calibrate(name: str, target: str) -> list[str]:
    spec = resolve_spec(target)
    session = Session(spec, steps=20)
    report = diagnose_and_fix(spec, steps=20)
    session._report = report  # the same diagnosis for the placebo (annotated fixes do not change it)
    dtype = compute_dtype(spec.precision, report)
    u = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}.get(dtype, 2.0 ** -24)
    mods = session.implicated()
    healthy = session.healthy(spec, dtype, session.reference.lr)
    ref = session.reference
    h_curve = curve_err(healthy.losses, ref.losses) if healthy is not None and healthy.trained else None
    h_grad = grad_errors(healthy.grads, ref.grads)[0] if healthy is not None else None
    rows = []
    seen = set()
    for f in report.findings:
        for p in f.fixes:
            v = p.verification
            if p.verified is None or "fix_id" not in v:
                continue
            key = (p.id, repr(v.get("params")))
            if key in seen:
                continue
            seen.add(key)
            c, g = v.get("max_rel_err_curve"), v.get("grad_rel_err")
            fu = float(v["tolerance"].get("u", u))  # a precision switch computes in another dtype
            same = fu == u
            rows.append(f"| {name} | {spec.precision} | {_u(h_curve, u)} / {_u(h_grad, u)} | {p.id} "
                        f"{(v['params'].get('modules') or v['params'].get('precision') or '')} | {_u(c, fu)} "
                        f"({_ratio(c, h_curve) if same else 'other dtype'}) | {_u(g, fu)} "
                        f"({_ratio(g, h_grad) if same else 'other dtype'}) | "
                        f"{'yes' if p.verified else 'no: ' + str(v.get('reason'))[:70]} |")
    if mods:
        pv = session.verify(_placebo(mods), tuple(f"{f.code}@{f.module or '<root>'}" for f in report.findings
                                                   if f.severity == "error"))
        rows.append(f"| {name} | {spec.precision} | | **placebo** | {_u(pv.max_rel_err_curve, u)} | "
                    f"{_u(pv.grad_rel_err, u)} | {'YES (defect)' if pv.verified else 'no: ' + pv.reason[:70]} |")
    return rows


def main(only: list[str]) -> None:
    targets = [(os.path.basename(p)[:-3], p) for p in sorted(glob.glob(os.path.join(CASES_DIR, "*.py")))]
    targets += [(n, n) for n in BUILTIN]
    if only:
        targets = [t for t in targets if any(w in t[0] for w in only)]
    lines = ["# Verification calibration", "",
             "Generated by `bench/calibrate_verification.py` (torch " + torch.__version__ + ", CPU, 20 steps). "
             "Errors against the fp32 reference in units of the compute dtype's unit roundoff u; in parentheses the "
             "ratio to the healthy run's error (same precision, the modules the diagnosis implicates in fp32). "
             f"`HEALTHY_FACTOR` = {HEALTHY_FACTOR:g} must exceed every ratio of a fix that is known to be correct. "
             "Most known fixes keep exactly the implicated modules in fp32 and so *are* the healthy run (ratio "
             "1.00); the factor is a margin for an equivalent but different set, not a measured spread.",
             "", "| case | precision | healthy curve / grad | fix | curve (ratio) | grad (ratio) | verified |",
             "|---|---|---|---|---|---|---|"]
    t0 = time.perf_counter()
    for name, target in targets:
        torch.manual_seed(0)
        try:
            rows = calibrate(name, target)
        except Exception as e:  # noqa: BLE001 - a case that cannot run is listed as such
            rows = [f"| {name} | | | error: {type(e).__name__}: {str(e)[:80]} | | | |"]
        for r in rows:
            print(r, flush=True)
        lines += rows
    lines += ["", f"Wall time {time.perf_counter() - t0:.0f} s on a loaded 2-core machine (indicative only)."]
    if not only:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(os.path.join(HERE, "results", "calibration.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
