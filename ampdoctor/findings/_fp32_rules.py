"""``must-stay-fp32``: parts of a model that need float32 and run in half precision.

Three mechanisms, all read from the trace:

* modules the model *declares* fp32 (``RunResult.keep_fp32``, Hugging Face's ``_keep_in_fp32_modules``) whose
  ops run in fp16/bf16 -- ``from_pretrained(..., dtype=torch.float16)`` honours the declaration, ``.half()``,
  ``.to()`` and autocast do not;
* frequency buffers of rotary position embeddings (a floating buffer feeding ``sin``/``cos``) stored in
  fp16/bf16: the angle ``position * inv_freq`` inherits the buffer's relative rounding (bf16: 2**-9);
* norm statistics (``pow``/``mean``/``var`` before an ``rsqrt``) computed in half precision.
"""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.findings._buffer_origins import buffer_candidates
from ampdoctor.findings._common import (
    ALIAS_OPS,
    CASTS,
    HALF,
    base_evidence,
    bf16_fix,
    dtype_name,
    feeders,
    fmt,
    is_low,
    keep_fp32_fix,
    limits,
    op_base,
    unit_roundoff,
    where,
)
from ampdoctor.findings._context import Context
from ampdoctor.findings._registry import RUN_END, Candidate, rule
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, ops_with

#: ops whose result is the statistic of a norm (before the ``rsqrt``)
NORM_STAT_OPS = ops_with(Kind.NORM_STATISTIC)
#: ops that turn a statistic into a scale
NORM_SCALE_OPS = ops_with(Kind.NORM_SCALE)
#: an fp32 module "runs in half" when one of these ops in it has a low-precision output
COMPUTE_SKIP = CASTS | ALIAS_OPS


def _components_match(entry: str, name: str) -> int:
    """End position (in components) of ``entry``'s dotted components inside ``name``'s, or -1.

    ``"wo"`` matches ``"encoder.block.0.layer.1.DenseReluDense.wo"`` (component 6), ``"indexer.weights_proj"``
    matches ``"layers.3.indexer.weights_proj"``; ``"wo"`` does not match ``"word_embeddings"``."""
    want = entry.split(".")
    have = name.split(".")
    n = len(want)
    for i in range(len(have) - n + 1):
        if have[i:i + n] == want:
            return i + n
    return -1


def declared_root(entries: list[str], module: str) -> str | None:
    """The module (``module`` or an ancestor) that a ``_keep_in_fp32_modules`` entry names, or ``None``."""
    if not module:
        return None
    best: str | None = None
    for e in entries:
        end = _components_match(e, module)
        if end > 0:
            root = ".".join(module.split(".")[:end])
            if best is None or len(root) < len(best):
                best = root
    return best


def _strict_entries(ctx: Context) -> list[str]:
    """``_keep_in_fp32_modules_strict`` of the user's model (kept fp32 for bf16 as well as fp16)."""
    model = getattr(ctx.spec.model, "module", ctx.spec.model)
    return list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])


def _entries_for(dtype: Any, loose: list[str], strict: list[str]) -> list[str]:
    """Entries that apply to a value of ``dtype``: transformers keeps ``_keep_in_fp32_modules`` in fp32 only when
    loading in fp16 (they guard against bf16-pretrained magnitudes overflowing fp16); the ``_strict`` list also for
    bf16."""
    return list(strict) if dtype_name(dtype) == "bfloat16" else [*loose, *strict]


def _attr(entry: str, strict: list[str]) -> str:
    return "_keep_in_fp32_modules_strict" if entry in strict else "_keep_in_fp32_modules"


def _low_ops_by_root(ctx: Context, loose: list[str], strict: list[str]) -> dict[str, list[OpRecord]]:
    out: dict[str, list[OpRecord]] = {}
    for r in ctx.records:
        if r.kind != "op" or r.phase != "forward" or not is_low(r.dtype) or op_base(r.op) in COMPUTE_SKIP:
            continue
        root = declared_root(_entries_for(r.dtype, loose, strict), r.module)
        if root is not None:
            out.setdefault(root, []).append(r)
    return out


def _declared_fixes(module: str, precision: str | None, ran_in: Any) -> tuple[FixProposal, ...]:
    fixes = [
        keep_fp32_fix(module),
        FixProposal(
            "load the model with its dtype argument, which honours the declaration (not .half()/.to()/autocast)",
            f"model = AutoModel.from_pretrained(name, dtype=torch.{dtype_name(ran_in)})  # declared modules stay "
            "float32"),
    ]
    if dtype_name(ran_in) == "float16":
        fixes.append(bf16_fix(precision))
    return tuple(fixes)


