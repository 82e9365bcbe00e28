"""The quick pass of ``check`` never hides an error: every shared case and field case (failure and healthy twin) in
fp16-amp and bf16-amp, the full diagnosis's verdict against the triage's decision (``bench/check_safety.py`` runs
the same sweep and commits the table). A case whose diagnosis has an error finding, or raises, must take the full
diagnosis; ``check`` must then agree with it. Shared cases are skipped without the folder, except under CI."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import check_safety  # noqa: E402

CASES = check_safety._specs()


@pytest.mark.parametrize("precision", check_safety.PRECISIONS)
@pytest.mark.parametrize(("name", "make"), CASES, ids=[n for n, _ in CASES])
def test_quick_pass_hides_no_error(name: str, make: Any, precision: str) -> None:
    row = check_safety.one(name, make, precision)
    assert not row["violation"], row
    assert row["check"] == row["diagnosis"] or row["diagnosis"].startswith("raised"), row


def test_shared_cases_are_there() -> None:
    if not any(n.startswith("shared/") for n, _ in CASES):
        if os.environ.get("CI") == "true":
            pytest.fail(f"no shared cases in {check_safety.SHARED}")
        pytest.skip("no shared cases folder")
