"""Every built-in scenario is diagnosed as its EXPECT says: the failing ones name code, module and phase as
``findings[0]``; the healthy controls are ``ok``."""

from __future__ import annotations

import pytest

import ampdoctor
from ampdoctor.scenarios import list_scenarios, load_scenario


@pytest.mark.parametrize("name", list_scenarios())
def test_builtin_scenario_diagnosis(name: str) -> None:
    module = load_scenario(name)
    expect = module.EXPECT
    report = ampdoctor.diagnose_file(module.__file__)
    if expect.get("healthy"):
        assert report.ok, [(f.code, f.module, f.op, f.phase) for f in report.findings]
        return
    f = report.findings[0]
    assert f.code in expect["codes"], report.codes()
    assert (f.module, f.phase) == (expect["module"], expect["phase"])
    assert f.explanation and f.evidence
