"""The minimal keep-in-fp32 policy: on the T5 demo and the public T5 cases it keeps the overflowing ``wo`` (or
the gated product) in fp32 and nothing unrelated."""

from __future__ import annotations

import pytest

from ampdoctor.fixes import minimal_fp32_policy
from tests.conftest import SHARED_CASES, in_ci

FF = "encoder.block.0.layer.1.DenseReluDense"


def _check(policy: object) -> None:
    mods = policy.modules  # type: ignore[attr-defined]
    assert any(m == f"{FF}.wo" or m == FF for m in mods), mods
    assert all(m.startswith(FF) for m in mods), mods  # nothing unrelated (no layer norm, no attention)


def test_t5_demo_policy_is_wo_alone() -> None:
    p = minimal_fp32_policy("t5_fp16_amp_ff_overflow", steps=6)
    assert p.verified and p.modules == (f"{FF}.wo",), p.tried
    assert len(p.tried) >= 2  # the whole implicated set (wo + a downstream layer norm) was tried and shrunk
    assert p.keep_in_fp32_modules == ["wo"]
    assert p.fp32_flop_fraction is not None and 0.0 < p.fp32_flop_fraction < 0.2
    assert "_keep_in_fp32_modules = ['wo']" in p.snippet() and "enabled=False" in p.snippet()


@pytest.mark.parametrize("name", ["t5_amp_wo_overflow", "t5_gated_ff_product_overflow_fp16"])
def test_public_t5_cases(name: str) -> None:
    path = SHARED_CASES / f"{name}.py"
    if not path.is_file():
        if in_ci():
            pytest.fail(f"shared case {path} is missing")
        pytest.skip(f"shared case {path} is missing")
    p = minimal_fp32_policy(str(path), steps=6)
    _check(p)
    if name == "t5_amp_wo_overflow":
        assert p.verified, p.verification.get("reason")
