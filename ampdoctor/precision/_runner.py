"""The diagnosis's runs: the shared step (:mod:`ampdoctor.precision._step`) observed by the trace.

``run(spec, reference=...)`` prepares one copy, runs ``spec.steps`` steps with :class:`_TraceObserver` and
returns a :class:`RunResult`: the trace, losses, gradient coverage, dtypes and scales.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.precision._distributed import wrapper_kind
from ampdoctor.precision._heap import release_free_heap
from ampdoctor.precision._input_errors import input_error
from ampdoctor.precision._shared_copy import SharedCopy
from ampdoctor.precision._spec import StepSpec
from ampdoctor.precision._step import (
    LOW_DTYPES,
    Observer,
    Prepared,
    StepLoop,
    prepare,
)
from ampdoctor.trace import (
    FULL,
    HALF_DTYPES,
    REFERENCE,
    REFERENCE_HEADROOM,
    Request,
    Trace,
    TraceResult,
    dtype_info,
    dtype_name,
    is_nonfinite,
    iter_tensors,
)

log = logging.getLogger(__name__)


@dataclass
class ParamState:
    """A trainable parameter's state after a backward pass."""

    name: str
    owner: str
    dtype: str
    requires_grad: bool
    grad_none: bool
    in_optimizer: bool
    grad_dtype: str = ""
    grad_zero: Any = None  # fraction of exactly-zero grad elements (a float; off the host a device tensor until read)


