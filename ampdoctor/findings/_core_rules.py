"""Rules for non-finite values: overflow, nan-from-inf, masked-row-nan, constant-out-of-range,
nonfinite-input (parameter coverage, unused-parameters, is in ``_unused_params.py``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ampdoctor.findings._buffer_origins import buffer_candidates
from ampdoctor.findings._clamps import caught_candidates
from ampdoctor.findings._clamps import handled as caught_handled
from ampdoctor.findings._common import (
    CASTS,
    base_evidence,
    bf16_fix,
    dtype_name,
    feeders,
    fmt,
    is_low,
    keep_fp32_fix,
    limits,
    op_base,
    src_text,
    where,
)
from ampdoctor.findings._context import Context, nan_record, reference_nonfinite
from ampdoctor.findings._fp8_casts import clip_candidates as fp8_clip_candidates
from ampdoctor.findings._fp8_casts import handled as fp8_handled
from ampdoctor.findings._literals import latent_literal_candidates, out_of_range_literal, rounded_literal_candidates
from ampdoctor.findings._poles import flushed_pole_input
from ampdoctor.findings._registry import (
    SETUP_CRASH,
    SETUP_INPUT,
    Candidate,
    rule,
)
from ampdoctor.findings._remedies import propose
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import OPS, Family, Kind, OpRecord, Reduces, Upcast, ops_with

SOFTMAX_OPS = ops_with(Kind.SOFTMAX)
#: reductions (and the squares they sum) that the upcast_op fix can run in float32 by name; an inline ``x * x``
#: cannot be told from any other product at the torch-function level, so it gets keep_fp32 instead
UPCASTABLE_REDUCTIONS = frozenset(n for n, i in OPS.items() if i.upcast is Upcast.FP32 and (
    i.family is Family.NORM or i.reduces is Reduces.RATIO))


def _loss_scale_at(ctx: Context, step: int) -> float | None:
    """The loss scale a step's backward ran with: the run's GradScaler before that step's update."""
    scaler = ctx.spec.scaler
    if scaler is None or not scaler.is_enabled():
        return None
    initial = float(scaler.get_scale()) if getattr(scaler, "_scale", None) is not None else float(
        scaler._init_scale)
    before = [initial, *ctx.scales]
    return before[step] if step < len(before) else None


def backoff_severity(ctx: Context, step: int) -> str:
    """Severity of an inf that only the loss scale made at ``step``: ``info`` while GradScaler calibrates (every
    step up to this one was skipped, the scale halving from its initial value: what GradScaler does by design),
    ``warning`` for a back-off later in the run (the gradients grew)."""
    first = _loss_scale_at(ctx, 0)
    before = [first, *ctx.scales] if first is not None else []
    calibrating = len(before) > step and all(before[j + 1] < before[j] for j in range(step))
    return "info" if calibrating else "warning"


def _state_twin(ctx: Context, r: OpRecord) -> OpRecord | None:
    """The reference's record of ``r``'s op at the step whose weights the target's step ran on. Each step GradScaler
    skipped left the target's weights where they were while the reference (no scaler) applied its update: after
    ``j`` skips the target's step ``s`` repeats the reference's step ``s - j`` (same batch every step; a
    ``train_step`` may draw its own, so it keeps the aligned step). ``None`` when the steps coincide."""
    scaler = ctx.spec.scaler
    if scaler is None or not scaler.is_enabled() or getattr(ctx.spec, "train_step", None) is not None:
        return None
    before = [float(scaler.get_scale()), *ctx.scales]
    state = r.step - sum(1 for i in range(min(r.step, len(before) - 1)) if before[i + 1] < before[i])
    if state == r.step or not 0 <= r.index < len(ctx.target_keys):
        return None
    cand = ctx.ref_align.get((state, *ctx.target_keys[r.index][1:]))
    return cand if cand is not None and cand.shape == r.shape else None


