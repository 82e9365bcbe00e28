"""Pre-flight headroom: from one fp32 forward+backward, how much range each module has in each format.

>>> h = ampdoctor.headroom(model, batch)                 # doctest: +SKIP
>>> h.predicted_failures("fp16"), h.keep_fp32("fp16")    # doctest: +SKIP
(['encoder.block.0.layer.1.DenseReluDense.wo'], ['encoder.block.0.layer.1.DenseReluDense.wo'])

Margin in bits is ``log2(format max / |max|)``: negative means the value does not fit (it becomes inf, or is
clipped by a saturating fp8 cast). The flush fraction is the share of nonzero values below half the
format's smallest subnormal (they round to zero). Activations (forward) and gradients (backward) are judged;
weights are reported with the forward op that reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.precision._cuda_policy import DEVICE_KINDS, policy_for
from ampdoctor.precision._runner import run
from ampdoctor.precision._spec import StepSpec, make_spec
from ampdoctor.precision._step import saved_rng
from ampdoctor.trace import HEADROOM_FORMATS, HEADROOM_ONLY

FORMATS: tuple[str, ...] = tuple(name for name, _, _ in HEADROOM_FORMATS)
_MAX = {name: mx for name, mx, _ in HEADROOM_FORMATS}
#: margin (bits) under which a module is predicted to fail: fp16 overflow; fp8 recipes scale per tensor, so for
#: e4m3/e5m2 the relevant measure is the dynamic range (|max| / smallest nonzero) against the format's range
FLUSH_WARN = 0.5


@dataclass(frozen=True)
class HeadroomRow:
    """One module and phase: the largest and smallest magnitudes seen, and per format margin and flush."""

    module: str
    phase: str
    op: str
    absmax: float
    min_nonzero: float
    numel: int
    margin_bits: dict[str, float]
    flush_fraction: dict[str, float]
    #: per autocast device kind ("cuda", "cpu"): the largest |max| among the ops that autocast may run in the low
    #: dtype (all but its float32-listed ops, e.g. sum, softmax, pow); 0.0 when every op here runs in float32
    autocast_absmax: dict[str, float] = field(default_factory=dict)

    def margin(self, fmt: str, autocast: str | None = None) -> float:
        """Margin in bits in ``fmt``; with ``autocast`` ("cuda"/"cpu"), only of the ops autocast runs low."""
        if autocast is None:
            return self.margin_bits[fmt]
        amax = self.autocast_absmax.get(autocast, self.absmax)
        return math.log2(_MAX[fmt] / amax) if amax > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "phase": self.phase, "op": self.op, "absmax": self.absmax,
                "min_nonzero": self.min_nonzero if math.isfinite(self.min_nonzero) else None,
                "numel": self.numel, "margin_bits": self.margin_bits, "flush_fraction": self.flush_fraction,
                "autocast_absmax": self.autocast_absmax}


@dataclass(frozen=True)
class Headroom:
    rows: tuple[HeadroomRow, ...]
    loss: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def predicted_failures(self, fmt: str = "fp16", autocast: str | None = None) -> list[str]:
        """Modules whose forward or backward values exceed ``fmt``'s max (negative margin).

        ``autocast="cuda"`` (or ``"cpu"``) judges a ``*-amp`` run: ops that autocast runs in float32 under that
        device's policy are left out (their values never take the low dtype)."""
        _check_format(fmt)
        if autocast not in (None, *DEVICE_KINDS):
            raise ValueError(f"invalid autocast {autocast!r}, expected None or one of {', '.join(DEVICE_KINDS)}")
        out: list[str] = []
        for r in self.rows:
            if r.margin(fmt, autocast) < 0 and r.module not in out:
                out.append(r.module)
        return out

    def underflowing(self, fmt: str = "fp16", threshold: float = FLUSH_WARN) -> list[str]:
        """Modules where more than ``threshold`` of the nonzero values would flush to zero in ``fmt``."""
        _check_format(fmt)
        return sorted({r.module for r in self.rows if r.flush_fraction[fmt] > threshold})

    def keep_fp32(self, fmt: str = "fp16") -> list[str]:
        """Innermost modules to keep in fp32: forward overflow sites (their parents inherit the inf)."""
        bad = [r.module for r in self.rows if r.phase == "forward" and r.margin_bits[fmt] < 0]
        inner = [m for m in dict.fromkeys(bad) if not any(o != m and o.startswith(m + ".") for o in bad)]
        return inner

    def safe(self, fmt: str = "fp16") -> bool:
        return not self.predicted_failures(fmt)

    def to_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "rows": [r.to_dict() for r in self.rows],
                "predicted_failures": {f: self.predicted_failures(f) for f in FORMATS},
                "keep_fp32": {f: self.keep_fp32(f) for f in FORMATS}, "notes": list(self.notes)}


def _runs_fp32(op: str, device_kind: str) -> bool:
    """Whether autocast on ``device_kind`` runs ``op`` in float32 (its fp32 lists), from the policy registry."""
    try:
        return (policy_for(op, device_kind) or "").startswith("fp32")
    except (TypeError, ValueError):
        return False


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}, expected one of {', '.join(FORMATS)}")


