"""Detectors: small registered functions over what one step's read-back told the guard.

Each detector subscribes to one event type (a loss read back, a step's gradient norms, a step closed, a scale
read back, lost-update counts) and returns the anomalies it sees (:class:`Detection`), updating the run-wide
accumulators in :class:`DetectorState` (gradient coverage, lost updates, loss-scale health). Registration
rejects duplicate names; detectors of one event run in registration order.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ampdoctor.watch._options import Kind, WatchOptions
from ampdoctor.watch._record import LostUpdates, StepRecord

log = logging.getLogger("ampdoctor.watch")

#: grad-spike records and scale changes kept for the report (a window: memory stays flat)
WINDOW = 32


@dataclass(frozen=True)
class Detection:
    kind: Kind
    record: StepRecord
    message: str
    #: the first step of what was detected (a run of GradScaler-skipped steps: its first skip), when earlier
    first_step: int | None = None


# ---------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class LossSeen:
    record: StepRecord
    value: float
    late: bool          # read after the step's optimizer update (or after GradScaler skipped it)
    micro: bool = False     # one of several losses of the step (a micro-batch's)


@dataclass(frozen=True)
class GradsSeen:
    record: StepRecord
    names: tuple[str, ...]
    norms: tuple[float, ...]


@dataclass(frozen=True)
class ScaleSeen:
    record: StepRecord
    value: float


@dataclass(frozen=True)
class StepClosed:
    record: StepRecord


@dataclass(frozen=True)
class LostSeen:
    names: tuple[str, ...]
    counts: tuple[float, ...]


@dataclass(frozen=True)
class ProbeSeen:
    record: StepRecord
    names: tuple[str, ...]      # in backward order
    flags: tuple[float, ...]    # 1: the gradient held inf/NaN


Event = LossSeen | GradsSeen | ScaleSeen | StepClosed | LostSeen | ProbeSeen


@dataclass
class ScaleHealth:
    """GradScaler over the whole run (counters, not a window): skipped steps, runs of skips, the scale's path."""

    steps: int = 0
    skipped: int = 0
    run: int = 0
    run_start: int = -1
    longest: int = 0
    longest_start: int = -1
    peak: float | None = None
    last: float | None = None
    lowest: float | None = None
    #: skips from step 0 until the first applied step (GradScaler calibrating a too-large initial scale)
    initial_run: int = 0
    calibrating: bool = True
    #: the parameters whose gradients overflowed in a skipped step, first in backward order (probe), and that step
    overflow_params: tuple[str, ...] = ()
    overflow_params_step: int = -1
    changes: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=4 * WINDOW))

    @property
    def skip_rate(self) -> float:
        return self.skipped / self.steps if self.steps else 0.0


@dataclass
class DetectorState:
    """What detectors remember between steps; bounded whatever the run's length."""

    options: WatchOptions
    backoff: float = 0.5
    #: exact confirmation of non-finite gradients (a device read, on the anomaly path only)
    confirm_nonfinite: Callable[[Sequence[str]], tuple[str, ...]] = lambda names: tuple(names)
    owners: dict[str, str] = field(default_factory=dict)
    norm_history: deque[float] = field(default_factory=deque)
    spikes: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    n_spikes: int = 0
    coverage_open: bool = True
    zero_grads: dict[str, bool] = field(default_factory=dict)
    #: the reduced dtype the step's backward ran in ("float16"/"bfloat16": autocast, else the parameters), or None
    backward_dtype: Callable[[], str | None] = lambda: None
    #: that dtype when parameters reached by the graph ended the coverage steps with exactly-zero gradients
    zero_dtype: str | None = None
    lost: LostUpdates = field(default_factory=LostUpdates)
    health: ScaleHealth = field(default_factory=ScaleHealth)
    skip_run: list[StepRecord] = field(default_factory=list)
    #: detectors that raised: dropped for the rest of the run (one warning each), the others go on
    broken: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.norm_history = deque(self.norm_history, maxlen=self.options.spike_window)


E = TypeVar("E")
Detector = Callable[[Any, DetectorState], list[Detection]]
DETECTORS: dict[type, list[tuple[str, Detector]]] = {}
_NAMES: set[str] = set()


def detector(name: str, event: type) -> Callable[[Detector], Detector]:
    """Register ``fn(event, state) -> [Detection, ...]`` for ``event``; a second detector named ``name`` is an error."""
    def register(fn: Detector) -> Detector:
        if name in _NAMES:
            raise ValueError(f"a watch detector named {name!r} is already registered")
        _NAMES.add(name)
        DETECTORS.setdefault(event, []).append((name, fn))
        return fn
    return register