def unscaled_absmax(ctx: Context, r: OpRecord, scale: float) -> float | None:
    """|max| of backward record ``r``'s value without the loss scale ``scale``, or None when nothing tells."""
    ref = ctx.ref(r)
    if ref is not None:
        # the reference runs at loss scale 1 (precision/_step.prepare): its value is the unscaled gradient, read at
        # the step with the target's weights (after skipped steps the aligned step has weights the target never had)
        twin = _state_twin(ctx, r)
        return (twin or ref).stats.get("absmax")
    if op_base(r.op) in CASTS and r.inputs and r.inputs[0] >= 0:
        # a cast only the target makes (``out.float()`` is no op in fp32, so its backward cast has no reference
        # twin): its own wider input is the scaled value it rounds
        return ctx.records[r.inputs[0]].stats.get("absmax", math.inf) / scale
    return None


def scale_explains(ctx: Context, r: OpRecord) -> float | None:
    """The loss scale when only it pushes backward record ``r`` over the format's max (unscaled, the fp32 value
    fits): GradScaler then skips the step and backs off, which is calibration, not a fault."""
    if r.phase != "backward":
        return None
    scale = _loss_scale_at(ctx, r.step)
    if scale is None or scale <= 1:
        return None
    unscaled = unscaled_absmax(ctx, r, scale)
    return scale if unscaled is not None and math.isfinite(unscaled) and unscaled <= limits(r.dtype)[0] else None


@rule("overflow", severity="error", precedence=40,
      summary="a value finite in fp32 exceeds the format's range: inf (or clipped) in the target")
