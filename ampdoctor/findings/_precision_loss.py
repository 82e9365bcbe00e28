"""The precision-loss rule: an op's finite result deviates from fp32 beyond what rounding explains.

The per-op errors and tolerances are ``ctx.relative_errors`` / ``ctx.precision_loss_records``.
"""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.findings._absolute_args import absolute_arg_findings
from ampdoctor.findings._analysis import output_deviation, reduction_length
from ampdoctor.findings._common import (
    CANCEL_OPS,
    CASTS,
    LOW,
    base_evidence,
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
from ampdoctor.findings._crash import out_of_range_findings
from ampdoctor.findings._elementwise import (
    AMPLIFIERS,
    amplified_records,
    decision_source,
    decision_steers,
    element_loss_records,
    input_rounding,
    typical_cancellation,
)
from ampdoctor.findings._integer_values import integer_rounding_findings
from ampdoctor.findings._registry import Candidate, rule
from ampdoctor.findings._rounded_operands import rounded_operand_findings
from ampdoctor.findings._types import Finding, FixProposal
from ampdoctor.trace import Kind, OpRecord, ops_with

PERIODIC = ops_with(Kind.PERIODIC)
THRESHOLDS = ops_with(Kind.THRESHOLDS)

#: relative error above which precision-loss is a warning (below it: info)
WARN_REL = 0.05
#: a changed decision whose indices select later computation is an error from this fraction of rows (1 in 20)
DECISION_ERROR_FRACTION = 0.05


@rule("precision-loss", severity="warning", precedence=50,
      summary="no inf/NaN, but an op's result deviates from fp32 beyond what rounding explains")
def precision_loss(ctx: Context) -> list[Candidate]:
    """An op's finite result deviates from the fp32 reference by more than rounding to the dtype explains.

    Tolerance: the unit roundoff u of the lowest precision the op touches (fp16 2**-11, bf16 2**-8, e4m3 2**-4)
    and the number K of terms each output sums (matmul: the inner dimension, conv: C_in * kernel size, its input
    gradient: C_out / groups * kernel size, softmax / norms: the row length, element-wise: 1). Summing K
    rounded terms gives a relative error of about sqrt(K) * u typically (random rounding errors add in
    quadrature; K * u is the worst case), so an op is flagged when its *own* error exceeds
    ``min(16 * sqrt(K) * u, 0.1)``: fp16 element-wise 0.0078, fp16 matmul with K=1024 0.1 (cap), bf16
    element-wise 0.0625. The observed error is the relative error of the tensor's L2 norm or of its
    |max| against the reference (a lower bound of the element-wise error). A layer's *own* error is what it
    adds to the error its inputs already carried: ``(1 + error(output)) / (1 + max(error(inputs))) - 1``, about
    their difference (a ratio, so that GradScaler's scale S in the gradients, an error of S - 1 against the scale-1
    reference, cancels) -- a matmul that receives a 3% error and returns 3.1% is not the culprit; a subtraction
    that receives 0.2% and returns 80% (catastrophic cancellation: ``x - mean(x)`` of values with a large common
    offset, ``E[x**2] - E[x]**2``) is.
    What an input carried is the larger of its norm's / |max|'s error and the relative 2-norm of its sampled
    difference from fp32 (norms can agree while elements do not); a K-term sum of products multiplies it by its
    cancellation gain ``sqrt(K) * rms(a) * rms(b) / rms(result)`` (about 1 for terms of random sign), and an
    output's |max| error is also compared with its inputs' worst sampled element error (a |max| is one
    element). Measured by hand on the zoo's bf16 conv nets, recomputing the flagged ops exactly from their own
    bf16 inputs: resnet's ``convolution_backward`` adds 0.17% (median) of its own and mobilenet_v2's classifier
    0.05%, where the old measure reported 19% and 18% -- their inputs' elements carried it. Everything computed
    from a flagged op inherits its error and is not flagged again; only the first step is
    compared (after an optimizer step the two runs hold different weights). Severity ``warning`` at a 5% own error
    or more; smaller own errors are ``info`` and reported only when the first step's loss (or output) deviates by
    more than 1% and no inf/NaN explains it. At most five ops, the largest own errors. A cancelling op whose
    operands' rounding ``|operand| * u`` is at least its true fp32 result (every significant bit cancels), with an
    own error of 50% or more while the first step's loss (or output) deviates by 5% or more, is an ``error``: its
    result is rounding noise that reaches what the user reads (``E[x**2] - E[x]**2`` rounding to 0, then
    ``rsqrt(var + eps)`` multiplying the centred values by ``1 / sqrt(eps)``), with ``output_deviation``. So is
    one whose norm hides it (a few large elements keep the norm and |max| close): the operands' rounding reaches
    the *typical* (median sampled) true element, the op's own median element error is 50% or more and the loss
    deviates by 5% (``typical_result``, ``element_own_error``: a KL of nearby log-probabilities). A NaN
    made from finite inputs where the reference is finite (``sqrt`` of a variance that cancellation made negative)
    is an ``error`` reported at the cancelling op. When the target run raised and a finite low-precision input of
    the failing op leaves the fp32 range (an index computed from a value that rounds up), the op that rounded it
    out is an ``error`` (:mod:`ampdoctor.findings._crash`).

    Element-wise (:mod:`ampdoctor.findings._elementwise`): the trace keeps 64 values per step-0 output at fixed
    positions (the same in both runs), so every finding carries ``elementwise`` -- ``p50``/``p99``/``max`` of
    ``|t - r| / max(|r|, rms(r) / 16)`` and ``sign_flips`` -- and an element-wise op (K = 1: a reduction mixes
    all its terms' errors into every element) whose own median element error exceeds 25% is a ``warning`` even
    when its norm and |max| agree (``sin`` of a large angle: ``argument_absmax``, ``argument_abs_error``). Decision
    ops (argmax, topk, sort, ``max.dim``) are compared index by index: rows that
    choose differently are a ``warning`` at the low-precision op that computed the compared scores, with
    ``decisions_changed``, ``rows``, ``changed_fraction``, ``changed_rows``, ``examples``, ``decision_op``,
    ``decision_module`` and ``ties_target``/``ties_reference``/``ties_created`` (rows whose winner ties with the
    next candidate; for a sort, rows where two neighbours in the order are equal); inside the decision's own
    module the op that rounds the scores is blamed before an upstream input's rounding, and a low-precision softmax or
    exp of inputs below 1 in magnitude (relative condition number ``|input| < 1``: rounding its result is coarser
    than its input's rounding carried through -- a near-uniform router's bf16 probabilities) right before the
    decision is blamed itself; its producer is blamed instead when the input's own rounding carried through
    (``|l| u``) exceeds 4x the softmax's (``u`` times its condition ``|l - max l|``, bounded by the input's spread,
    or 1): logits on a large common offset (|l| ~60, bf16 spacing 0.25, differences ~0.05), evidence
    ``input_rounding``. It is an ``error`` when at
    least 5% of the rows (and 2) choose differently and later ops pick values with the chosen indices
    (``indexed_by``: ``x[idx]``, a gather, an embedding lookup -- an MoE router's experts, a VQ codebook's codes):
    those rows take a different computation, not a rounded one. An amplifier (``sin``, ``cos``,
    ``exp``) whose median element error exceeds ``max(16 * u, 5%)`` (u of the low precision its argument was
    computed in) is a ``warning`` at the op that lost the argument's digits -- the amplifier itself when it runs
    in the low precision on a rounded large argument (Fourier features, positions), the low-precision op upstream
    with the largest own element error when autocast runs it in float32 (``exp(logits - offset)``) -- with
    ``amplifier_op``, ``amplifier_module``, ``argument_absmax`` and ``argument_abs_error``: sin/cos turn an
    argument's absolute error into the result's absolute error, exp into its relative error, so a relative
    error of u at |argument| A becomes about A * u. When the values come from a batch ampdoctor cast for a pure
    ``fp16``/``bf16`` precision, the explanation says so (under ``-amp`` the batch stays float32).

    Integer values (:mod:`ampdoctor.findings._integer_values`): a tensor of positions, ids or indices (integers in
    the fp32 reference) cast or computed in a dtype beyond the integers it holds exactly (bf16 256, fp16 2048)
    rounds distinct integers together (``257 -> 256``): reported at the cast or op that rounded them, with
    ``integers_exact_up_to``, ``sampled_changed``, ``examples``; an ``error`` when what is computed from them
    deviates (``sin(pos * freq)`` wrong in some element, a median element off by 25%, the output by 1%).

    Rounded arguments of sin/cos and softmax (:mod:`ampdoctor.findings._absolute_args`): a float value (a
    diffusion timestep, a sigma, a coordinate) rounded into fp16/bf16 and then encoded by ``sin``/``cos`` at a
    high frequency -- the argument off by at least 0.5 radians in some sampled element, the result by more than a
    quarter of its amplitude -- or logits on a large common offset (an ALiBi bias, drifted logits) whose
    differences a (log-)softmax reads -- off by at least 0.25, the result by more than 25% -- is an ``error`` at
    the rounding site upstream (the cast, the low-precision op or GEMM with a bias, the batch tensor), with
    ``function_op``, ``argument_abs_error``, ``origin_abs_error``: the rounding's relative error is only u, the
    function reads its absolute error. Masks (|logit| >= 4096) and products (``100 * cos``) are left out."""
    # long: the docstring is this code's entry in docs/codes.md
    lost = _lost_accuracy_findings(ctx)
    decisions = _decision_findings(ctx)
    ints = integer_rounding_findings(ctx)
    phases = absolute_arg_findings(ctx, {c.order for c in ints if isinstance(c.order, int)} | _skip_explained(ctx))
    at = {c.order for c in decisions} | {c.order for c in phases}
    amplified = [c for c in _amplified_findings(ctx) if c.order not in at]
    at |= {c.order for c in amplified}
    return (_cancellation_findings(ctx) + out_of_range_findings(ctx) + ints + phases
            + rounded_operand_findings(ctx) + decisions
            + lost + amplified
            + [c for c in _element_findings(ctx) if c.order not in at])


def _cancellation_findings(ctx: Context) -> list[Candidate]:
    """A NaN made from finite inputs where fp32 is finite, reported at the cancelling op upstream (an error)."""
    out: list[Candidate] = []
    for o, cancel in ctx.cancellation_nan_origins:
        r = o.record
        at = cancel or r
        err = ctx.relative_errors
        ev = base_evidence(at)
        ref = ctx.ref(r)
        ev.update({"nan_op": ctx.describe(r), "n_nan": int(r.stats["n_nan"]),
                   "ref_absmax": ref.stats["absmax"] if ref is not None else None})
        txt = ""
        if cancel is not None:
            cref = ctx.ref(cancel)
            ins = [ctx.records[i] for i in cancel.inputs if i >= 0]
            in_max = max((x.stats.get("absmax", 0.0) for x in ins), default=0.0)
            ev.update({"relative_error": err.get(cancel.index), "operand_absmax": in_max,
                       "result_absmax": cancel.stats["absmax"],
                       "ref_result_absmax": cref.stats["absmax"] if cref is not None else None,
                       "unit_roundoff": unit_roundoff(cancel.dtype)})
            if cref is not None and cref.stats["absmax"] > 0 and in_max > 0:
                ev["digits_cancelled"] = math.log2(in_max / cref.stats["absmax"])
            txt = (f"{where(cancel)} subtracts operands of |max| {fmt(in_max)} whose true difference is only "
                   f"|max| {fmt(ev['ref_result_absmax'] or 0.0)}: in {dtype_name(cancel.dtype)} (u = "
                   f"{fmt(unit_roundoff(cancel.dtype))}) the rounding error of the operands "
                   f"({fmt(in_max * 2 * unit_roundoff(cancel.dtype))}) "
                   f"exceeds the result, which comes out wrong by {fmt(err.get(cancel.index, 0.0))}x its size and "
                   "can change sign. ")
        expl = (f"{txt}{where(r)} then returns {int(r.stats['n_nan'])} NaN from finite inputs while the fp32 "
                f"reference is finite (|max| {fmt(ev['ref_absmax'] or 0.0)}): a value that must be positive "
                "(a variance) became negative or zero. The NaN " + (o.reasons[0] if o.reasons else "spreads") + ".")
        fixes = [
            FixProposal("compute the statistic in a cancellation-free form and in float32",
                        "var = x.float().var(-1, unbiased=False, keepdim=True)  # two-pass, not E[x^2]-E[x]^2"),
        ]
        if at.module:
            fixes.append(keep_fp32_fix(at.module))
        out.append(Candidate(Finding(
            "precision-loss", "error", at.module, at.op, at.phase,
            f"catastrophic cancellation in {at.module or '<root>'} turns into NaN", expl, ev, tuple(fixes), at.step),
            at.index))
    return out


def _lost_accuracy_findings(ctx: Context) -> list[Candidate]:
    """The ops whose own error exceeds their tolerance: at most five, one per (module, op, phase)."""
    out: list[Candidate] = []
    flagged = ctx.precision_loss_records
    # one finding per (module, op, phase), the largest own error; at most 5, the largest
    best: dict[tuple[str, str, str], tuple[OpRecord, float, float, float, int, float]] = {}
    for item in flagged:
        r, e, inh = item[0], item[1], item[2]
        key = (r.module, r.op, r.phase)
        if key not in best or e - inh > best[key][1] - best[key][2]:
            best[key] = item
    top = sorted(best.values(), key=lambda x: -(x[1] - x[2]))[:5]
    deviation = output_deviation(ctx)
    if deviation is None or deviation <= 0.01 or ctx.harmful_origins():
        top = [x for x in top if x[1] - x[2] >= WARN_REL]  # small own errors the result does not show: not reported
    for r, e, inh, tol, k, u in sorted(top, key=lambda x: x[0].index):
        ref = ctx.ref(r)
        assert ref is not None
        own = e - inh
        severity = "warning" if own >= WARN_REL else "info"
        dt = dtype_name(r.dtype)
        ev = base_evidence(r)
        if r.index in ctx.element_errors:
            ev["elementwise"] = ctx.element_errors[r.index]
        ev.update({"relative_error": e, "inherited_error": inh, "own_error": own, "tolerance": tol,
                   "reduction_length": k, "unit_roundoff": u, "norm": r.stats["norm"], "ref_norm": ref.stats["norm"],
                   "absmax": r.stats["absmax"], "ref_absmax": ref.stats["absmax"]})
        ins = [ctx.records[i] for i in r.inputs if i >= 0]
        sub_in = sum(int(x.stats.get("n_subnormal", 0)) for x in ins)
        if sub_in:
            ev["subnormal_inputs"] = sub_in
        expl = (f"{where(r)} deviates from the fp32 reference by {own:.2%} beyond the {inh:.2%} its inputs carried "
                f"(norm {fmt(r.stats['norm'])} vs {fmt(ref.stats['norm'])}, |max| {fmt(r.stats['absmax'])} vs "
                f"{fmt(ref.stats['absmax'])}); rounding to {dt} explains about sqrt(K) * u = "
                f"{math.sqrt(k) * u:.2g} (K = {k}, u = {fmt(u)}; flagged above {tol:.2g}).")
        cancel_ev, cancel_txt, noise = _cancellation(ctx, r, own, deviation)
        cancelling = bool(cancel_ev)
        ev.update(cancel_ev)
        expl += cancel_txt + _elementwise_text(ctx, r)
        if noise:
            severity = "error"
        amp_ev, amp_txt = _amplification(ctx, r, inh)
        ev.update(amp_ev)
        expl += amp_txt
        if sub_in:
            expl += (f" Its inputs hold {sub_in} subnormal value(s) (below {fmt(limits(r.dtype)[1])}, where {dt} keeps "
                     "fewer significant bits)" + ("; loss scaling lifts backward values out of that range."
                                                  if r.phase == "backward" else "."))
        out.append(Candidate(Finding(
            "precision-loss", severity, r.module, r.op, r.phase,
            (f"catastrophic cancellation in {r.module or '<root>'}: {op_base(r.op)} returns rounding noise in {dt}"
             if noise else f"{op_base(r.op)} loses {own:.1%} accuracy in {dt} in {r.module or '<root>'}"), expl, ev,
            _fixes(r, bool(sub_in), bool(cancelling)), r.step), r.index))
    return out


def _cancellation(ctx: Context, r: OpRecord, own: float, deviation: float | None) -> tuple[dict[str, float], str, bool]:
    """Evidence and text when ``r`` subtracts operands far larger than its true result, and whether the result is
    rounding noise that reaches the output (an error): the operands' rounding ``|operand| * u`` is at least the
    fp32 result, the op's own error is >= 50%, and the first step's loss (or output) deviates by >= 5%."""
    ref = ctx.ref(r)
    in_max = max((ctx.records[i].stats.get("absmax", 0.0) for i in r.inputs if i >= 0), default=0.0)
    if ref is None or op_base(r.op) not in CANCEL_OPS or in_max <= 0 or ref.stats["absmax"] <= 0:
        return {}, "", False
    u, true_max = unit_roundoff(r.dtype), ref.stats["absmax"]
    dev = deviation if deviation is not None else 0.0  # None: a non-finite loss, explained by the inf/NaN rules
    noise = in_max * u >= true_max and own >= 0.5 and dev >= WARN_REL
    typical = None if noise or dev < WARN_REL else typical_cancellation(ctx, r, in_max, dev)
    if typical is not None:  # the norm hides it: the typical element is noise
        return typical[0], typical[1], True
    if in_max / true_max <= 1 / (16 * u):
        return {}, "", False
    dt = dtype_name(r.dtype)
    ev = {"operand_absmax": in_max, "digits_cancelled": math.log2(in_max / true_max)}
    txt = (f" Catastrophic cancellation: operands of |max| {fmt(in_max)} give a result of |max| {fmt(true_max)}, "
           f"so ~{ev['digits_cancelled']:.0f} of the leading bits cancel and {dt}'s rounding of the operands "
           "dominates the result.")
    if noise:
        ev["output_deviation"] = dev
        txt += (f" The operands' rounding ({fmt(in_max * u)}) is as large as the true result: what the op returns "
                f"is rounding noise (a variance E[x^2] - E[x]^2 can come out 0 or negative), and the step's "
                f"{'loss' if ctx.target.losses and ctx.target.losses[0] is not None else 'output'} deviates from "
                f"fp32 by {dev:.1%}.")
    return ev, txt, noise


def _fixes(r: OpRecord, subnormal_inputs: bool, cancelling: bool) -> tuple[FixProposal, ...]:
    """Loss scaling for subnormal backward inputs, fp32 for the module, removing an offset, fp16 over bf16."""
    fixes = [keep_fp32_fix(r.module)] if r.module else []
    if subnormal_inputs and r.phase == "backward":
        fixes.insert(0, FixProposal(
            "use dynamic loss scaling so the gradients stay in the normal range",
            "scaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()", id="grad_scaler", params={}))
    if cancelling:
        fixes.append(FixProposal("remove the large common offset before the low-precision part (center or "
                                 "normalize the inputs in float32)", "x = (x.float() - x.float().mean(-1, "
                                 "keepdim=True)).to(x.dtype)"))
    if dtype_name(r.dtype) == "bfloat16":
        fixes.append(FixProposal("use float16 with loss scaling for this part: 3 more mantissa bits "
                                 "(u = 2**-11 instead of 2**-8)", id="switch_precision",
                                 params={"precision": "fp16-amp"}))
    return tuple(fixes)


def _argument(ctx: Context, r: OpRecord) -> tuple[OpRecord, float | None]:
    """r's first input, through casts without a reference of their own (autocast's float32 copy), and the median
    absolute difference of its sampled elements from the reference (None when not sampled)."""
    i = next((j for j in r.inputs if j >= 0), -1)
    arg = ctx.records[i]
    for _ in range(4):
        ups = [j for j in arg.inputs if j >= 0]
        if ctx.ref(arg) is not None or op_base(arg.op) not in CASTS or len(ups) != 1:
            break
        arg = ctx.records[ups[0]]
    ref = ctx.ref(arg)
    if ref is None or not arg.sample or len(arg.sample) != len(ref.sample):
        return arg, None
    d = sorted(abs(a - b) for a, b in zip(arg.sample, ref.sample) if math.isfinite(a) and math.isfinite(b))
    return arg, (d[(len(d) - 1) // 2] if d else None)


def _amplification(ctx: Context, r: OpRecord, inherited: float) -> tuple[dict[str, float], str]:
    """sin/cos/exp turn an argument's absolute error into the result's absolute (sin) or relative (exp) error."""
    if op_base(r.op) not in AMPLIFIERS or not any(i >= 0 for i in r.inputs):
        return {}, ""
    arg, measured = _argument(ctx, r)
    a = arg.stats.get("absmax", 0.0)
    err = measured if measured is not None else a * max(inherited, unit_roundoff(arg.dtype))
    unit = "radians of phase" if op_base(r.op) in PERIODIC else "which exp turns into the same relative error"
    return ({"argument_absmax": a, "argument_abs_error": err},
            f" {op_base(r.op)} amplifies its argument's error: arguments up to {fmt(a)} held in "
            f"{dtype_name(arg.dtype)} are off by {fmt(err)} (median) in absolute terms, {unit}"
            " -- compute the argument and the function in float32.")


def _elementwise_text(ctx: Context, r: OpRecord) -> str:
    ee = ctx.element_errors.get(r.index)
    if ee is None:
        return ""
    return (f" Element by element the median relative error against fp32 is {ee['p50']:.1%} (p99 {ee['p99']:.1%}, "
            f"max {ee['max']:.3g}, {int(ee['sign_flips'])} sign flip(s) in {int(ee['n'])} sampled elements).")


def _batch_note(ctx: Context, r: OpRecord) -> str:
    """When the values come from a batch tensor ampdoctor cast for the precision: say so."""
    prec = ctx.spec.precision or ""
    if prec.endswith("-amp") or not prec:
        return ""
    cast = [x for x in [r, *feeders(ctx.records, r, 6)] if x.kind == "batch" and is_low(x.dtype)]
    if not cast:
        return ""
    return (f" The batch feeding it was cast to {dtype_name(cast[0].dtype)} by precision '{prec}' (it casts the "
            "whole model and its floating inputs); under autocast ('-amp') inputs stay float32.")


def _decision_findings(ctx: Context) -> list[Candidate]:
    """Decision ops (argmax, topk, sort, ``max.dim``) whose choice differs from fp32 in some rows."""
    out: list[Candidate] = []
    for ch in ctx.decision_changes:
        d = ch["decision"]
        src = decision_source(ctx, d)
        if src is None or not (is_low(src.dtype) or any(dtype_name(x) in LOW for x in src.input_dtypes)):
            continue
        n, rows = len(ch["changed_rows"]), ch["rows"]
        dt = dtype_name(src.dtype)
        ev = base_evidence(src)
        ties_t, ties_r = ch["ties_target"], ch["ties_reference"]
        steers = decision_steers(ctx, d)
        ev.update({"decisions_changed": n, "rows": rows, "changed_fraction": n / max(rows, 1),
                   "changed_rows": ch["changed_rows"][:20], "examples": ch["examples"], "decision_op": d.op,
                   "decision_module": d.module, "ties_target": ties_t, "ties_reference": ties_r,
                   "indexed_by": steers})
        severe = steers > 0 and n >= 2 and n / max(rows, 1) >= DECISION_ERROR_FRACTION
        if op_base(d.op) in THRESHOLDS:
            if not severe:
                continue  # a mask that flips a near-threshold element in a few rows, or selects nothing, is noise
            ev["mask_note"] = _threshold_note(ctx, ch, src, ev)
        if ties_t is not None and ties_r is not None:
            ev["ties_created"] = max(0, ties_t - ties_r)
        if src.index in ctx.element_errors:
            ev["elementwise"] = ctx.element_errors[src.index]
        tie_txt = (f" {ev['ties_created']} row(s) hold exact ties in {dt} that fp32 tells apart (distinct values "
                   "that round to the same number)." if ev.get("ties_created") else "")
        rounding = input_rounding(ctx, d)
        if rounding is not None and rounding["producer"] == src.op:
            ev["input_rounding"] = rounding
            tie_txt += (f" The {op_base(rounding['softmax'])} after it is not what decides: its inputs sit on a common "
                        f"offset (|l| up to {fmt(rounding['input_absmax'])}, spread <= "
                        f"{fmt(rounding['input_spread'])}), so rounding them moves each probability by up to "
                        f"{fmt(rounding['carried'])} relatively, more than the softmax's own rounding "
                        f"({fmt(rounding['own'])}). Subtracting the offset (or the row max) before rounding, or these "
                        "logits in float32, keeps the choice.")
        expl = (f"{d.op} in {d.module or '<root>'} ({d.phase}, step 0) chooses differently from the fp32 reference "
                f"in {n} of {rows} row(s) (e.g. row {ch['examples'][0]['row']}: {ch['examples'][0]['target']} vs "
                f"{ch['examples'][0]['reference']}). The scores it compares come from {where(src)}, computed in "
                f"{dt} (u = {fmt(unit_roundoff(src.dtype))}): where candidates are closer than that rounding, the "
                f"pick changes although the tensor's norm agrees.{tie_txt}{ev.pop('mask_note', '')}"
                + _batch_note(ctx, src))
        if severe:
            expl += (f" The chosen indices select what is computed next ({steers} op(s) index with them: routing, a "
                     f"gather, a codebook lookup), so {n / rows:.0%} of the rows take a different path than in "
                     "float32 -- not rounding noise but a different computation.")
        fixes = [FixProposal("compute the scores that are compared in float32",
                             "scores = layer(x.float()) if needed; idx = scores.float().argmax(-1)")]
        keep = d.module if "input_rounding" in ev and d.module else src.module  # src's output is cast back
        if keep:
            fixes.insert(0, keep_fp32_fix(keep))
        out.append(Candidate(Finding(
            "precision-loss", "error" if severe else "warning", src.module, src.op, src.phase,
            f"{op_base(d.op)} picks differently in {dt} for {n}/{rows} rows in {d.module or '<root>'}", expl, ev,
            tuple(fixes), src.step), src.index))
    return out


def _threshold_note(ctx: Context, ch: dict[str, Any], src: OpRecord, ev: dict[str, Any]) -> str:
    """For a comparison's mask (rows shown as ``[true elements, sum of their positions]``): how far the kept sets'
    sizes moved, and the length of the running total / reduction that rounded the compared values."""
    moved = [abs(e["target"][0] - e["reference"][0]) for e in ch["examples"]]
    k = reduction_length(ctx, src)
    ev.update({"mask_row_format": "[true elements, sum of their positions]", "mask_size_change_max": max(moved),
               "reduction_length": k})
    txt = (f" Each row of the mask is shown as [true elements, sum of their positions]: the kept set moves by up to "
           f"{max(moved)} element(s) in the rows shown.")
    if k > 1:
        txt += (f" {op_base(src.op)} sums up to {k} terms in {dtype_name(src.dtype)}: its rounding grows with the "
                "length (a running total near the threshold drifts by many spacings), so compute it in float32.")
    return txt


def _skip_explained(ctx: Context) -> set[int]:
    """Records whose error another finding explains (flagged, saturated, underflowed, a rotary buffer, non-finite)."""
    return {r.index for r, *_ in ctx.precision_loss_records} | set(ctx.saturated_sources) | {
        r.index for r, *_ in ctx.underflow_origins} | {t.index for t, _ in ctx.trig_buffer_sources} | {
        i for i, e in ctx.relative_errors.items() if not math.isfinite(e)}


def _amplified_findings(ctx: Context) -> list[Candidate]:
    """sin/cos/exp whose elements are wrong because their low-precision argument was (at most five)."""
    out: list[Candidate] = []
    seen: set[int] = set()
    for amp, src, thr in amplified_records(ctx, _skip_explained(ctx)):
        if src.index in seen or len(out) >= 5:
            continue
        seen.add(src.index)
        ee = ctx.element_errors[amp.index]
        dt = dtype_name(src.dtype if is_low(src.dtype) else next(d for d in src.input_dtypes if dtype_name(d) in LOW))
        ev = base_evidence(src)
        own = ctx.element_errors.get(src.index)
        amp_ev, amp_txt = _amplification(ctx, amp, ctx.element_errors.get(src.index, {}).get("p50", 0.0))
        ev.update({"elementwise": ee, "amplifier_op": amp.op, "amplifier_module": amp.module, "threshold": thr,
                   **amp_ev})
        if own is not None and src.index != amp.index:
            ev["origin_elementwise"] = own
        head = (f"{where(amp)} is wrong element by element: the median relative error against fp32 is {ee['p50']:.1%} "
                f"(p99 {ee['p99']:.1%}, {int(ee['sign_flips'])} sign flip(s) in {int(ee['n'])} sampled elements; "
                f"flagged above {thr:.2g}) while the tensor's norm hardly shows it.")
        if src.index != amp.index:
            head += (f" Its argument comes from {where(src)}, computed in {dt}" + (
                f" (median element error {own['p50']:.1%} there)" if own is not None else "") + ".")
        out.append(Candidate(Finding(
            "precision-loss", "warning", src.module, src.op, src.phase,
            f"{op_base(amp.op)} amplifies {dt} rounding to {ee['p50']:.0%} per element in {amp.module or '<root>'}",
            head + amp_txt + _batch_note(ctx, src), ev, _fixes(src, False, False), src.step), src.index))
    return out


def _element_findings(ctx: Context) -> list[Candidate]:
    """Ops whose own median element error exceeds ``ELEMENT_WARN`` (norm and |max| hide it): at most five."""
    skip = _skip_explained(ctx)
    out: list[Candidate] = []
    seen: set[tuple[str, str, str]] = set()
    for r, e, inh in element_loss_records(ctx, skip):
        if (r.module, r.op, r.phase) in seen or len(out) >= 5:
            continue
        seen.add((r.module, r.op, r.phase))
        ee = ctx.element_errors[r.index]
        dt = dtype_name(r.dtype)
        ev = base_evidence(r)
        ev.update({"elementwise": ee, "inherited_p50": inh, "own_error": e - inh})
        expl = (f"{where(r)} is wrong element by element: the median relative error against fp32 is {e:.1%} "
                f"(p99 {ee['p99']:.1%}, max {ee['max']:.3g}, {int(ee['sign_flips'])} sign flip(s) in "
                f"{int(ee['n'])} sampled elements) while its inputs carried {inh:.2%}; the tensor's norm and |max| "
                "hardly show it.")
        cancel_ev, cancel_txt, noise = _cancellation(ctx, r, e - inh, output_deviation(ctx))
        amp_ev, amp_txt = _amplification(ctx, r, inh)
        ev.update({**cancel_ev, **amp_ev})
        expl += cancel_txt + amp_txt + _batch_note(ctx, r)
        out.append(Candidate(Finding(
            "precision-loss", "error" if noise else "warning", r.module, r.op, r.phase,
            (f"catastrophic cancellation in {r.module or '<root>'}: {op_base(r.op)} returns rounding noise in {dt}"
             if noise else f"{op_base(r.op)} loses {e - inh:.0%} per element in {dt} in {r.module or '<root>'}"),
            expl, ev, _fixes(r, False, bool(cancel_ev)), r.step), r.index))
    return out
