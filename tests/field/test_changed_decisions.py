"""Changed decisions (argmax/topk/argmin) are an error only when the chosen indices select later computation.

The field cases ``moe-router-probs-bf16-topk`` (top-k routing, ``index_add``) and ``vq-codebook-argmin-bf16-amp``
(argmin, an embedding lookup) are errors; here the same near-tie flips without any op indexing with the result
(a predicted class returned for a metric) stay a warning, whatever the modules are called."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor


class Scorer(nn.Module):
    """Logits on a common offset of 60 (bf16 spaces values by 0.25 there): the argmax flips for many rows."""

    def __init__(self, route: bool) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Embedding(8, 16)
        self.route = route
        with torch.no_grad():
            self.a.weight.mul_(0.1)
            self.a.bias.fill_(60.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.a(x)
        idx = logits.argmax(-1)
        if self.route:  # the choice picks what is computed next: a lookup with the chosen index
            return self.b(idx).sum(-1) + logits.mean(-1)
        return logits.mean(-1) + 0 * idx  # the choice is only reported (an accuracy metric)


def _run(route: bool) -> ampdoctor.Finding:
    torch.manual_seed(0)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    r = ampdoctor.diagnose(Scorer(route), x, precision="bf16", loss_fn=lambda out, b: F.mse_loss(out.float(),
                                                                                                  torch.zeros(64)))
    return next(f for f in r.findings if "decisions_changed" in f.evidence)


def test_a_changed_choice_that_selects_computation_is_an_error() -> None:
    f = _run(route=True)
    assert f.severity == "error" and f.evidence["indexed_by"] > 0
    assert f.evidence["changed_fraction"] >= 0.05 and (f.module, f.op) == ("a", "aten.addmm.default")


def test_a_changed_choice_that_is_only_reported_stays_a_warning() -> None:
    f = _run(route=False)
    assert f.severity == "warning" and f.evidence["indexed_by"] == 0
    assert f.evidence["changed_fraction"] >= 0.05  # as many flips as above: only their use differs


class SoftmaxRouter(nn.Module):
    """Scores -> softmax in the activations' dtype -> top-2 -> gather. With logits below 1 in magnitude the
    softmax's relative condition number |l| is < 1: rounding the probabilities is coarser than the logits' rounding
    carried through, so the pick is blamed on the softmax (the element-error ranking alone named the addmm)."""

    def __init__(self, offset: float, spread: float) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.v = nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(spread)
            self.a.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.a(x).softmax(-1)
        w, idx = probs.topk(2, -1)
        picked = self.v(x).gather(1, idx)
        return (w * picked).sum(-1)


def _router(offset: float, spread: float) -> ampdoctor.Finding:
    torch.manual_seed(0)
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(2))
    r = ampdoctor.diagnose(SoftmaxRouter(offset, spread), x, precision="bf16",
                           loss_fn=lambda out, b: out.float().pow(2).mean())
    return next(f for f in r.findings if "decisions_changed" in f.evidence)


def test_near_uniform_probabilities_blame_the_softmax() -> None:
    f = _router(0.0, 0.02)  # logits |l| < 1: probabilities ~1/8 tie in bf16
    assert (f.module, f.op) == ("", "aten._softmax.default") and f.evidence["ties_created"] > 0

