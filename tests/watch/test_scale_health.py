"""A loss-scale collapse names the parameters whose gradients overflowed, first in backward order.

The model's last layer has large weights (|w| ~ 100, real magnitudes of an un-normalised head): under fp16 autocast
and GradScaler's 65536, the gradient flowing out of ``head`` into ``body`` is ``scale / (2N) * w`` ~ 8e5, past fp16's
65504, while ``head``'s own weight gradient (``scale / (2N) * x``) stays finite. So GradScaler skips every step, and the
first non-finite gradients in backward order are ``body``'s (then ``stem``'s), never ``head``'s. The healthy twin
(the same head at PyTorch's init) skips nothing and names nothing.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ampdoctor.watch import watch


def _model(head_scale: float) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(stem=nn.Linear(8, 8), body=nn.Linear(8, 8), head=nn.Linear(8, 1)))
    with torch.no_grad():
        m.head.weight.mul_(head_scale)
    return m


def _run(head_scale: float, steps: int = 4) -> tuple[object, nn.Module]:
    m = _model(head_scale)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 0.5
    with watch(m, opt, sc, locate=False, coverage_steps=0) as w:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().mean() * 0.5     # the bias gradient, scale / 2, fits fp16
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            w.step(loss)
    return w.report(), m


def test_collapse_names_the_parameters_whose_gradients_overflowed_in_backward_order() -> None:
    r, m = _run(300.0)
    f = r.findings[0]
    assert (f.code, f.severity) == ("loss-scale-collapse", "error")
    assert r.summary["skipped_steps"] == 4                # step 0 included
    assert f.evidence["params"] == ["body.weight", "body.bias", "stem.weight", "stem.bias"]
    assert f.evidence["params_step"] == 1                 # probed in the backward after the first skip
    assert "body.weight" in f.explanation
    assert not any(h._ampdoctor_hook for p in m.parameters()           # the probe's hooks are gone
                   for h in getattr(p, "_post_accumulate_grad_hooks", {}).values())


def test_a_healthy_head_names_nothing() -> None:
    r, _ = _run(1.0)
    assert r.codes() == [] and r.summary["skipped_steps"] == 0