def overflow(ctx: Context) -> list[Candidate]:
    """An op's result is finite in the fp32 reference but inf in the target dtype (fp16 max 65504, bf16
    3.39e38, e4m3 448, e5m2 57344), and the inf reaches the loss, a gradient or an update, or the op that
    absorbs it computes a different result than the reference. The origin is the earliest such op whose
    inputs were all finite; later NaN are reported as ``nan-from-inf``. Inline math (a residual add, GELU's
    ``pow(x, 3)``) is blamed on the module whose own code runs it, backward ops on the module that ran
    their forward op. A registered buffer that the model cast already made inf (a mask of
    ``torch.finfo(torch.float32).min`` stored in fp16) is the origin itself: phase ``setup``, its owning module,
    ranked before what it feeds when that turns harmful (a ``warning`` otherwise). A user's unscaled fp8 cast
    beyond max + half a spacing is one too (``findings/_fp8_casts``).
    An inf that a guard catches (clamp, clip, ``nan_to_num``, ``where(isinf...)``, a saturating cast; T5's fp16
    clamp) is still an overflow at the op that made it, with ``caught_by`` (op, module, bounds, in_reference) in
    evidence, even when nothing downstream is inf; a guard that never clips is not reported.
    A backward inf that only the loss scale makes (unscaled, the fp32 value fits: ``loss_scale``,
    ``unscaled_absmax``) is GradScaler's back-off, no error: ``info`` while it calibrates (every step so far was
    skipped, the scale halving from its initial 65536 -- normal behaviour), a ``warning`` when it happens later
    (the gradients grew); so is the ``nan-from-inf`` it makes."""
    # long: the docstring is this code's entry in docs/codes.md
    out: list[Candidate] = fp8_clip_candidates(ctx, "overflow") + caught_candidates(ctx, _overflow_fixes)  # fp8, guards
    fp8_done = fp8_handled(ctx) | caught_handled(ctx)
    for o in ctx.harmful_origins():
        r = o.record
        s = r.stats
        n_inf = int(s["n_posinf"] + s["n_neginf"])
        if o.deliberate or r.kind != "op" or n_inf == 0 or r.index in fp8_done or out_of_range_literal(
                ctx, r) is not None:
            continue
        if reference_nonfinite(ctx, r) or flushed_pole_input(ctx, r) is not None:
            continue  # fp32 makes it too (nonfinite-reference), or log(0) of flushed zeros (underflow upstream)
        fmax = limits(r.dtype)[0]
        ref = ctx.ref(r)
        ev = base_evidence(r)
        ev.update({"format_max": fmax, "n_inf": n_inf})
        if ref is not None and math.isfinite(ref.stats["absmax"]):
            ev["ref_absmax"] = ref.stats["absmax"]
            ev["ratio_to_max"] = ref.stats["absmax"] / fmax
            ref_txt = (f"the fp32 reference reaches |max| {fmt(ref.stats['absmax'])}, "
                       f"{ref.stats['absmax'] / fmax:.2f}x {dtype_name(r.dtype)}'s max {fmt(fmax)}")
        elif ref is not None:
            ref_txt = "the fp32 reference overflows here as well (the values exceed even float32's range)"
            ev["ref_nonfinite"] = True
        else:
            ref_txt = f"no aligned reference op; judged against {dtype_name(r.dtype)}'s max {fmt(fmax)}"
        nan = nan_record(ctx, r.index)
        tail = f"; the first NaN follows at {where(nan)}" if nan is not None and nan.index != r.index else ""
        ins = ", ".join(r.input_dtypes) or "none"
        at = f" [{src_text(r)}]" if r.src else ""
        expl = (f"{where(r)}{at} produced {n_inf} inf value(s) in {dtype_name(r.dtype)} from finite inputs "
                f"(input dtypes: {ins}): {ref_txt}. This inf {o.reasons[0]}{tail}.")
        if r.phase == "backward":
            expl += (f" It is a backward op of {r.node or 'the forward op'}: the forward value fits, its derivative "
                     "does not.")
        ev["first_nan"] = ctx.describe(nan) if nan is not None else None
        fixes = _overflow_fixes(ctx, r)
        severity = "error"
        scale = scale_explains(ctx, r)
        if scale is not None:
            # only the loss scale pushes this gradient over the max: GradScaler skips the step and backs off
            severity = backoff_severity(ctx, r.step)
            ev["loss_scale"] = scale
            ev["unscaled_absmax"] = unscaled_absmax(ctx, r, scale)
            expl += (f" The gradient is multiplied by the loss scale {fmt(scale)}; unscaled it is "
                     f"{fmt(ev['unscaled_absmax'])} and fits, so GradScaler skips this step and halves the scale "
                     "(normal while it calibrates; a scale that keeps falling is reported as loss-scale-collapse).")
        out.append(Candidate(Finding(
            "overflow", severity, r.module, r.op, r.phase,
            f"{op_base(r.op)} overflows {dtype_name(r.dtype)} in {r.module or '<root>'}",
            expl, ev, tuple(fixes), r.step), r.index))
    return out + buffer_candidates(ctx, "nonfinite")


def _feeds_softmax(ctx: Context, r: OpRecord) -> bool:
    """A softmax within a few ops downstream reads ``r`` (through the scale, the mask add, views)."""
    for x in ctx.records[r.index + 1:r.index + 48]:
        if x.kind == "op" and op_base(x.op) in SOFTMAX_OPS and any(
                y.index == r.index for y in feeders(ctx.records, x, 5)):
            return True
    return False


def _overflow_fixes(ctx: Context, r: OpRecord) -> list[FixProposal]:
    """The mechanism's own remedies first (a reduction upcast; scale-before-matmul and SDPA for attention
    scores), then fp32 for the module and bf16."""
    base = op_base(r.op)
    info = OPS.get(base)
    fixes: list[FixProposal] = []
    reduction = info is not None and (info.reduces is Reduces.RATIO or Kind.NORM_STATISTIC in info.kinds)
    if reduction and base in UPCASTABLE_REDUCTIONS and r.phase == "forward" and r.module:
        fixes.append(propose("fp32-reduction", modules=[r.module], ops=[base]))
    if r.module:
        fixes.append(keep_fp32_fix(r.module))
    gemm = info is not None and info.reduces in (Reduces.INNER_0, Reduces.INNER_1)
    if gemm and r.phase == "forward" and _feeds_softmax(ctx, r):
        fixes += [propose("scale-q"), propose("sdpa")]
    fixes.append(bf16_fix(ctx.spec.precision))
    return fixes


