"""Turn what a watch recorded (per-step host values, coverage of the first steps) into :class:`Finding` objects.

Everything here is host-side and pure: the guard (``_guard.py``) reads device statistics back once per step
and hands plain numbers to these functions. Codes produced: ``loss-scale-collapse``, ``unused-parameters``,
``low-precision-params`` and, for non-finite losses or gradients whose origin the guard cannot see,
``overflow`` with ``module == ""`` (a replay names the origin; its findings are merged by :func:`merge_replay`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from ampdoctor.findings import Evidence, Finding, FixProposal, Report, group_by_owner
from ampdoctor.watch._detectors import ScaleHealth
from ampdoctor.watch._options import WatchOptions
from ampdoctor.watch._record import Coverage, LostUpdates, StepRecord

#: Codes whose finding names the op that produced a bad value (used to attribute a loss-scale collapse).
ORIGIN_CODES = ("overflow", "underflow", "nan-from-inf", "masked-row-nan", "constant-out-of-range", "saturation",
                "must-stay-fp32", "nonfinite-input", "fp8-scale", "precision-loss", "nonfinite-reference")
#: Of those, the codes whose finding says where an inf/NaN was made (a replay reporting one located it locally).
NONFINITE_CODES = ("overflow", "nan-from-inf", "masked-row-nan", "constant-out-of-range", "nonfinite-input",
                   "fp8-scale", "nonfinite-reference")

#: A parameter whose updates were lost at least this often is named in a ``low-precision-params`` finding.
LOST_NAMED = 0.10
#: ... and the finding is an error from this fraction on (most of its updates never land).
LOST_ERROR = 0.50

_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


def skipped_runs(records: Iterable[StepRecord]) -> list[tuple[int, int, bool]]:
    """Runs of consecutive skipped steps as ``(first index, length, ongoing)`` into ``records``."""
    recs = list(records)
    runs: list[tuple[int, int, bool]] = []
    i = 0
    while i < len(recs):
        if recs[i].skipped:
            j = i
            while j < len(recs) and recs[j].skipped:
                j += 1
            runs.append((i, j - i, j == len(recs)))
            i = j
        else:
            i += 1
    return runs


def _shorten(names: Sequence[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


def _overflowing(params: Sequence[str], step: int) -> tuple[dict[str, Any], str]:
    """Evidence and a sentence naming the parameters whose gradients overflowed (probe; backward order)."""
    if not params:
        return {}, ""
    return ({"params": list(params[:16]), "params_step": step},
            f" The first gradients to hold inf/NaN (step {step}, backward order): {_shorten(list(params))}.")


def collapse_findings(records: Sequence[StepRecord], collapse_steps: int, backoff: float,
                      params: Sequence[str] = (), params_step: int = -1) -> list[Finding]:
    """``loss-scale-collapse`` for each run of >= ``collapse_steps`` skipped steps.

    A run still going at the end of the history is an error (the weights stopped changing); a run that
    ended mid-training is a warning. A run that starts at the first step and ended is GradScaler calibrating a
    too-large initial scale, its normal behaviour: no finding here (:func:`health_finding` judges the whole run).
    """
    out: list[Finding] = []
    for first, length, ongoing in skipped_runs(records):
        if length < collapse_steps or (first == 0 and records[0].step == 0 and not ongoing):
            continue
        run = records[first:first + length]
        scales = [r.scale for r in run if r.scale is not None]
        after = scales[-1] * backoff if scales else None
        start, end = run[0].step, run[-1].step
        total_skipped = sum(1 for r in records if r.skipped)
        losses = [r.loss for r in run if r.loss is not None]
        ev: dict[str, Any] = {
            "first_skipped_step": start, "last_skipped_step": end, "consecutive_skipped": length,
            "skipped_steps": total_skipped, "steps": len(records), "scales": scales, "scale_after": after,
            "ongoing": ongoing,
        }
        if losses:
            ev["losses"] = losses
        named, sentence = _overflowing(params, params_step)
        ev.update(named)
        scale_txt = (f"the scale fell from {scales[0]:g} to {after:g}" if scales and after is not None
                     else "the scale fell each step")
        expl = (f"GradScaler found inf/NaN gradients on {length} consecutive steps ({start}..{end}) and skipped "
                f"every optimizer.step(); {scale_txt} (x{backoff:g} per skipped step). The weights did not change. "
                "The scaler only reacts: some op produces non-finite gradients at every scale. "
                + ("It is still happening at the last step seen." if ongoing else "Training recovered afterwards.")
                + sentence)
        fixes = (
            FixProposal("locate the op producing the non-finite gradients: replay the reproducer",
                        "ampdoctor.replay('reproducer.pt', model_factory=make_model)"),
            FixProposal("train in bf16 autocast, which needs no loss scaling",
                        "with torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = model(batch)"),
        )
        out.append(Finding(
            "loss-scale-collapse", "error" if ongoing else "warning", "", "", "backward",
            f"loss scale collapsed: {length} consecutive skipped steps from step {start}", expl, ev, fixes, start))
    return out


def health_finding(h: ScaleHealth, o: WatchOptions, backoff: float) -> Finding | None:
    """The whole run's loss-scale health as one ``loss-scale-collapse`` error, or ``None`` when healthy.

    Chronic: after GradScaler's initial calibration (the skips from step 0 up to the first applied step), more than
    ``collapse_skip_rate`` of at least ``collapse_min_steps`` steps were skipped. Sunk: the scale ends
    ``collapse_scale_bits`` powers of two or more below its peak after calibration. Either way most updates never
    happened.
    """
    calib = h.initial_run if h.initial_run < h.steps else 0
    steps, skipped = h.steps - calib, h.skipped - calib
    rate = skipped / steps if steps else 0.0
    chronic = steps >= o.collapse_min_steps and rate > o.collapse_skip_rate
    final = None if h.last is None else h.last * (backoff if h.run else 1.0)
    sunk = (h.peak is not None and final is not None and final > 0
            and math.log2(h.peak / final) >= o.collapse_scale_bits) or (final == 0.0 and bool(h.peak))
    if not (chronic or sunk):
        return None
    trajectory = [[s, v] for s, v in h.changes]
    ev: dict[str, Any] = {
        "skipped_steps": h.skipped, "steps": h.steps, "skip_rate": h.skipped / h.steps if h.steps else 0.0,
        "skip_rate_after_calibration": rate, "calibration_skips": calib, "longest_skip_run": h.longest,
        "longest_skip_run_start": h.longest_start, "scale_peak": h.peak, "scale_final": final,
        "scale_trajectory": trajectory, "chronic": chronic, "sunk": sunk, "ongoing": h.run > 0,
    }
    named, sentence = _overflowing(h.overflow_params, h.overflow_params_step)
    ev.update(named)
    why = []
    if chronic:
        why.append(f"{skipped} of {steps} steps after calibration were skipped ({100 * rate:.0f}%, threshold "
                   f"{100 * o.collapse_skip_rate:.0f}%)")
    if sunk and h.peak is not None and final is not None:
        why.append(f"the scale fell from its peak {h.peak:g} to {final:g} and stayed there")
    expl = (f"Over the whole run GradScaler skipped {h.skipped} of {h.steps} optimizer steps (longest run: "
            f"{h.longest} from step {h.longest_start}); " + "; ".join(why) + ". Most updates never reached the "
            "weights: some op produces non-finite gradients at almost every scale. The scaler only reacts." + sentence)
    fixes = (
        FixProposal("locate the op producing the non-finite gradients: replay the reproducer",
                    "ampdoctor replay repro/stepNNNNNN-loss-scale-collapse.pt --factory mypkg:build_model"),
        FixProposal("train in bf16 autocast, which needs no loss scaling",
                    "with torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = model(batch)"),
    )
    return Finding("loss-scale-collapse", "error", "", "", "backward",
                   f"loss scale collapsed over the run: {h.skipped} of {h.steps} steps skipped", expl, ev, fixes,
                   max(h.longest_start, 0))


def with_health(findings: list[Finding], health: Finding | None) -> list[Finding]:
    """The run-wide collapse error replaces the per-episode ``loss-scale-collapse`` findings (kept as episodes)."""
    if health is None:
        return findings
    episodes = [f for f in findings if f.code == "loss-scale-collapse"]
    base = dict(episodes[-1].evidence) if episodes else {}
    ev = Evidence.of({**base, **health.evidence, "episodes": [dict(f.evidence) for f in episodes][:8]})
    return [dataclasses.replace(health, evidence=ev)] + [f for f in findings if f.code != "loss-scale-collapse"]


def nonfinite_findings(records: Sequence[StepRecord], owners: dict[str, str]) -> list[Finding]:
    """The first non-finite loss and the first non-finite gradients seen outside GradScaler's protection.

    The guard sees where a bad value *arrived*, not the op that made it: the finding uses code ``overflow``
    with ``module == ""`` and names the affected parameters; replaying the reproducer names the origin.
    """
    out: list[Finding] = []
    bad_loss = [r for r in records if r.loss is not None and not math.isfinite(r.loss)]
    if bad_loss:
        r = bad_loss[0]
        out.append(Finding(
            "overflow", "error", "", "", "forward", f"non-finite loss ({r.loss}) at step {r.step}",
            f"The loss was {r.loss} at step {r.step} ({len(bad_loss)} step(s) in total). The watch sees the value "
            "after the fact; replay the reproducer of this step to find the op where it starts.",
            {"step": r.step, "loss": r.loss, "nonfinite_loss_steps": [x.step for x in bad_loss][:32]},
            (FixProposal("replay the step under full diagnosis",
                         "ampdoctor.replay('reproducer.pt', model_factory=make_model)"),), r.step))
    bad_grad = [r for r in records if r.nonfinite_params and not r.skipped]
    if bad_grad:
        r = bad_grad[0]
        groups = group_by_owner(r.nonfinite_params, owners)
        out.append(Finding(
            "overflow", "error", "", "", "backward",
            f"non-finite gradients at step {r.step} in {len(r.nonfinite_params)} parameter(s)",
            f"At step {r.step} the gradients of {len(r.nonfinite_params)} parameter(s) "
            f"({_shorten(r.nonfinite_params)}) held inf/NaN when optimizer.step() was called; without a "
            "GradScaler that step writes them into the "
            "weights. Replay the reproducer of this step to find the op where they start.",
            {"step": r.step, "parameters": list(r.nonfinite_params), "owners": list(groups),
             "nonfinite_grad_steps": [x.step for x in bad_grad][:32]},
            (FixProposal("replay the step under full diagnosis",
                         "ampdoctor.replay('reproducer.pt', model_factory=make_model)"),), r.step))
    return out


def coverage_findings(cov: Coverage | None, owners: dict[str, str], *, ddp: bool) -> list[Finding]:
    """``unused-parameters``: grads never computed, grads always exactly zero, trainable params missing from the
    optimizer. One finding per owner module (the module that registers the parameters)."""
    out: list[Finding] = []
    if cov is None or cov.steps == 0:
        return out
    for owner, params in group_by_owner(cov.never_grad, owners).items():
        where = owner or "<root>"
        expl = (f"{len(params)} trainable parameter(s) of {where} ({_shorten(params)}) received no gradient in any "
                f"backward of the first {cov.steps} step(s): the module's output never reaches the loss. "
                "DDP (find_unused_parameters=False) fails on the next step, fused/flattening fp16 optimizers break on "
                "None grads, and these weights are never trained.")
        out.append(Finding(
            "unused-parameters", "error" if ddp else "warning", owner, "", "backward",
            f"{where}: {len(params)} trainable parameter(s) never get a gradient", expl,
            {"parameters": params, "count": len(params), "steps_observed": cov.steps, "ddp": ddp},
            (FixProposal("leave these parameters out of training",
                         f"for p in model.{owner}.parameters():\n    p.requires_grad_(False)" if owner else "",
                         id="exclude_unused", params={"parameters": params}),
             FixProposal("under DDP, let it tolerate unused parameters",
                         "DistributedDataParallel(model, find_unused_parameters=True)")),
            0))
    for owner, params in group_by_owner(cov.zero_grad, owners).items():
        where = owner or "<root>"
        out.append(Finding(
            "unused-parameters", "warning", owner, "", "backward",
            f"{where}: gradients are exactly zero", f"The gradients of {len(params)} parameter(s) of {where} "
            f"({_shorten(params)}) were exactly zero in every one of the first {cov.steps} step(s): the module is "
            "in the graph but no signal flows back (a zero multiplier, a saturated tanh/sigmoid, a detached path).",
            {"parameters": params, "count": len(params), "steps_observed": cov.steps, "zero_gradients": True},
            (FixProposal("replay a step under full diagnosis to see where the gradient vanishes",
                         "ampdoctor.diagnose(model, batch, precision=...)"),), 0))
    for owner, params in group_by_owner(cov.not_in_optimizer, owners).items():
        where = owner or "<root>"
        out.append(Finding(
            "unused-parameters", "warning", owner, "", "optimizer",
            f"{where}: trainable parameters missing from the optimizer",
            f"{len(params)} trainable parameter(s) of {where} ({_shorten(params)}) require grad but are in none of "
            "the optimizer's param_groups, so they are never updated.",
            {"parameters": params, "count": len(params)},
            (FixProposal("add them to the optimizer or freeze them",
                         "optimizer.add_param_group({'params': [...]})"),), 0))
    return out


def low_precision_findings(lost: LostUpdates | None, owners: dict[str, str]) -> list[Finding]:
    """``low-precision-params``: parameters stored in fp16/bf16 and updated in place by the optimizer (no fp32
    master copy). Evidence is measured: elements whose gradient was non-zero but whose value did not change."""
    out: list[Finding] = []
    if lost is None or not lost.dtypes:
        return out
    frac = {n: lost.lost.get(n, 0) / lost.updates[n] for n in lost.dtypes if lost.updates.get(n, 0) > 0}
    named = [n for n in lost.dtypes if frac.get(n, 0.0) >= LOST_NAMED]
    for owner, params in group_by_owner(named, owners).items():
        worst = max(frac[n] for n in params)
        n_lost = sum(lost.lost.get(n, 0) for n in params)
        n_upd = sum(lost.updates.get(n, 0) for n in params)
        dtypes = sorted({lost.dtypes[n] for n in params})
        where = owner or "<root>"
        expl = (f"{where} keeps its parameters in {'/'.join(dtypes)} and the optimizer updates them in place (no fp32 "
                f"master copy). Over the first {lost.steps} step(s), {n_lost} of {n_upd} element updates with a "
                f"non-zero gradient were rounded away (w + dw == w): an update below half an ulp of the weight is lost "
                f"(bf16 ulp(1.0) = 2**-7, fp16 ulp(1.0) = 2**-10). Worst parameter: {100 * worst:.0f}% lost.")
        out.append(Finding(
            "low-precision-params", "error" if worst >= LOST_ERROR else "warning", owner, "", "optimizer",
            f"{where}: {100 * n_lost / max(n_upd, 1):.0f}% of weight updates are lost in {'/'.join(dtypes)}", expl,
            {"parameters": params, "dtypes": dtypes, "lost_updates": n_lost, "updates": n_upd,
             "fraction_lost": n_lost / max(n_upd, 1), "fraction_lost_by_parameter": {n: frac[n] for n in params},
             "steps_measured": lost.steps},
            (FixProposal("keep fp32 master weights: leave the model in fp32 and train under autocast",
                         "model.float()\nwith torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = ..."),
             FixProposal("or keep an fp32 copy in the optimizer (Kahan summation / stochastic rounding optimizers)")),
            0))
    if not out:
        total_lost = sum(lost.lost.values())
        total = sum(lost.updates.values())
        out.append(Finding(
            "low-precision-params", "info", "", "", "optimizer",
            f"{len(lost.dtypes)} parameter(s) are trained without an fp32 master copy",
            f"The optimizer updates {len(lost.dtypes)} low-precision parameter(s) in place; "
            + (f"{total_lost} of {total} element updates were rounded away in the first {lost.steps} step(s)."
               if total else "no update could be measured yet."),
            {"parameters": list(lost.dtypes)[:64], "count": len(lost.dtypes), "lost_updates": total_lost,
             "updates": total, "steps_measured": lost.steps}, (), 0))
    return out


def order(findings: Iterable[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; the earliest step first within a severity (stable)."""
    return sorted(findings, key=lambda f: (_SEVERITY_RANK[f.severity], f.step))


