"""Run a step in a target precision, or as an fp32 reference, on copies of the caller's objects.

The model, optimizer and scaler are deep-copied together (so the copied optimizer points at the copied
parameters); the caller's RNG state is saved and restored, and the reference and target runs start from the
same RNG state, so dropout masks agree.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampdoctor.precision import _distributed
from ampdoctor.precision._spec import ScenarioError, StepSpec
from ampdoctor.trace import Trace, TraceResult, iter_tensors

log = logging.getLogger(__name__)

LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
AMP_DTYPES = {"fp16-amp": torch.float16, "bf16-amp": torch.bfloat16}


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
    grad_zero: Any = None  # device tensor: fraction of exactly-zero grad elements, read with the trace


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
    #: per step, per tracked low-precision parameter: fraction of elements with a nonzero gradient whose value
    #: did not change in the optimizer step (the update rounded away)
    update_lost: list[dict[str, Any]] = field(default_factory=list)
    param_dtypes: dict[str, str] = field(default_factory=dict)
    optimizer_state_dtypes: dict[str, list[str]] = field(default_factory=dict)
    optimizer_info: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    owners: dict[str, str] = field(default_factory=dict)
    keep_fp32: list[str] = field(default_factory=list)
    models: Any = None
    #: per-tensor fp8 statistics when the precision is emulated fp8 (:class:`ampdoctor.precision.Fp8Stats`)
    fp8: Any = None


class _NoAutocast(TorchFunctionMode):
    """Runs every torch call with autocast disabled, also inside a user's own ``torch.autocast`` block."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if torch.is_autocast_enabled(self.device_type):
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _cast_batch(batch: Any, dtype: torch.dtype, only_low: bool = False) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if only_low and t.dtype not in (torch.float16, torch.bfloat16):
            return t
        return t.to(dtype)

    return _map(batch, cast)


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn)) for k, v in obj.items()) if type(obj) is dict else {
            k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_map(v, fn) for v in obj)
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    return obj


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if batch is None:
        return model()
    return model(batch)


def default_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if isinstance(output, dict) and loss is None:
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.is_floating_point():
        return output
    return None


