"""``check``'s two tiers: when the float32 range pass and one cheaply observed target step are enough.

``ampdoctor check`` gates a model on one verdict: is there an error finding in ``spec.precision``? The full diagnosis
(fp32 reference and target, both full-tier traces, then every rule) answers it at ~15x a plain step. This module
decides, from mechanisms, whether that diagnosis can find anything that changes the verdict:

1. :func:`spec_reasons` -- what neither pass can stand for: a pure ``fp16``/``bf16`` run (every parameter, buffer,
   the batch and the optimizer state cast to 16 bits: lost updates, setup casts, 16-bit state), more than one step,
   an enabled ``GradScaler``, a user ``train_step``, transforms, trainable parameters outside the optimizer, 16-bit
   state already in the model or the optimizer,
   16-bit tensors in the batch (the reference upcasts them, so code computing in the batch's dtype outside
   autocast -- a noise schedule cast to the latents' dtype -- differs only in the target),
   a process group of several ranks (every rank must run the same collectives), modules declared fp32 for the
   format (``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict`` for both).
2. :func:`reference_reasons` -- from the float32 run of ``ampdoctor headroom`` (forward and backward, no optimizer
   step: an inf the update makes is the guard step's to see):
   a crash or a non-finite loss; NaN or float32's max in float32 (sentinels such as ``finfo(float32).min``, masked
   rows), an inf in float32 that reaches the backward, the optimizer or a forward-only output (a forward inf that
   is absorbed, T5's ``log(0)`` of its position buckets, is left to the guard step's comparison); a forward/backward
   finite value within one bit of the format's max (overflow, also one a clamp catches); a literal or scalar
   argument that is 0 or ±1 in the format but not in float32 (constant-out-of-range); integers (every sampled
   element, as the integer-values rule reads them) or a tensor made from no floating input (positions, ids cast to
   float) beyond the integers the format holds exactly; a decision (argmax, topk, argmin) whose indices select
   later values (an MoE router, a codebook lookup: the precision-loss rule compares its choices); trainable
   parameters with no gradient or outside the optimizer.
3. :func:`guard_step` -- the target step itself, on copies, under the cheap trace tier (one ``aminmax`` per op):
   it raised (a dtype mismatch under autocast, a literal that does not fit); any op output inf/NaN (also one
   absorbed downstream) of a kind (NaN, +inf, -inf) that its float32 twin (same phase, module, op and occurrence)
   does not hold; the loss (or output |max|) off by more than 1% from float32; a parameter whose gradient
   is exactly zero in the target and not in float32; a sin/cos or softmax whose float32 argument is large enough
   that the format's rounding at its magnitude can move it by a phase or a logit difference (a timestep before its
   sinusoid, an ALiBi bias), when the target held a value on its way in low precision that could be that rounding
   (for a softmax: one that adds an offset -- a cast, an add, a GEMM's bias -- not a product such as an LM head
   without a bias, whose rounding scales with the differences). That one is decided from MEASURED errors: the guard
   step samples the argument and its possible rounding sites (:class:`~ampdoctor.trace.KeyedSamples`, at the
   positions the float32 run sampled: :func:`reference_request`) and escalates only when the argument is off by what
   the rule reads and a site could carry the rule's share of it (within :data:`MEASURED_SLACK`); what it cannot
   measure is bounded by its size, as before. These are the error conditions of the rules that compare
   the runs: saturation (dead gradients, or a pole's inf), underflow (dead gradients, the loss, an inf/NaN it feeds;
   flushed values without such a consequence are a warning), overflow and nan-from-inf (an inf, also one a clamp
   catches: the clamp's input holds it), precision-loss (a NaN from finite inputs, a loss off by 5%).

Any reason runs the full diagnosis; none means the quick pass is the answer (the report says which). Warnings
and infos the full diagnosis would add (precision-loss measures, decision changes) do not gate ``check``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ampdoctor.precision._contexts import map_batch
from ampdoctor.precision._rounded_args import (  # (the rule's thresholds, re-exported: equal by test to findings')
    ABS_ARG_DEPTH,  # noqa: F401
    ABS_ARG_LOST,
    ABS_ARG_SENTINEL,  # noqa: F401
    ABS_ARG_SLACK,
    MEASURED_SLACK,
    argument_candidates,
    argument_reasons,
    keyed,
    sample_keys,
)
from ampdoctor.precision._runner import RunResult
from ampdoctor.precision._spec import StepSpec
from ampdoctor.precision._step import Observer, StepLoop, prepare, saved_rng
from ampdoctor.trace import (
    HALF_DTYPES,
    HEADROOM_ONLY,
    KeyedSamples,
    Kind,
    Request,
    Trace,
    TraceResult,
    dtype_info,
    dtype_limits,
    op_base,
    ops_with,
    unit_roundoff,
)

#: the precisions the quick pass can judge, and their low dtype (autocast keeps fp32 parameters and state); the
#: dtype comes from the dtype registry (``fp16-amp`` -> ``fp16``), not a table of our own
QUICK: dict[str, torch.dtype] = {p: dtype_info(p.removesuffix("-amp")).dtype  # type: ignore[union-attr]
                                 for p in ("fp16-amp", "bf16-amp")}
#: a value this many bits below the format's max is still safe after the target's rounding (2x: one bit)
MARGIN_BITS = 1.0
#: relative loss (or output |max|) deviation of the target from float32 that triggers the diagnosis
LOSS_REL = 0.01
#: at most this many reasons are kept (the first ones, in the order above)
MAX_REASONS = 8


@dataclass(frozen=True)
class Triage:
    """Why ``check`` ran the full diagnosis (``reasons``), or what the quick pass measured when it did not."""

    precision: str | None
    reasons: tuple[str, ...]
    #: the guard step's numbers (``loss``, ``reference_loss``, ``ops``): empty when it did not run
    guard: dict[str, Any] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return bool(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "full_diagnosis": self.full, "reasons": list(self.reasons),
                "guard": self.guard}


def spec_reasons(spec: StepSpec) -> list[str]:
    """What the quick pass cannot stand for, from the spec alone (before anything runs)."""
    out: list[str] = []
    if spec.precision not in QUICK:
        out.append(f"{spec.precision or 'as-given'} is judged by its full run only (the quick pass covers "
                   f"{', '.join(QUICK)}: autocast keeps float32 parameters and optimizer state)")
    if spec.steps != 1:
        out.append(f"{spec.steps} steps: the range pass sees the first step only")
    if spec.scaler is not None and spec.scaler.is_enabled():
        out.append("an enabled GradScaler: scaled gradients and skipped steps are judged by the full run")
    if spec.train_step is not None:
        out.append("a user train_step: its own code (clipping, scaling, updates) is judged by the full run")
    if spec.transforms:
        out.append("transforms (a fix being verified)")
    if spec.optimizer is not None:
        stepped = {id(p) for g in spec.optimizer.param_groups for p in g["params"]}
        left = [n for n, p in spec.model.named_parameters() if p.requires_grad and id(p) not in stepped]
        if left:
            out.append(f"{len(left)} trainable parameter(s) are not in the optimizer ({left[0]}, ...)")
    low = sorted({str(t.dtype).replace("torch.", "") for t in _state(spec) if t.dtype in HALF_DTYPES})
    if low:
        out.append(f"the model or optimizer already holds {'/'.join(low)} state (lost updates, 16-bit parameters)")
    low_in = _batch_low_dtypes(spec.batch)
    if low_in:  # the reference upcasts them: code that casts to the batch's dtype (a schedule) runs fp32 there
        out.append(f"the batch holds {'/'.join(sorted(low_in))} tensors: code computing in the batch's dtype "
                   "outside autocast is judged by the full run")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out.append("a torch.distributed process group of several ranks: every rank runs the same diagnosis")
    inner = getattr(spec.model, "module", spec.model)
    declared = getattr(inner, "_keep_in_fp32_modules_strict", None) or (
        QUICK.get(spec.precision or "") == torch.float16 and getattr(inner, "_keep_in_fp32_modules", None))
    if declared:  # as transformers: the plain list guards fp16 only, the strict one bf16 too
        out.append(f"the model declares modules to keep in float32 for {spec.precision} ({', '.join(declared)}): "
                   "must-stay-fp32 turns a precision loss there into an error")
    return out


def _batch_low_dtypes(batch: Any) -> set[str]:
    found: set[str] = set()

    def note(t: torch.Tensor) -> torch.Tensor:
        if t.dtype in HALF_DTYPES:
            found.add(str(t.dtype).replace("torch.", ""))
        return t

    map_batch(batch, note)
    return found


def _state(spec: StepSpec) -> list[torch.Tensor]:
    ts = [t for t in list(spec.model.parameters()) + list(spec.model.buffers()) if t.is_floating_point()]
    if spec.optimizer is not None:
        ts += [v for st in spec.optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return ts


def reference_reasons(ref: RunResult, precision: str) -> list[str]:
    """What the float32 run (full tier, headroom flush counts) shows the target may get wrong."""
    dtype = QUICK[precision]
    fmt = "fp16" if dtype == torch.float16 else "bf16"
    fmax = dtype_limits(dtype)[0]
    f32max = dtype_limits(torch.float32)[0]
    exact = 1.0 / unit_roundoff(dtype)  # the largest integer below which every integer is exact: 2048, 256
    out: list[str] = []
    if ref.exc is not None:
        out.append(f"the float32 run raised {type(ref.exc).__name__}")
    if any(loss is not None and not math.isfinite(loss) for loss in ref.losses):
        out.append("the float32 loss is not finite")
    outputs = set(ref.output_records) if ref.forward_only else set()
    for r in ref.trace.records:
        s = r.stats
        if not s or r.kind == "alloc":
            continue
        where = f"{r.op or r.kind} in {r.module or '<root>'} ({r.phase})"
        sentinel = bool(s.get("n_at_max", 0)) or s.get("absmax", 0.0) >= f32max
        if s.get("n_nan", 0):
            out.append(f"{where} holds NaN already in float32")
        elif (sentinel or s.get("n_posinf", 0) or s.get("n_neginf", 0)) and (
                r.phase != "forward" or r.index in outputs):
            out.append(f"{where} holds inf or float32's max already in float32, and it reaches a gradient, update or "
                       "output")
        if r.phase in ("forward", "backward"):
            # a forward inf or float32-max sentinel (T5's log(0) buckets, its finfo(float32).min mask) is the guard
            # step's to compare: it matters where the target computes it in the low dtype (inf there, or a raise)
            out += _range_reasons(r, s, fmt, dtype, fmax, exact, where, sentinel)
        out = list(dict.fromkeys(out))  # the same op in the same module (views of one value) once
        if len(out) >= MAX_REASONS:
            break
    out += _routing_reasons(ref.trace)
    cov = ref.coverage[0] if ref.coverage and not ref.forward_only else []
    unused = [p.name for p in cov if p.grad_none or not p.in_optimizer]
    if unused:
        out.append(f"{len(unused)} trainable parameter(s) get no gradient ({unused[0]}, ...)")
    return out[:MAX_REASONS]


def _range_reasons(r: Any, s: dict[str, float], fmt: str, dtype: torch.dtype, fmax: float, exact: float,
                   where: str, sentinel: bool) -> list[str]:
    """One forward/backward record of the float32 run: overflow, literals, integers (``sentinel``: it holds
    float32's max, which hides the range of its other values: the guard step judges it)."""
    out = []
    absmax = 0.0 if sentinel else s.get("absmax", 0.0)
    if absmax > fmax / 2 ** MARGIN_BITS:
        out.append(f"{where}: |max| {absmax:.4g} within {MARGIN_BITS:g} bit of {fmt}'s max {fmax:.4g}")
    for v in tuple(r.scalars) + tuple(v for _, v in r.literals):
        if _changes_class(v, dtype):
            out.append(f"{where}: the constant {v:g} is {_round(v, dtype):g} in {fmt}")
            break
    if absmax > exact and (_integers(r.sample, exact) or (r.kind in ("op", "batch", "input") and not r.inputs)):
        out.append(f"{where}: integers (every sampled element) or a tensor made from no floating input (positions, "
                   f"ids) with |max| {absmax:.4g} above {exact:g}, the largest integer {fmt} holds exactly")
    return out


def _routing_reasons(trace: TraceResult) -> list[str]:
    """A decision (argmax, topk, argmin) whose chosen indices pick later values (``x[idx]``, a gather, an embedding
    lookup: an MoE router, a VQ codebook): the low precision can change the choice, which the precision-loss rule
    compares index by index and the cheap guard step does not see."""
    gathers = ops_with(Kind.GATHERS)
    used = {i for r in trace.records if op_base(r.op) in gathers for i in r.index_src}
    for d in trace.decisions:
        if d.input_index in used:
            return [f"{d.op} in {d.module or '<root>'} chooses indices that select later computation (routing, a "
                    "lookup): rounding its scores can change the choice"]
    return []


def reference_request(precision: str) -> Request:
    """What ``check``'s float32 run computes (:data:`~ampdoctor.trace.HEADROOM_ONLY`, read by ``headroom`` and this
    module), with element samples of every output large enough to be a rounding site the guard step measures
    (:func:`argument_reasons`; smaller ones are ruled out by their size alone)."""
    u = unit_roundoff(QUICK[precision])
    site = min(ABS_ARG_LOST.values()) / (2 * ABS_ARG_SLACK * MEASURED_SLACK * u)
    return replace(HEADROOM_ONLY, samples_above=min(HEADROOM_ONLY.samples_above, site))


def _integers(sample: Any, exact: float) -> bool:
    """The trace's element sample holds only integers, two distinct magnitudes of them beyond ``exact`` (what the
    integer-values rule reads)."""
    vals = [v for v in sample if math.isfinite(v)]
    return bool(vals) and all(v == int(v) for v in vals) and len({abs(v) for v in vals if abs(v) > exact}) >= 2


def _round(v: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(dtype))


def _changes_class(v: float, dtype: torch.dtype) -> bool:
    """A finite number that is 0 or ±1 in ``dtype`` without being so in float32. (One that is inf there, a
    ``-1e9`` fill, either raises or makes an inf in a low-precision tensor, which the guard step sees; in a float32
    tensor of the target it is harmless.)"""
    if not math.isfinite(v) or v == 0:
        return False
    r = _round(v, dtype)
    return r == 0 or (abs(r) == 1.0 and abs(v) != 1.0)


class _Guard(Observer):
    """The cheap trace tier around the target step, plus which parameters get an all-zero gradient."""

    def __init__(self, prep: Any, sample: set[tuple[str, str, str, int]]) -> None:
        self.tr = Trace(prep.model, prep.optimizer, full=False)
        self.samples = KeyedSamples(self.tr.mode, sample) if sample else None  # above the trace: after its records
        self.model = prep.model
        self.zero: list[tuple[str, Any]] = []

    def context(self, loop: StepLoop) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self.tr)
        if self.samples is not None:
            stack.enter_context(self.samples)
        return stack

    def step_start(self, loop: StepLoop, step: int) -> None:
        self.tr.set_step(step)

    def forward_done(self, loop: StepLoop, step: int, output: Any, loss: Any) -> None:
        self.tr.mark("output", output)

    def grads_ready(self, loop: StepLoop, step: int) -> None:
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self.zero.append((name, None if p.grad is None else torch.count_nonzero(p.grad) == 0))