def precision_note(requested: tuple[str, str] | None, ran: str | None) -> str | None:
    """A sentence when the steps did not run in the precision a framework was asked for (``None`` when they did):
    ``requested`` is ``(fp16|bf16, by)``, ``ran`` the precision the watch saw (autocast dtype, else parameters)."""
    if requested is None:
        return None
    want, by = requested
    if ran is not None and ran.startswith(want):
        return None
    why = (f"the parameters are {ran}, see the low-precision-params finding" if ran in ("fp16", "bf16")
           else f"{want} is not applied on this device, e.g. fp16 on CPU")
    return (f"{by} asked for {want}, but the steps ran in {ran or 'fp32'} (autocast and parameters as the watch saw "
            f"them; {why}): this report says nothing about {want}. "
            f"Run on a GPU, or ask ampdoctor.diagnose(..., precision='{want}-amp') for what {want} would do.")


def with_ranks(findings: Sequence[Finding], ranks: dict[str, Any]) -> list[Finding]:
    """Name the rank that saw the job's first non-finite value (``ranks``: :meth:`RankAgreement.summary`).

    On that rank its first non-finite finding gets ``origin_rank`` evidence. On any other rank a finding naming the
    origin (the module/op its replay located, when it did) comes first, and the watch's generic non-finite findings
    (no module, no op) for a step at which another rank made them and this one did not are dropped: it only
    received them. A non-finite loss is always the rank's own (computed before any collective).
    """
    origin = ranks.get("nonfinite_origin")
    if not origin:
        return list(findings)
    me, world, src = ranks["rank"], ranks["world_size"], origin["rank"]
    base = {"origin_rank": src, "rank": me, "world_size": world}
    if src == me:
        out, done = [], False
        for f in findings:
            if not done and f.code in NONFINITE_CODES:
                f, done = dataclasses.replace(f, evidence=f.evidence.replace(**base, local=True)), True
            out.append(f)
        return out
    events = ranks.get("rank_events", [])
    received = [e["step"] for e in events if e["rank"] == me and not e["local"]]
    kind = {"nonfinite-loss": "non-finite loss", "nonfinite-grads": "non-finite gradients"}.get(origin["kind"],
                                                                                               "non-finite value")
    what = origin["code"] or kind
    where = f" in {origin['module'] or '<root>'} ({origin['op'] or 'op unknown'})" if origin["code"] else ""
    title = (f"{what} on rank {src} at step {origin['step']}{where} reaches rank {me} through the gradient "
             "collective" if received else f"{what} on rank {src} at step {origin['step']}{where}; rank {me}'s "
             "own values stayed finite")
    expl = (f"Rank {src} made the job's first non-finite value ({origin['kind'] or 'inf/NaN'} at step "
            f"{origin['step']}{where}). "
            + (f"Rank {me}'s gradients held inf/NaN at step(s) {', '.join(map(str, received[:8]))} only because "
               "the data-parallel gradient collective (DDP's all-reduce, FSDP's reduce-scatter) averages every rank's "
               "gradients: look on rank " + str(src) + ", not here."
               if received else f"Rank {me} computed finite values; every replica is affected through rank {src}.")
            + f" Rank {src}'s report and reproducer name the op.")
    finding = Finding(
        origin["code"] or "overflow", "error", origin["module"], origin["op"], origin["phase"] or "forward", title,
        expl, {**base, "local": False, "received": bool(received), "received_at_steps": received[:32],
               "origin": origin},
        (FixProposal(f"replay rank {src}'s reproducer of step {origin['step']} (reproducer_dir of rank {src})",
                     "ampdoctor replay repro/rank1/stepNNNNNN-KIND.pt --factory mypkg:build_model"),),
        origin["step"])
    def only_received(f: Finding) -> bool:   # the generic gradient finding of a step another rank made them at
        step = f.step
        return (f.code == "overflow" and not f.module and not f.op and f.phase == "backward"
                and any(e["step"] == step and e["local"] and e["rank"] != me for e in events)
                and not any(e["step"] == step and e["local"] and e["rank"] == me for e in events))

    return [finding, *(f for f in findings if not only_received(f))]