@rule("nan-from-inf", severity="error", precedence=90,
      summary="an inf from an earlier overflow turns into NaN (inf - inf, inf * 0); a propagation step")
def nan_from_inf(ctx: Context) -> list[Candidate]:
    """The step where an inf made elsewhere becomes NaN: ``inf - inf``, ``inf * 0``, ``inf * rsqrt(inf)``
    (a norm over an inf row), ``0 * inf`` in GELU's backward. Never ranked above the overflow that made the
    inf; it tells where the NaN that users see comes from."""
    out: list[Candidate] = []
    for o in ctx.harmful_origins():
        nan = nan_record(ctx, o.record.index)
        if nan is None or nan.index == o.record.index or reference_nonfinite(ctx, o.record):
            continue
        ins = [ctx.records[i] for i in nan.inputs if i >= 0]
        inf_in = sum(int(x.stats.get("n_posinf", 0) + x.stats.get("n_neginf", 0)) for x in ins)
        ev = base_evidence(nan)
        ev.update({"n_nan": int(nan.stats["n_nan"]), "inf_inputs": inf_in,
                   "origin": ctx.describe(o.record)})
        expl = (f"{where(nan)} receives {inf_in} inf value(s) that started at {where(o.record)} and returns "
                f"{int(nan.stats['n_nan'])} NaN (inf - inf, inf * 0 or inf/inf). Fix the origin, not this op.")
        # NaN made from a gradient that only the loss scale pushed over the max: GradScaler skips this step
        severity = backoff_severity(ctx, o.record.step) if scale_explains(ctx, o.record) is not None else "error"
        out.append(Candidate(Finding(
            "nan-from-inf", severity, nan.module, nan.op, nan.phase,
            f"inf becomes NaN at {op_base(nan.op)} in {nan.module or '<root>'}", expl, ev, (), nan.step),
            o.record.index))
    return out


@rule("masked-row-nan", severity="error", precedence=15,
      summary="a softmax over a row whose every entry is -inf (a fully masked row) returns NaN")
def masked_row_nan(ctx: Context) -> list[Candidate]:
    """A softmax whose input holds -inf but no +inf or NaN returns NaN: every entry of some row was masked
    (left padding with a causal mask, an all-pad sequence), so max-subtraction computes ``-inf - (-inf)``.
    The NaN rows then reach real tokens through ``attn @ V`` (0 * NaN) and every gradient."""
    out: list[Candidate] = []
    recs = ctx.records
    carried = ctx.lineage.carried
    for r in recs:
        if op_base(r.op) not in SOFTMAX_OPS or r.stats.get("n_nan", 0) == 0 or r.index not in carried:
            continue
        ins = [recs[i] for i in r.inputs if i >= 0]
        if not ins:
            continue
        x = ins[0]
        if x.stats.get("n_neginf", 0) == 0 or x.stats.get("n_posinf", 0) or x.stats.get("n_nan", 0):
            continue
        origins = sorted(carried[r.index])
        if not any(o.harmful for o in ctx.origins if o.record.index in origins):
            continue
        src = recs[origins[0]]
        row = r.shape[-1] if r.shape else 1
        nan_rows = int(r.stats["n_nan"]) // max(row, 1)
        ev = base_evidence(r)
        ev.update({"nan_rows": nan_rows, "row_length": row, "neginf_inputs": int(x.stats["n_neginf"]),
                   "mask_origin": ctx.describe(src), "mask_literal": min(src.scalars) if src.scalars else None})
        made = "a -inf literal" if any(math.isinf(v) for v in src.scalars) else "an overflowed mask value"
        expl = (f"{where(r)} takes the softmax of {nan_rows} row(s) of length {row} whose every entry is -inf "
                f"({made} written by {src.op} in {src.module or '<root>'}); -inf - (-inf) = NaN. Rows that keep at "
                "least one unmasked key are fine, so only fully masked (padding) rows break.")
        fixes = (
            FixProposal("use a finite mask value: torch.finfo(scores.dtype).min instead of -inf",
                        "scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)", id="safe_mask",
                        params={"modules": [r.module]}),
            FixProposal("use F.scaled_dot_product_attention (its safe softmax returns 0 for fully masked rows)",
                        "out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)"),
            FixProposal("zero the output of fully masked rows",
                        "probs = probs.masked_fill(~allowed.any(-1, keepdim=True), 0.0)"),
        )
        out.append(Candidate(Finding(
            "masked-row-nan", "error", r.module, r.op, r.phase,
            f"softmax over fully masked rows gives NaN in {r.module or '<root>'}", expl, ev, fixes, r.step),
            origins[0]))
    return out


