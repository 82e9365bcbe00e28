"""``diagnose``: run a step in the target precision next to an fp32 reference, trace both, explain.

>>> report = ampdoctor.diagnose(model, batch, precision="fp16-amp")        # doctest: +SKIP
>>> f = report.findings[0]; f.code, f.module, f.op, f.phase                 # doctest: +SKIP
('overflow', 'encoder.block.0.layer.1.DenseReluDense.wo', 'aten.mm.default', 'forward')
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import DiagnosisError
from ampdoctor.findings import CODES, Finding, Report, analyse, build_context
from ampdoctor.findings._context import Context, chain_summary, dtype_name, limits
from ampdoctor.findings._knowledge import enrich_all
from ampdoctor.precision import (
    StepSpec,
    _distributed,
    load_scenario_module,
    make_spec,
    run,
    saved_rng,
    spec_from_module,
)
from ampdoctor.trace._lineage import is_nonfinite

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
    Raises :class:`ampdoctor.precision.ScenarioError` for unusable input, before anything runs.
    """
    if policy not in ("cuda", "native"):
        raise ValueError(f"invalid policy {policy!r}, expected 'cuda' or 'native'")
    spec = make_spec(model, batch, precision=precision, loss_fn=loss_fn, optimizer=optimizer, scaler=scaler,
                     train_step=train_step, steps=steps)
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


def diagnose_spec(spec: StepSpec, *, policy: str = "cuda", progress: Any = None) -> Report:
    def phase(name: str) -> None:
        log.info("diagnose: %s", name)
        if progress is not None:
            progress(name)

    t0 = time.perf_counter()
    phase("reference")
    with saved_rng():
        reference = run(spec, reference=True, policy=policy)
    phase("target")
    with saved_rng():
        target = run(spec, reference=False, policy=policy)
    phase("analysis")
    ctx = build_context(spec, target, reference)
    findings = enrich_all(analyse(ctx), spec.model, spec.precision)
    # under DDP/FSDP: one all_reduce shares each rank's own non-finite origin (every rank runs diagnose)
    agreement = _distributed.agree(spec.model, ctx.records, ctx.lineage.carried,
                                   [o.record.index for o in ctx.harmful_origins()], findings, CODES)
    if agreement is not None:
        findings = [Finding(**kw) for kw in agreement.inserted] + list(agreement.findings)
    if target.exc is not None and not any(f.severity == "error" for f in findings):
        err = target.trace.error or {}
        where = f" in {err.get('op', '?')} of {err.get('module') or '<root>'}" if err else ""
        raise DiagnosisError(
            f"the {spec.precision or 'as-given'} run raised {type(target.exc).__name__} at step {target.exc_step}"
            f"{where}: {str(target.exc).splitlines()[0] if str(target.exc) else ''}. ampdoctor found no numerics "
            "cause for it; run the step without ampdoctor to see the full traceback") from target.exc
    summary = _summary(ctx, findings, time.perf_counter() - t0)
    if agreement is not None:
        summary.update(agreement.summary())  # rank, world_size, nonfinite_ranks, nonfinite_origin, ...
    phase("done")
    return Report(tuple(findings), spec.precision, summary, tuple(_layers(ctx)), spec.source)


def _summary(ctx: Context, findings: list[Any], elapsed: float) -> dict[str, Any]:
    t, ref = ctx.target, ctx.reference
    recs = t.trace.records
    first_nf = next((r for r in recs if is_nonfinite(r)), None)
    first_nan = next((r for r in recs if r.stats.get("n_nan", 0) > 0), None)
    s: dict[str, Any] = {
        "precision": ctx.spec.precision,
        "steps": ctx.spec.steps,
        "loss_target": t.losses,
        "loss_reference": ref.losses if ref is not None else [],
        "forward_only": t.forward_only,
        "device": t.device,
        "torch_version": torch.__version__,
        "elapsed_s": round(elapsed, 3),
        "ops_traced": len(recs),
        "origins": [{"op": o.record.op, "module": o.record.module, "phase": o.record.phase,
                     "step": o.record.step, "harmful": o.harmful, "why": o.reasons[0] if o.reasons else "absorbed"}
                    for o in ctx.origins[:20]],
    }
    if first_nf is not None:
        s["first_nonfinite"] = ctx.describe(first_nf)
    if first_nan is not None:
        s["first_nan"] = ctx.describe(first_nan)
    harmful = ctx.harmful_origins()
    if harmful:
        s["chain"] = chain_summary(ctx, harmful[0].record.index)
    scales = ctx.scales
    if scales:
        s["scales"] = scales
        s["skipped_steps"] = ctx.skipped_steps
    if t.fp8 is not None:
        s["fp8"] = [{"module": x.module, "role": x.role, "format": x.format, "step": x.step, "amax": x.amax,
                     "scale": x.scale, "amax_history": x.amax_history, "saturated": x.saturated,
                     "underflowed": x.underflowed, "nonzero": x.nonzero, "numel": x.numel}
                    for x in t.fp8.tensors]
    if t.exc is not None:
        s["exception"] = {"type": type(t.exc).__name__, "message": str(t.exc).splitlines()[0][:300] if str(t.exc)
                          else "", "step": t.exc_step}
    return s


def _layers(ctx: Context) -> list[dict[str, Any]]:
    """Per module and phase: the op with the largest |max| in the target, against the reference."""
    best: dict[tuple[str, str], Any] = {}
    order: dict[tuple[str, str], int] = {}
    benign = {o.record.index for o in ctx.origins if not o.harmful}
    carried = ctx.lineage.carried
    for r in ctx.records:
        if r.kind != "op" or r.phase not in ("forward", "backward") or r.step != 0 or not r.stats:
            continue
        if r.index in carried and carried[r.index] <= benign:
            continue  # benign infinities (masks, log(0)) are not range
        key = (r.module, r.phase)
        order.setdefault(key, len(order))
        amax = math.inf if (r.stats["n_posinf"] + r.stats["n_neginf"]) else r.stats["absmax"]
        cur = best.get(key)
        if cur is None or amax > cur[0]:
            best[key] = (amax, r)
    out = []
    for key, (amax, r) in sorted(best.items(), key=lambda kv: order[kv[0]]):
        ref = ctx.ref(r)
        numel = max(r.stats["numel"], 1.0)
        rel = None
        if ref is not None and ref.stats["norm"] > 0 and math.isfinite(r.stats["norm"]):
            rel = abs(r.stats["norm"] - ref.stats["norm"]) / ref.stats["norm"]
        flush = 0.0
        if ref is not None:
            flush = max(0.0, (r.stats["n_zero"] - ref.stats["n_zero"]) / numel)
        out.append({
            "module": r.module, "depth": order[key], "phase": r.phase, "op": r.op, "dtype": dtype_name(r.dtype),
            "ref_absmax": ref.stats["absmax"] if ref is not None else None, "target_absmax": amax,
            "min_nonzero": r.stats["min_nonzero"] if math.isfinite(r.stats["min_nonzero"]) else None,
            "flush_fraction": flush, "rel_error": rel,
            "nonfinite": int(r.stats["n_nan"] + r.stats["n_posinf"] + r.stats["n_neginf"]),
            "format_max": limits(r.dtype)[0],
        })
    return out