#: why a replay did not reproduce the anomaly (``not_reproduced``): the model's output is not a loss, so only the
#: forward ran; or the whole step ran and stayed finite
_UNREPRODUCED = {
    "loss-outside-model": (
        "The replay of step {step} did not reproduce it: the watched model's output is not a loss (not a scalar, "
        "no .loss), so the loss was computed outside the model, in the script's own code, and the replay, which "
        "re-runs only the model's forward with the recorded inputs, ran the forward alone{prec}: it stayed finite "
        "there. The inf/NaN therefore starts after the model's output: in the loss the script computes (e.g. log, "
        "pow or exp of a saturated sigmoid/softmax) or in that loss's backward. To name the op, let the replay run "
        "the loss: compute it inside a module (a wrapper whose forward returns it), record it "
        "(ampdoctor.watch(..., loss_code=True)), or pass it: w.replay_with(train_step), "
        "ampdoctor.replay(FILE, loss_fn=...), ampdoctor.diagnose(..., loss_fn=...)."),
    "not-repeated": (
        "The replay of step {step} did not reproduce it: it re-ran the step from the recorded state and inputs"
        "{prec} and saw no inf/NaN, so what made it depends on something the replay does not repeat (data or "
        "state prepared by the script outside the model's forward and its loss, a random draw, another kernel). "
        "Diagnose that step with its real inputs: ampdoctor.diagnose(model, batch, loss_fn=..., train_step=...)."),
}


