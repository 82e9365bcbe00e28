"""Every runnable real failure in ``../shared/cases`` is diagnosed as its ``EXPECT`` says.

``EXPECT`` is read with :mod:`ast` (no import at collection time). ``findings[0]`` must carry one of the expected
codes, the expected module (as in ``named_modules()``) and phase. Without the folder the tests are skipped,
except under CI (``CI=true``), where a missing folder is a failure.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest

import ampdoctor

SHARED_CASES = Path(__file__).resolve().parents[1].parent / "shared" / "cases"
CORE_CODES = {"overflow", "nan-from-inf", "masked-row-nan", "constant-out-of-range", "unused-parameters",
              "nonfinite-input"}
#: codes another helper is building now; cases that expect only these (and no core code) are xfail for now


def _expect(path: Path) -> dict[str, Any] | None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EXPECT" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _cases() -> list[Any]:
    if not SHARED_CASES.is_dir():
        return [pytest.param(None, id="shared-cases-missing")]
    out = []
    for path in sorted(SHARED_CASES.glob("*.py")):
        exp = _expect(path)
        if exp is None:
            continue
        out.append(pytest.param(path, id=path.stem))
    return out or [pytest.param(None, id="shared-cases-missing")]


def _t5_cases() -> list[Any]:
    if not SHARED_CASES.is_dir():
        return [pytest.param(None, id="shared-cases-missing")]
    return [pytest.param(p, id=p.stem) for p in sorted(SHARED_CASES.glob("*.py"))
            if "T5Config" in p.read_text(encoding="utf-8")] or [pytest.param(None, id="shared-cases-missing")]


def _require_folder(path: Path | None) -> Path:
    if path is not None:
        return path
    msg = (f"shared scenario cases not found (or no case with EXPECT) at {SHARED_CASES}: the project's workspace "
           "lays out shared/ next to the repository (repo/../shared/cases); run the tests from a checkout placed there")
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


_REPORTS: dict[Path, ampdoctor.Report] = {}


def _report(path: Path) -> ampdoctor.Report:
    if path not in _REPORTS:
        _REPORTS[path] = ampdoctor.diagnose_file(str(path))
    return _REPORTS[path]


def _describe(report: ampdoctor.Report) -> str:
    return "; ".join(f"{f.code} {f.module!r} {f.op} {f.phase} ({f.severity})" for f in report.findings[:5]) or "none"


@pytest.mark.parametrize("path", _cases())
def test_shared_case_root_cause(path: Path | None) -> None:
    path = _require_folder(path)
    exp = _expect(path)
    assert exp is not None
    report = _report(path)
    if exp.get("healthy"):
        assert report.ok, f"{path.name} is healthy but got findings: {_describe(report)}"
        return
    assert report.findings, f"{path.name}: no finding (expected {exp})"
    f = report.findings[0]
    got = f"findings: {_describe(report)}"
    assert f.code in exp["codes"], got
    assert f.module == exp["module"], got
    assert f.phase == exp["phase"], got
    assert f.severity == "error", got
    assert not report.ok


@pytest.mark.parametrize("path", _t5_cases())
def test_t5_relative_position_log_is_benign(path: Path | None) -> None:
    """T5's bucketing computes log(0) = -inf and discards it: it is an origin, never a finding."""
    path = _require_folder(path)
    report = _report(path)
    bad = [f for f in report.findings if f.severity == "error" and f.op == "aten.log.default"]
    assert not bad, f"benign log(0) blamed: {_describe(report)}"
    logs = [o for o in report.summary["origins"] if o["op"] == "aten.log.default"]
    assert logs, "the relative-position log(0) should be traced as a (benign) origin"
    assert all(o["harmful"] is False and o["module"].endswith("SelfAttention") for o in logs), logs
