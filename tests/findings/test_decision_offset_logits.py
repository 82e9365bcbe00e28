"""A changed top-k after a bf16 softmax is blamed by condition numbers: on the softmax when its inputs are small
(the MoE / EViT field cases), on the op that produced the logits when they sit on a large common offset.

Ground truth built here by hand: a top-2 router over 8 experts whose gate has a shared bias of 60 (logits 60 +- 0.08,
differences ~0.05; bf16 spacing at 60 is 0.25). Rounding only the logits to bf16 (softmax in fp32) changes the
expert set of ~all 128 tokens; rounding only the probabilities (fp32 logits, bf16 softmax output) changes ~25: the
logits' rounding (|l| u ~ 0.23 relative on each probability) decides, not the softmax's (u ~ 0.004). Twin: the same
router with its logits and softmax in float32 (the rest of the model bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor


class OffsetRouter(nn.Module):
    def __init__(self, fp32: bool, d: int = 32, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])
        self.k, self.fp32 = k, fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            logits = F.linear(x.float(), self.gate.weight.float(), self.gate.bias.float())
        else:
            logits = self.gate(x)
        w, idx = logits.softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = (idx == i).nonzero(as_tuple=True)
            if len(tok):
                out = out.index_add(0, tok, expert(x[tok]) * w[tok, slot, None].to(x.dtype))
        return out


class Net(nn.Module):
    def __init__(self, fp32: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.moe = OffsetRouter(fp32)
        self.head = nn.Linear(32, 10)
        with torch.no_grad():
            self.moe.gate.weight.mul_(0.05)  # near-uniform routing ...
            self.moe.gate.bias.fill_(60.0)  # ... on a large common offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.moe(h))


def _setup(fp32: bool) -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Net(fp32), torch.randn(128, 16, generator=g), torch.randint(0, 10, (128,), generator=g)


def _diagnose(fp32: bool) -> ampdoctor.Report:
    m, x, y = _setup(fp32)
    return ampdoctor.diagnose(m, x, precision="bf16", loss_fn=lambda o, _: F.cross_entropy(o.float(), y))


def test_offset_logits_blame_the_op_that_rounds_them_not_the_softmax() -> None:
    m, x, _ = _setup(False)
    with torch.no_grad():  # the truth: which rounding changes the selected experts
        logits = m.moe.gate(m.inp(x))
        ref = logits.softmax(-1).topk(2, -1).indices.sort(-1).values

        def changed(sel: torch.Tensor) -> int:
            return int((sel.topk(2, -1).indices.sort(-1).values != ref).any(-1).sum())

        by_logits = changed(logits.bfloat16().float().softmax(-1))
        by_probs = changed(logits.softmax(-1).bfloat16().float())
    assert logits.abs().min() > 59 and by_logits >= 100 and by_probs <= 40 and by_logits > 3 * by_probs
    f = _diagnose(False).findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("precision-loss", "moe.gate", "aten.addmm.default",
                                                             "forward", "error")
    assert f.evidence["decision_op"] == "aten.topk.default" and f.evidence["decisions_changed"] >= 100
    rounding = f.evidence["input_rounding"]
    assert rounding["softmax"] == "aten._softmax.default" and rounding["input_absmax"] == 60.0
    assert rounding["carried"] > 4 * rounding["own"]
    assert "not what decides" in f.explanation
    assert f.fixes[0].params == {"modules": ["moe"]}  # keep_fp32 on the gate alone casts its logits back to bf16


def test_fp32_router_twin_changes_no_decision() -> None:
    report = _diagnose(True)
    assert not [f for f in report.findings if "decision_op" in f.evidence], report.codes()
    assert not [f for f in report.findings if f.severity == "error"]
