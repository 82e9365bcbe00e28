"""Which module an op belongs to: forward (module stack), backward (autograd node ownership) and the optimizer
step (the module owning the parameter being updated). Module names are those of ``named_modules()``."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampdoctor


def mlp() -> nn.Module:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 8), act=nn.ReLU(), fc2=nn.Linear(8, 2)))


def run_traced(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer | None = None):  # noqa: ANN201
    with ampdoctor.trace(model, opt, full=True) as t:
        model(x).pow(2).mean().backward()
        if opt is not None:
            opt.step()
    return t.result().records


def ops(records, **where) -> list:  # noqa: ANN001
    return [r for r in records if r.kind == "op" and all(getattr(r, k) == v for k, v in where.items())]


def test_forward_ops_belong_to_the_innermost_module():
    recs = run_traced(mlp(), torch.randn(3, 4))
    fwd = [(r.op, r.module) for r in ops(recs, phase="forward") if r.op != "aten.t.default"]
    assert ("aten.addmm.default", "fc1") in fwd
    assert ("aten.relu.default", "act") in fwd
    assert ("aten.addmm.default", "fc2") in fwd
    # the loss is written in user code outside every module: the root ("")
    assert ("aten.pow.Tensor_Scalar", "") in fwd and ("aten.mean.default", "") in fwd


def test_backward_ops_belong_to_the_module_that_ran_their_forward():
    recs = run_traced(mlp(), torch.randn(3, 4))
    bwd = ops(recs, phase="backward")
    assert bwd and all(r.node for r in bwd)
    owners = {(r.node, r.module) for r in bwd if r.node != "AccumulateGrad"}
    assert ("ReluBackward0", "act") in owners
    assert {m for n, m in owners if n == "AddmmBackward0"} == {"fc1", "fc2"}
    assert {m for n, m in owners if n in ("PowBackward0", "MeanBackward0")} == {""}
    # gradients written into .grad are attributed to the parameter's module
    acc = ops(recs, phase="backward", node="AccumulateGrad")
    assert sorted((r.module, r.shape) for r in acc) == [("fc1", (8,)), ("fc1", (8, 4)), ("fc2", (2,)),
                                                         ("fc2", (2, 8))]


class Parent(nn.Module):
    """Inline math in the parent's own forward, before and after a child module."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(x) * 3.0)  # the parent's own code, feeding the child
        return self.child(h) * 2.0  # parent code again; its output reaches `h` only through the child


def test_inline_math_in_a_parent_forward():
    model = nn.Sequential(OrderedDict(block=Parent()))
    recs = run_traced(model, torch.randn(2, 4))
    keep = ("aten.addmm.default", "aten.mul.Tensor", "aten.tanh.default")
    fwd = [(r.op, r.module) for r in ops(recs, phase="forward") if r.op in keep]
    assert fwd == [("aten.addmm.default", "block.pre"), ("aten.mul.Tensor", "block"), ("aten.tanh.default", "block"),
                   ("aten.addmm.default", "block.child"), ("aten.mul.Tensor", "block")]


def test_backward_of_inline_math_before_a_child_belongs_to_the_parent():
    """The parent's output reaches its inline nodes only through the child's nodes; they are still the
    parent's (a hook-based tool would blame the next child or nobody)."""
    model = nn.Sequential(OrderedDict(block=Parent()))
    recs = run_traced(model, torch.randn(2, 4))
    owner: dict[str, set[str]] = {}
    for r in ops(recs, phase="backward"):
        if r.node != "AccumulateGrad":
            owner.setdefault(r.node, set()).add(r.module)
    assert owner["AddmmBackward0"] == {"block.pre", "block.child"}
    assert owner["MulBackward0"] == {"block"}, owner  # both products: * 2.0 after the child and * 3.0 before
    assert owner["TanhBackward0"] == {"block"}, owner


def test_a_module_called_twice_owns_both_calls():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.shared(torch.relu(self.shared(x)))

    recs = run_traced(Twice(), torch.randn(2, 4))
    assert [r.module for r in ops(recs, phase="forward", op="aten.addmm.default")] == ["shared", "shared"]
    # second call: grad of input and weight; first call: weight only (x needs no grad)
    assert [r.module for r in ops(recs, phase="backward", node="AddmmBackward0", op="aten.mm.default")] == [
        "shared"] * 3
    assert {r.module for r in ops(recs, phase="backward", node="ReluBackward0")} == {""}


def test_attribution_recovers_after_an_exception_inside_a_child():
    class Fragile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.head(self.inner(x))

    model = Fragile()
    good, bad = torch.randn(2, 4), torch.randn(2, 5)
    with ampdoctor.trace(model, full=True) as t:
        with pytest.raises(RuntimeError):
            model(bad)  # the shape error unwinds `inner` without its post hook having popped normally
        model(good).sum().backward()
    recs = t.result().records
    addmm = [(r.module, r.phase) for r in recs if r.op == "aten.addmm.default"]
    assert addmm == [("inner", "forward"), ("head", "forward")]
    sums = [r.module for r in recs if r.op == "aten.sum.default" and r.phase == "forward"]
    assert sums == [""]  # back at the root after the failed call


def test_phases_forward_backward_optimizer():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    recs = run_traced(model, torch.randn(3, 4), opt)
    phases = [r.phase for r in recs]
    first_bwd, first_opt = phases.index("backward"), phases.index("optimizer")
    assert set(phases[:first_bwd]) == {"forward"}
    assert set(phases[first_bwd:first_opt]) == {"backward"}
    assert set(phases[first_opt:]) == {"optimizer"}


def _param_owner_by_shape(model: nn.Module) -> dict[tuple[int, ...], str]:
    out = {}
    for mname, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            assert tuple(p.shape) not in out  # shapes identify parameters in these tests
            out[tuple(p.shape)] = mname
    return out


def test_optimizer_ops_belong_to_the_owning_module_not_the_parameter_name():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    recs = run_traced(model, torch.randn(3, 4), opt)
    upd = ops(recs, phase="optimizer", op="aten.add_.Tensor")
    owner = _param_owner_by_shape(model)
    assert {(r.shape, r.module) for r in upd} == set(owner.items())


@pytest.mark.parametrize("step", [1, 2])
def test_adamw_every_tensor_op_of_the_update_is_attributed(step):
    """AdamW (single-tensor): every op on a parameter-shaped tensor (the parameter, its moments and the
    temporaries ``sqrt(v) / bias_correction + eps``) belongs to the module that owns the parameter."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(3, 4)
    if step == 2:  # optimizer state exists before the traced step
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    recs = run_traced(model, x, opt)
    owner = _param_owner_by_shape(model)
    wrong = [(r.op, r.shape, r.module) for r in ops(recs, phase="optimizer")
             if r.shape != () and r.module != owner[r.shape]]
    assert wrong == []


def test_adamw_foreach_updates_are_recorded_per_parameter():
    """The multi-tensor path (the default on CUDA) updates in place with ``_foreach_*_`` ops that return
    nothing; the writes must still be recorded, each attributed to its own parameter's module."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    recs = run_traced(model, torch.randn(3, 4), opt)
    owner = _param_owner_by_shape(model)
    upd = [r for r in ops(recs, phase="optimizer") if r.op.startswith("aten._foreach_addcdiv_")]
    assert {(r.shape, r.module) for r in upd} == set(owner.items()), [(r.op, r.shape, r.module) for r in upd]
