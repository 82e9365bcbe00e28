"""torch.compile: diagnosed eager (see test_generate), and ``--compiled`` compares compiled with eager outputs."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from ampdoctor.diagnose_generate import compiled_findings
from ampdoctor.precision import _compiled
from ampdoctor.precision._compiled import compare_compiled, compare_outputs


class Rescale(nn.Module):
    """``(x * 1000) / 1000`` at x = 100: eager fp16 rounds the product to inf; inductor's fused CPU kernel keeps
    the intermediate in float32 and returns 100. A real compile-only numerics difference."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1000.0))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": (x * self.scale) / self.scale, "z": x + 1}


def test_compile_sensitive_output_is_flagged_by_name() -> None:
    if _compiled.compile_unavailable(torch.device("cpu")) is not None:
        pytest.fail("no C++ compiler on PATH: torch.compile cannot run on CPU here (install g++)")
    cmp = compare_compiled(Rescale(), torch.full((4, 8), 100.0), "fp16")
    assert (cmp["verdict"], cmp["first_differing_output"]) == ("differs", "y")
    y, z = cmp["outputs"]
    assert (y["eager_nonfinite"], y["compiled_nonfinite"]) == (32, 0)
    assert z["status"] == "identical"
    [f] = compiled_findings(cmp, "fp16")
    assert (f.code, f.severity) == ("precision-loss", "warning") and "'y'" in f.title


def test_compare_outputs_identical_tolerance_and_first_difference() -> None:
    a = {"logits": torch.ones(3), "hidden": torch.zeros(2)}
    assert compare_outputs(a, {k: v.clone() for k, v in a.items()})["verdict"] == "identical"
    near = {"logits": torch.ones(3) * (1 + 1e-4), "hidden": torch.zeros(2)}
    assert compare_outputs(a, near)["verdict"] == "within tolerance"
    off = {"logits": torch.ones(3), "hidden": torch.tensor([0.0, 5.0])}
    out = compare_outputs(a, off)
    assert (out["verdict"], out["first_differing_output"]) == ("differs", "hidden")
    assert compiled_findings(compare_outputs(a, a), "fp16") == []


def test_without_a_compiler_the_comparison_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cmp = compare_compiled(nn.Linear(2, 2), torch.ones(1, 2), "fp16")
    assert cmp["verdict"] == "unavailable" and "C++ compiler" in cmp["reason"]
    assert compiled_findings(cmp, "fp16") == []


def test_generation_and_hf_paths_carry_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    import ampdoctor
    from tests.inference._models import gpt2, prompt

    monkeypatch.setattr(shutil, "which", lambda name: None)  # the wiring, without a minute of compilation
    rep = ampdoctor.diagnose_generate(gpt2(spike=False, overflow=False), prompt(), max_new_tokens=2, compiled=True)
    assert rep.summary["compiled"]["verdict"] == "unavailable" and rep.ok
