"""ampdoctor: find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy.

>>> import torch, ampdoctor
>>> from torch import nn
>>> gen = torch.Generator().manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
>>> with torch.no_grad():                 # weights whose products outgrow fp16's 65504
...     _ = model[0].weight.copy_(torch.randn(8, 8, generator=gen) * 3000)
>>> report = ampdoctor.diagnose(model, torch.randn(4, 8, generator=gen) * 10, precision="fp16")
>>> f = report.findings[0]
>>> report.ok, f.code, f.module, f.op, f.phase
(False, 'overflow', '0', 'aten.addmm.default', <Phase.FORWARD: 'forward'>)

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
