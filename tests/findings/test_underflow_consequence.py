"""``underflow`` severity follows what was lost: a zeroed gradient that would have moved nothing is a warning.

MobileViT-like (the zoo's healthy fp16-amp mobilevit, its q/k weights): an attention block whose input reaches its
bias-free query / key projections only ~1e-6 large (x * 1e-6 here; a tiny random-init net there; the zoo net's
zero-initialised q/k biases get fp32 gradients up to 1.8e-11, which AdamW would turn into ~2e-6 steps away from 0,
so that run, by this rule, keeps its error). The scores ``q @ k^T`` then
flush to 0 in fp16 under autocast + GradScaler(65536), and q/k get all-zero gradients where fp32 has ~2e-15.
AdamW's first update from such a gradient is ``lr * g / (g + eps)`` = 1e-3 * 2e-7 = 2e-10, under half an fp32 ulp
of weights ~0.25 (7e-9): nothing would have moved, so it is a warning. At x * 1e-4 the fp32 gradients are ~2e-11
and the update (2e-6) moves the weights by hundreds of ulps: that stays an error.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


class Attn(nn.Module):
    def __init__(self, scale: float, d: int = 16) -> None:
        super().__init__()
        self.scale = scale
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        q, k, v = self.q(h), self.k(h), self.v(x)
        a = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 4.0, -1)
        return x + self.o(torch.bmm(a, v))


class Net(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.attn = Attn(scale)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x)).mean(1)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _underflows(scale: float) -> tuple[list[ampdoctor.Finding], dict[str, float]]:
    torch.manual_seed(0)
    model = Net(scale)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    ref = Net(scale)
    ref.load_state_dict(model.state_dict())
    _loss(ref(x), x).backward()  # the fp32 gradients, computed here independently
    grads = {n: p.grad.abs().max().item() for n, p in ref.named_parameters() if p.grad is not None}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = ampdoctor.diagnose(model, x, precision="fp16-amp", loss_fn=_loss, optimizer=opt)
    return [f for f in report.findings if f.code == "underflow"], grads


def test_negligible_lost_gradients_are_a_warning() -> None:
    found, grads = _underflows(1e-6)
    assert 1e-16 < max(grads["attn.q.weight"], grads["attn.k.weight"]) < 1e-14 < 1e-3 < grads["attn.v.bias"]
    assert found and all(f.module == "attn" for f in found)
    fwd = [f for f in found if f.phase == "forward"]
    assert fwd and sorted(fwd[0].evidence["dead_parameters"]) == ["attn.k.weight", "attn.q.weight"]
    for f in found:
        assert f.severity == "warning", (f.phase, f.evidence.get("dead_parameters"))
        assert f.evidence["ref_lost_gradient_absmax"] < 1e-14 and "moved nothing" in f.explanation


def test_lost_gradients_that_would_move_adam_stay_an_error() -> None:
    found, grads = _underflows(1e-4)
    assert 1e-12 < grads["attn.q.weight"] < 1e-10
    fwd = [f for f in found if f.phase == "forward"]
    assert fwd and fwd[0].severity == "error"
    assert sorted(fwd[0].evidence["dead_parameters"]) == ["attn.k.weight", "attn.q.weight"]
    assert fwd[0].evidence["ref_lost_gradient_absmax"] > 1e-12 and "moved nothing" not in fwd[0].explanation