def not_reproduced(replay: Report, kind: str, step: int, custom_step: bool) -> dict[str, Any] | None:
    """Why an in-process replay of a non-finite ``kind`` anomaly found no inf/NaN origin, or None when it found
    one (or the anomaly is not about non-finite values). The mechanism: the replay ran forward only (the model
    returns no loss and no ``train_step`` was given), or it ran the whole step and stayed finite."""
    if kind not in ("nonfinite-loss", "nonfinite-grads", "loss-scale-collapse") or any(
            f.code in NONFINITE_CODES for f in replay.findings):
        return None
    reason = "loss-outside-model" if replay.summary.get("forward_only") and not custom_step else "not-repeated"
    prec = f" in {replay.precision}" if replay.precision else ""
    return {"reason": reason, "step": step, "anomaly": kind,
            "note": _UNREPRODUCED[reason].format(step=step, prec=prec)}


def unreproduced_on_rank(info: dict[str, Any] | None, ranks: dict[str, Any] | None) -> dict[str, Any] | None:
    """A replay that found no inf/NaN on a rank that only received them from another rank's collective: it could
    not, and the note says so instead of blaming something the replay does not repeat."""
    origin = (ranks or {}).get("nonfinite_origin")
    if info is None or ranks is None or not origin or origin["rank"] == ranks["rank"] or any(
            e["rank"] == ranks["rank"] and e["local"] for e in ranks.get("rank_events", [])):
        return info
    note = (f"The replay of step {info['step']} on rank {ranks['rank']} saw no inf/NaN, as expected: this rank's own "
            f"values stay finite; rank {origin['rank']} made the job's first non-finite value (step "
            f"{origin['step']}) and the gradient collective brought it here. Rank {origin['rank']}'s report and "
            "reproducer name the op.")
    return {**info, "reason": "other-rank", "note": note}


