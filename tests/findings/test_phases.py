"""The literal and hidden-overflow mechanisms in the backward and the optimizer (issue 13 items 3 and 5, every phase).

* a gradient guard in a hook (``p.register_hook(lambda g: g.clamp(...))``, ``clamp_``, a post-accumulate
  ``nan_to_num_``) catches a weight gradient that overflows fp16 in the backward matmul: ``overflow`` at that
  ``mm``, phase ``backward``, with the guard in evidence. The hooks are the user's, on the user's parameters; the
  diagnosis runs them on its copies (``deepcopy`` drops tensor hooks);
* an ``eps`` in a custom autograd Function's backward that is 0 in fp16 (``x / (n + 1e-8)`` for an all-zero row):
  ``constant-out-of-range`` at the add, phase ``backward``;
* an ``eps=1e-8`` in a hand-written Adam run on fp16 parameters: ``constant-out-of-range`` at the add, phase
  ``optimizer`` (the optimizer phase keeps full statistics for an op whose literal is 0 in its dtype);
each with a healthy twin.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


# ---------------------------------------------------------------------------------------- hidden backward overflow
def _guard(kind: str):  # noqa: ANN202
    if kind == "clamp":
        return lambda p: p.register_hook(lambda g: g.clamp(-1e4, 1e4))
    if kind == "clamp_":
        return lambda p: p.register_hook(lambda g: g.clamp_(-1e4, 1e4))

    def post(p: torch.Tensor) -> None:
        p.grad.nan_to_num_(posinf=1e4, neginf=-1e4)

    return lambda p: p.register_post_accumulate_grad_hook(post)


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)
        with torch.no_grad():
            self.proj.weight.mul_(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _guarded(kind: str, gain: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Probe()
    for p in model.parameters():
        _guard(kind)(p)
    # positive inputs ~240 on 512 rows: the weight gradient sums to ~1.3e5, past fp16's max, in the backward mm
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(1)).abs() * gain
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    return ampdoctor.diagnose(model, x, precision="fp16", optimizer=opt, loss_fn=lambda out, b: out.float().sum())


@pytest.mark.parametrize("kind,guard_op", [("clamp", "aten.clamp.default"), ("clamp_", "aten.clamp_.default"),
                                           ("post", "aten.nan_to_num_.default")])
def test_gradient_guard_in_a_hook_hides_a_backward_overflow(kind, guard_op):
    report = _guarded(kind, 300.0)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == ("overflow", "error", "proj", "aten.mm.default",
                                                             "backward")
    ev = f.evidence
    assert ev["ref_absmax"] > 65504 and ev["n_inf"] > 0
    assert ev["caught_by"]["op"] == guard_op and ev["caught_by"]["phase"] == "backward"
    assert ev["caught_by"]["output_absmax"] == 1e4
    assert "hidden, not fixed" in f.explanation


@pytest.mark.parametrize("kind", ["clamp", "post"])
def test_gradient_guard_that_never_clips_is_clean(kind):
    report = _guarded(kind, 3.0)  # gradients ~1.3e3: the guard runs and changes nothing
    assert report.ok and not report.findings, [(f.code, f.module) for f in report.findings]


def test_the_copy_runs_the_users_gradient_hooks_and_leaves_them():
    torch.manual_seed(0)
    model = Probe()
    calls: list[int] = []
    handle = model.proj.weight.register_hook(lambda g: calls.append(1))
    ampdoctor.diagnose(model, torch.randn(4, 16), precision="fp16", loss_fn=lambda out, b: out.float().sum())
    assert len(calls) == 2  # once in the reference, once in the target, on their copies
    assert model.proj.weight.grad is None and len(model.proj.weight._backward_hooks) == 1
    handle.remove()


# ---------------------------------------------------------------------------------------- a literal in a backward
class _RowNorm(torch.autograd.Function):
    """``|x|`` per row with a hand-written backward ``g * x / (|x| + eps)``."""

    @staticmethod
    def forward(ctx, x, eps):  # noqa: ANN001, ANN205
        n = x.pow(2).sum(-1, keepdim=True).sqrt()
        ctx.save_for_backward(x, n)
        ctx.eps = eps
        return n

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x, n = ctx.saved_tensors
        return g * x / (n + ctx.eps), None


class NormHead(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RowNorm.apply(self.fc(x), self.eps)


class Net(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.norm_head = NormHead(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_head(x)


def _norm_report(eps: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    x[::4] = 0  # padded rows: |x| = 0, and only the eps keeps 0 / 0 away
    return ampdoctor.diagnose(Net(eps), x, precision="fp16", loss_fn=lambda out, b: out.float().pow(2).mean())


def test_eps_in_a_custom_backward_that_flushes_in_fp16():
    report = _norm_report(1e-8)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "error", "norm_head", "aten.add.Tensor", "backward")
    assert f.evidence["constant"] == 1e-8 and f.evidence["constant_in_dtype"] == 0.0
    assert f.evidence["consequence"]["op"] == "aten.div.Tensor" and f.evidence["consequence"]["phase"] == "backward"


def test_eps_the_backward_dtype_holds_is_clean():
    report = _norm_report(1e-3)
    assert report.ok and "constant-out-of-range" not in report.codes(), report.codes()


# ---------------------------------------------------------------------------------------- a literal in an optimizer
class HandAdam(torch.optim.Optimizer):
    """Adam written by hand: its state and arithmetic in the parameters' dtype."""

    def __init__(self, params, lr: float = 1e-3, eps: float = 1e-8) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                st["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)  # grad**2 * 1e-3 underflows fp16
                p.sub_(group["lr"] * st["m"] / (st["v"].sqrt() + group["eps"]))


def _adam_report(eps: float) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    return ampdoctor.diagnose(model, x, precision="fp16", optimizer=HandAdam(model.parameters(), eps=eps),
                              loss_fn=lambda out, b: out.float().pow(2).mean(), steps=2)


def test_eps_in_a_hand_written_adam_that_flushes_in_fp16():
    report = _adam_report(1e-8)
    lits = [f for f in report.findings if f.code == "constant-out-of-range"]
    assert lits, report.codes()
    f = lits[0]
    assert (f.severity, f.module, f.op, f.phase, f.step) == ("error", "0", "aten.add.Tensor", "optimizer", 0)
    assert f.evidence["constant"] == 1e-8 and f.evidence["constant_in_dtype"] == 0.0
    assert f.evidence["consequence"]["op"] == "aten.div.Tensor"
    # fp16 parameters updated directly are the setup behind it: low-precision-params (with the eps) ranks first
    top = report.findings[0]
    assert (top.code, top.module, top.phase) == ("low-precision-params", "0", "optimizer")


def test_eps_the_optimizer_dtype_holds_is_clean():
    report = _adam_report(1e-4)
    assert report.ok and not report.findings, [(f.code, f.module, f.phase) for f in report.findings]
