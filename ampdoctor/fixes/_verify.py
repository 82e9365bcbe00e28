"""The public entry points of verification: :func:`verify` (one fix) and :func:`diagnose_and_fix` (every fix the
diagnosis proposes), with how a scenario becomes a step and how proposals of several findings merge.

The verdict itself is :mod:`._verdict`; the baselines shared by the fixes of one step are :mod:`._session`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ampdoctor.findings import Finding, FixProposal, Report
from ampdoctor.fixes._actions import FIXES, build_plan
from ampdoctor.fixes._session import DEFAULT_STEPS, Session, check_args
from ampdoctor.fixes._verdict import Verification
from ampdoctor.precision import ScenarioError, StepSpec, load_scenario_module, saved_rng, spec_from_module


def resolve_spec(scenario: Any) -> StepSpec:
    """A :class:`StepSpec` from a spec, a scenario file path, a built-in scenario name or a module with make()."""
    if isinstance(scenario, StepSpec):
        return scenario
    if isinstance(scenario, (str, os.PathLike)):
        path = os.fspath(scenario)
        with saved_rng():  # importing the file and make() draw random numbers: not from the caller's stream
            if os.path.isfile(path):
                return spec_from_module(load_scenario_module(path), source=path)
            from ampdoctor.scenarios import BUILTIN, load_scenario

            if path in BUILTIN:
                mod = load_scenario(path)
                return spec_from_module(mod, source=getattr(mod, "__file__", path) or path)
        raise ScenarioError(f"scenario {path!r} is neither a file nor a built-in scenario ({', '.join(BUILTIN)})")
    if callable(getattr(scenario, "make", None)):
        with saved_rng():
            return spec_from_module(scenario, source=getattr(scenario, "__file__", "") or "")
    raise TypeError(f"scenario must be a StepSpec, a scenario file path, a built-in scenario name or a module with "
                    f"make(), got {type(scenario).__name__}")


def _same_scope(a: FixProposal, b: FixProposal) -> bool:
    lists = ("modules", "module", "parameters")
    return a.id == b.id and {k: v for k, v in a.params.items() if k not in lists} == {
        k: v for k, v in b.params.items() if k not in lists}


def merged_params(report: Report, proposal: FixProposal) -> dict[str, Any]:
    """``proposal.params`` with the module/parameter lists of every finding that proposes the same fix merged in
    (two fully masked softmaxes in two layers need one safe_mask over both)."""
    params = dict(proposal.params)
    for key in ("modules", "parameters"):
        if key not in params:
            continue
        names = list(params[key])
        for f in report.findings:
            for p in f.fixes:
                if _same_scope(p, proposal):
                    names += [n for n in p.params.get(key, []) if n not in names]
        params[key] = names
    return params


def _fix_key(fix_id: str, params: dict[str, Any]) -> tuple[str, str]:
    """One key per distinct fix: merged module/parameter lists are sets (finding b's ``[b, a]`` is finding a's
    ``[a, b]``), so a fix several findings propose is verified once."""
    norm = {k: sorted(v) if k in ("modules", "parameters") and isinstance(v, list) else v for k, v in params.items()}
    return fix_id, repr(sorted(norm.items()))


def targets_of(report: Report, proposal: FixProposal) -> tuple[str, ...]:
    """``code@module`` of every finding that proposes this fix (its module lists merged): what it must cure."""
    return tuple(dict.fromkeys(f"{f.code}@{f.module or '<root>'}" for f in report.findings
                               if any(_same_scope(p, proposal) for p in f.fixes)))


def _finding_of(report: Report, proposal: FixProposal) -> Finding | None:
    return next((f for f in report.findings if any(p is proposal for p in f.fixes)), None) or next(
        (f for f in report.findings if any(p == proposal for p in f.fixes)), None)


def _proposal_for(report: Report, which: str) -> tuple[FixProposal, Finding]:
    for f in report.findings:
        for p in f.fixes:
            if p.id == which:
                return p, f
    proposed = sorted({p.id for f in report.findings for p in f.fixes if p.id})
    raise ValueError(f"no finding proposes fix {which!r}; proposed fixes: {', '.join(proposed) or 'none'} "
                     f"(registered: {', '.join(sorted(FIXES))})")


def verify(proposal: FixProposal | str, scenario: Any, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
           report: Report | None = None) -> Verification:
    """Apply one fix to a step, re-diagnose it and train ``steps`` steps next to fp32; return the numbers.

    >>> from ampdoctor.fixes import verify
    >>> v = verify("switch_precision", "t5_fp16_amp_ff_overflow")      # doctest: +SKIP
    >>> v.verified, v.loss_fp32, v.loss_broken, v.loss_fixed          # doctest: +SKIP
    (True, 4.87, nan, 4.87)

    ``proposal`` is a fix id (the first proposal with that id in the step's diagnosis) or a
    :class:`FixProposal`: its ``params`` are used as given, unless ``report`` (the diagnosis it came from) is
    passed, in which case module/parameter lists of the same fix proposed by other findings are merged in and the
    diagnosis is not run again. ``scenario`` is a :class:`StepSpec`, a scenario file, a built-in scenario name
    or a module with ``make()``. Everything runs on copies; the caller's objects and RNG state are left as they
    were. Cost: two diagnoses (original, fixed) and four or five untraced ``steps``-step runs (fp32, rounded-start
    fp32, original target, fixed target); one host sync per step and run.
    """
    check_args(steps, policy)
    spec = resolve_spec(scenario)
    session = Session(spec, steps=steps, policy=policy, report=report)
    finding: Finding | None = None
    if isinstance(proposal, str):
        proposal, finding = _proposal_for(session.report, proposal)
    elif isinstance(proposal, FixProposal):
        finding = _finding_of(report, proposal) if report is not None else None
    else:
        raise TypeError(f"proposal must be a FixProposal or a fix id (str), got {type(proposal).__name__}")
    if not proposal.id:
        raise ValueError(f"fix {proposal.title!r} is advice without an automatic action (no id); it cannot be "
                         "verified automatically")
    params = merged_params(session.report, proposal) if finding is not None else dict(proposal.params)
    plan = build_plan(proposal.id, params, session.context(finding.module if finding is not None else ""))
    return session.verify(plan, targets_of(session.report, proposal) if finding is not None else ())


def diagnose_and_fix(spec: Any, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
                     until_verified: bool = False) -> Report:
    """Diagnose a step and verify every fix the findings propose; fixes are annotated and ordered verified-first.

    >>> report = diagnose_and_fix("t5_fp16_amp_ff_overflow")          # doctest: +SKIP
    >>> [(p.id, p.verified) for p in report.findings[0].fixes]       # doctest: +SKIP
    [('keep_fp32', True), ('switch_precision', True)]

    Each proposal with an id gets ``verified`` True/False and ``verification`` (see :class:`Verification`); its
    ``params`` become the merged ones that were verified (so :func:`ampdoctor.fixes.fix` applies exactly that).
    Within a finding: verified fixes first, then advice without an action, then fixes that failed. A fix
    proposed by several findings is verified once. ``spec``: as ``scenario`` of :func:`verify`.
    ``until_verified=True`` stops at the first verified fix (findings in report order, fixes in proposal order);
    the fixes after it keep ``verified=None`` -- enough for ``fix(model, report)`` and much cheaper.
    """
    if not isinstance(until_verified, bool):
        raise TypeError(f"until_verified must be a bool, got {type(until_verified).__name__}")
    check_args(steps, policy)
    spec = resolve_spec(spec)
    session = Session(spec, steps=steps, policy=policy)
    report = session.report
    done: dict[tuple[str, str], tuple[dict[str, Any], Verification | None, str]] = {}
    findings = []
    for f in report.findings:
        fixes = []
        for p in f.fixes:
            if not p.id or p.id not in FIXES:
                fixes.append(p)
                continue
            params = merged_params(report, p)
            key = _fix_key(p.id, params)
            if key not in done and until_verified and any(v is not None and v.verified for _, v, _ in done.values()):
                fixes.append(p)
                continue
            if key not in done:
                try:
                    plan = build_plan(p.id, params, session.context(f.module))
                    done[key] = (plan.params, session.verify(plan, targets_of(report, p)), "")
                except (ValueError, TypeError) as e:
                    done[key] = (params, None, f"{type(e).__name__}: {e}")
            used, v, err = done[key]
            if v is None:
                fixes.append(replace(p, verified=False, verification={"verified": False, "reason": err}))
            else:
                fixes.append(replace(p, params=dict(used), verified=v.verified, verification=v.to_dict()))
        order = {True: 0, None: 1, False: 2}
        fixes.sort(key=lambda x: order[x.verified])
        findings.append(replace(f, fixes=tuple(fixes)))
    return replace(report, findings=tuple(findings))


__all__ = ["diagnose_and_fix", "merged_params", "resolve_spec", "targets_of", "verify"]
