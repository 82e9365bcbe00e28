"""The layer table of an emulated fp8 run shows the fp8 casts, the only ranges that can overflow or flush there.

Before, an fp8 run's ``Report.layers`` listed the float32 ops around the linears (margins of ~+100 bits against
float32's max), which says nothing about fp8. A too-high learning rate under delayed scaling grows the tensors
between steps: the stale amax history clips them, and the table must show those casts with negative margins, in
agreement with the ``fp8-scale`` findings; the low-learning-rate twin's casts fit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.report._format import layer_rows, least_headroom


def _diagnose(lr: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    return ampdoctor.diagnose(model, x, precision="fp8", steps=3,
                              optimizer=torch.optim.AdamW(model.parameters(), lr=lr),
                              loss_fn=lambda out, b: out.float().pow(2).mean())


def _scaled_max(report: ampdoctor.Report, module: str, role: str) -> float:
    """|x| * scale of the cast that scaled largest, recomputed from the run summary's per-call fp8 rows."""
    return max(r["amax"] * r["scale"] for r in report.summary["fp8"] if r["module"] == module and r["role"] == role)


def test_fp8_table_lists_the_casts_and_shows_delayed_scalings_clipping():
    report = _diagnose(lr=0.3)
    rows = layer_rows(report)
    assert rows and all(r.dtype in ("float8_e4m3fn", "float8_e5m2") and r.op.startswith("fp8 cast") for r in rows)
    assert {r.module for r in rows} == {"0", "2", "4"} and len(rows) == 3 * 3   # input, weight, grad_output each
    worst = least_headroom(rows, 1)[0]
    role = worst.op[len("fp8 cast ("):-1]
    assert worst.margin_bits is not None and worst.margin_bits < -1              # clipped by 2x and more
    assert worst.ref_absmax == _scaled_max(report, worst.module, role) > worst.target_absmax == (
        448.0 if worst.dtype == "float8_e4m3fn" else 57344.0)
    clipped = {(f.module, f.phase) for f in report.findings if f.code == "fp8-scale" and f.severity != "info"}
    # every cast the table shows clipped by 2x and more is at a module and pass an fp8-scale warning names (one
    # finding per linear and pass: a layer's input and weight share the forward one)
    assert {(r.module, r.phase) for r in rows if r.margin_bits is not None and r.margin_bits < -1} <= clipped
    assert (worst.module, worst.phase) in clipped

def test_fp8_table_of_a_healthy_run_fits_the_formats():
    report = _diagnose(lr=1e-4)
    assert not [f for f in report.findings if f.severity != "info"]
    rows = layer_rows(report)
    assert len(rows) == 9 and all(r.dtype.startswith("float8") for r in rows)
    # dynamic first step and delayed later steps of a slowly moving model: every cast within a tenth of a bit
    assert all(r.margin_bits is not None and r.margin_bits > -0.1 and math.isfinite(r.ref_absmax) for r in rows)
    assert all(r.flush_fraction is not None and r.flush_fraction < 0.01 for r in rows)
