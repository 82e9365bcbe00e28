"""What calibrating fix verification needs, as a public API (``bench/calibrate_verification.py`` and the
calibration tests use it): a verification :class:`Session` with its baseline curves (fp32 reference, the broken
target run, the healthy run with the implicated modules in fp32), a :func:`placebo` plan that changes nothing and
so must never verify, and the error measures and factors the tolerances are built from (``docs/fixes.md``).

>>> from ampdoctor.fixes.calibration import Session, placebo, resolve_spec
>>> session = Session(resolve_spec("t5_fp16_amp_ff_overflow"), steps=10)      # doctest: +SKIP
>>> session.verify(placebo(session.implicated())).verified                   # doctest: +SKIP
False
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ampdoctor.fixes._actions import FixPlan
from ampdoctor.fixes._session import Session
from ampdoctor.fixes._tolerance import (
    HEALTHY_CAP,
    HEALTHY_FACTOR,
    TOLERANCES,
    compute_dtype,
    curve_err,
    grad_errors,
)
from ampdoctor.fixes._verify import resolve_spec, targets_of


def placebo(modules: Iterable[str]) -> FixPlan:
    """A fix that changes nothing: each named module's forward wrapped in a function that calls it. Verification
    must reject it wherever the step is broken (the finding stays reported, the run stays non-finite)."""
    names = list(modules)

    def wrap(model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        for name in names:
            m = model.get_submodule(name)
            inner = m.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                return _inner(*args, **kwargs)

            m.forward = forward  # type: ignore[method-assign]

    return FixPlan("placebo", {"modules": names}, "a no-op forward wrapper", "", (wrap,))


__all__ = ["HEALTHY_CAP", "HEALTHY_FACTOR", "TOLERANCES", "Session", "compute_dtype", "curve_err", "grad_errors",
           "placebo", "resolve_spec", "targets_of"]