def _declared(ctx: Context) -> list[Candidate]:
    """Modules (and parameters) the model declares float32 that run (or are held) in 16-bit precision."""
    loose, strict = list(ctx.target.keep_fp32), _strict_entries(ctx)
    if not loose and not strict:
        return []
    out, reported = _declared_causes(ctx, loose, strict)
    warnings, covered = _declared_in_half(ctx, loose, strict, reported)
    return out + warnings + _declared_params(ctx, loose, strict, covered)


def _declared_cause_records(ctx: Context) -> list[tuple[OpRecord, str]]:
    """Where a harmful overflow, a cancellation NaN or a precision loss starts, with what happens there."""
    causes: list[tuple[OpRecord, str]] = []
    for o in ctx.harmful_origins():
        r = o.record
        s = r.stats
        if r.kind == "op" and not o.deliberate and s.get("n_posinf", 0) + s.get("n_neginf", 0) > 0 and is_low(r.dtype):
            causes.append((r, f"overflows {dtype_name(r.dtype)} (max {fmt(limits(r.dtype)[0])}) and the inf "
                              f"{o.reasons[0] if o.reasons else 'spreads'}"))
    for o, cancel in ctx.cancellation_nan_origins:
        at = cancel or o.record
        causes.append((at, "loses its leading digits to cancellation and the NaN that follows "
                           + (o.reasons[0] if o.reasons else "spreads")))
    for r, e, inh, *_ in ctx.precision_loss_records:
        causes.append((r, f"deviates {e - inh:.1%} from fp32 beyond what its inputs carried (error {e:.1%})"))
    return causes


def _declared_causes(ctx: Context, loose: list[str], strict: list[str]) -> tuple[list[Candidate], set[str]]:
    """1) a declared-fp32 module is where a failure starts: the declaration is the fix (one error per root)."""
    out: list[Candidate] = []
    reported: set[str] = set()
    err = ctx.relative_errors
    for r, what in _declared_cause_records(ctx):
        entries = _entries_for(r.dtype, loose, strict)
        root = declared_root(entries, r.module)
        if root is None or root in reported:
            continue
        entry = next(e for e in entries if _components_match(e, r.module) > 0)
        ev = base_evidence(r)
        ev.update({"declared_fp32": entries, "matched_entry": entry, "declared_module": root,
                   "declared_by": _attr(entry, strict), "ran_in": dtype_name(r.dtype)})
        ref = ctx.ref(r)
        if ref is not None and math.isfinite(ref.stats.get("absmax", math.nan)):
            ev["ref_absmax"] = ref.stats["absmax"]
            ev["format_max"] = limits(r.dtype)[0]
        if math.isfinite(err.get(r.index, math.inf)):
            ev["relative_error"] = err[r.index]
        expl = (f"The model declares {root} float32 ({_attr(entry, strict)} contains {entry!r}), but "
                f"{where(r)} runs in {dtype_name(r.dtype)} and {what}. The declaration is honoured only by "
                "from_pretrained(..., dtype=...): .half(), .to(dtype) and torch.autocast all run the module in low "
                "precision.")
        if "ref_absmax" in ev:
            expl += f" fp32 reference |max| {fmt(ev['ref_absmax'])}."
        reported.add(root)
        out.append(Candidate(Finding(
            "must-stay-fp32", "error", r.module, r.op, r.phase,
            f"{root} is declared float32 but runs in {dtype_name(r.dtype)}", expl, ev,
            _declared_fixes(root, ctx.spec.precision, r.dtype), r.step), r.index))
    return out, reported


def _declared_in_half(ctx: Context, loose: list[str], strict: list[str],
                      reported: set[str]) -> tuple[list[Candidate], set[str]]:
    """2) no failure: declared modules running in half are one warning per declaration entry not already an
    error; returns them and every declared root seen (``reported`` included)."""
    low = _low_ops_by_root(ctx, loose, strict)
    by_entry: dict[str, list[str]] = {}
    for root in sorted(low, key=lambda m: low[m][0].index):
        entries = _entries_for(low[root][0].dtype, loose, strict)
        entry = next(e for e in entries if _components_match(e, root) > 0)
        by_entry.setdefault(entry, []).append(root)
    out: list[Candidate] = []
    covered = set(reported)
    for entry, roots in by_entry.items():
        covered.update(roots)
        if any(_components_match(entry, m) > 0 for m in reported):
            continue  # the error above already names this declaration
        out.append(_declared_warning(ctx, entry, roots, [x for m in roots for x in low[m]], loose, strict))
    return out, covered


