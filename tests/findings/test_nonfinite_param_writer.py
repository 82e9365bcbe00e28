"""``nonfinite-input`` on a parameter: a 16-bit parameter that the optimizer updates in its own dtype was most
likely made non-finite by the previous step's update, not by the checkpoint.

Ground truth built here: one real Adam step (eps=1e-8, 0 in fp16) on an fp16 Linear whose gradients are small
enough that grad**2 flushes to 0 turns weights into inf; the next step is what a watch replays (or a user
diagnoses). The same inf stored in an fp32 model (a broken checkpoint) keeps the data/checkpoint advice.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


def _small_loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean() * 1e-3


def _after_one_fp16_adam_step() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 1)).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).half()
    _small_loss(m(x), x).backward()
    opt.step()
    opt.zero_grad()
    return m, opt, x


def test_a_16_bit_parameter_in_the_optimizer_points_at_the_previous_update() -> None:
    m, opt, x = _after_one_fp16_adam_step()
    assert not torch.isfinite(m[0].weight).all()  # ground truth: the fp16 Adam step wrote inf
    r = ampdoctor.diagnose(m, x, precision=None, loss_fn=_small_loss, optimizer=opt)
    f = r.findings[0]
    assert (f.code, f.module, f.phase, f.severity) == ("nonfinite-input", "0", "setup", "error"), f
    assert f.evidence["optimizer"] == "Adam" and f.evidence["eps"] == 1e-8 and f.evidence["eps_in_dtype"] == 0.0
    assert "previous step's update" in f.explanation and "eps=1e-08 is 0 in float16" in f.explanation
    assert f.fixes[0].id == "fp32_master" and "checkpoint)" not in f.explanation


def test_an_fp32_parameter_keeps_the_checkpoint_advice() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 1))
    with torch.no_grad():
        m[0].weight[0, 0] = float("inf")  # a broken checkpoint
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    r = ampdoctor.diagnose(m, x, precision=None, loss_fn=_small_loss,
                           optimizer=torch.optim.Adam(m.parameters(), eps=1e-8))
    f = r.findings[0]
    assert (f.code, f.module, f.phase) == ("nonfinite-input", "0", "setup"), f
    assert "optimizer" not in f.evidence and "clean the data (or the checkpoint)" in f.explanation
