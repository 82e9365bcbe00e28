"""Two field cases as unmodified training scripts under ``ampdoctor run`` (``run_script``): the watch sees the
non-finite step, replays it under the op trace and names the module and op, as ``diagnose`` does for the scenario.

Sources: the Mamba-style softplus (openvinotoolkit/openvino#31654, unslothai/unsloth-zoo#211) and EfficientViT's
ReLU linear attention (mit-han-lab/efficientvit#110); models in ``bench/_field_cases.py``. The healthy twin (same
script, magnitudes that fit) never replays and gets no overflow; its ``model.half()`` training without fp32 master
weights is reported as ``low-precision-params`` in both runs, correctly.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from ampdoctor.integrations.run import run_script

BENCH = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

MAMBA = """
    import sys, torch
    sys.path.insert(0, {bench!r})
    from _field_cases import SSM
    torch.manual_seed(0)
    model = SSM()
    with torch.no_grad():
        model.mixer.dt_proj.bias.fill_(float(sys.argv[1]))   # dt pre-activations: exp(14) > 65504
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(2, 6, 8).half()
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
"""

VIT = """
    import sys, torch
    import torch.nn.functional as F
    sys.path.insert(0, {bench!r})
    from _field_cases import LinearViT
    torch.manual_seed(0)
    model = LinearViT()
    with torch.no_grad():
        model.stem.weight.mul_(float(sys.argv[1]))           # token features ~10: (v^T k) q over 512 tokens
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(2):
        x, y = torch.randn(2, 512, 8).half(), torch.randint(0, 10, (2,))
        opt.zero_grad()
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
"""


@pytest.mark.parametrize(("src", "bad", "good", "expect"), [
    (MAMBA, "14", "2", ("overflow", "mixer", "aten.exp.default", "forward")),
    (VIT, "12", "1", ("overflow", "attn", "aten.bmm.default", "forward")),
], ids=["mamba-softplus", "efficientvit-linear-attention"])
def test_run_script_replays_and_names_the_op(tmp_path, src: str, bad: str, good: str,
                                             expect: tuple[str, str, str, str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(src.format(bench=BENCH)))
    r = run_script(["python", str(script), bad])
    assert r.summary["script"] == {"status": "completed"} and "replay" in r.summary
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase) == expect, [(g.code, g.module, g.op, g.phase) for g in r.findings]
    assert f.severity == "error" and f.evidence["ref_absmax"] > 65504 == f.evidence["format_max"]
    twin = run_script(["python", str(script), good])
    assert "replay" not in twin.summary
    assert not [g for g in twin.findings if g.code in ("overflow", "nan-from-inf")], twin.findings