def guard_step(spec: StepSpec, ref: RunResult, *, policy: str = "cuda") -> tuple[list[str], dict[str, Any]]:
    """Run ``spec``'s target step once under the cheap trace tier (on copies) and compare it with ``ref``."""
    dtype = QUICK[str(spec.precision)]
    cands = argument_candidates(ref.trace, dtype)  # their arguments and rounding sites are sampled
    with saved_rng():
        prep = prepare(spec, reference=False)
        guard = _Guard(prep, sample_keys(ref.trace.records, cands))
        done = StepLoop(spec, prep, policy=policy, observers=(guard,)).run(1)
    res = guard.tr.result()
    samples = guard.samples.result() if guard.samples is not None else {}
    out: list[str] = []
    if done.exc is not None:
        out.append(f"the {spec.precision} step raised {type(done.exc).__name__}: {str(done.exc)[:200]}")
    twins = _occurrences(ref.trace.records)
    for key, r in keyed(res.records, ops_only=False):
        lo, hi = r.stats.get("min", 0.0), r.stats.get("max", 0.0)
        twin = twins.get(key)
        where = f"{r.op} in {r.module or '<root>'} ({r.phase})"
        if not (math.isfinite(lo) and math.isfinite(hi)) and not _same_kinds(lo, hi, twin):
            out.append(f"{where} made inf/NaN in the {spec.precision} step that its float32 twin does not hold")
            break
    loss = done.losses[0] if done.losses else None
    ref_loss = ref.losses[0] if ref.losses else None
    if loss is not None and ref_loss is not None and _rel(loss, ref_loss) > LOSS_REL:
        out.append(f"the {spec.precision} loss {loss:.6g} is {_rel(loss, ref_loss):.1%} off float32's {ref_loss:.6g}")
    t_out = _output_absmax(res.records, res.marks.get("output", []), "min", "max")
    r_out = _output_absmax(ref.trace.records, ref.output_records, "absmax", "absmax")
    if loss is None and t_out is not None and r_out is not None and _rel(t_out, r_out) > LOSS_REL:
        out.append(f"the {spec.precision} output |max| {t_out:.6g} is {_rel(t_out, r_out):.1%} off float32's")
    out += _zeroed(guard.zero, ref)
    out += argument_reasons(ref.trace, res.records, dtype, "fp16" if dtype == torch.float16 else "bf16", samples)
    return out, {"loss": loss, "reference_loss": ref_loss, "ops": len(res.records), "samples": len(samples)}


