"""``diagnose``: run a step in the target precision next to an fp32 reference, trace both, explain.

>>> report = ampdoctor.diagnose(model, batch, precision="fp16-amp")        # doctest: +SKIP
>>> f = report.findings[0]; f.code, f.module, f.op, f.phase                 # doctest: +SKIP
('overflow', 'encoder.block.0.layer.1.DenseReluDense.wo', 'aten.mm.default', 'forward')
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import DiagnosisError
from ampdoctor.findings import (
    Finding,
    Report,
    agree,
    analyse,
    attach_exception,
    build_context,
    enrich_all,
    layers,
    summary,
)
from ampdoctor.precision import (
    RunResult,
    SharedCopy,
    StepSpec,
    load_scenario_module,
    make_spec,
    run,
    saved_rng,
    spec_from_module,
    unread_updates,
)
from ampdoctor.precision.headroom import (
    Headroom,
    headroom_from_run,
    headroom_run_spec,
    headroom_spec,
    shares_reference,
)
from ampdoctor.precision.triage import Triage, guard_step, reference_reasons, reference_request, spec_reasons

log = logging.getLogger(__name__)


def diagnose(
    model: nn.Module,
    batch: Any = None,
    *,
    precision: str | None = None,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    train_step: Any = None,
    steps: int = 1,
    policy: str = "cuda",
    progress: Any = None,
    fp8_recipe: Any = None,
) -> Report:
    """Diagnose ``steps`` training (or inference) steps of ``model`` in ``precision``.

    >>> report = diagnose(model, {"input_ids": ids, "labels": ids}, precision="fp16-amp")   # doctest: +SKIP
    >>> report.ok, report.findings[0].code                                                 # doctest: +SKIP

    Runs a float32 reference and the target on deep copies made together (model, optimizer, scaler), so the
    caller's objects, their grads, hooks and the global RNG state are left exactly as they were.
    ``progress``, if given, is called as ``progress(phase)`` with ``"reference"``, ``"target"``, ``"analysis"``
    and ``"done"`` as the diagnosis moves on (the CLI draws a progress bar with it). ``policy``
    chooses how ``"fp16-amp"``/``"bf16-amp"`` are run off-GPU: ``"cuda"`` emulates CUDA's autocast op policy,
    ``"native"`` uses the device's own autocast. Host syncs: one per step and run (statistics read back).
    ``fp8_recipe``: the :class:`~ampdoctor.precision.Fp8Recipe` (scaling, history length, margin, amax floor) an fp8
    ``precision`` runs with -- the one your training uses; its format must be the precision's (``"fp8"``: hybrid).
    Default: ``Fp8Recipe()`` in the precision's format.
    Raises :class:`ampdoctor.precision.ScenarioError` for unusable input, before anything runs.
    """
    if policy not in ("cuda", "native"):
        raise ValueError(f"invalid policy {policy!r}, expected 'cuda' or 'native'")
    spec = make_spec(model, batch, precision=precision, loss_fn=loss_fn, optimizer=optimizer, scaler=scaler,
                     train_step=train_step, steps=steps, fp8_recipe=fp8_recipe)
    return diagnose_spec(spec, policy=policy, progress=progress)


def diagnose_file(path: str, **overrides: Any) -> Report:
    """Diagnose a scenario file (a ``.py`` defining ``make()``); ``overrides`` replace keys of ``make()``."""
    policy = overrides.pop("policy", "cuda")
    progress = overrides.pop("progress", None)
    if policy not in ("cuda", "native"):
        raise ValueError(f"invalid policy {policy!r}, expected 'cuda' or 'native'")
    with saved_rng():  # importing the file and make() draw random numbers: not from the caller's stream
        module = load_scenario_module(path)
        spec = spec_from_module(module, source=str(path), **overrides)
    return diagnose_spec(spec, policy=policy, progress=progress)


def diagnose_spec(spec: StepSpec, *, policy: str = "cuda", progress: Any = None,
                  reference: RunResult | None = None, shared: SharedCopy | None = None) -> Report:
    """spec -> target run -> reference run -> context -> rules -> ranking -> enrichment -> agreement -> report.

    The target runs first so that the reference can leave out what nothing reads: its last optimizer step when
    the target skipped its own or ran it in float32 on float32 master weights
    (:func:`~ampdoctor.precision.unread_updates`; listed in ``summary["reference_updates_not_run"]``). The second
    run's copy is made over the first one's storages where they fit (:class:`~ampdoctor.precision.SharedCopy`: no
    second allocation of the model).

    ``reference``: the float32 reference run of this very spec when the caller already ran it
    (:func:`headroom_and_diagnose`); it is not run again, and the target's copy is made over its storages through
    ``shared``, the one the caller's reference run handed its copy over to."""
    def phase(name: str) -> None:
        log.info("diagnose: %s", name)
        if progress is not None:
            progress(name)

    t0 = time.perf_counter()
    if shared is None:
        shared = SharedCopy(spec)
    first = reference is None  # the target first: the reference then leaves out an update nothing reads
    phase("target")
    with saved_rng():
        target = run(spec, reference=False, policy=policy, hand_over=shared if first else None,
                     reuse=None if first else shared)
    if first:
        phase("reference")
        with saved_rng():
            reference = run(spec, reference=True, policy=policy, reuse=shared,
                            no_update=unread_updates(spec, target))
    phase("analysis")
    ctx = build_context(spec, target, reference)
    findings = enrich_all(analyse(ctx), spec.model, spec.precision)  # rules, ranking, enrichment
    # under DDP/FSDP: one all_reduce shares each rank's own non-finite origin (every rank runs diagnose)
    agreement = agree(spec.model, ctx.records, ctx.lineage.carried, [o.record.index for o in ctx.harmful_origins()],
                      findings)
    if agreement is not None:
        findings = list(agreement.inserted) + list(agreement.findings)
    _raise_unexplained_crash(spec, target, findings)
    findings = attach_exception(findings, ctx)  # the crash's exception, on the finding that explains it
    run_summary = summary(ctx, findings, time.perf_counter() - t0)
    if agreement is not None:
        run_summary.update(agreement.summary())  # rank, world_size, nonfinite_ranks, nonfinite_origin, ...
    phase("done")
    return Report(tuple(findings), spec.precision, run_summary, tuple(layers(ctx)), spec.source)


