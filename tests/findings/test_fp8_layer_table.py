"""The layer table of an emulated fp8 run shows the fp8 casts, the only ranges that can overflow or flush there.

Before, an fp8 run's ``Report.layers`` listed the float32 ops around the linears (margins of ~+100 bits against
float32's max), which says nothing about fp8. A too-high learning rate under delayed scaling grows the tensors
between steps: the stale amax history clips them, and the table must show those casts with negative margins, in
agreement with the ``fp8-scale`` findings; the low-learning-rate twin's casts fit.
"""

from __future__ import annotations

import math

import pytest
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
    named = {(f.module, role): (f, ev) for f in report.findings if f.code == "fp8-scale" and f.severity != "info"
             for role, ev in f.evidence["roles"].items() if ev["severity"] == "warning"}
    # every cast the table shows clipped by 2x and more is a role an fp8-scale warning names with its own numbers
    # (one finding per linear and pass; a layer whose input and weight clip lists both)
    table = {(r.module, r.op[len("fp8 cast ("):-1]) for r in rows if r.margin_bits is not None and r.margin_bits < -1}
    assert table <= set(named) and (worst.module, role) in named
    for (module, role), (f, ev) in named.items():
        assert f.phase == ("backward" if role == "grad_output" else "forward")
        assert ev["saturated"] == sum(r["saturated"] for r in report.summary["fp8"]
                                      if (r["module"], r["role"]) == (module, role)) > 0
    f, ev = named[("2", "weight")]  # module 2's weight clips thousands of values: named as the weight, not via input
    assert ev["saturated"] > 4096 and "weight" in f.title and f.evidence["roles_losing"] == ["input", "weight"]

def test_fp8_table_of_a_healthy_run_fits_the_formats():
    report = _diagnose(lr=1e-4)
    assert not [f for f in report.findings if f.severity != "info"]
    rows = layer_rows(report)
    assert len(rows) == 9 and all(r.dtype.startswith("float8") for r in rows)
    # dynamic first step and delayed later steps of a slowly moving model: every cast within a tenth of a bit
    assert all(r.margin_bits is not None and r.margin_bits > -0.1 and math.isfinite(r.ref_absmax) for r in rows)
    assert all(r.flush_fraction is not None and r.flush_fraction < 0.01 for r in rows)


# -- each role of a layer with its own numbers: a clipped weight is named as the weight ------------------------------

RAMP = (0.3, 1.0)  # a gain that grows 3.3x between step 0 and step 1: a history-1 delayed scale clips at step 1
FLAT = (1.0, 1.0)


class Gained(nn.Module):
    """``F.linear(x * a[step], W * b[step])``: the input's and the weight's ranges move between steps by schedules
    kept in buffers (a warm-up, a weight-norm reparametrisation), so the truth of each role is computable."""

    def __init__(self, x_gain: tuple[float, ...], w_gain: tuple[float, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(16, 32) * 0.2)
        self.head = nn.Linear(16, 4)
        self.register_buffer("xg", torch.tensor(x_gain))
        self.register_buffer("wg", torch.tensor(w_gain))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.step.clamp(max=len(self.xg) - 1)
        self.step += 1
        return self.head(torch.relu(nn.functional.linear(x * self.xg[s], self.w * self.wg[s])))


def _gained(x_gain: tuple[float, ...], w_gain: tuple[float, ...]) -> tuple[ampdoctor.Report, Gained, torch.Tensor]:
    model = Gained(x_gain, w_gain)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(model, x, precision="fp8", steps=2, loss_fn=lambda out, b: out.float().mean(),
                                fp8_recipe=ampdoctor.precision.Fp8Recipe(scaling="delayed", amax_history_len=1))
    return report, model, x


def _clipped_at_step_1(t0: torch.Tensor, t1: torch.Tensor) -> int:
    """e4m3 values of ``t1`` beyond the max under the scale computed from ``t0``'s amax (delayed, history 1)."""
    scale = 448.0 / t0.abs().amax()
    return int(((t1 * scale).abs() > 464.0).sum())


def _forward_finding(report: ampdoctor.Report) -> ampdoctor.Finding:
    found = [f for f in report.findings if f.code == "fp8-scale" and f.module == "" and f.phase == "forward"]
    assert len(found) == 1, [(f.code, f.module, f.phase, f.title) for f in report.findings]
    return found[0]


def test_a_weight_that_clips_is_named_as_the_weight_with_its_own_numbers():
    report, m, x = _gained(FLAT, RAMP)
    truth = _clipped_at_step_1(m.w.detach() * RAMP[0], m.w.detach() * RAMP[1])
    assert truth > 50                                       # the truth: a large share of the weight clips
    f = _forward_finding(report)
    assert (f.code, f.severity, f.op, f.phase, f.step) == ("fp8-scale", "warning", "aten.linear.default", "forward", 1)
    assert f.evidence["role"] == "weight" and f.evidence["roles_losing"] == ["weight"]
    w = f.evidence["roles"]["weight"]
    assert w["saturated"] == truth and w["numel"] == 2 * m.w.numel()
    assert abs(w["amax"] / float(m.w.detach().abs().amax() * RAMP[1]) - 1) < 1e-6
    assert w["first_saturated"]["amax_history"] == pytest.approx(float(m.w.detach().abs().amax() * RAMP[0]), rel=1e-6)
    assert "input" not in f.evidence["roles"] and f.title.startswith("fp8 weight of <root>: ")


def test_a_layer_whose_input_and_weight_clip_lists_both_roles_each_with_its_numbers():
    report, m, x = _gained(RAMP, RAMP)
    f = _forward_finding(report)
    assert (f.severity, f.op, f.phase, f.step) == ("warning", "aten.linear.default", "forward", 1)
    assert f.evidence["roles_losing"] == ["input", "weight"] and f.evidence["role"] == "input"
    roles = f.evidence["roles"]
    assert roles["input"]["saturated"] == _clipped_at_step_1(x * RAMP[0], x * RAMP[1]) > 50
    assert roles["weight"]["saturated"] == _clipped_at_step_1(m.w.detach() * RAMP[0], m.w.detach() * RAMP[1]) > 50
    for role in ("input", "weight"):
        r = roles[role]
        assert r["severity"] == "warning" and r["first_saturated"]["step"] == 1 and r["clip_error_share"] > 0.5
        assert f"{role} {r['saturated']}/{r['numel']} values saturate" in f.title
        assert f"fp8 {role} of <root> (e4m3, delayed scaling): {r['saturated']} value(s) saturate" in f.explanation
    # the proposed margin covers both roles' 3.3x jump: 2 bits
    margin = next(x for x in f.fixes if x.id == "fp8_recipe" and x.params["scaling"] == "delayed")
    assert margin.params["margin"] == 2
    assert report.to_dict()["findings"][0]["evidence"]["roles"]["weight"]["saturated"] == roles["weight"]["saturated"]


def test_flat_ranges_make_no_fp8_finding():
    report, _, _ = _gained(FLAT, FLAT)
    assert not [f for f in report.findings if f.code == "fp8-scale"], [f.title for f in report.findings]
    # the emulation's own statistics make no NaN/inf a trace could take for the run's first non-finite value (its
    # median once used a NaN placeholder for the zeros, which every fp8 report showed as "First NaN")
    assert "first_nonfinite" not in report.summary and "first_nan" not in report.summary
