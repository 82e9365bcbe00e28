"""A new user trains a DiT block (adaLN-Zero conditioning on the diffusion timestep) in emulated fp8 with Transformer
Engine's default delayed scaling, and each step samples another timestep.

The timestep embedding goes through a small MLP; one of its hidden units tracks ``t`` (a weight of 100 on the
slowest sinusoid, ~0.018 t: an outlier unit the conditioning relies on to scale one channel of the MLP branch).
Step 0 samples ``t = 50``, step 1 ``t = 400``: the input of the MLP's second layer (``t_mlp.2``) grows ~5x, but a
delayed scale comes from the amax history of step 0, so the unit clips at the format max. The finding must name
``t_mlp.2``, its input, the forward, step 1, with the amax and the history amax the truth has (the fp32 model's
input to that layer, per step; the fp8 run's differs only by ``t_mlp.0``'s e4m3 rounding). Its proposed recipe change,
current scaling, verifies; under current scaling the same training is clean.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampdoctor.precision import Fp8Recipe

D = 32
T = (50, 400)  # the timestep each training step samples


def _t_embedding(t: torch.Tensor) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000) * torch.arange(D // 2) / (D // 2))
    angle = t.float()[:, None] * freqs[None]
    return torch.cat([angle.cos(), angle.sin()], -1)


class DiTBlock(nn.Module):
    """adaLN-Zero: shift/scale/gate of both branches from the timestep conditioning; attention via SDPA."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.t_mlp = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, D))
        self.ada = nn.Linear(D, 6 * D)
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.out = nn.Linear(D, 4)
        self.register_buffer("ts", torch.tensor(T))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        with torch.no_grad():  # hidden unit 0 tracks t (100 x the slowest sine); it scales channel 7 of the MLP
            self.t_mlp[0].weight[0].zero_()
            self.t_mlp[0].weight[0, D - 1], self.t_mlp[0].bias[0] = 100.0, 0.0
            self.t_mlp[2].weight[D - 1].zero_()
            self.t_mlp[2].weight[D - 1, 0], self.t_mlp[2].bias[D - 1] = 1.0, 0.0
            self.ada.weight[4 * D + 7].zero_()
            self.ada.weight[4 * D + 7, D - 1], self.ada.bias[4 * D + 7] = 1.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.ts[self.step.clamp(max=len(T) - 1)].expand(x.shape[0])
        self.step += 1
        c = self.t_mlp(_t_embedding(t))
        s1, sc1, g1, s2, sc2, g2 = self.ada(F.silu(c)).chunk(6, -1)
        h = self.norm1(x) * (1 + sc1[:, None]) + s1[:, None]
        q, k, v = self.qkv(h).view(x.shape[0], x.shape[1], 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        x = x + g1[:, None] * self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape))
        h = self.norm2(x) * (1 + sc2[:, None]) + s2[:, None]
        return self.out(x + g2[:, None] * self.fc2(F.gelu(self.fc1(h))))


def _spec(recipe: Fp8Recipe | None):  # noqa: ANN202
    from ampdoctor.precision import make_spec

    model = DiTBlock()
    x = torch.randn(8, 16, D, generator=torch.Generator().manual_seed(1))
    return make_spec(model, x, precision="fp8", steps=len(T), fp8_recipe=recipe,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                     loss_fn=lambda out, b: out.float().pow(2).mean())


def _truth() -> tuple[float, float]:
    """(amax at step 0, amax at step 1) of ``t_mlp.2``'s input in the fp32 model."""
    model, seen = DiTBlock(), []
    model.t_mlp[2].register_forward_pre_hook(lambda mod, a: seen.append(float(a[0].abs().max())))
    x = torch.randn(8, 16, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x)
        model(x)
    return seen[0], seen[1]


def test_delayed_scaling_clips_the_timestep_unit_and_current_scaling_verifies():
    from ampdoctor.diagnose import diagnose_spec
    from ampdoctor.fixes import verify

    before, after = _truth()
    assert after / before > 4                                 # the truth: the t unit grows 5x from t=50 to t=400
    spec = _spec(Fp8Recipe())                                 # TE's default: delayed, history 1024, margin 0
    report = diagnose_spec(spec)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase, f.step) == (
        "fp8-scale", "warning", "t_mlp.2", "aten.linear.default", "forward", 1)
    assert f.evidence["roles_losing"] == ["input"]
    first = f.evidence["roles"]["input"]["first_saturated"]
    assert first["amax"] == pytest.approx(after, rel=0.05) and first["amax_history"] == pytest.approx(before, rel=0.05)
    assert first["saturated"] >= 8                            # the unit, in each of the 8 samples
    dynamic = next(p for p in f.fixes if p.id == "fp8_recipe" and p.params["scaling"] == "dynamic")
    v = verify(dynamic, spec, report=report)
    assert v.verified, v.reason


def test_the_same_training_under_current_scaling_is_clean():
    from ampdoctor.diagnose import diagnose_spec

    report = diagnose_spec(_spec(Fp8Recipe(scaling="dynamic")))
    assert not [f for f in report.findings if f.severity != "info"], [f.title for f in report.findings]
