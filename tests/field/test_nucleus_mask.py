"""A threshold on a low-precision running total is a decision: nucleus (top-p) sampling's ``cumsum > p`` mask.

Sorted probabilities summed in bfloat16 (``cumsum`` over the vocabulary: its rounding grows with the length) move
the row's kept set against fp32 in most rows; the mask then selects what is computed next (``masked_fill``), so
the comparison counts as a changed decision and the blame goes to the op that rounds, the cumsum. The logits are
multiples of 1/16 (exact in bfloat16) and the softmax/sort run in float32, so the cumsum is the only rounding: the
twin that sums in float32 is clean, and a mask that selects nothing stays clean too."""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


class Nucleus(nn.Module):
    def __init__(self, fp32_cumsum: bool, select: bool = True) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(0.5))
        self.fp32_cumsum, self.select = fp32_cumsum, select

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = (x * self.temp).float()
        probs, idx = logits.softmax(-1).sort(-1, descending=True)
        cum = probs.cumsum(-1) if self.fp32_cumsum else probs.to(self.temp.dtype).cumsum(-1)  # the model's dtype
        drop = (cum - probs) > 0.9
        if not self.select:
            return (probs * logits.gather(-1, idx)).sum(-1) + 0 * drop.sum()
        return (probs.masked_fill(drop, 0.0) * logits.gather(-1, idx)).sum(-1)


def _diagnose(fp32_cumsum: bool, select: bool = True) -> ampdoctor.Report:
    x = torch.randint(-64, 65, (64, 1000), generator=torch.Generator().manual_seed(1)).float() / 8
    return ampdoctor.diagnose(Nucleus(fp32_cumsum, select), x, precision="bf16",
                              loss_fn=lambda out, b: out.float().pow(2).mean())


def test_a_bf16_cumsum_threshold_that_masks_is_an_error_blamed_on_the_cumsum() -> None:
    r = _diagnose(fp32_cumsum=False)
    f = next(f for f in r.findings if f.evidence.get("decision_op", "").startswith("aten.gt"))
    assert (f.code, f.severity, f.op, f.phase) == ("precision-loss", "error", "aten.cumsum.default", "forward")
    assert f.evidence["changed_fraction"] >= 0.05 and f.evidence["indexed_by"] > 0
    assert f.evidence["reduction_length"] == 1000 and "cumsum sums up to 1000 terms" in f.explanation
    ex = f.evidence["examples"][0]
    assert ex["target"] != ex["reference"] and len(ex["target"]) == 2  # [true elements, sum of their positions]


def test_the_twin_summing_in_float32_is_clean() -> None:
    r = _diagnose(fp32_cumsum=True)
    assert r.ok and not [f for f in r.findings if "decisions_changed" in f.evidence]


def test_a_changed_mask_that_selects_nothing_gets_no_finding() -> None:
    r = _diagnose(fp32_cumsum=False, select=False)
    assert not [f for f in r.findings if f.evidence.get("decision_op", "").startswith("aten.gt")]
