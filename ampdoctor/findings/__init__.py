"""Findings: one registered rule per cause code, ranked into a :class:`~ampdoctor.Report`.

Rules read a :class:`Context` (target and reference runs aligned op by op, classified origins) and return
candidates; :func:`analyse` runs them all and ranks them: errors first, then the earliest cause in the
run, then the code's precedence (``docs/codes.md``).
"""

from __future__ import annotations

from ampdoctor.findings import (  # noqa: F401  (registers the rules)
    _core_rules,
    _fp32_rules,  # must-stay-fp32
    _range_rules,  # noqa: F401  (saturation, underflow, precision-loss)
    _reference_rules,  # nonfinite-reference
    _training_rules,
)
from ampdoctor.findings._context import Context, build_context
from ampdoctor.findings._registry import CODE_INFO, RULES, Candidate, CodeInfo, codes_markdown, rule
from ampdoctor.findings._types import CODES, SCHEMA_VERSION, Finding, FixProposal, Report

_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


def rank(candidates: list[Candidate]) -> list[Finding]:
    """Most important first: severity, then when the cause happened, then code precedence."""
    def key(c: Candidate) -> tuple[int, float, int]:
        info = CODE_INFO.get(c.finding.code)
        return (_SEVERITY_RANK[c.finding.severity], c.order, info.precedence if info else 99)

    seen: set[tuple[str, str, str, str]] = set()
    out: list[Finding] = []
    for c in sorted(candidates, key=key):
        f = c.finding
        k = (f.code, f.module, f.op, f.phase)
        if k in seen:
            continue
        seen.add(k)
        out.append(f)
    return out


def analyse(ctx: Context) -> list[Finding]:
    """Run every registered rule on ``ctx`` and rank the findings."""
    candidates: list[Candidate] = []
    for fn in RULES.values():
        candidates.extend(fn(ctx))
    return rank(candidates)


__all__ = [
    "CODES",
    "CODE_INFO",
    "RULES",
    "SCHEMA_VERSION",
    "Candidate",
    "CodeInfo",
    "Context",
    "Finding",
    "FixProposal",
    "Report",
    "analyse",
    "build_context",
    "codes_markdown",
    "rank",
    "rule",
]