def _declared_warning(ctx: Context, entry: str, roots: list[str], recs: list[OpRecord], loose: list[str],
                      strict: list[str]) -> Candidate:
    r = min(recs, key=lambda x: x.index)
    top = max(recs, key=lambda x: x.stats.get("absmax", 0.0))
    ref = ctx.ref(top)
    fmax = limits(r.dtype)[0]
    ev = base_evidence(r)
    entries = _entries_for(r.dtype, loose, strict)
    ev.update({"declared_fp32": entries, "matched_entry": entry, "declared_by": _attr(entry, strict),
               "declared_module": roots[0], "modules": roots,
               "ran_in": dtype_name(r.dtype), "low_precision_ops": len(recs), "ops": sorted({x.op for x in recs}),
               "format_max": fmax, "absmax": top.stats.get("absmax")})
    if ref is not None:
        ev["ref_absmax"] = ref.stats.get("absmax")
        ev["headroom"] = fmax / max(ref.stats.get("absmax", 0.0), 1e-30)
    many = f" and {len(roots) - 1} more module(s) matching {entry!r}" if len(roots) > 1 else ""
    expl = (f"The model declares {entry!r} float32 ({_attr(entry, strict)} = {entries}), but {roots[0]}{many} run "
            f"{len(recs)} op(s) in {dtype_name(r.dtype)}, starting with {where(r)}. Nothing failed in this step: "
            f"|max| {fmt(top.stats.get('absmax', 0.0))} in {top.module} against {dtype_name(r.dtype)}'s max "
            f"{fmt(fmax)}. The model's authors keep it in float32 because its values outgrow the format on real "
            "(e.g. bf16-pretrained) weights.")
    return Candidate(Finding(
        "must-stay-fp32", "warning", roots[0], r.op, "forward",
        f"{roots[0]}{' (+' + str(len(roots) - 1) + ')' if len(roots) > 1 else ''} declared float32 but runs in "
        f"{dtype_name(r.dtype)}", expl, ev, _declared_fixes(roots[0], ctx.spec.precision, r.dtype), r.step),
        r.index)


def _declared_params(ctx: Context, loose: list[str], strict: list[str], covered: set[str]) -> list[Candidate]:
    """3) declared parameters (an entry naming a parameter, e.g. "query_tokens") held in half."""
    out: list[Candidate] = []
    for name, dt in ctx.target.param_dtypes.items():
        entries = _entries_for(dt, loose, strict)
        if dt in HALF and any(_components_match(e, name) > 0 for e in entries):
            owner = ctx.target.owners.get(name, "")
            if declared_root(entries, owner) in covered or declared_root(entries, name) in covered:
                continue  # its module is already reported
            out.append(Candidate(Finding(
                "must-stay-fp32", "warning", owner, "", "setup",
                f"parameter {name} is declared float32 but is {dt}",
                f"The model declares {name} float32 (_keep_in_fp32_modules = {entries}) but it is held in {dt}.",
                {"parameter": name, "dtype": dt, "declared_fp32": entries},
                _declared_fixes(owner or name, ctx.spec.precision, dt)), RUN_END))
    return out


