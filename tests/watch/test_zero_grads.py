"""Exactly-zero gradients in a reduced-precision backward (``ampdoctor.watch._zero_grads``): flushed values are
``underflow`` at the op where they flush, not ``unused-parameters``; zeros that are zero in fp32 too stay
``unused-parameters``.

The failing set-up is pure fp16 training without loss scaling: a small loss (x 1e-6) whose gradient reaches the
last Linear as one fp16 subnormal; its input-gradient matmul (``aten.mm``, backward) lands below 2**-24, so the
LayerNorm and every layer before it get exactly-zero gradients. The healthy twin is the same model with a loss of
normal size.
"""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.watch import watch


class Net(nn.Module):
    def __init__(self, loss_mul: float, gate: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 1))
        self.gate = nn.Linear(32, 32) if gate else None
        self.loss_mul = loss_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.net[0].weight.dtype)
        h = self.net[:3](x)
        if self.gate is not None:      # in the graph, but its gradient is exactly zero in fp32 too
            h = h + 0.0 * self.gate(x)
        return self.net[3:](h).float().mean() * self.loss_mul


def _train(loss_mul: float, watched: bool, gate: bool = False, **options) -> tuple[list[torch.Tensor], object]:
    torch.manual_seed(0)
    m = Net(loss_mul, gate).half()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 32, generator=g) for _ in range(4)]
    w = watch(m, opt, **options) if watched else None
    if w is not None:
        w.__enter__()
    try:
        for x in xs:
            opt.zero_grad()
            loss = m(x)
            loss.backward()
            if w is not None:
                w.step(loss)
            opt.step()
    finally:
        if w is not None:
            w.__exit__(None, None, None)
    return [p.detach().clone() for p in m.parameters()], (w.report() if w is not None else None)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_fp16_gradient_underflow_is_named_at_the_op_where_it_flushes() -> None:
    plain, _ = _train(1e-6, False)
    weights, r = _train(1e-6, True)
    assert _same(weights, plain)                       # the replay ran on copies
    assert not any(f.code == "unused-parameters" for f in r.findings), r.codes()
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase, f.severity) == ("underflow", "net.5", "aten.mm.default", "backward",
                                                             "error"), r.findings
    assert f.step == 2                                 # the last coverage step, counted in the run
    zero = f.evidence["zero_gradient_parameters"]
    assert {"net.0.weight", "net.1.weight", "net.1.bias", "net.3.weight"} <= set(zero)
    assert "net.5.weight" not in zero                  # its own gradient is a (tiny) non-zero fp16 value
    assert f.evidence["flushed_fraction"] == 1.0 and f.evidence["ref_absmax"] > 0


def test_without_a_replay_the_zeros_are_a_suspected_underflow() -> None:
    _, r = _train(1e-6, True, locate=False)
    assert not any(f.code == "unused-parameters" for f in r.findings), r.codes()
    found = {f.module: f for f in r.findings if f.code == "underflow"}
    assert set(found) == {"net.0", "net.1", "net.3"}
    assert all(f.severity == "warning" and f.evidence["confirmed"] is False and f.evidence["dtype"] == "float16"
               for f in found.values())


def test_zero_in_fp32_too_stays_unused_parameters() -> None:
    """A zero multiplier: the fp16 zeros are zero in fp32 too, the replay finds no underflow for them."""
    _, r = _train(1.0, True, gate=True)
    found = [f for f in r.findings if f.code == "unused-parameters"]
    assert [f.module for f in found] == ["gate"] and found[0].evidence["fp32_checked"] is True
    assert not any(f.code == "underflow" for f in r.findings), r.findings


def test_healthy_twin_stays_clean_and_bitwise_identical() -> None:
    plain, _ = _train(1.0, False)
    weights, r = _train(1.0, True)
    assert _same(weights, plain)
    assert not any(f.code in ("underflow", "unused-parameters") for f in r.findings), r.findings
    assert not any(a["kind"] == "zero-grads" for a in r.summary["anomalies"])