@rule("constant-out-of-range", severity="error", precedence=10,
      summary="a literal (fill value, eps, clamp bound, sentinel) does not fit the dtype it is written into")
def constant_out_of_range(ctx: Context) -> list[Candidate]:
    """A constant written into a low-precision tensor is outside its range: ``masked_fill(mask, -1e9)`` on
    fp16 raises "value cannot be converted to type c10::Half without overflow"; ``x[mask] = -1e9`` silently
    stores -inf. The cause is the literal, not the data: use ``torch.finfo(x.dtype).min``. Also a literal that is
    0 in the dtype (``x + 1e-10`` in fp16), one that is not ±1 but becomes exactly ±1 (``clamp(y, -1 + 1e-6,
    1 - 1e-6)`` in fp16 lets tanh's ±1 reach ``atanh``), and an offset that rounds away against the values it meets
    (``x + 1e-4`` on values >= 1 in bf16: the result equals ``x`` where fp32's does not). Error when the value it
    should have changed makes a harmful inf/NaN (zeros, or ±1, on the way) -- the literal then precedes that
    symptom as its root cause -- else a warning (info for a no-op offset: eps guards round away by design against
    large values). A finite literal beyond the dtype's max that makes inf where fp32 holds the finite value, with
    no harm in this run (``sigmoid(-1e9 -> -inf) = 0``), is a warning (``mechanism`` latent: one fully masked row
    and it is NaN); ``finfo(dtype).min`` and a literal ``-inf`` are not reported. In every phase: an eps in a custom
    backward or a hand-written optimizer is judged like one in the forward. Evidence: ``constant``,
    ``constant_in_dtype``, ``mechanism`` (rounded / no-op / latent), ``consequence``, ``absorbed_by``."""
    # long: the docstring is this code's entry in docs/codes.md; the body is two short loops
    out: list[Candidate] = []
    err = ctx.target.trace.error
    if err is not None and "without overflow" in err.get("message", ""):
        ev: dict[str, Any] = {"message": err["message"], "input_dtypes": err.get("input_dtypes", []),
                              "constants": err.get("scalars", [])}
        dt = (err.get("input_dtypes") or ["float16"])[0]
        ev["format_max"] = limits(dt)[0]
        if err.get("src"):
            ev["source"] = f"{err['src'][0]}:{err['src'][1]}"
        lit = err.get("scalars") or []
        lit_txt = f" the literal {lit[0]:g}" if lit else " a literal"
        expl = (f"{err['op']} in {err['module'] or '<root>'} ({err['phase']}, step {err['step']}) raised: "
                f"\"{err['message']}\". It writes{lit_txt} into a {dt} tensor whose range is ±{fmt(limits(dt)[0])}.")
        out.append(Candidate(Finding(
            "constant-out-of-range", "error", err["module"], err["op"], err["phase"],
            f"constant does not fit {dt} in {err['module'] or '<root>'}", expl, ev,
            (_finfo_fix(err["module"]),), err["step"]), SETUP_CRASH))
    for o in ctx.harmful_origins():
        r = o.record
        if r.kind == "input" and r.stats.get("numel") == 1 and (r.stats["n_posinf"] + r.stats["n_neginf"]) > 0:
            # a Python literal torch already converted to a one-element low-precision tensor (``x[m] = -1e9``)
            user = next((ctx.records[i] for i in ctx.chain(r.index)[1:]
                         if ctx.records[i].kind == "op" and ctx.records[i].stats.get("numel", 0) > 1), None)
            if user is None:
                continue
            sign = "-inf" if r.stats["n_neginf"] else "inf"
            ev = base_evidence(user)
            ev.update({"constant": sign, "constant_dtype": dtype_name(r.dtype), "format_max": limits(r.dtype)[0]})
            expl = (f"{where(user)} writes a one-element constant that is already {sign} in {dtype_name(r.dtype)}: "
                    f"a Python literal beyond ±{fmt(limits(r.dtype)[0])} (like -1e9 in `x[mask] = -1e9`) is "
                    f"converted silently. The {sign} {o.reasons[0]}.")
            out.append(Candidate(Finding(
                "constant-out-of-range", "error", user.module, user.op, user.phase,
                f"literal overflows {dtype_name(r.dtype)} in {user.module or '<root>'}", expl, ev,
                (_finfo_fix(user.module),), user.step), r.index))
            continue
        v = out_of_range_literal(ctx, r)
        if v is None:
            continue
        ev = base_evidence(r)
        ev.update({"constant": v, "format_max": limits(r.dtype)[0]})
        expl = (f"{where(r)} writes the literal {v:g} into a {dtype_name(r.dtype)} tensor (max "
                f"{fmt(limits(r.dtype)[0])}); it is stored as {'-inf' if v < 0 else 'inf'} silently. "
                f"The inf {o.reasons[0]}.")
        out.append(Candidate(Finding(
            "constant-out-of-range", "error", r.module, r.op, r.phase,
            f"literal {v:g} overflows {dtype_name(r.dtype)} in {r.module or '<root>'}", expl, ev,
            (_finfo_fix(r.module),), r.step), r.index))
    out.extend(_flushed_literal_candidates(ctx) + rounded_literal_candidates(ctx) + latent_literal_candidates(ctx))
    return out


