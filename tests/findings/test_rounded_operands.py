"""``precision-loss`` at a cancelling op whose operand a cast (or a whole-model cast of a buffer) rounded.

``1 - x`` of values x near 1 keeps only the digits the rounding of x left: bf16 spaces values below 1 by 2**-8,
so x = 0.9991 becomes 1 and ``1 - x`` is 0 (the fp32 value is 9e-4), and x in [0.990, 0.997] moves by up to
0.002, a third of ``1 - x``. Built from plain modules; the healthy twin subtracts in float32 and casts after.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


class Gate(nn.Module):
    """Mixes two inputs with per-row weights ``x`` and ``1 - x`` gathered from a float32 table (a schedule)."""

    def __init__(self, table: torch.Tensor, cast_first: bool) -> None:
        super().__init__()
        self.register_buffer("table", table)
        self.proj = nn.Linear(8, 8)
        self.cast_first = cast_first

    def forward(self, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.cast_first:
            x = self.table.to(a.dtype)[idx][:, None]
            w = 1 - x
        else:
            x = self.table[idx][:, None]
            w = (1 - x).to(a.dtype)
            x = x.to(a.dtype)
        return self.proj((x * a + w * b).float())


def _run(table: torch.Tensor, cast_first: bool) -> ampdoctor.Report:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = {"a": torch.randn(16, 8, generator=g).bfloat16(), "b": torch.randn(16, 8, generator=g).bfloat16(),
             "idx": torch.arange(16)}
    return ampdoctor.diagnose(Gate(table, cast_first), batch, precision="bf16-amp",
                              loss_fn=lambda out, batch: out.float().pow(2).mean())


NEAR_ONE = torch.linspace(0.9991, 0.95, 16)  # the first rounds to 1.0 in bf16
BELOW = torch.linspace(0.990, 0.997, 16)  # bf16 holds them as 0.9922 or 0.9961: never 1


def test_a_difference_rounded_to_zero_is_an_error_at_the_subtraction() -> None:
    assert (NEAR_ONE.bfloat16().float() == 1).sum() >= 1 and (NEAR_ONE < 1).all()  # ground truth
    r = _run(NEAR_ONE, cast_first=True)
    f = r.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "precision-loss", "error", "", "aten.rsub.Scalar", "forward"), f
    ev = f.evidence
    assert ev["zeros_created"] == int((NEAR_ONE.bfloat16().float() == 1).sum())
    assert ev["ref_absmax"] == pytest.approx((1 - NEAR_ONE).max().item(), rel=1e-3)
    assert ev["rounded_operand"]["op"] == "aten._to_copy.default"
    assert ev["digits_cancelled"] >= 4


def test_digits_lost_without_zeros_is_a_warning() -> None:
    low = 1 - BELOW.bfloat16().float()
    assert ((low - (1 - BELOW)).abs() / (1 - BELOW)).max() > 0.25 and (low > 0).all()  # ground truth
    r = _run(BELOW, cast_first=True)
    f = next(f for f in r.findings if f.op == "aten.rsub.Scalar")
    assert (f.code, f.severity) == ("precision-loss", "warning") and f.evidence["zeros_created"] == 0
    assert r.ok


@pytest.mark.parametrize("table", [NEAR_ONE, BELOW])
def test_subtracting_in_float32_first_is_clean(table: torch.Tensor) -> None:
    r = _run(table, cast_first=False)
    assert not [f for f in r.findings if f.code == "precision-loss"], r.findings