def with_unreproduced(findings: Sequence[Finding], info: dict[str, Any] | None) -> list[Finding]:
    """The watch's generic non-finite findings (module and op unknown) say that the replay did not reproduce the
    step, why, and what to do, instead of only pointing at a replay."""
    if info is None:
        return list(findings)
    fixes: tuple[FixProposal, ...] = (FixProposal("record the loop's loss code, so that the replay runs it too",
                         "with ampdoctor.watch(model, optimizer, scaler, loss_code=True) as w:"),
             FixProposal("compute the loss inside a module, so that a replay re-runs it",
                         "class WithLoss(nn.Module):\n    def __init__(self, model):\n        super().__init__()\n"
                         "        self.model = model\n    def forward(self, x, y):\n"
                         "        return my_loss(self.model(x), y)"),
             FixProposal("replay the step with the script's loss",
                         "ampdoctor.replay('reproducer.pt', model_factory=make_model, "
                         "loss_fn=lambda output, batch: my_loss(output, batch))"))
    if info["reason"] != "loss-outside-model":
        fixes = fixes[2:] if info["reason"] != "other-rank" else ()
    out = []
    for f in findings:
        if f.code in ("overflow", "loss-scale-collapse") and not f.module and not f.op:
            f = dataclasses.replace(f, explanation=f"{f.explanation} {info['note']}",
                                    evidence=f.evidence.replace(replay="not-reproduced",
                                                                replay_reason=info["reason"]),
                                    fixes=fixes + tuple(f.fixes))
        out.append(f)
    return out