@dataclass
class RunResult:
    """One run (target or reference) of the spec's steps."""

    label: str
    precision: str | None
    trace: TraceResult
    losses: list[float | None] = field(default_factory=list)
    loss_records: list[int | None] = field(default_factory=list)
    output_records: list[int] = field(default_factory=list)
    forward_only: bool = False
    exc: BaseException | None = None
    exc_step: int | None = None
    exc_traceback: str = ""
    coverage: list[list[ParamState]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    param_dtypes: dict[str, str] = field(default_factory=dict)
    optimizer_state_dtypes: dict[str, list[str]] = field(default_factory=dict)
    optimizer_info: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    owners: dict[str, str] = field(default_factory=dict)
    keep_fp32: list[str] = field(default_factory=list)
    models: Any = None
    #: per-tensor fp8 statistics when the precision is emulated fp8 (:class:`ampdoctor.precision.Fp8Stats`)
    fp8: Any = None
    #: per step, the norm of all gradients as ``optimizer.step`` read them (NaN: no optimizer step); only with an
    #: enabled GradScaler (its one reader compares it with the loss scale), else empty
    grad_norms: list[float] = field(default_factory=list)
    #: per step, the GradScaler's scale while the step ran (empty without an enabled scaler)
    step_scales: list[float] = field(default_factory=list)
    #: the steps whose ``optimizer.step`` the run entered (its step pre-hook fired; a GradScaler that found an
    #: inf/NaN gradient skips it)
    updated_steps: list[int] = field(default_factory=list)
    #: the steps whose optimizer step the run did not run because nothing reads it (``run(no_update=...)``)
    updates_not_run: list[int] = field(default_factory=list)


def _coverage(model: nn.Module, names: dict[int, str], owners: dict[int, str], opt: Any) -> list[ParamState]:
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else None
    out = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        zero: Any = None
        if g is not None and g.numel():  # count_nonzero: no gradient-sized temporary
            zero = (g.numel() - torch.count_nonzero(g)).to(torch.float64) / g.numel()
            if g.device.type == "cpu":  # reading is free on the host: a float, not a 0-d tensor kept until the read
                zero = float(zero)
        out.append(ParamState(
            names.get(id(p), ""), owners.get(id(p), ""), str(p.dtype).replace("torch.", ""), True, g is None,
            True if in_opt is None else id(p) in in_opt, "" if g is None else str(g.dtype).replace("torch.", ""),
            zero))
    return out


#: elements per chunk of :func:`sum_of_squares` on the host; a chunk norm below :data:`_TINY` may have lost squares
#: below float32's normal range (each under 1.2e-38: 8e-34 at most, 1e-9 of 1e-24); such a chunk is summed again
#: multiplied by 2**100 (exact: its squares are then all normal and cannot overflow)
_CHUNK, _TINY, _UP = 1 << 16, 1e-12, 2.0 ** 100


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """``sum(g**2)`` as a float64 0-d tensor, to ~1e-7 relative accuracy, no host sync on an accelerator.

    On the host, where a float64 copy of a gradient costs ~25-50x a float32 pass (~20 s per step at 750M
    parameters), it sums the float32 norms of 64K-element chunks in float64 (one float32 norm of a large tensor is
    off by ~1e-3). A chunk whose float32 norm is not finite (inf/NaN values, or squares overflowing) is summed in
    float64, one below 1e-12 (squares that may underflow) scaled up by 2**100; zero chunks (embedding rows no token
    used) cost nothing more. The values read back cost no sync on the host."""
    if g.device.type != "cpu" or g.numel() == 0:
        return g.double().pow(2).sum()
    x = g.reshape(-1)
    n = x.numel() // _CHUNK * _CHUNK
    rows = [x[:n].view(-1, _CHUNK)] if n else []
    if n < x.numel():
        rows.append(x[n:].view(1, -1))
    parts = []
    for r in rows:
        norms = torch.linalg.vector_norm(r, dim=1, dtype=torch.float32)
        sq = norms.double().pow(2)
        finite = torch.isfinite(norms)
        redo = ~finite | (norms < _TINY)
        if bool(redo.any()):
            redo &= (r.amax(dim=1) != 0) | (r.amin(dim=1) != 0)  # all-zero chunks are exact (no copy)
            idx = redo.nonzero().squeeze(1)
            sub = r.index_select(0, idx)
            big = ~finite[idx]
            up = torch.linalg.vector_norm(sub.float() * _UP, dim=1, dtype=torch.float32).double().pow(2) / _UP ** 2
            if bool(big.any()):
                up[big] = sub[big].double().pow(2).sum(dim=1)
            sq[idx] = up.to(sq.dtype)
        parts.append(sq.sum())
    return torch.stack(parts).sum()


def _measured_writes(spec: StepSpec, reference: bool) -> Any:
    """Which writes into module state the trace measures (``WriteLog.measure``; None: all).

    Two rules read the write log (``findings._updates``): a lost update needs a write into 16-bit state in the
    target (the reference's twin of it tells whether fp32 loses it too), and ``loss-scaling-misuse`` compares the
    update of the training-step code's own writes (module ``""``: outside every module, or the root module's own
    state inside ``optimizer.step``) with the reference's. So the target measures its 16-bit writes and the
    reference the writes into state the target holds in 16 bits, both the module-less ones; the others are
    logged unmeasured, saving per write an old-value copy and a re-run on copies of every input one format wider
    -- at an AdamW step the parameter, both moments and the denominator in float64 (on a 750M-parameter step,
    most of the reference run's optimizer time and the bf16-amp peak memory), and in the backward the float32
    accumulation of a shared parameter's gradient (a tied embedding's, 33M elements at 750M). With transforms
    (a fix being verified) or a user ``train_step`` the target's dtypes are not known before it runs: the
    reference measures every write."""
    if reference and (spec.transforms or spec.train_step is not None):
        return None
    if reference:
        cast = spec.precision in LOW_DTYPES
        state = list(spec.model.named_parameters()) + list(spec.model.named_buffers())
        low = {n for n, t in state if t.is_floating_point() and (cast or t.dtype in HALF_DTYPES)}
        return lambda t, meta, module: not module or meta[1] in low
    return lambda t, meta, module: _compared_write(module, t.dtype)


def _compared_write(module: str, dtype: torch.dtype | str) -> bool:
    """A target write the update rules compare with the reference's same write: one into 16-bit state, or a
    module-less one (loop code, or the root module's own state inside ``optimizer.step``)."""
    return not module or dtype_name(dtype) in _HALF_NAMES


_HALF_NAMES = frozenset(dtype_name(d) for d in HALF_DTYPES)


def _narrow(dtype: torch.dtype) -> bool:
    """A floating dtype narrower than float32 (or one the dtype registry does not know)."""
    if not dtype.is_floating_point:
        return False
    info = dtype_info(dtype)
    return info is None or info.low_precision


class _TraceObserver(Observer):
    """The diagnosis's observer: the op-level trace (its write log gives lost updates), gradient coverage and
    the loss/output marks."""

    def __init__(self, spec: StepSpec, prep: Prepared, result: RunResult, headroom: bool,
                 request: Request | None = None) -> None:
        model, opt = prep.model, prep.optimizer
        self.spec, self.result, self.opt = spec, result, opt
        if request is None:  # what the findings read of each run (the read audit: ampdoctor.trace.Request)
            request = FULL if not prep.reference else REFERENCE_HEADROOM if headroom else REFERENCE
        self.tr = Trace(model, opt, full=True, request=request)
        self.tr.mode.headroom = headroom
        self.tr.mode.writes.measure = _measured_writes(spec, prep.reference)
        self.names = self.tr.attribution.param_names
        self.owners = self.tr.attribution.param_owner
        self.model = model
        if prep.device.type == "cpu":  # the backward's freed activations: hand their heap pages back first
            self.tr.on_optimizer_pre.append(self._release_heap)
        self.tr.on_optimizer_pre.append(self._snapshot)
        self.tr.on_optimizer_pre.append(self._entered)
        if prep.scaler is not None and prep.scaler.is_enabled():
            # read only against a loss scale (``loss-scaling-misuse``): a step without an enabled scaler skips
            # the norm (a pass over every gradient, ~2.5 s per run at 750M parameters on this CPU)
            self.tr.on_optimizer_pre.append(self._grad_norm)
        self.norms: list[Any] = []
        self._released = 0  # steps whose heap pages were handed back
        for t in iter_tensors(prep.batch):
            try:
                self.tr.mode.batch_ptrs.add(t.untyped_storage().data_ptr())
            except Exception:
                pass

    def context(self, loop: StepLoop) -> Any:
        return self.tr

    def own_work(self, loop: StepLoop) -> Any:
        return self.tr.paused()  # the loop's loss and scale reads: not the step's ops

    def step_start(self, loop: StepLoop, step: int) -> None:
        self.tr.set_step(step)
        scaler = loop.prep.scaler
        if scaler is not None and scaler.is_enabled():
            with self.tr.paused():  # one host sync per step, with the loss's; ours, not the step's
                self.result.step_scales.append(float(scaler.get_scale()))

    def _release_heap(self) -> None:
        """Before the (first) ``optimizer.step`` of each step, when the backward's activations are freed and the
        optimizer is about to allocate its state: the heap's free pages go back to the OS (:mod:`._heap`)."""
        if self._released < self.tr.mode.step + 1:  # once per step
            self._released = self.tr.mode.step + 1
            release_free_heap()

    def _grad_norm(self) -> None:
        """The gradients as the (first) ``optimizer.step`` of a step reads them: one device scalar, no sync."""
        step = self.tr.mode.step
        while len(self.norms) <= step:
            self.norms.append(None)
        if self.norms[step] is None and self.opt is not None:
            gs = [p.grad for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
            if gs:
                norm = torch.stack([sum_of_squares(g.detach()) for g in gs]).sum().sqrt()
                self.norms[step] = float(norm) if norm.device.type == "cpu" else norm  # a host float on the host

    def _entered(self) -> None:
        step = self.tr.mode.step
        if step not in self.result.updated_steps:
            self.result.updated_steps.append(step)

    def _snapshot(self) -> None:
        if len(self.result.coverage) <= self.tr.mode.step:
            with self.tr.paused():  # our own count_nonzero/div: not the step's ops
                self.result.coverage.append(_coverage(self.model, self.names, self.owners, self.opt))

    def forward_done(self, loop: StepLoop, step: int, output: Any, loss: Any) -> None:
        self.tr.mark("output", output)
        self.result.output_records = self.tr.marks.get("output", [])

    def grads_ready(self, loop: StepLoop, step: int) -> None:
        self._snapshot()

    def step_end(self, loop: StepLoop, step: int, loss: torch.Tensor | None) -> None:
        if self.spec.train_step is not None:
            self._snapshot()  # a train_step that ran no optimizer: its gradients as it left them
        idx = self.tr.index_of(loss) if loss is not None and loss.is_floating_point() else None
        self.result.loss_records.append(idx)
        if idx is not None:
            self.tr.marks.setdefault("loss", []).append(idx)

    def failed(self, loop: StepLoop, step: int, exc: BaseException) -> None:
        first_forward = step == 0 and not any(r.phase != "forward" for r in self.tr.mode.records)
        if loop.prep.reference and first_forward:
            raise input_error(exc, loop.stage, loop.output_type) from exc

    def finish(self, loop: StepLoop) -> None:
        """Read everything back at once (trace statistics, coverage zero-fractions, gradient norms) and drop the
        callbacks: they close over the trace, a reference cycle through the model copy that would keep the copy
        alive until the next garbage collection (the next run's copy would be made first)."""
        res, opt = self.result, self.opt
        if opt is not None:
            for p, st in opt.state.items():
                res.optimizer_state_dtypes[self.names.get(id(p), "")] = [
                    str(v.dtype).replace("torch.", "") for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
        zero_ts = [ps.grad_zero for cov in res.coverage for ps in cov if isinstance(ps.grad_zero, torch.Tensor)]
        res.trace = self.tr.result()
        known = [n for n in self.norms if isinstance(n, torch.Tensor)]
        vals = iter(torch.stack([n.cpu() for n in known]).tolist() if known else [])
        res.grad_norms = [float("nan") if n is None else n if isinstance(n, float) else next(vals) for n in self.norms]
        if zero_ts:
            it = iter(torch.stack([z.cpu() for z in zero_ts]).tolist())
            for cov in res.coverage:
                for ps in cov:
                    if isinstance(ps.grad_zero, torch.Tensor):
                        ps.grad_zero = next(it)
        self.tr.on_optimizer_pre.clear()
        self.tr.on_optimizer_post.clear()
        self.tr.mode.writes.measure = None  # this run's predicate: not kept past it


def _describe(prep: Prepared, result: RunResult, names: dict[int, str], owners: dict[int, str]) -> None:
    model, opt = prep.model, prep.optimizer
    result.owners = {names[i]: owners[i] for i in names}
    result.param_dtypes = {names.get(id(p), ""): str(p.dtype).replace("torch.", "") for p in model.parameters()}
    result.keep_fp32 = list(getattr(getattr(model, "module", model), "_keep_in_fp32_modules", None) or [])
    if opt is not None:
        result.optimizer_info = {"type": type(opt).__name__, "defaults": {
            k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, str, bool, tuple))}}


def unread_updates(spec: StepSpec, target: RunResult) -> frozenset[int]:
    """The reference's optimizer steps that nothing in a diagnosis reads, given its target run: the last step's
    (earlier ones feed the next step), when the target ran every step to its end and its last update
    - never entered ``optimizer.step`` (a GradScaler that found an inf/NaN gradient skips it -- a fresh scaler's
      first steps usually do), or
    - ran only float32/float64 ops with finite results inside ``optimizer.step`` and wrote no state that the
      update rules compare (a 16-bit tensor, or the root module's own state: ``findings._updates``) -- the
      amp precisions' fp32 master weights.

    What reads the reference's updates compares them with the target's: the same write in both runs (the update
    rules), the twin of a target op that lost precision, flushed or went non-finite -- none of which such an
    update has. Leaving it out saves a plain step's AdamW (at 750M parameters its state allocation, ~40 % of the
    reference run) and its peak memory. Only for the diagnosis's own loop (a user ``train_step`` runs whole), a
    ``torch.optim.Optimizer`` (its step pre-hook says whether the step ran) and no DDP/FSDP wrapper (every rank
    must take the same decision without a collective)."""
    last = spec.steps - 1
    if (spec.train_step is not None or not isinstance(spec.optimizer, torch.optim.Optimizer)
            or wrapper_kind(spec.model) is not None or target.exc is not None or target.forward_only
            or len(target.losses) != spec.steps):
        return frozenset()
    if last not in target.updated_steps:
        return frozenset({last})
    recs = target.trace.records
    first = next((i for i, r in enumerate(recs) if r.step == last), len(recs))
    start = min((m for m in target.trace.marks.get("optimizer_step", []) if m >= first), default=None)
    if start is None:  # (records are in step order: from ``start`` on, the last step's update and after)
        return frozenset()
    if any(_narrow(r.dtype) or is_nonfinite(r) for r in recs[start:]):
        return frozenset()
    if any(w.index >= start and _compared_write(w.module, w.dtype) for w in target.trace.writes):
        return frozenset()
    return frozenset({last})


def run(spec: StepSpec, *, reference: bool, policy: str = "cuda", keep_models: bool = False,
        headroom: bool = False, reuse: SharedCopy | None = None, hand_over: SharedCopy | None = None,
        request: Request | None = None, no_update: frozenset[int] = frozenset()) -> RunResult:
    """Run ``spec.steps`` traced steps on copies; ``reference=True`` is the float32, autocast-free run.

    ``request``: the statistics the run's reader needs (``ampdoctor.trace.Request``); by default what the findings
    read of a diagnosis's target (``FULL``) or reference (``REFERENCE``, ``REFERENCE_HEADROOM`` with ``headroom``).

    ``reuse``: make the copy over the storages a previous run handed over; ``hand_over``: hand this run's copy's
    storages over to the next run when it is done (:class:`~ampdoctor.precision._shared_copy.SharedCopy`; the
    diagnosis's target, then its reference).

    ``no_update``: steps whose optimizer step is not run (:func:`unread_updates`: the reference's last update when
    nothing compares with it); listed in :attr:`RunResult.updates_not_run`.

    The step is :mod:`ampdoctor.precision._step`'s (the one every caller runs), observed by the trace.
    Exceptions raised by the step are recorded in the result (a crash is part of a diagnosis), except an
    error in the reference run's first forward, which means the input is unusable: that raises
    :class:`ScenarioError`.
    """
    prep = prepare(spec, reference=reference, shared=reuse)
    result = RunResult("reference" if reference else "target", prep.precision, TraceResult([], True),
                       device=str(prep.device))
    observer = _TraceObserver(spec, prep, result, headroom, request)
    _describe(prep, result, observer.names, observer.owners)
    loop = StepLoop(spec, prep, policy=policy, observers=(observer,), no_update=no_update)
    done = loop.run(spec.steps)
    result.updates_not_run = sorted(s for s in no_update if s < len(done.losses) and not done.forward_only)
    result.losses, result.scales, result.forward_only = done.losses, done.scales, done.forward_only
    result.exc, result.exc_step, result.exc_traceback, result.fp8 = (done.exc, done.exc_step, done.exc_traceback,
                                                                     done.fp8)
    if keep_models:
        result.models = (prep.model, prep.optimizer, prep.scaler, prep.batch)
        return result
    if hand_over is not None:
        hand_over.keep(prep.model, prep.optimizer)
    if prep.device.type == "cpu":
        del loop, observer, prep  # the copy goes now (nothing else refers to it): its heap pages go back before
        release_free_heap()       # the next run allocates
    return result
