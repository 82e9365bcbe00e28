"""ampdoctor: find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy.

>>> import ampdoctor
>>> report = ampdoctor.diagnose(model, batch, precision="fp16-amp")   # doctest: +SKIP
>>> report.findings[0].code, report.findings[0].module                # doctest: +SKIP
('overflow', 'encoder.block.0.layer.1.DenseReluDense.wo')
"""

__version__ = "0.1.0"


class AmpDoctorError(Exception):
    """Base class of every error ampdoctor raises on purpose. Messages say what, where and what to do."""


from ampdoctor import watch  # noqa: E402  (a callable module: ampdoctor.watch(...) and ampdoctor.watch.replay)
from ampdoctor.diagnose import diagnose, diagnose_file  # noqa: E402
from ampdoctor.findings._types import CODES, Finding, FixProposal, Report  # noqa: E402
from ampdoctor.fixes import diagnose_and_fix, fix, verify  # noqa: E402
from ampdoctor.precision.headroom import headroom  # noqa: E402
from ampdoctor.trace import trace  # noqa: E402
from ampdoctor.watch import AnomalyError  # noqa: E402

__all__ = [
    "__version__",
    "AmpDoctorError",
    "CODES",
    "Finding",
    "FixProposal",
    "Report",
    "diagnose",
    "diagnose_file",
    "trace",
    "headroom",
    "diagnose_and_fix",
    "fix",
    "verify",
    "watch",
    "AnomalyError",
]