def _bind_train_step(train_step: Any, optimizer: Any, scaler: Any) -> dict[str, Any]:
    try:
        params = inspect.signature(train_step).parameters
    except (TypeError, ValueError):
        return {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw: dict[str, Any] = {}
    if optimizer is not None and ("optimizer" in params or var_kw):
        kw["optimizer"] = optimizer
    if scaler is not None and ("scaler" in params or var_kw):
        kw["scaler"] = scaler
    return kw


@contextlib.contextmanager
def saved_rng() -> Iterator[None]:
    """Save the global RNG states and restore them on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def copy_objects(spec: StepSpec) -> tuple[nn.Module, Any, Any]:
    try:
        return copy.deepcopy((spec.model, spec.optimizer, spec.scaler))
    except Exception as e:
        raise ScenarioError(
            f"cannot copy the model/optimizer/scaler ({type(e).__name__}: {e}); ampdoctor runs on copies so that "
            "your objects are never changed: make them deep-copyable (no open files, locks or generators held)"
        ) from e


def _precision_context(precision: str | None, device: torch.device, policy: str) -> Any:
    if precision in AMP_DTYPES:
        dtype = AMP_DTYPES[precision]
        if policy == "cuda" and device.type != "cuda":
            try:
                from ampdoctor.precision.emulation import cuda_autocast
            except ImportError:  # emulation not available: native autocast stands in
                return torch.autocast(device.type, dtype=dtype)
            return cuda_autocast(dtype, device_type=device.type)
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def _fp8_context(precision: str | None, model: nn.Module) -> Any:
    if precision is None or not precision.startswith("fp8"):
        return contextlib.nullcontext()
    from ampdoctor.precision.fp8 import Fp8Recipe, fp8_autocast

    fmt = {"fp8": "hybrid", "fp8-e4m3": "e4m3", "fp8-e5m2": "e5m2"}[precision]
    return fp8_autocast(model, Fp8Recipe(format=fmt))


def _coverage(model: nn.Module, names: dict[int, str], owners: dict[int, str], opt: Any) -> list[ParamState]:
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else None
    out = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        zero = None
        if g is not None and g.numel():  # count_nonzero: no gradient-sized temporary
            zero = (g.numel() - torch.count_nonzero(g)).to(torch.float64) / g.numel()
        out.append(ParamState(
            names.get(id(p), ""), owners.get(id(p), ""), str(p.dtype).replace("torch.", ""), True, g is None,
            True if in_opt is None else id(p) in in_opt, "" if g is None else str(g.dtype).replace("torch.", ""),
            zero))
    return out


def _cast_optimizer_state(opt: Any, dtype: torch.dtype) -> None:
    """Optimizer state follows its parameters' dtype (as after ``model.half()`` and a fresh optimizer)."""
    if opt is None:
        return
    for st in opt.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                st[k] = v.to(dtype)


def _low_precision_names(spec: StepSpec) -> set[str]:
    """Trainable parameters that the target run keeps in fp16/bf16 (cast by the precision or given so)."""
    names = {id(p): n for n, p in spec.model.named_parameters()}
    low = {torch.float16, torch.bfloat16}
    cast = spec.precision in LOW_DTYPES
    return {names[id(p)] for p in spec.model.parameters() if p.requires_grad and (cast or p.dtype in low)}


def run(spec: StepSpec, *, reference: bool, policy: str = "cuda", keep_models: bool = False,
        headroom: bool = False) -> RunResult:
    """Run ``spec.steps`` steps on copies; ``reference=True`` is the float32, autocast-free run.

    Exceptions raised by the step are recorded in the result (a crash is part of a diagnosis), except an
    error in the reference run's first forward, which means the input is unusable: that raises
    :class:`ScenarioError`.
    """
    precision = None if reference else spec.precision
    model, opt, scaler = copy_objects(spec)
    batch = copy.deepcopy(spec.batch)
    device = _device_of(model)
    dtypes = _distributed.param_dtypes(model)
    if reference:
        if any(t.is_floating_point() and t.dtype != torch.float32 for t in list(model.parameters()) + list(
                model.buffers())):
            model.to(torch.float32)
            _cast_optimizer_state(opt, torch.float32)
        batch = _cast_batch(batch, torch.float32, only_low=True)
    elif precision in LOW_DTYPES:
        model.to(LOW_DTYPES[precision])
        _cast_optimizer_state(opt, LOW_DTYPES[precision])
        batch = _cast_batch(batch, LOW_DTYPES[precision])

    for transform in spec.transforms:
        transform(model, opt, scaler)
    _distributed.resync_after_cast(model, dtypes)  # a cast leaves DDP's gradient hooks on stale accumulators
    tr = Trace(model, opt, full=True)
    tr.mode.headroom = headroom
    names = tr.attribution.param_names
    owners_by_id = tr.attribution.param_owner
    result = RunResult("reference" if reference else "target", precision, TraceResult([], True),
                       device=str(device))
    result.owners = {names[i]: owners_by_id[i] for i in names}
    result.param_dtypes = {names.get(id(p), ""): str(p.dtype).replace("torch.", "") for p in model.parameters()}
    result.keep_fp32 = list(getattr(getattr(model, "module", model), "_keep_in_fp32_modules", None) or [])
    if opt is not None:
        result.optimizer_info = {"type": type(opt).__name__, "defaults": {
            k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, str, bool, tuple))}}

    covered_step: list[int] = []

    def snapshot() -> None:
        if len(result.coverage) <= tr.mode.step:
            result.coverage.append(_coverage(model, names, owners_by_id, opt))
            covered_step.append(tr.mode.step)

    tr.on_optimizer_pre.append(snapshot)
    low_names = _low_precision_names(spec)
    tracked = [(names.get(id(p), ""), p) for p in model.parameters() if names.get(id(p), "") in low_names]
    before: dict[str, torch.Tensor] = {}

    def params_before() -> None:
        before.clear()
        for n, p in tracked:
            before[n] = p.detach().clone()

    def params_after() -> None:
        lost: dict[str, Any] = {}
        for n, p in tracked:
            g = p.grad
            if g is None or n not in before:
                continue
            moving = g != 0
            lost[n] = ((p.detach() == before[n]) & moving).sum().to(torch.float64) / moving.sum().clamp(min=1)
        result.update_lost.append(lost)
        before.clear()

    if tracked and opt is not None:
        tr.on_optimizer_pre.append(params_before)
        tr.on_optimizer_post.append(params_after)
    for t in iter_tensors(batch):
        try:
            tr.mode.batch_ptrs.add(t.untyped_storage().data_ptr())
        except Exception:
            pass
    amp = contextlib.nullcontext() if reference else _precision_context(precision, device, policy)
    no_autocast = _NoAutocast(device.type) if reference else contextlib.nullcontext()
    fp8 = contextlib.nullcontext() if reference else _fp8_context(precision, model)
    step_kw = _bind_train_step(spec.train_step, opt, scaler) if spec.train_step is not None else {}
    loss_dtype_checked = False
    with tr, no_autocast, fp8:
        for step in range(spec.steps):
            tr.set_step(step)
            try:
                loss: Any = None
                if spec.train_step is not None:
                    with amp:
                        loss = spec.train_step(model, batch, **step_kw)
                    if not isinstance(loss, torch.Tensor):
                        loss = None
                    snapshot()
                else:
                    if opt is not None:
                        opt.zero_grad(set_to_none=True)
                    else:
                        model.zero_grad(set_to_none=True)
                    grad_ctx = contextlib.nullcontext() if not result.forward_only else torch.no_grad()
                    with amp, grad_ctx:
                        out = call_model(model, batch)
                        loss = spec.loss_fn(out, batch) if spec.loss_fn is not None else default_loss(out)
                    if spec.loss_fn is not None and not loss_dtype_checked:
                        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                            raise ScenarioError(
                                "loss_fn must return a scalar Tensor, got "
                                + (f"a {str(loss.dtype).replace('torch.', '')} tensor of shape {tuple(loss.shape)}"
                                   if isinstance(loss, torch.Tensor) else type(loss).__name__)
                                + "; return a floating-point scalar, e.g. loss.mean() (not argmax or a count)")
                        loss_dtype_checked = True
                    tr.mark("output", out)
                    result.output_records = tr.marks.get("output", [])
                    if loss is None or not loss.requires_grad:
                        result.forward_only = True
                    else:
                        if scaler is not None:
                            scaler.scale(loss).backward()
                            snapshot()
                            if opt is not None:
                                scaler.step(opt)
                                scaler.update()
                        else:
                            loss.backward()
                            snapshot()
                            if opt is not None:
                                opt.step()
                if loss is not None:
                    idx = tr.index_of(loss) if loss.is_floating_point() else None
                    result.loss_records.append(idx)
                    if idx is not None:
                        tr.marks.setdefault("loss", []).append(idx)
                    with torch.no_grad():
                        result.losses.append(float(loss.detach().float().item()))
                else:
                    result.loss_records.append(None)
                    result.losses.append(None)
                if scaler is not None and scaler.is_enabled():
                    result.scales.append(float(scaler.get_scale()))
            except ScenarioError:
                raise
            except Exception as e:
                first_forward = step == 0 and not any(r.phase != "forward" for r in tr.mode.records)
                if reference and first_forward:
                    raise ScenarioError(
                        f"the model cannot run this batch even in float32: {type(e).__name__}: {e}. Check the "
                        "batch's keys, shapes and dtypes against the model's forward") from e
                result.exc, result.exc_step = e, step
                result.exc_traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
                # the traceback's frames hold the copy and the step's activations: drop this frame (its locals
                # are the copy) and clear the finished ones below it, keeping file/line for display
                e.__traceback__ = e.__traceback__.tb_next if e.__traceback__ is not None else None
                traceback.clear_frames(e.__traceback__)
                log.info("%s run raised at step %d: %s", result.label, step, e)
                break
    if hasattr(fp8, "stats"):
        result.fp8 = fp8.stats()
    if opt is not None:
        for p, st in opt.state.items():
            dts = [str(v.dtype).replace("torch.", "") for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
            result.optimizer_state_dtypes[names.get(id(p), "")] = dts
    # read everything back at once: the trace statistics and the coverage zero-fractions
    zero_ts = [ps.grad_zero for cov in result.coverage for ps in cov if ps.grad_zero is not None]
    result.trace = tr.result()
    if result.update_lost:
        flat = [v for d in result.update_lost for v in d.values()]
        lost_vals = iter(torch.stack([v.cpu() for v in flat]).tolist())
        result.update_lost = [{k: next(lost_vals) for k in d} for d in result.update_lost]
    if zero_ts:
        vals = torch.stack([z.cpu() for z in zero_ts]).tolist()
        it = iter(vals)
        for cov in result.coverage:
            for ps in cov:
                if ps.grad_zero is not None:
                    ps.grad_zero = next(it)
    if keep_models:
        result.models = (model, opt, scaler, batch)
    # The callbacks close over ``tr`` (a reference cycle through the model copy): break it, so the copy is freed
    # as soon as this returns, not at the next garbage collection (the next run's copy would be made first).
    tr.on_optimizer_pre.clear()
    tr.on_optimizer_post.clear()
    return result

