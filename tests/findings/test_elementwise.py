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


class Ranker(nn.Module):
    """A retrieval scorer: one score per candidate, candidates ranked by ``argsort`` (a sort). The scores sit on a
    common offset of 60, where bf16 spaces values by 0.25: candidates closer than that tie and reorder."""

    def __init__(self, offset: float, spread: float) -> None:
        super().__init__()
        self.score = nn.Linear(16, 1)
        with torch.no_grad():
            self.score.weight.mul_(spread)
            self.score.bias.fill_(offset)

    def forward(self, cands: torch.Tensor) -> torch.Tensor:  # (queries, candidates, 16) -> ranking per query
        return self.score(cands).squeeze(-1).argsort(-1, descending=True)


def _ranker(offset: float, spread: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    return Ranker(offset, spread), torch.randn(8, 12, 16)


def test_bf16_scores_reorder_a_ranking_and_create_ties() -> None:
    model, x = _ranker(60.0, 0.3)
    ref = model(x)
    with torch.autocast("cpu", torch.bfloat16):
        low = model(x)
    assert (ref != low).any(dim=-1).sum() > 0  # plain autocast reorders rows
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    f = next(f for f in _pl(r) if "decisions_changed" in f.evidence)
    assert (f.code, f.module, f.op, f.phase) == ("precision-loss", "score", "aten.addmm.default", "forward"), f
    ev = f.evidence
    assert ev["decision_op"] == "aten.sort.default" and ev["rows"] == 8
    assert ev["decisions_changed"] == int((ref != low).any(dim=-1).sum())
    assert ev["ties_target"] > ev["ties_reference"] and ev["ties_created"] > 0  # scores fp32 tells apart now tie
    ex = ev["examples"][0]
    assert sorted(ex["target"]) == sorted(ex["reference"]) and ex["target"] != ex["reference"]  # same set, new order


def test_ranker_healthy_twin_keeps_its_order() -> None:
    model, x = _ranker(0.0, 1.0)  # scores of spread ~2 around 0: bf16's rounding (~0.008) cannot reorder them
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    assert not _pl(r), r.findings


class FourierFeatures(nn.Module):
    """Random Fourier features (NeRF-style positional encoding): ``cos/sin(B x)`` with B ~ N(0, scale**2). Under
    bf16 autocast ``B x`` comes out of the matmul in bf16: angles of |max| ~380 are off by ~1 radian."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 32, bias=False)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.proj.weight.normal_(0.0, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.proj(x)
        return self.head(torch.cat([torch.cos(a), torch.sin(a)], -1))


def _fourier(scale: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(4)
    return FourierFeatures(scale), torch.rand(64, 3)


def test_bf16_cos_of_fourier_angles_is_wrong_per_element() -> None:
    model, x = _fourier(100.0)
    a = model.proj(x).detach()
    with torch.autocast("cpu", torch.bfloat16):
        low = model.proj(x).detach()
    err = (torch.cos(low).float() - torch.cos(a)).abs()
    assert err.median() > 0.05 and a.abs().max() > 200  # plain autocast: phase error ~ |a| * 2**-9, cos off by 0.07
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    f = next(f for f in _pl(r) if f.op == "aten.cos.default")
    assert (f.code, f.module, f.phase, f.severity) == ("precision-loss", "", "forward", "warning")
    ev = f.evidence
    assert ev["amplifier_op"] == "aten.cos.default" and ev["argument_absmax"] > 200
    assert ev["elementwise"]["p50"] > ev["threshold"] >= 0.0625 and ev["argument_abs_error"] > 0.1
    assert "radians of phase" in f.explanation


def test_fourier_healthy_twin_small_angles() -> None:
    model, x = _fourier(1.0)  # angles below ~5: bf16 keeps them within ~0.02 rad
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    assert not _pl(r), r.findings


class Boltzmann(nn.Module):
    """Unnormalised weights ``exp(e - max(e))`` of energies computed by a Linear whose bias puts them near 200:
    bf16 spaces values there by 1, the difference keeps that absolute error and exp turns it into a relative one
    (autocast runs exp itself in float32 -- the damage is done before it)."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.energy = nn.Linear(16, 8)
        with torch.no_grad():
            self.energy.weight.mul_(4.0)
            self.energy.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.energy(x)
        return torch.exp(e - e.amax(-1, keepdim=True))


def _boltzmann(offset: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(5)
    return Boltzmann(offset), torch.randn(32, 16)


def test_exp_of_a_large_logit_difference_amplifies_bf16_rounding() -> None:
    model, x = _boltzmann(200.0)
    ref = model(x)
    with torch.autocast("cpu", torch.bfloat16):
        low = model(x)
    assert ((low - ref).abs() / ref.abs().clamp_min(1e-3)).median() > 0.1  # plain autocast: weights off by >10%
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    f = next(f for f in _pl(r) if f.evidence.get("amplifier_op") == "aten.exp.default")
    # the subtraction is where bf16's rounding at 200 becomes the whole value (catastrophic cancellation), exp amplifies
    assert (f.code, f.module, f.op, f.phase) == ("precision-loss", "", "aten.sub.Tensor", "forward"), f
    ev = f.evidence
    assert ev["elementwise"]["p50"] > 0.1 and ev["origin_elementwise"]["p50"] > 0.05
    assert 0.1 < ev["argument_abs_error"] < 1.0  # bf16 spacing at 200 is 1: about half of it, median
    assert "exp amplifies" in f.explanation and "energy" not in f.module


def test_boltzmann_healthy_twin_without_offset() -> None:
    model, x = _boltzmann(0.0)
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    assert not _pl(r), r.findings


class TwoBranches(nn.Module):
    """The difference of two nearly equal branches (a residual correction, a contrastive margin): both sit on a
    common offset of 50, where bf16 spaces values by 0.25 -- larger than their true difference, whose sign flips."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight + 0.01 * torch.randn_like(self.a.weight))
            self.a.bias.fill_(offset)
            self.b.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) - self.b(x)


def _branches(offset: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(6)
    return TwoBranches(offset), torch.randn(32, 16)


def test_bf16_difference_of_close_branches_flips_signs() -> None:
    model, x = _branches(50.0)
    ref = model(x)
    with torch.autocast("cpu", torch.bfloat16):
        low = model(x).float()
    assert ((ref.sign() != low.sign()) & (ref.abs() > 1e-3)).sum() > 0  # plain autocast flips signs
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    f = _pl(r)[0]
    assert (f.code, f.module, f.op, f.phase) == ("precision-loss", "", "aten.sub.Tensor", "forward"), f
    assert f.evidence["elementwise"]["sign_flips"] > 0 and f.evidence["digits_cancelled"] > 4
    assert "sign flip" in f.explanation


def test_branches_healthy_twin_without_offset() -> None:
    model, x = _branches(0.0)
    r = ampdoctor.diagnose(model, x, precision="bf16-amp")
    assert not _pl(r), r.findings


class BranchesWithSpareHead(TwoBranches):
    """TwoBranches plus a trainable head forward never calls: a bf16 precision-loss warning and an unused
    parameter in the same run."""

    def __init__(self, offset: float) -> None:
        super().__init__(offset)
        self.spare = nn.Linear(8, 8)


def test_unused_parameters_rank_before_a_precision_loss_warning() -> None:
    # offset 4: the typical element is off by ~28% (a warning); from ~6 on the typical element is rounding noise
    # (an error: at 10 its median is off by 100% and the loss by 39%, although the |max| element keeps 3 bits)
    torch.manual_seed(6)
    model, x = BranchesWithSpareHead(4.0), torch.randn(32, 16)
    r = ampdoctor.diagnose(model, x, precision="bf16-amp", loss_fn=lambda out, batch: out.float().pow(2).mean(),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    codes = [(f.code, f.module, f.severity) for f in r.findings]
    # a weight that never gets a gradient is a functional bug in every precision; the bf16 loss still follows
    assert codes[0] == ("unused-parameters", "spare", "warning"), codes
    assert ("precision-loss", "", "warning") in codes[1:]
