"""A ``torch.compile``d model under the watch (CPU inductor): the user passes the compiled module, as they train it.
A middle Linear's fp16 weights (x 3e5, below fp16's max) make its output overflow; LayerNorm turns inf into NaN.

The replay unwraps the compiled module (``_orig_mod``, as it unwraps DDP) and runs it eagerly, op by op, so it names
the Linear, ``aten.addmm``, forward (it used to fail: ``diagnose`` refuses compiled modules). The healthy twin stays
free of inf/NaN findings and trains bitwise as the same compiled loop without the watch. Inductor compiles the
first graph in ~10 s on 2 shared cores (the twin reuses its cache).
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


def train(scale: float, watched: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    with torch.no_grad():
        m[2].weight.mul_(scale)
    m = m.half()
    compiled = torch.compile(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)

    def loop(w):  # type: ignore[no-untyped-def]
        for _ in range(3):
            opt.zero_grad()
            loss = compiled(torch.randn(4, 8, generator=g).half()).float().pow(2).mean()
            loss.backward()
            opt.step()
            if w is not None:
                w.step(loss)

    if not watched:
        loop(None)
        return m, None
    with ampdoctor.watch(compiled, opt) as w:
        loop(w)
    return m, w.report()


def test_compiled_model_replays_eagerly_and_names_the_op() -> None:
    _, r = train(3e5, True)
    assert "replay_error" not in r.summary, r.summary["replay_error"]
    first = r.findings[0]
    assert (first.code, first.module, first.op, first.phase) == ("overflow", "2", "aten.addmm.default", "forward")
    assert "nan-from-inf" in r.codes()


def test_compiled_healthy_twin_is_clean_and_bitwise_unchanged() -> None:
    plain, _ = train(1.0, False)
    watched, r = train(1.0, True)
    assert "replay" not in r.summary and not [f for f in r.findings if f.code in ("overflow", "nan-from-inf")]
    for (n, a), (_, b) in zip(plain.state_dict().items(), watched.state_dict().items()):
        assert torch.equal(a, b), n