def headroom_and_diagnose(spec: StepSpec, *, policy: str = "cuda", progress: Any = None) -> tuple[Headroom, Report]:
    """What ``ampdoctor check`` runs: the range headroom of ``spec``'s float32 step and the diagnosis in
    ``spec.precision``. When :func:`~ampdoctor.precision.headroom.shares_reference`, ONE float32 run, traced with
    flush counts, serves as both the headroom run and the diagnosis's reference (two runs instead of three)."""
    if not shares_reference(spec):
        if progress is not None:
            progress("headroom")
        return headroom_spec(spec), diagnose_spec(spec, policy=policy, progress=progress)
    if progress is not None:
        progress("headroom")
    log.info("diagnose: reference (+ headroom)")
    shared = SharedCopy(spec)
    with saved_rng():
        reference = run(spec, reference=True, policy=policy, headroom=True, hand_over=shared)
    return headroom_from_run(spec, reference), diagnose_spec(spec, policy=policy, progress=progress,
                                                             reference=reference, shared=shared)


@dataclass(frozen=True)
class CheckResult:
    """What ``ampdoctor check`` ran: the float32 headroom, the diagnosis (``None`` when the quick pass found no
    mechanism that it could judge) and why (:class:`~ampdoctor.precision.triage.Triage`)."""

    headroom: Headroom
    report: Report | None
    triage: Triage

    @property
    def ok(self) -> bool:
        """No error finding (a quick pass that found nothing to diagnose is ok)."""
        return self.report is None or self.report.ok


def headroom_and_check(spec: StepSpec, *, policy: str = "cuda", progress: Any = None,
                       full: bool = False) -> CheckResult:
    """``ampdoctor check`` in two tiers (:mod:`ampdoctor.precision.triage`). Where the spec alone calls for the full
    diagnosis (or ``full=True``), :func:`headroom_and_diagnose` (one float32 run for headroom and the reference).
    Otherwise the quick pass: ``ampdoctor headroom``'s float32 run (no optimizer step: the cheapest traced run),
    its mechanisms, then one target step under the cheap trace tier; only a reason found there runs the full
    diagnosis, with its own reference run (the headroom run has no optimizer step to stand for)."""
    def phase(name: str) -> None:
        log.info("check: %s", name)
        if progress is not None:
            progress(name)

    pre = ["the full diagnosis was asked for"] if full else spec_reasons(spec)
    if pre:
        h, report = headroom_and_diagnose(spec, policy=policy, progress=progress)
        return CheckResult(h, report, Triage(spec.precision, tuple(pre)))
    phase("headroom")
    hspec = headroom_run_spec(spec)
    with saved_rng():
        href = run(hspec, reference=True, headroom=True, request=reference_request(str(spec.precision)))
    h = headroom_from_run(hspec, href)
    reasons = reference_reasons(href, str(spec.precision))
    info: dict[str, Any] = {}
    if not reasons:
        phase("guard")
        reasons, info = guard_step(spec, href, policy=policy)
    triage = Triage(spec.precision, tuple(reasons), info)
    if not triage.full:
        phase("done")
        return CheckResult(h, None, triage)
    log.info("check: full diagnosis: %s", "; ".join(reasons))
    return CheckResult(h, diagnose_spec(spec, policy=policy, progress=progress), triage)


def _raise_unexplained_crash(spec: StepSpec, target: RunResult, findings: list[Finding]) -> None:
    """The target run crashed and no error finding explains it: pass the user's error on."""
    if target.exc is None or any(f.severity == "error" for f in findings):
        return
    err = target.trace.error or {}
    where = f" in {err.get('op', '?')} of {err.get('module') or '<root>'}" if err else ""
    raise DiagnosisError(
        f"the {spec.precision or 'as-given'} run raised {type(target.exc).__name__} at step {target.exc_step}"
        f"{where}: {str(target.exc).splitlines()[0] if str(target.exc) else ''}. ampdoctor found no numerics "
        "cause for it; run the step without ampdoctor to see the full traceback") from target.exc