def headroom(model: Any, batch: Any = None, *, loss_fn: Any = None, train_step: Any = None) -> Headroom:
    """Range headroom of every module in fp16, bf16, e4m3 and e5m2 from one fp32 forward+backward.

    Runs on a float32 copy with autocast disabled (the caller's objects are untouched; one host sync).
    """
    spec = make_spec(model, batch, loss_fn=loss_fn, train_step=train_step)
    return headroom_spec(spec)


def headroom_spec(spec: StepSpec) -> Headroom:
    spec = headroom_run_spec(spec)
    with saved_rng():
        res = run(spec, reference=True, headroom=True, request=HEADROOM_ONLY)  # read by headroom_from_run only
    return headroom_from_run(spec, res)


def headroom_run_spec(spec: StepSpec) -> StepSpec:
    """The spec :func:`headroom_spec` runs (traced, ``headroom=True``): ``spec``'s first forward and backward in
    float32, no optimizer step, no loss scaler."""
    from dataclasses import replace

    return replace(spec, steps=1, optimizer=None, scaler=None, precision=None)


def shares_reference(spec: StepSpec) -> bool:
    """Whether the diagnosis's float32 reference run of ``spec``, traced with ``headroom=True``, is also
    :func:`headroom_spec`'s run: one step, no loss scaler (its scaled backward would shift every gradient's range),
    the library's own step (a user ``train_step`` may depend on the optimizer headroom leaves out). Its first
    forward and backward are then the same ops on the same values; the optimizer step after them is ignored."""
    scaler = spec.scaler
    return spec.steps == 1 and spec.train_step is None and (scaler is None or not scaler.is_enabled())


def headroom_from_run(spec: StepSpec, res: Any) -> Headroom:
    """:class:`Headroom` from a float32 run traced with ``headroom=True`` (:func:`headroom_spec`'s own run, or a
    diagnosis's reference run when :func:`shares_reference`): forward and backward op records of step 0."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in res.trace.records:
        if r.kind != "op" or r.phase not in ("forward", "backward") or not r.stats or r.step != 0:
            continue
        s = r.stats
        if s.get("n_nan", 0) or s.get("n_posinf", 0) or s.get("n_neginf", 0) or s.get("n_at_max", 0):
            continue  # non-finite in fp32 or exactly at fp32's max: mask sentinels and log(0), not data range
        key = (r.module, r.phase)
        b = best.setdefault(key, {"absmax": 0.0, "op": r.op, "min_nonzero": math.inf, "numel": 0,
                                  "nonzero": 0.0, "autocast": dict.fromkeys(DEVICE_KINDS, 0.0),
                                  **{f"flush_{f}": 0.0 for f in FORMATS}})
        if s["absmax"] > b["absmax"]:
            b["absmax"], b["op"] = s["absmax"], r.op
        for kind in DEVICE_KINDS:
            if not _runs_fp32(r.op, kind):
                b["autocast"][kind] = max(b["autocast"][kind], s["absmax"])
        b["min_nonzero"] = min(b["min_nonzero"], s["min_nonzero"])
        b["numel"] += int(s["numel"])
        b["nonzero"] += s["numel"] - s["n_zero"]
        for f in FORMATS:
            b[f"flush_{f}"] += s.get(f"flush_{f}", 0.0)
    rows = []
    for (module, phase), b in best.items():
        margin = {f: (math.log2(_MAX[f] / b["absmax"]) if b["absmax"] > 0 else math.inf) for f in FORMATS}
        flush = {f: (b[f"flush_{f}"] / b["nonzero"] if b["nonzero"] else 0.0) for f in FORMATS}
        rows.append(HeadroomRow(module, phase, b["op"], b["absmax"], b["min_nonzero"], b["numel"], margin, flush,
                                b["autocast"]))
    loss = res.losses[0] if res.losses else None
    return Headroom(tuple(rows), loss, tuple(_notes(spec, res, loss)))


def _notes(spec: StepSpec, res: Any, loss: float | None) -> list[str]:
    """What makes the rows incomplete: a crash, or values that are non-finite already in float32."""
    import torch

    from ampdoctor.trace import iter_tensors

    notes = []
    if res.exc is not None:
        notes.append(f"the fp32 run raised {type(res.exc).__name__}: {res.exc}")
    # NaN (not -inf: additive attention masks are -inf by design) in the input makes the fp32 run non-finite
    bad = sum(int(torch.isnan(t).sum()) for t in iter_tensors(spec.batch) if t.is_floating_point())
    if bad:
        notes.append(f"the batch holds {bad} NaN value(s): the float32 run is non-finite from its input, so its "
                     "range cannot be judged; fix the data first")
    if loss is not None and not math.isfinite(loss):
        notes.append(f"the float32 loss is {loss}: the step is non-finite even in float32, which no precision "
                     "change fixes; values that are non-finite in float32 are left out of the rows")
    return notes
