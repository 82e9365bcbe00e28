"""The report's tables built from a diagnosis: the run summary and the per-layer ranges (``Report.summary`` and
``Report.layers``)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ampdoctor.findings._common import dtype_name, limits
from ampdoctor.findings._context import Context, chain_summary
from ampdoctor.findings._fp8_emulated import unquantised_gemms
from ampdoctor.findings._payloads import LayerStat
from ampdoctor.trace import dtype_info, is_nonfinite

log = logging.getLogger(__name__)


def summary(ctx: Context, findings: list[Any], elapsed: float) -> dict[str, Any]:
    """The run in numbers for :attr:`Report.summary`: losses, origins, the NaN chain, loss scales, fp8 scaling."""
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
        s["fp8_unquantised"] = unquantised_gemms(ctx)  # GEMMs with a weight the emulation did not see
        if s["fp8_unquantised"]:
            mods = sorted({g["module"] or "<root>" for g in s["fp8_unquantised"]})
            log.warning("the fp8 emulation quantises F.linear / nn.Linear only: %d module(s) multiply by a weight "
                        "another way and ran in float32, undiagnosed for fp8 (summary['fp8_unquantised']): %s",
                        len(mods), ", ".join(mods[:6]) + (", ..." if len(mods) > 6 else ""))
    if ref is not None and ref.updates_not_run:  # nothing compares with them (precision.unread_updates)
        s["reference_updates_not_run"] = list(ref.updates_not_run)
    if t.exc is not None:
        s["exception"] = {"type": type(t.exc).__name__, "message": str(t.exc).splitlines()[0][:300] if str(t.exc)
                          else "", "step": t.exc_step}
    return s


def _fp8_layers(fp8: Any) -> list[LayerStat]:
    """An emulated fp8 run's ranges: per module and tensor role, the cast to fp8 that scaled largest over the
    run's steps (delayed scaling saturates at a later step), with the largest share flushed to 0 of any of its
    casts. Everything but the linears' casts runs in float32 there, so these are the ranges that can overflow or
    flush: ``ref_absmax`` is ``|x| * scale`` before the cast (above ``format_max``: clipped), ``target_absmax``
    what the cast keeps, ``flush_fraction`` the elements that became 0. A non-finite scale (amax 0 without a
    floor) gives NaN."""
    best: dict[tuple[str, str], Any] = {}
    order: dict[str, int] = {}
    flush: dict[tuple[str, str], float] = {}
    for x in fp8.tensors:
        key = (x.module, x.role)
        order.setdefault(x.module, len(order))
        scaled = x.amax * x.scale if math.isfinite(x.scale) else math.nan
        fmax = limits(x.format)[0]  # the registry knows the short names ("e4m3")
        if abs(scaled - fmax) <= fmax * 2.0 ** -21:  # fmax / amax * amax: fmax up to the float32 scale's rounding
            scaled = fmax
        cur = best.get(key)
        if cur is None or not scaled <= cur[0]:  # NaN (a broken scale) wins
            best[key] = (scaled, x)
        flush[key] = max(flush.get(key, 0.0), x.underflowed / x.numel if x.numel else 0.0)
    out = []
    for (module, role), (scaled, x) in best.items():
        info = dtype_info(x.format)
        dtype, fmax = (info.name, info.max) if info is not None else (x.format, math.inf)
        out.append(LayerStat.of({
            "module": module, "depth": order[module], "phase": "backward" if role == "grad_output" else "forward",
            "op": f"fp8 cast ({role})", "dtype": dtype, "ref_absmax": scaled,
            "target_absmax": min(scaled, fmax) if not math.isnan(scaled) else math.nan,
            "flush_fraction": flush[(module, role)], "nonfinite": 0, "format_max": fmax,
        }))
    return out


def layers(ctx: Context) -> list[LayerStat]:
    """Per module and phase: the op with the largest |max| in the target, against the reference (in an emulated
    fp8 run, the fp8 casts: :func:`_fp8_layers`)."""
    if ctx.target.fp8 is not None and ctx.target.fp8.tensors:
        return _fp8_layers(ctx.target.fp8)
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
        out.append(LayerStat.of({
            "module": r.module, "depth": order[key], "phase": r.phase, "op": r.op, "dtype": dtype_name(r.dtype),
            "ref_absmax": ref.stats["absmax"] if ref is not None else None, "target_absmax": amax,
            "min_nonzero": r.stats["min_nonzero"] if math.isfinite(r.stats["min_nonzero"]) else None,
            "flush_fraction": flush, "rel_error": rel,
            "nonfinite": int(r.stats["n_nan"] + r.stats["n_posinf"] + r.stats["n_neginf"]),
            "format_max": limits(r.dtype)[0],
        }))
    return out


__all__ = ["layers", "summary"]