def _buffer_names(ctx: Context) -> list[tuple[str, Any]]:
    model = getattr(ctx.spec.model, "module", ctx.spec.model)
    try:
        return [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    except Exception:  # noqa: BLE001 - a model without named_buffers: nothing to report
        return []


#: angle error bound (|max angle| * unit roundoff, radians) above which a low-precision frequency buffer changes
#: what sin/cos compute rather than their last digits
TRIG_ERROR_LIMIT = 1.0


def _rope(ctx: Context) -> list[Candidate]:
    """Low-precision floating buffers feeding sin/cos (rotary frequencies)."""
    recs = ctx.records
    buffers = _buffer_names(ctx)
    out: list[Candidate] = []
    seen_leaf: set[int] = set()
    for r, leaf in ctx.trig_buffer_sources:
        if leaf.index in seen_leaf:
            continue
        seen_leaf.add(leaf.index)
        arg = recs[r.inputs[0]] if r.inputs and r.inputs[0] >= 0 else None
        ref_arg = ctx.ref(arg) if arg is not None else None
        angle = (ref_arg or arg).stats.get("absmax", 0.0) if arg is not None else 0.0
        out.append(_rope_candidate(ctx, r, leaf, angle, _buffer_name(buffers, leaf, ctx.ref(leaf))))
    return out


def _buffer_name(buffers: list[tuple[str, Any]], leaf: OpRecord, lref: OpRecord | None) -> str:
    """The model buffer a traced leaf is: same shape and (when the reference has it) the same norm."""
    for n, b in buffers:
        if tuple(b.shape) == leaf.shape and (lref is None or abs(
                float(b.detach().float().norm()) - lref.stats.get("norm", 0.0)) <= 1e-3 * (
                lref.stats.get("norm", 0.0) + 1e-12)):
            return n
    return ""


def _rope_fixes(name: str, owner: str, dt: str) -> tuple[FixProposal, ...]:
    return (
        FixProposal("keep the frequency buffer in float32 after casting the model (recompute it in fp32)",
                    "model.to(torch.bfloat16)\nrope.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, "
                    "dtype=torch.float32) / dim))", id="keep_fp32_buffers",
                    params={"buffers": [name] if name else [], "modules": [owner] if owner else []}),
        FixProposal("use autocast instead of casting the model: buffers then stay float32",
                    "with torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = model(**batch).loss",
                    id="switch_precision",
                    params={"precision": "bf16-amp" if dt == "bfloat16" else "fp16-amp"}),
    )


def _rope_candidate(ctx: Context, r: OpRecord, leaf: OpRecord, angle: float, name: str) -> Candidate:
    """The finding for buffer ``leaf`` feeding trig op ``r`` at largest angle ``angle``."""
    dt = dtype_name(leaf.dtype)
    u = unit_roundoff(leaf.dtype)
    exact = 2 ** round(-math.log2(u))  # significant bits p = -log2(u): integers exact up to 2**p
    consumer = next((c for c in ctx.records[leaf.index + 1:] if leaf.index in c.inputs), None)
    at = consumer or r
    ev = base_evidence(at)
    ev.update({"buffer": name or f"<buffer of shape {list(leaf.shape)}>", "buffer_dtype": dt,
               "max_angle": angle, "angle_error_bound": angle * u, "unit_roundoff": u,
               "integers_exact_up_to": exact, "trig_op": r.op})
    e = ctx.relative_errors.get(r.index)
    if e is not None and math.isfinite(e):
        ev["trig_relative_error"] = e
    expl = (f"The floating buffer {ev['buffer']} feeds {op_base(r.op)} in {r.module or '<root>'} (a rotary "
            f"embedding's frequencies) and is stored in {dt}: each frequency carries a relative rounding "
            f"error up to u = {fmt(u)}, so the angle position * freq is off by up to {fmt(angle * u)} rad at "
            f"the largest angle {fmt(angle)} (upcasting the buffer later does not restore the lost bits). "
            f"{dt} holds integers exactly only up to {exact}: positions beyond it are not exact either.")
    if "trig_relative_error" in ev:
        expl += f" The {op_base(r.op)} output deviates {ev['trig_relative_error']:.1%} from fp32."
    owner = at.module or leaf.module
    # the rounding can move the angle by more than TRIG_ERROR_LIMIT radians: sin/cos are then meaningless (an
    # error, ranked before what it feeds); below that (short positions) it is a warning about latent drift
    severity = "error" if angle * u > TRIG_ERROR_LIMIT else "warning"
    return Candidate(Finding(
        "must-stay-fp32", severity, owner, at.op, "forward",
        f"rotary frequencies {ev['buffer']} stored in {dt}", expl, ev, _rope_fixes(name, owner, dt), at.step),
        at.index)


def _norm_stats(ctx: Context) -> list[Candidate]:
    """Statistics of a hand-written norm (``x.pow(2).mean()`` before ``rsqrt``) computed in half precision."""
    recs = ctx.records
    out: list[Candidate] = []
    done: set[str] = set()
    for r in recs:
        if r.kind != "op" or r.phase != "forward" or op_base(r.op) not in NORM_SCALE_OPS or r.module in done:
            continue
        # the statistic ops of this module that feed the scale
        own_ops = feeders(recs, r, 4, lambda x, m=r.module: x.module == m and x.kind == "op")
        stats = [x for x in own_ops if op_base(x.op) in NORM_STAT_OPS and is_low(x.dtype)]
        if not stats:
            continue
        done.add(r.module)
        first = min(stats, key=lambda x: x.index)
        ref = ctx.ref(first)
        dt = dtype_name(first.dtype)
        fmax = limits(first.dtype)[0]
        ev = base_evidence(first)
        ev.update({"statistic_ops": sorted({x.op for x in stats}), "scale_op": r.op, "format_max": fmax,
                   "unit_roundoff": unit_roundoff(first.dtype)})
        head = ""
        if ref is not None and math.isfinite(ref.stats.get("absmax", math.nan)):
            ev["ref_absmax"] = ref.stats["absmax"]
            ev["headroom"] = fmax / max(ref.stats["absmax"], 1e-30)
            head = (f" The fp32 value reaches |max| {fmt(ref.stats['absmax'])}, "
                    + (f"beyond {dt}'s max {fmt(fmax)}" if ref.stats["absmax"] > fmax else
                       f"{ev['headroom']:.3g}x below {dt}'s max {fmt(fmax)}") + ".")
        expl = (f"{where(first)} computes a normalization statistic ({', '.join(op_base(x.op) for x in stats)} before "
                f"{op_base(r.op)}) in {dt}: squares of activations overflow fp16 from |x| > 256, and the mean of "
                f"many squares carries {dt}'s rounding (u = {fmt(unit_roundoff(first.dtype))}).{head} Norm "
                "statistics belong in float32 (LlamaRMSNorm / T5LayerNorm upcast before pow(2).mean()).")
        fixes = (
            FixProposal("compute the statistic in float32 and cast back after normalizing",
                        "var = x.float().pow(2).mean(-1, keepdim=True)\ny = (x.float() * torch.rsqrt(var + eps))"
                        ".to(x.dtype) * weight"),
            keep_fp32_fix(r.module) if r.module else bf16_fix(ctx.spec.precision),
        )
        out.append(Candidate(Finding(
            "must-stay-fp32", "warning", first.module, first.op, "forward",
            f"norm statistics computed in {dt} in {first.module or '<root>'}", expl, ev, fixes, first.step),
            first.index))
    return out


@rule("must-stay-fp32", severity="error", precedence=30,
      summary="a part the model needs in float32 (declared fp32 modules, RoPE frequencies, norm statistics) runs "
              "in half precision")
def must_stay_fp32(ctx: Context) -> list[Candidate]:
    """A part of the model that must stay float32 runs in fp16/bf16.

    * **Declared fp32 modules.** Hugging Face models list modules in ``_keep_in_fp32_modules`` (T5/mT5's ``wo``:
      bf16-pretrained feed-forward outputs reach ~1e5 > fp16's 65504). An entry matches a module whose dotted
      name contains it as whole components (``"wo"`` matches ``...DenseReluDense.wo``, not ``word_embeddings``).
      ``from_pretrained(..., dtype=torch.float16)`` keeps them fp32; ``.half()``, ``.to()`` and ``torch.autocast``
      do not. As in transformers, ``_keep_in_fp32_modules`` applies to fp16 only (it guards bf16-pretrained
      magnitudes against fp16's range); ``_keep_in_fp32_modules_strict`` applies to bf16 as well. When such a
      module is where a harmful overflow or a precision loss starts, this finding (``error``, same op and phase as
      the overflow) names the declaration as the root cause; without a failure it is a ``warning``.
    * **Rotary frequencies.** A floating buffer that feeds ``sin``/``cos`` (``inv_freq``) stored in bf16/fp16: the
      angle ``position * inv_freq`` carries the buffer's relative rounding (bf16 u = 2**-8: up to 8 rad at
      position 2048; bf16 holds integers exactly only up to 2**8 = 256, fp16 up to 2048). ``warning``.
    * **Norm statistics.** ``pow(2)``/``mean``/``var`` feeding an ``rsqrt`` computed in fp16/bf16 in a hand-written
      norm: squares overflow fp16 from |x| > 256, means carry the format's rounding. ``warning``.
    * **Integer buffers.** A float buffer of integers (positions, indices) beyond the integers the cast dtype holds
      exactly (fp16 2048, bf16 256): distinct values tie. Phase ``setup`` on the owning module; an ``error`` when
      what the reading module computes afterwards deviates or raises."""
    return _declared(ctx) + _rope(ctx) + _norm_stats(ctx) + buffer_candidates(ctx, "inexact")


__all__ = ["declared_root", "must_stay_fp32"]