def run_detectors(event: Event, state: DetectorState) -> list[Detection]:
    out: list[Detection] = []
    for name, fn in DETECTORS.get(type(event), ()):
        if name in state.broken:
            continue
        try:
            out.extend(fn(event, state))
        except Exception as exc:  # noqa: BLE001 - one broken detector must not blind the others
            state.broken.add(name)
            log.warning("the %r detector failed (%s: %s) and is off for the rest of the run; "
                        "the other checks go on. Please report this with the traceback.", name,
                        type(exc).__name__, exc, exc_info=exc)
    return out


def is_spike(norm: float, previous: Sequence[float], factor: float, min_history: int = 5) -> tuple[bool, float]:
    """``norm > factor * median(previous)``; returns ``(spike, median)``. Needs ``min_history`` finite norms."""
    if len(previous) < min_history or not math.isfinite(norm):
        return False, math.nan
    med = statistics.median(previous)
    return med > 0 and norm > factor * med, med


# ---------------------------------------------------------------------------------------------- detectors
@detector("loss", LossSeen)
def _loss(e: LossSeen, s: DetectorState) -> list[Detection]:
    if e.record.loss is None or math.isfinite(e.record.loss):   # several micro-batch losses: a NaN one stays
        e.record.loss = e.value
    if math.isfinite(e.value):
        return []
    return [Detection("nonfinite-loss", e.record, f"the loss is {e.value} at step {e.record.step}{_when(e)}"
                      + "; replay the reproducer (or use on_anomaly='replay') to find the op where it starts.")]


def _when(e: LossSeen) -> str:
    """What the data says about the loss: a micro-batch's, a step GradScaler skipped, read after the update."""
    what = ["a micro-batch loss"] if e.micro else []
    if e.record.skipped:
        what.append("GradScaler skipped the step's update")
    elif e.late:
        what.append("seen after its optimizer step")
    return f" ({'; '.join(what)})" if what else ""


@detector("coverage", GradsSeen)
def _coverage(e: GradsSeen, s: DetectorState) -> list[Detection]:
    """Gradients exactly zero in every coverage step. A parameter with a gradient tensor is reached by the autograd
    graph: in a reduced-precision backward its zeros may be values that flushed below the format's smallest
    subnormal (fp16: 2**-24), so the last coverage step is a ``zero-grads`` anomaly for a replay to compare with
    fp32 (it names the op where they flushed, or finds them zero in fp32 too)."""
    if not s.coverage_open or e.record.skipped:
        return []
    for n, x in zip(e.names, e.norms):
        s.zero_grads[n] = s.zero_grads.get(n, True) and x == 0.0
    if e.record.step + 1 < s.options.coverage_steps or s.zero_dtype is not None:
        return []
    zero = [n for n in e.names if s.zero_grads.get(n)]
    dtype = s.backward_dtype() if zero else None
    if dtype is None:
        return []
    s.zero_dtype = dtype
    owners = list(dict.fromkeys(s.owners.get(n, "") or "<root>" for n in zero))
    return [Detection(
        "zero-grads", e.record,
        f"the gradients of {len(zero)} parameter(s) (modules: {', '.join(owners[:4])}) were exactly zero in each of "
        f"the first {e.record.step + 1} step(s) of a {dtype} backward although the graph reaches them: gradient "
        "underflow is likely (values below the format's smallest subnormal flush to 0); a replay against fp32 "
        "names the op where they flush.")]


@detector("gradients", GradsSeen)
def _gradients(e: GradsSeen, s: DetectorState) -> list[Detection]:
    rec = e.record
    if rec.skipped:        # GradScaler (fused path) found inf/NaN and skips this update: its verdict stands
        return []
    bad = [n for n, x in zip(e.names, e.norms) if not math.isfinite(x)]
    # a per-tensor fp32 norm can overflow for finite, huge gradients: confirm exactly (anomaly path only)
    rec.nonfinite_params = s.confirm_nonfinite(bad) if bad else ()
    rec.grad_norm = math.sqrt(math.fsum(x * x for x in e.norms)) if not bad else math.inf
    if not rec.nonfinite_params:
        return []
    # backward runs from the loss towards the inputs: the first gradient to turn non-finite belongs to the LAST
    # affected module in parameter (≈ forward) order, so that one is named first (nearest the origin)
    owners = list(dict.fromkeys(s.owners.get(n, "") or "<root>" for n in reversed(rec.nonfinite_params)))
    return [Detection(
        "nonfinite-grads", rec,
        f"non-finite gradients at step {rec.step} in {len(rec.nonfinite_params)} parameter(s) "
        f"(modules nearest the origin first: {', '.join(owners[:4])}; parameters: "
        f"{', '.join(list(reversed(rec.nonfinite_params))[:4])}); an optimizer step now writes "
        "them into the weights. Replay the reproducer (or use on_anomaly='replay') to find the op where they "
        "start; on_anomaly='skip' drops such steps.")]


