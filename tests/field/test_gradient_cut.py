"""unused-parameters tells a cut autograd graph (the parameters' values reach the loss through the traced ops,
no gradient comes back) from an unwired module (they never reach it), by data flow, not by module names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor


class Student(nn.Module):
    """A student and a teacher; ``cut`` runs the teacher under no_grad (its params still require grad)."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.teacher = nn.Linear(8, 8)
        self.student = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)  # never reaches the output: an unwired module
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cut == "no_grad":
            with torch.no_grad():
                t = self.teacher(x)
        else:
            t = self.teacher(x).detach()
        self.side(x)
        return self.student(x) + t


def _diagnose(cut: str, with_opt: bool) -> ampdoctor.Report:
    torch.manual_seed(0)
    m = Student(cut)
    opt = torch.optim.SGD(m.parameters(), lr=0.1) if with_opt else None
    return ampdoctor.diagnose(m, torch.randn(4, 8), precision="bf16-amp", optimizer=opt,
                              loss_fn=lambda out, batch: F.mse_loss(out.float(), batch))


def _by_module(report: ampdoctor.Report) -> dict[str, ampdoctor.Finding]:
    return {f.module: f for f in report.findings if f.code == "unused-parameters"}


def test_cut_graph_is_an_error_when_the_optimizer_trains_it() -> None:
    for cut in ("no_grad", "detach"):
        found = _by_module(_diagnose(cut, with_opt=True))
        t, side = found["teacher"], found["side"]
        assert t.severity == "error" and t.evidence["reaches_loss"] and t.evidence["in_optimizer"], cut
        assert "cut" in t.explanation and "use_reentrant=False" in t.fixes[0].snippet
        assert side.severity == "warning" and not side.evidence["reaches_loss"], cut  # unwired, as before
        assert "student" not in found


def test_cut_graph_without_an_optimizer_stays_a_warning() -> None:
    """A frozen teacher under no_grad that merely lacks requires_grad_(False): nothing says it should train."""
    found = _by_module(_diagnose("no_grad", with_opt=False))
    assert found["teacher"].severity == "warning" and found["teacher"].evidence["reaches_loss"]
    assert not found["teacher"].evidence["in_optimizer"]
