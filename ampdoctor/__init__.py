"""ampdoctor: find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy.

>>> import ampdoctor
>>> report = ampdoctor.diagnose(model, batch, precision="fp16-amp")   # doctest: +SKIP
>>> report.findings[0].code, report.findings[0].module                # doctest: +SKIP
('overflow', 'encoder.block.0.layer.1.DenseReluDense.wo')

``ampdoctor.watch(...)`` is the always-on guard (a function); its reproducers replay with
``ampdoctor.replay(path, model_factory=...)``.
"""

from ampdoctor.diagnose import diagnose, diagnose_file
from ampdoctor.diagnose_generate import diagnose_generate
from ampdoctor.errors import AmpDoctorError, AnomalyError
from ampdoctor.findings import CODES, Finding, FixProposal, Report
from ampdoctor.fixes import diagnose_and_fix, fix, verify
from ampdoctor.precision.headroom import headroom
from ampdoctor.trace import trace
from ampdoctor.watch import load_reproducer, replay, watch

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "AmpDoctorError",
    "CODES",
    "Finding",
    "FixProposal",
    "Report",
    "diagnose",
    "diagnose_file",
    "diagnose_generate",
    "trace",
    "headroom",
    "diagnose_and_fix",
    "fix",
    "verify",
    "watch",
    "replay",
    "load_reproducer",
    "AnomalyError",
]