def _flushed_literal_candidates(ctx: Context) -> list[Candidate]:
    """A literal eps added in a low dtype that rounds to 0 there (``x + 1e-10`` in fp16): the zeros it should
    prevent reach a division, rsqrt or log. Error when a harmful inf/NaN is computed from it, else a warning."""
    from ampdoctor.findings._literals import feeds_harm, flushed_literal_evidence, flushed_literals

    out: list[Candidate] = []
    for r, lit, ref_zero, zero in flushed_literals(ctx):
        harm = feeds_harm(ctx, r)
        dt = dtype_name(r.dtype)
        ev = base_evidence(r)
        ev.update(flushed_literal_evidence(ctx, r, lit, ref_zero, zero))
        at = f" [{src_text(r)}]" if r.src else ""
        expl = (f"{where(r)}{at} adds the literal {lit:g}, which is 0 in {dt} (smallest subnormal "
                f"{fmt(limits(dt)[2])}): the op is a no-op and {zero} value(s) stay exactly 0 where the fp32 "
                f"reference holds {lit:g} ({int(ref_zero)} zeros there).")
        if harm is not None:
            ev["consequence"] = ctx.describe(harm)
            expl += f" The zeros then make inf/NaN at {where(harm)}."
        fix = propose("dtype-eps", modules=[r.module])
        out.append(Candidate(Finding(
            "constant-out-of-range", "error" if harm is not None else "warning", r.module, r.op,
            r.phase,
            f"literal {lit:g} is 0 in {dt} in {r.module or '<root>'}", expl, ev, (fix,), r.step), r.index))
    return out


def _finfo_fix(module: str) -> FixProposal:
    return propose("mask-finfo-min", modules=[module])


@rule("nonfinite-input", severity="error", precedence=20,
      summary="the batch (or a parameter) already holds inf/NaN before any op runs")