def _occurrences(records: list[Any]) -> dict[tuple[str, str, str, int], dict[str, float]]:
    """The float32 run's op records' statistics by :func:`_keyed`'s key."""
    return {key: r.stats for key, r in keyed(records)}


def _same_kinds(lo: float, hi: float, twin: dict[str, float] | None) -> bool:
    """A target record's non-finite kinds (NaN, -inf, +inf from its ``aminmax``) are all in its float32 twin."""
    if twin is None:
        return False
    if math.isnan(lo) or math.isnan(hi):
        return bool(twin.get("n_nan", 0))
    return (lo != -math.inf or bool(twin.get("n_neginf", 0))) and (hi != math.inf or bool(twin.get("n_posinf", 0)))


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _output_absmax(records: list[Any], idx: list[int], lo: str, hi: str) -> float | None:
    vals = [max(abs(records[i].stats.get(lo, 0.0)), abs(records[i].stats.get(hi, 0.0))) for i in idx
            if 0 <= i < len(records) and records[i].stats]
    return max(vals) if vals else None


def _zeroed(zero: list[tuple[str, Any]], ref: RunResult) -> list[str]:
    """Parameters whose gradient is None or all zero in the target where float32's is not (one host read)."""
    ref_zero = {p.name: p.grad_zero for p in (ref.coverage[0] if ref.coverage else [])}
    known = [(n, z) for n, z in zero if z is not None]
    flags = dict(zip([n for n, _ in known], torch.stack([z for _, z in known]).tolist() if known else []))
    bad = [n for n, z in zero if (z is None or flags.get(n)) and n in ref_zero
           and ref_zero[n] is not None and ref_zero[n] < 1.0]
    if not bad:
        return []
    return [f"{len(bad)} parameter(s) get an all-zero or no gradient in the target but not in float32 ({bad[0]}, ...)"]
