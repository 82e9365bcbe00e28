"""Precision loss measured element-wise (issue 13 item 6): decisions changed by rounding (argmax of a classifier,
an MoE router's top-k), and sin of large arguments, where the tensors' norms agree with fp32 but the elements or
the choices do not. Each failing model has a healthy twin that must stay clean."""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor


def _pl(report: ampdoctor.Report) -> list[ampdoctor.Finding]:
    return [f for f in report.findings if f.code == "precision-loss"]


class Classifier(nn.Module):
    """A linear head whose logits sit on a large common offset (a bias of 60): bf16 spaces values near 60 by 0.25,
    so classes closer than that collapse into ties and the argmax flips for some rows."""

    def __init__(self, offset: float, spread: float) -> None:
        super().__init__()
        self.head = nn.Linear(16, 8)
        with torch.no_grad():
            self.head.weight.mul_(spread)
            self.head.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).argmax(-1)


def _clf(offset: float, spread: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Classifier(offset, spread), torch.randn(64, 16)


def test_bf16_argmax_flips_rows_of_a_classifier() -> None:
    model, x = _clf(60.0, 0.1)
    ref = model(x)
    low = model.to(torch.bfloat16)(x.bfloat16())
    model.float()
    flipped = int((ref != low).sum())
    assert flipped > 0  # the mechanism exists in plain torch
    r = ampdoctor.diagnose(model, x, precision="bf16")
    f = _pl(r)[0]
    assert (f.code, f.module, f.op, f.phase) == ("precision-loss", "head", "aten.addmm.default", "forward")
    ev = f.evidence
    assert ev["decisions_changed"] == flipped and ev["rows"] == 64
    assert ev["decision_op"] == "aten.argmax.default"
    assert ev["ties_created"] > 0  # distinct fp32 logits rounded to the same bf16 value
    assert "cast to bfloat16 by precision 'bf16'" in f.explanation  # the batch cast is named as such


def _confident(n: int, winners: int) -> torch.Tensor:
    """Inputs whose first ``winners`` classes lead by >= 1 (a confident classifier / router), plus small noise."""
    x = 0.05 * torch.randn(n, 16)
    for j in range(winners):
        x[torch.arange(n), (torch.arange(n) * (j + 3)) % 8] += 4.0 - 1.5 * j
    return x


def test_classifier_healthy_twin_keeps_its_decisions() -> None:
    model, _ = _clf(0.0, 1.0)
    with torch.no_grad():
        model.head.weight.copy_(torch.eye(8, 16))
    x = _confident(64, 1)  # margins of ~4 around 0: bf16 rounding cannot reorder them
    r = ampdoctor.diagnose(model, x, precision="bf16")
    assert not _pl(r), r.findings


class Router(nn.Module):
    """MoE-style: softmax over 8 experts, top-2 per token, gate-weighted expert outputs."""

    def __init__(self, offset: float, spread: float) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 8)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
        with torch.no_grad():
            self.gate.weight.mul_(spread)
            self.gate.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), -1)
        w, idx = probs.topk(2, -1)
        outs = torch.stack([e(x) for e in self.experts], 1)  # (tokens, experts, 16)
        picked = outs.gather(1, idx.unsqueeze(-1).expand(-1, -1, 16))
        return (w.unsqueeze(-1) * picked).sum(1)


def _router(offset: float, spread: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    return Router(offset, spread), torch.randn(48, 16)


def test_bf16_router_changes_expert_choice() -> None:
    model, x = _router(40.0, 0.05)
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    f = next(f for f in _pl(r) if "decisions_changed" in f.evidence)
    assert (f.module, f.op, f.phase) == ("gate", "aten.addmm.default", "forward"), f
    assert f.evidence["decision_op"] == "aten.topk.default" and f.evidence["decisions_changed"] >= 1
    ex = f.evidence["examples"][0]
    assert sorted(ex["target"]) != sorted(ex["reference"])


def test_router_healthy_twin_keeps_its_experts() -> None:
    model, _ = _router(0.0, 1.0)
    with torch.no_grad():
        model.gate.weight.copy_(torch.eye(8, 16))
    x = _confident(48, 2)  # two clear experts per token
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    assert not [f for f in _pl(r) if "decisions_changed" in f.evidence], r.findings


class Positions(nn.Module):
    """``sin(position * freq)`` for positions starting at ``start`` (a long-context offset), then a projection."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(self.start, self.start + x.shape[0], dtype=x.dtype, device=x.device)[:, None]
        freq = torch.linspace(0.5, 1.0, 16, dtype=x.dtype, device=x.device)
        return self.proj(x + torch.sin(pos * freq))


def test_bf16_sin_of_large_positions_is_wrong_per_element() -> None:
    torch.manual_seed(2)
    model, x = Positions(4000), torch.randn(32, 16)
    ang = torch.arange(4000, 4032.0)[:, None] * torch.linspace(0.5, 1.0, 16)
    err = (torch.sin(ang.bfloat16() * torch.linspace(0.5, 1.0, 16).bfloat16()).float() - torch.sin(ang)).abs()
    assert err.median() > 0.3 and math.isclose(torch.sin(ang).norm(), torch.sin(ang.bfloat16()).float().norm(),
                                               rel_tol=0.2)  # elements wrong, norm about right
    r = ampdoctor.diagnose(model, x, precision="bf16")
    f = next(f for f in _pl(r) if f.op == "aten.sin.default")
    assert (f.module, f.phase) == ("", "forward")
    ee = f.evidence["elementwise"]
    assert ee["p50"] > 0.25 and ee["sign_flips"] > 0 and f.evidence["argument_absmax"] > 3000
    assert "radians of phase" in f.explanation


def test_sin_healthy_twin_small_positions() -> None:
    torch.manual_seed(2)
    model, x = Positions(0), torch.randn(32, 16)  # angles below 32: bf16 keeps them within 0.06 rad
    r = ampdoctor.diagnose(model, x, precision="bf16")
    assert not [f for f in _pl(r) if f.op == "aten.sin.default" or "decisions_changed" in f.evidence], r.findings