def nonfinite_input(ctx: Context) -> list[Candidate]:
    """inf/NaN present in the data fed to the model (or in a parameter as loaded): no op made them, so no
    precision change can fix it. Check the data pipeline (division by a zero std, log of 0) or the
    checkpoint. A 16-bit parameter that the optimizer updates in its own dtype is the exception: the previous
    step's update is the likely writer (Adam's ``eps`` 1e-8 is 0 in fp16: where ``grad**2`` flushes, the update
    divides by zero), so the finding carries ``optimizer``, ``eps`` and ``eps_in_dtype`` and proposes fp32 master
    weights -- what a watch's replay of the next step sees."""
    out: list[Candidate] = []
    for o in ctx.origins:
        r = o.record
        if r.kind not in ("batch", "param"):
            continue
        s = r.stats
        n_nan, n_inf = int(s["n_nan"]), int(s["n_posinf"] + s["n_neginf"])
        ev = {"dtype": dtype_name(r.dtype), "n_nan": n_nan, "n_inf": n_inf, "numel": int(s["numel"]),
              "shape": list(r.shape)}
        if r.kind == "param":
            ev["parameter"] = r.name
            module, phase, title = ctx.target.owners.get(r.name, ""), "setup", f"parameter {r.name} is non-finite"
            what = f"parameter {r.name}"
        else:
            module, phase, title = "", "forward", "the batch contains non-finite values"
            what = f"an input tensor of shape {list(r.shape)}"
        expl = (f"{what} holds {n_nan} NaN and {n_inf} inf of {int(s['numel'])} values before any op ran; "
                f"{'it ' + o.reasons[0] if o.harmful else 'it is absorbed downstream'}.")
        fixes: tuple[FixProposal, ...] = (FixProposal(
            "find where the data gets non-finite and drop or repair those samples",
            "assert torch.isfinite(batch['x']).all(), 'non-finite input'"),)
        writer = _low_precision_updater(ctx, r) if r.kind == "param" else None
        if writer is not None:
            ev.update(writer)
            expl += (f" It is a {ev['dtype']} parameter that {writer['optimizer']} updates in its own dtype, so the "
                     "previous step's update is the prime suspect, not the checkpoint" + (
                         f": eps={writer['eps']:g} is 0 in {ev['dtype']}, so where grad**2 underflows the update "
                         "divides by zero" if writer.get("eps_in_dtype") == 0.0 else "") +
                     ". Diagnose the step before this one (or run that step with ampdoctor.diagnose).")
            fixes = (propose("fp32-master"), FixProposal(
                "if the weights must stay low precision, use an eps the dtype can hold",
                "torch.optim.Adam(params, eps=1e-4)  # fp16 holds 1e-4, not 1e-8")) + fixes
        else:
            expl += " No precision setting fixes this: clean the data (or the checkpoint)."
        out.append(Candidate(Finding(
            "nonfinite-input", "error" if o.harmful else "warning", module, "", phase,
            title, expl, ev, fixes, r.step), SETUP_INPUT if o.harmful else r.index))
    return out


def _low_precision_updater(ctx: Context, r: OpRecord) -> dict[str, Any] | None:
    """``{optimizer, eps, eps_in_dtype}`` when the non-finite parameter is 16-bit and in the optimizer, whose
    update then runs in that dtype (the likely writer of an inf/NaN found before the step); else None."""
    opt = ctx.spec.optimizer
    if opt is None or not is_low(r.dtype) or not r.name:
        return None
    try:
        p = ctx.spec.model.get_parameter(r.name)
    except (AttributeError, TypeError):
        return None
    if not any(q is p for g in opt.param_groups for q in g["params"]):
        return None
    out: dict[str, Any] = {"optimizer": type(opt).__name__}
    eps = opt.defaults.get("eps")
    if isinstance(eps, float):
        out["eps"] = eps
        out["eps_in_dtype"] = float(torch.tensor(eps).to(p.dtype).float())
    return out
