"""The watch's :class:`Report`: its own findings (``_rules``) merged with a replay's, and a bounded summary."""

from __future__ import annotations

import dataclasses
from typing import Any

from ampdoctor.findings import Report
from ampdoctor.watch import _rules
from ampdoctor.watch._payload import precision_settings
from ampdoctor.watch._policy import AnomalyPolicy
from ampdoctor.watch._record import Coverage
from ampdoctor.watch._steps import StepTracker
from ampdoctor.watch._zero_grads import with_zero_replay


def precision_of(t: StepTracker) -> dict[str, Any]:
    params = [p for _, p in t.params.trainable] or list(t.model.parameters())
    return precision_settings(t.autocast, params)


def backward_dtype(t: StepTracker) -> str | None:
    """The reduced dtype the steps' backward ran in (autocast's, else the parameters'), None for fp32."""
    name = precision_of(t)["name"] or ""
    return "float16" if name.startswith("fp16") else "bfloat16" if name.startswith("bf16") else None


def build_report(t: StepTracker, policy: AnomalyPolicy, disabled: str | None) -> Report:
    recs = t.records
    coverage = t.coverage
    if coverage is None:   # still measuring: a provisional verdict on what was seen so far
        never = tuple(n for n, p in t.params.trainable if id(p) not in t.cov_seen) if t.cov_steps else ()
        coverage = Coverage(t.cov_steps, never, (), t.params.not_in_optimizer)
    if policy.sharded:     # FSDP: a rank's parameters are its shards (empty ones too): coverage says nothing
        coverage = Coverage(0, (), (), ())
    s = t.state
    cur = t.it.record       # the open step: checked (and maybe stopped by "raise") but not closed
    seen = recs + [cur] if cur.nonfinite_params or cur.loss is not None else recs
    episodes = _rules.collapse_findings(recs, t.options.collapse_steps, s.backoff, s.health.overflow_params,
                                        s.health.overflow_params_step)
    setup = [policy.setup] if policy.setup is not None else []     # 16-bit weights under mixed precision
    own = (setup + _rules.with_health(episodes, _rules.health_finding(s.health, t.options, s.backoff))
           + _rules.nonfinite_findings(seen, t.params.owners)
           + _rules.coverage_findings(coverage, t.params.owners, ddp=t.ddp_strict)
           + _rules.low_precision_findings(s.lost if t.params.low else None, t.params.owners))
    merged = _rules.merge_replay(own, _at_run_step(policy.replay_report, policy.replay_step))
    merged = with_zero_replay(merged, _at_run_step(policy.zero_replay, policy.zero_replay_step), s.zero_dtype)
    ranks = policy.ranks.summary() if policy.ranks is not None else None
    unreproduced = _rules.unreproduced_on_rank(policy.unreproduced, ranks)   # a rank that only received it
    findings = _rules.with_unreproduced(merged, unreproduced)
    findings = _rules.with_ranks(findings, ranks) if ranks is not None else findings
    tail, precision, h = recs[-64:], precision_of(t), s.health
    summary: dict[str, Any] = {
        "source": "watch",
        "steps": t.n_steps,
        "skipped_steps": h.skipped,
        "steps_skipped_by_watch": policy.skipped_by_guard,
        "losses": [r.loss for r in tail if r.loss is not None],
        "grad_norms": [r.grad_norm for r in tail if r.grad_norm is not None],
        "loss_scales": [r.scale for r in tail if r.scale is not None],
        "longest_skip_run": h.longest,
        "loss_scale_peak": h.peak,
        "loss_scale_trajectory": [[st, v] for st, v in h.changes],
        "grad_spikes": list(s.spikes),
        "grad_spike_count": s.n_spikes,
        "anomalies": list(policy.recent),
        "anomaly_counts": dict(policy.counts),
        "reproducers": list(policy.reproducers),
        "coverage_steps": coverage.steps,
        "precision": precision["name"],
        "precision_settings": precision,
        "on_anomaly": t.options.on_anomaly,
        "disabled": disabled,
    }
    summary.update(_extra_summary(t, policy, precision["name"], ranks))
    if policy.replay_report is not None:
        summary["replay"] = {"source": policy.replay_report.source, "summary": policy.replay_report.summary,
                             **_unreproduced(unreproduced)}
    if s.broken:    # detectors that raised and were switched off (the rest of the watch kept working)
        summary["detectors_off"] = sorted(s.broken)
    if policy.replay_error is not None:
        summary["replay_error"] = policy.replay_error
    note = policy.replay_note or (unreproduced or {}).get("note")
    if note is not None:
        summary["replay_note"] = note
    layers = policy.replay_report.layers if policy.replay_report is not None else ()
    return Report(tuple(findings), precision["name"], summary, layers, t.options.source or "watch")


def _at_run_step(r: Report | None, base: int | None) -> Report | None:
    """A replay's report with its findings' steps counted in the run (the replay's step 0 is the run's step
    ``base``), so that ``finding.step`` says when in training the failure happened."""
    if r is None or not base:
        return r
    return dataclasses.replace(r, findings=tuple(dataclasses.replace(f, step=f.step + base)
                                                 if f.step is not None else f for f in r.findings))


def _unreproduced(info: dict[str, Any] | None) -> dict[str, Any]:
    """The replay found no inf/NaN origin: why, and what to do (also in the generic findings)."""
    return {} if info is None else {"reproduced": False, "not_reproduced": dict(info)}


def _extra_summary(t: StepTracker, policy: AnomalyPolicy, ran: str | None,
                   ranks: dict[str, Any] | None) -> dict[str, Any]:
    """The precision a framework was asked for when the steps ran another; the ranks' agreement (the same on every
    rank but ``rank``: who saw what, where the inf/NaN started); the earlier update a replay moved to."""
    out: dict[str, Any] = dict(ranks or {})
    if policy.moved is not None:    # the step started from inf/NaN state: which update the replay ran instead
        out["replay_moved"] = dict(policy.moved)
    note = _rules.precision_note(policy.requested, ran) if t.n_steps and policy.requested else None
    if note is not None and policy.requested is not None:
        out["precision_requested"], out["precision_note"] = policy.requested[0], note
    return out


__all__ = ["build_report", "precision_of"]
