"""Findings: one registered rule per cause code, ranked into a :class:`~ampdoctor.Report`.

Rules read a :class:`Context` (target and reference runs aligned op by op, classified origins) and return
candidates; :func:`analyse` runs them all and ranks them: errors first, then the earliest cause in the
run, then the code's precedence (``docs/codes.md``).
"""

from __future__ import annotations

from ampdoctor.findings import (  # noqa: F401  (importing a rule module registers its rules)
    _core_rules,  # overflow, nan-from-inf, masked-row-nan, constant-out-of-range, nonfinite-input
    _divergence,  # reference-diverges
    _fp32_rules,  # must-stay-fp32
    _precision_loss,  # precision-loss
    _reference_rules,  # nonfinite-reference
    _saturation,  # saturation
    _training_rules,  # low-precision-params, loss-scale-collapse, loss-scaling-misuse, fp8-scale
    _underflow,  # underflow
    _unused_params,  # unused-parameters
)
from ampdoctor.findings._context import Context, build_context, group_by_owner
from ampdoctor.findings._crash import attach_exception
from ampdoctor.findings._knowledge import enrich_all
from ampdoctor.findings._payloads import Evidence, LayerStat
from ampdoctor.findings._ranks import agree
from ampdoctor.findings._registry import CODE_INFO, RULES, Candidate, CodeInfo, Order, Stage, at, codes_markdown, rule
from ampdoctor.findings._remedies import REMEDIES, Remedy, remedies_for
from ampdoctor.findings._summary import layers, summary
from ampdoctor.findings._types import CODES, SCHEMA_VERSION, Finding, FixProposal, Link, Report, RunSummary, Site
from ampdoctor.findings._types import _jsonable as jsonable

_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}
#: precedence of a code without a registered rule (it sorts after every registered one)
UNREGISTERED_PRECEDENCE = 99


def rank_key(c: Candidate) -> tuple[int, Order, int]:
    """Severity, then when the cause happened (:class:`Order`), then the code's precedence: lower first."""
    info = CODE_INFO.get(c.finding.code)
    return (_SEVERITY_RANK[c.finding.severity], c.when, info.precedence if info else UNREGISTERED_PRECEDENCE)


def rank(candidates: list[Candidate]) -> list[Finding]:
    """Most important first (:func:`rank_key`); one finding per (code, module, op, phase), the first ranked."""

    seen: set[tuple[str, str, str, str]] = set()
    out: list[Finding] = []
    for c in sorted(candidates, key=rank_key):
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
    return rank(_divergence.temper(ctx, candidates))  # a run whose fp32 reference diverges too


__all__ = [
    "CODES",
    "CODE_INFO",
    "REMEDIES",
    "RULES",
    "SCHEMA_VERSION",
    "Candidate",
    "CodeInfo",
    "Context",
    "Evidence",
    "Finding",
    "FixProposal",
    "LayerStat",
    "Link",
    "Order",
    "Remedy",
    "Report",
    "RunSummary",
    "Site",
    "Stage",
    "analyse",
    "at",
    "agree",
    "attach_exception",
    "build_context",
    "enrich_all",
    "group_by_owner",
    "layers",
    "jsonable",
    "codes_markdown",
    "rank",
    "rank_key",
    "remedies_for",
    "rule",
    "summary",
]
