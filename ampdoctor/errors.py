"""Every error ampdoctor raises on purpose, in one hierarchy under :class:`AmpDoctorError`.

Messages say what happened, where (module path, op, dtype, step) and what to do. Each subclass also derives from
the builtin a caller would expect (a bad scenario is a ``ValueError``), so ``except ValueError`` keeps working.
The classes are re-exported where they were first defined (``ampdoctor.precision.ScenarioError``, ...).

>>> from ampdoctor.errors import AmpDoctorError, ScenarioError
>>> issubclass(ScenarioError, AmpDoctorError) and issubclass(ScenarioError, ValueError)
True
"""

from __future__ import annotations

__all__ = [
    "AmpDoctorError",
    "AnomalyError",
    "DiagnosisError",
    "NoFixError",
    "ReportFormatError",
    "ReproducerError",
    "ScenarioError",
]


class AmpDoctorError(Exception):
    """Base class of every error ampdoctor raises on purpose. Messages say what, where and what to do."""


class ScenarioError(AmpDoctorError, ValueError):
    """The model, batch, loss or scenario file cannot be run as given."""


class DiagnosisError(AmpDoctorError, RuntimeError):
    """The target run crashed and no rule explains the crash."""


class NoFixError(AmpDoctorError, ValueError):
    """The report has no fix that can be applied as asked."""


class ReportFormatError(AmpDoctorError, ValueError):
    """A file given to :func:`ampdoctor.report.load_report` is not an ampdoctor report this version can read."""


class ReproducerError(AmpDoctorError):
    """A reproducer cannot be written, read or replayed; the message says which file and what to do."""


class AnomalyError(AmpDoctorError):
    """Raised by a watch with ``on_anomaly="raise"``: what went wrong, at which step, where, what to do.

    ``kind`` is one of ``"nonfinite-loss"``, ``"nonfinite-grads"``, ``"grad-spike"``, ``"loss-scale-collapse"``;
    ``reproducer`` is the path written (or ``None``).
    """

    def __init__(self, message: str, *, kind: str, step: int, reproducer: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.step = step
        self.reproducer = reproducer