@detector("spikes", GradsSeen)
def _spikes(e: GradsSeen, s: DetectorState) -> list[Detection]:
    rec = e.record
    if rec.skipped or rec.nonfinite_params or rec.grad_norm is None:
        return []
    total = rec.grad_norm
    spike, med = is_spike(total, list(s.norm_history), s.options.grad_spike_factor)
    if math.isfinite(total):
        s.norm_history.append(total)
    if not spike and math.isfinite(total):
        return []
    rec.spike = True
    s.n_spikes += 1
    s.spikes.append({"step": rec.step, "grad_norm": total, "median": med})
    factor = s.options.grad_spike_factor
    msg = (f"gradient norm {total:.4g} at step {rec.step} is {total / med:.1f}x the running median {med:.4g} "
           f"(threshold {factor:g}x)" if math.isfinite(med) and med > 0 and math.isfinite(total) else
           f"gradient norm overflowed fp32 at step {rec.step}")
    return [Detection("grad-spike", rec, msg)]


@detector("lost-updates", LostSeen)
def _lost_updates(e: LostSeen, s: DetectorState) -> list[Detection]:
    for i, name in enumerate(e.names):
        s.lost.add(name, e.counts[2 * i], e.counts[2 * i + 1])
    return []


@detector("scale-trajectory", ScaleSeen)
def _scale_trajectory(e: ScaleSeen, s: DetectorState) -> list[Detection]:
    e.record.scale = e.value
    h = s.health
    if h.last != e.value:
        h.changes.append((e.record.step, e.value))
    h.last = e.value
    if e.record.step >= h.initial_run and not (h.calibrating and e.record.skipped):   # after the calibration
        h.peak = e.value if h.peak is None else max(h.peak, e.value)
    h.lowest = e.value if h.lowest is None else min(h.lowest, e.value)
    return []


@detector("overflowing-params", ProbeSeen)
def _overflowing_params(e: ProbeSeen, s: DetectorState) -> list[Detection]:
    bad = tuple(n for n, f in zip(e.names, e.flags) if f > 0)
    if bad and not s.health.overflow_params:
        s.health.overflow_params, s.health.overflow_params_step = bad, e.record.step
    return []


def collapse_due(s: DetectorState) -> bool:
    """True when closing one more skipped step reaches ``collapse_steps`` (its scales must be read first)."""
    return s.health.run + 1 == s.options.collapse_steps


@detector("skipped-steps", StepClosed)
def _skipped_steps(e: StepClosed, s: DetectorState) -> list[Detection]:
    rec, h = e.record, s.health
    h.steps += 1
    if h.calibrating:
        if rec.skipped:
            h.initial_run += 1
        else:
            h.calibrating = False
    if not rec.skipped:
        h.run = 0
        s.skip_run = []
        return []
    h.skipped += 1
    if h.run == 0:
        h.run_start = rec.step
    h.run += 1
    if len(s.skip_run) < s.options.collapse_steps:
        s.skip_run.append(rec)
    if h.run > h.longest:
        h.longest, h.longest_start = h.run, h.run_start
    if h.run != s.options.collapse_steps:
        return []
    run = s.skip_run
    scales = [r.scale for r in run if r.scale is not None]
    fell = f"from {scales[0]:g} to {scales[-1] * s.backoff:g} " if scales else ""
    # from step 0 on, with no update applied yet: maybe GradScaler calibrating a too-large initial scale
    start = (f"the first {len(run)}" if h.calibrating else str(len(run)))
    why = ("At the start of fp16 training that is GradScaler calibrating a too-large initial scale, harmless if it "
           "stops soon; if it goes on, some op" if h.calibrating else "The weights stopped changing. Some op")
    bad = next((r.step for r in run if r.loss is not None and not math.isfinite(r.loss)), None)
    if bad is not None and h.calibrating:   # loss scaling never touches the loss: an inf/NaN loss is no calibration
        why = (f"The loss itself was inf/NaN from step {bad}, which loss scaling never causes (it scales only the "
               "gradients): not GradScaler calibrating. The weights stopped changing. Some op")
    return [Detection(
        "loss-scale-collapse", rec,
        f"GradScaler skipped {start} consecutive optimizer steps ({run[0].step}..{rec.step}) because the "
        f"gradients held inf/NaN{'; the loss scale fell ' + fell.rstrip() if fell else ''}. {why} produces "
        "non-finite gradients at every scale: replay the reproducer (or use on_anomaly='replay') to locate it, "
        "or try bf16 autocast.", run[0].step)]


__all__ = ["DETECTORS", "Detection", "DetectorState", "GradsSeen", "LossSeen", "LostSeen", "ProbeSeen", "ScaleHealth",
           "ScaleSeen", "StepClosed", "collapse_due", "detector", "is_spike", "run_detectors"]