def _inf_before_underflow(findings: Sequence[Finding]) -> tuple[Finding, ...]:
    """A replay leading with an ``underflow`` at an op that also made inf/NaN (an ``exp`` whose small inputs flush
    and large ones overflow, over several micro-batches) leads with that op's inf/NaN error instead: the watch
    replayed because of inf/NaN, and that finding explains them."""
    first = findings[0]
    if first.code != "underflow":
        return tuple(findings)
    where = (first.module, first.op, first.phase)
    inf = next((f for f in findings if f.code in NONFINITE_CODES and f.severity == "error"
                and (f.module, f.op, f.phase) == where), None)
    return tuple(findings) if inf is None else (inf, *(f for f in findings if f is not inf))


def merge_replay(own: Sequence[Finding], replay: Report | None) -> list[Finding]:
    """Combine the watch's findings with a replay's.

    When the replay names an origin (a finding with a module or op), its findings come first, in the replay's
    own ranking; otherwise the watch's come first. A ``loss-scale-collapse`` without origin takes the module/op
    of the replay's first located cause; the watch's generic non-finite ``overflow`` findings (module ``""``)
    give way to a replay that explains the non-finite values. Duplicates (same code, module, op, phase) are
    kept once, the replay's version.
    """
    if replay is None or not replay.findings:
        return order(own)
    replay = dataclasses.replace(replay, findings=_inf_before_underflow(replay.findings))
    origin = next((f for f in replay.findings if f.code in ORIGIN_CODES and (f.module or f.op)), None)
    explained = any(f.code in ORIGIN_CODES for f in replay.findings)
    keys = {(f.code, f.module, f.op, f.phase) for f in replay.findings}
    mine: list[Finding] = []
    for f in own:
        if f.code == "overflow" and not f.module and not f.op and explained:
            continue
        if f.code == "loss-scale-collapse" and origin is not None and not f.module and not f.op:
            ev = f.evidence.replace(origin={"code": origin.code, "module": origin.module, "op": origin.op,
                                            "phase": origin.phase})
            f = dataclasses.replace(f, module=origin.module, op=origin.op, evidence=ev,
                                    explanation=f"{f.explanation} The replay locates the origin: {origin.code} in "
                                                f"{origin.module or '<root>'} ({origin.op or 'op unknown'}).")
        if (f.code, f.module, f.op, f.phase) not in keys:
            mine.append(f)
    if explained or any(f.module or f.op for f in replay.findings):
        return list(replay.findings) + order(mine)
    return order(mine) + list(replay.findings)


__all__ = [
    "Coverage",
    "LostUpdates",
    "StepRecord",
    "collapse_findings",
    "coverage_findings",
    "group_by_owner",
    "health_finding",
    "with_health",
    "with_ranks",
    "precision_note",
    "low_precision_findings",
    "merge_replay",
    "nonfinite_findings",
    "not_reproduced",
    "order",
    "skipped_runs",
    "with_unreproduced",
]
