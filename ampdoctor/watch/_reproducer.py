"""Reproducers: the state of one anomalous training step, written atomically, loaded safely, replayed.

A reproducer is a ``dict`` holding only tensors, dicts, lists, tuples, strings, numbers, booleans and
``None``, so it loads with ``torch.load(weights_only=True)``. Keys (format version 1):

``format``, ``version``
    ``"ampdoctor-reproducer"`` and ``1``.
``step``, ``anomaly``, ``message``
    The step index seen by the watch, the anomaly kind and the message logged for it.
``model_state``
    ``model.state_dict()`` (CPU copies) at detection time, which is the state the step started from: the guard
    detects before ``optimizer.step()`` writes (no scaler, or GradScaler with an applied step) or after a step that
    GradScaler skipped (weights untouched). For a non-finite loss reported after the update, it is the state after.
``grads``
    Parameter name -> gradient (CPU copy) or ``None``, as found at detection time (unscaled by GradScaler; the
    loop may already have cleared them when a skipped step is detected at the next forward).
``batch``, ``call``
    The step's batch in the scenario convention (``dict`` -> ``model(**batch)``, ``tuple``/``list`` ->
    ``model(*batch)``, else ``model(batch)``): the ``batch=`` given to ``Watch.step`` or the inputs of the last
    forward of the root module; ``call`` keeps that forward's ``args``/``kwargs``. Objects that are not tensors,
    containers or plain values are replaced by ``None`` and listed in ``dropped``.
``calls``
    When the root module was called several times in the step (a GAN's discriminator on the real and the fake
    batch) and no ``batch=`` was given: every call's ``{"args", "kwargs"}`` in order (``None`` otherwise). A replay
    without ``loss_fn``/``train_step`` runs them all (``_method_step.CallsReplay``) from the RNG state before the
    first, so a failure in any call is found; ``batch``/``call`` stay the last call's.
``optimizer_state``, ``optimizer_class``, ``optimizer_params``
    ``optimizer.state_dict()`` (CPU copies), the optimizer's qualified class name and the parameter names of each
    param group (to rebuild the groups on a fresh model).
``scaler_state``, ``scaler_device``
    ``GradScaler.state_dict()`` with ``scale`` set to the scale the step used (``None`` without scaler).
``rng``
    ``{"cpu": torch.get_rng_state() at the step's forward, "cuda": [...] or None}``.
``precision``
    ``{"name": "fp16-amp" | "bf16-amp" | "fp16" | "bf16" | "fp8" | "fp8-e4m3" | "fp8-e5m2" | None, "autocast": bool,
    "autocast_dtype": str | None, "device_type": str, "param_dtype": str}`` as seen during the forward; a forward
    inside ampdoctor's emulated fp8 block (``precision.fp8.fp8_autocast``) adds ``"fp8_recipe"``, the block's
    recipe as a dict of its fields, and the replay diagnoses the step with that recipe.
``source``, ``model_class``, ``torch_version``
    The scenario/script path when known (``""`` otherwise), the model's qualified class name, torch's version.

``hf_config``
    A Hugging Face model's ``config.to_dict()`` (``None`` otherwise): with ``model_class`` it rebuilds the
    architecture without executing any code.

The model's architecture is never pickled: :func:`replay` needs ``model_factory``, a recorded ``hf_config``, or
``trust_source=True`` to import the recorded ``source`` (a scenario file that defines ``make()``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import ReproducerError
from ampdoctor.findings import Finding, Report
from ampdoctor.trace import frame_boundary
from ampdoctor.watch._method_step import STEP_METHODS, CallsReplay, OverMicroBatches, training_step_replay
from ampdoctor.watch._rules import not_reproduced, with_unreproduced

log = logging.getLogger(__name__)

FORMAT = "ampdoctor-reproducer"
VERSION = 1
_REQUIRED = ("format", "version", "step", "anomaly", "model_state", "batch", "precision")

_REPLAYING: contextvars.ContextVar[bool] = contextvars.ContextVar("ampdoctor_replaying", default=False)


def is_replaying() -> bool:
    """True while :func:`replay` runs (instruments that attach globally use it to ignore the replay's objects)."""
    return _REPLAYING.get()


def to_saveable(obj: Any, dropped: list[str] | None = None, where: str = "",
                _path: frozenset[int] = frozenset()) -> Any:
    """A copy of ``obj`` that ``torch.load(weights_only=True)`` can read: tensors become detached CPU copies,
    mappings ``dict``, lists/tuples keep their kind; anything else, and a container that contains itself, becomes
    ``None`` (its path goes to ``dropped``). Copies from an accelerator synchronise (only done when a reproducer
    is written)."""
    if isinstance(obj, (Mapping, list, tuple)):
        if id(obj) in _path:
            if dropped is not None:
                dropped.append(f"{where or '<batch>'}: cycle")
            return None
        _path = _path | {id(obj)}
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if obj is None or isinstance(obj, bool):
        return obj
    for plain in (str, int, float):       # plain types only (TorchVersion is a str subclass, IntEnum an int)
        if isinstance(obj, plain):
            return plain(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, Mapping):
        return {to_saveable(k): to_saveable(v, dropped, f"{where}.{k}", _path) for k, v in obj.items()
                if isinstance(k, (str, int, float, bool))}
    if isinstance(obj, (list, tuple)):
        items = [to_saveable(v, dropped, f"{where}[{i}]", _path) for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    if dropped is not None:
        dropped.append(f"{where or '<batch>'}: {type(obj).__name__}")
    return None


def save_reproducer(payload: dict[str, Any], directory: str | os.PathLike[str], name: str) -> str:
    """Write ``payload`` to ``directory/name`` atomically (temporary file, fsync, ``os.replace``); returns the path."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    fd, tmp = tempfile.mkstemp(prefix=".ampdoctor-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def load_reproducer(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a reproducer written by a watch (``torch.load(weights_only=True)``, on CPU).

    >>> rep = load_reproducer("repro/step000012-nonfinite-grads.pt")      # doctest: +SKIP
    >>> rep["step"], rep["anomaly"], rep["precision"]["name"]              # doctest: +SKIP

    Raises :class:`ReproducerError` when the file is missing, truncated, corrupted or not a reproducer.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ReproducerError(f"no reproducer at {path!r}; pass the path of a .pt file written by "
                              "ampdoctor.watch(..., reproducer_dir=...)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated/corrupted archives
        first = (str(e).splitlines() or ["empty file" if os.path.getsize(path) == 0 else ""])[0][:200]
        raise ReproducerError(
            f"{path!r} is not a readable ampdoctor reproducer ({type(e).__name__}: {first}); "
            "the file is truncated, corrupted or holds objects other than tensors and plain values. "
            "Write a new one by rerunning the training with watch(..., reproducer_dir=...).") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ReproducerError(f"{path!r} is a torch file but not an ampdoctor reproducer (no format={FORMAT!r} key)")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ReproducerError(f"{path!r} lacks {', '.join(missing)}; it was not written by ampdoctor.watch")
    if not isinstance(obj["version"], int) or isinstance(obj["version"], bool):
        raise ReproducerError(f"{path!r} has a reproducer format version {obj['version']!r} that is not an integer: "
                              "the file was altered or not written by ampdoctor.watch; write a new one")
    if obj["version"] > VERSION:
        raise ReproducerError(f"{path!r} has reproducer format version {obj['version']!r}; this ampdoctor reads "
                              f"versions <= {VERSION}: upgrade ampdoctor")
    _check_fields(obj, path)
    return obj


#: field -> (accepted types, what it must be); ``None`` is accepted for the optional ones
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "model_state": ((dict,), "a state_dict (name -> tensor)", False),
    "precision": ((dict,), "a dict with the precision 'name'", False),
    "rng": ((dict,), "a dict of RNG state tensors", True),
    "optimizer_state": ((dict,), "an optimizer state_dict", True),
    "scaler_state": ((dict,), "a GradScaler state_dict", True),
    "step": ((int,), "an int", False),
}


def _check_fields(obj: dict[str, Any], path: str) -> None:
    """Every field replay reads has the type it was written with; a crafted or altered file gets one clear error
    here instead of a raw TypeError/KeyError deep inside the replay."""
    def bad(field: str, what: str) -> ReproducerError:
        return ReproducerError(f"{path!r}: field {field!r} must be {what}, got {type(obj.get(field)).__name__}; the "
                               "file was altered or not written by ampdoctor.watch; write a new one")

    for field, (types, what, optional) in _FIELD_TYPES.items():
        value = obj.get(field)
        if (value is None and optional) or (isinstance(value, types) and not isinstance(value, bool)):
            continue
        raise bad(field, what)
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj["model_state"].items()):
        raise bad("model_state", "a state_dict (name -> tensor)")
    name = obj["precision"].get("name")
    if name is not None and not isinstance(name, str):
        raise bad("precision", "a dict whose 'name' is a string or None")
    rng = obj.get("rng") or {}
    cpu = rng.get("cpu")
    if cpu is not None and (not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8
                            or cpu.numel() != torch.get_rng_state().numel()):
        raise bad("rng", "a dict whose 'cpu' entry is a torch.get_rng_state() tensor")
    method = obj.get("step_method") or ""
    if method not in ("", *STEP_METHODS):
        raise bad("step_method", f"'' or one of {', '.join(map(repr, STEP_METHODS))}")
    state = obj.get("optimizer_state")
    if state is not None and not (isinstance(state.get("state"), dict) and isinstance(state.get("param_groups"), list)):
        raise bad("optimizer_state", "an optimizer state_dict with 'state' and 'param_groups'")


def batch_from_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The scenario-convention batch for a forward called as ``model(*args, **kwargs)`` (``None`` if both given)."""
    if not kwargs:
        if len(args) == 1 and not isinstance(args[0], (Mapping, list, tuple)):
            return args[0]
        return tuple(args)
    if not args:
        return dict(kwargs)
    return None


def _load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    keys = set(model.state_dict())
    if not keys.issuperset(state) and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}   # written under a DDP wrapper
    elif keys and all(k.startswith("module.") for k in keys) and not any(k.startswith("module.") for k in state):
        state = {f"module.{k}": v for k, v in state.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ReproducerError(f"the model from model_factory does not match the reproducer's state_dict: "
                              f"{str(e).splitlines()[0][:300]}; build the same architecture (and config)") from e


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_to_device(v, device) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _rebuild_optimizer(payload: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer | None:
    """A fresh optimizer of the recorded class over ``model``'s parameters, loaded with the recorded state.
    Only ``torch.optim`` classes are rebuilt (no import of arbitrary names from a file)."""
    qual = payload.get("optimizer_class") or ""
    state = payload.get("optimizer_state")
    groups_names = payload.get("optimizer_params")
    if not qual or state is None or groups_names is None:
        return None
    module, _, cls_name = qual.rpartition(".")
    cls = getattr(torch.optim, cls_name, None) if module.startswith("torch.optim") else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        log.info("replay: optimizer %s is not a torch.optim class; replaying without it", qual)
        return None
    named = dict(model.named_parameters())
    if named and all(k.startswith("module.") for k in named) and not any(
            n.startswith("module.") for g in groups_names for n in g):
        named = {k[len("module."):]: v for k, v in named.items()}
    groups = []
    for names, saved in zip(groups_names, state["param_groups"]):
        if any(n not in named for n in names):
            log.info("replay: the optimizer's parameters do not match the model; replaying without optimizer")
            return None
        g = {k: v for k, v in saved.items() if k != "params"}
        g["params"] = [named[n] for n in names]
        groups.append(g)
    opt = cls(groups)  # type: ignore[call-arg]  # torch.optim classes take (params, **defaults)
    opt.load_state_dict(state)
    return opt


def _rebuild_scaler(payload: dict[str, Any]) -> torch.amp.GradScaler | None:
    state = payload.get("scaler_state")
    if not state:
        return None
    device = payload.get("scaler_device") or "cpu"
    scaler = torch.amp.GradScaler(device, init_scale=float(state.get("scale", 2.0 ** 16)),
                                  growth_factor=float(state.get("growth_factor", 2.0)),
                                  backoff_factor=float(state.get("backoff_factor", 0.5)),
                                  growth_interval=int(state.get("growth_interval", 2000)))
    scaler.load_state_dict(dict(state))
    return scaler


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    """Restore the caller's RNG states afterwards (the model factory and the replayed step draw from them)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _set_step_rng(rng: Any) -> None:
    if isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor):
        torch.set_rng_state(rng["cpu"])
    if isinstance(rng, dict) and rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _model_from_hf_config(payload: dict[str, Any]) -> nn.Module | None:
    """The architecture from the recorded Hugging Face config and model class, without executing any file: only a
    class of the installed ``transformers`` package is looked up (by name), and built from the config's values."""
    cfg, qual = payload.get("hf_config"), payload.get("model_class") or ""
    if not isinstance(cfg, dict) or not qual.startswith("transformers."):
        return None
    try:
        import transformers
    except ImportError as e:
        raise ReproducerError("this reproducer records a Hugging Face model; rebuilding it needs transformers "
                              "(pip install transformers), or pass --factory module:callable") from e
    cls = getattr(transformers, qual.rpartition(".")[2], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ReproducerError(f"the recorded model class {qual!r} is not a transformers model class; pass "
                              "--factory module:callable (model_factory=) that builds the architecture")
    config_class = cls.config_class
    if config_class is None:
        raise ReproducerError(f"{qual!r} declares no config class; pass --factory module:callable")
    return cls(config_class.from_dict(dict(cfg)))  # type: ignore[no-any-return]


def _model_from_source(payload: dict[str, Any], trust_source: bool) -> tuple[nn.Module, dict[str, Any]]:
    source = payload.get("source") or ""
    if not source:
        raise ReproducerError(
            "replay needs the model's architecture, which this reproducer does not record: pass "
            "--factory module:callable (Python: model_factory=<callable returning the model>)")
    if not trust_source:
        raise ReproducerError(
            f"replay needs the model's architecture; the reproducer names the file {source!r}, but a reproducer's "
            "fields are data and are never executed unless you ask: pass --trust-source (Python: "
            "trust_source=True) if you trust that file, or --factory module:callable")
    if not os.path.isfile(source):
        raise ReproducerError(f"the recorded source {source!r} is not a file; pass --factory module:callable")
    from ampdoctor.precision import load_scenario_module

    module = load_scenario_module(source)
    if not callable(getattr(module, "make", None)):
        raise ReproducerError(f"{source!r} defines no make(); pass --factory module:callable (model_factory=)")
    scenario = dict(module.make())
    return scenario.pop("model"), scenario


def _replay(payload: dict[str, Any], model_factory: Callable[[], nn.Module] | None, loss_fn: Any,
            train_step: Any, origin: str, trust_source: bool = False) -> Report:
    scenario: dict[str, Any] = {}
    if model_factory is not None:
        model = model_factory()
    else:
        built = _model_from_hf_config(payload)
        if built is None:
            model, scenario = _model_from_source(payload, trust_source)
        else:
            model = built
    if not isinstance(model, nn.Module):
        raise ReproducerError(f"model_factory returned {type(model).__name__}, expected a torch.nn.Module")
    _load_state(model, payload["model_state"])
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    batch = _to_device(payload["batch"], device)
    optimizer = _rebuild_optimizer(payload, model)
    scaler = _rebuild_scaler(payload)
    precision = (payload.get("precision") or {}).get("name")
    recipe = _recorded_recipe(payload)
    loss_fn = loss_fn if loss_fn is not None else scenario.get("loss_fn")
    train_step = train_step if train_step is not None else scenario.get("train_step")
    if train_step is None and payload.get("step_method") == "training_step":
        train_step = training_step_replay      # the model's own training_step (never a name from the file)
    micro = payload.get("micro_batches")
    if micro and len(micro) > 1 and payload.get("step_method") == "training_step":   # accumulated micro-batches
        batch, train_step = _to_device(list(micro), device), OverMicroBatches(train_step or training_step_replay)
    calls = payload.get("calls")
    if calls and (isinstance(train_step, CallsReplay) or (train_step is None and loss_fn is None)):
        batch, train_step = _to_device(calls, device), train_step or CallsReplay()   # every call of the step
    from ampdoctor.diagnose import diagnose

    _set_step_rng(payload.get("rng"))
    report = diagnose(model, batch, precision=precision, loss_fn=loss_fn, optimizer=optimizer, scaler=scaler,
                      train_step=train_step, fp8_recipe=recipe)
    summary = dict(report.summary)
    if isinstance(train_step, CallsReplay):
        summary.update(replayed_calls=len(calls or ()), forward_only=train_step.forward_only)
    summary["replay"] = {"step": payload["step"], "anomaly": payload["anomaly"], "reproducer": origin,
                         "optimizer": optimizer is not None, "scaler": scaler is not None}
    return Report(report.findings, report.precision, summary, report.layers, origin or report.source)


def _recorded_recipe(payload: dict[str, Any]) -> Any:
    """The fp8 recipe the watched forward ran under (``precision["fp8_recipe"]``), or ``None``."""
    fields = (payload.get("precision") or {}).get("fp8_recipe")
    if fields is None:
        return None
    from ampdoctor.precision import Fp8Recipe

    try:
        if not isinstance(fields, dict):
            raise TypeError(f"a dict of the recipe's fields, got {type(fields).__name__}")
        return Fp8Recipe(**fields)
    except (TypeError, ValueError) as e:
        raise ReproducerError(f"the reproducer's precision['fp8_recipe'] is not an fp8 recipe ({e}); it records "
                              "the fields of ampdoctor.precision.Fp8Recipe (format, scaling, amax_history_len, "
                              "margin, amax_floor): fix or remove that entry") from None


def replay_payload(payload: dict[str, Any], model_factory: Callable[[], nn.Module] | None = None, *,
                   loss_fn: Any = None, train_step: Any = None, origin: str = "", trust_source: bool = False) -> Report:
    """Rebuild the recorded step on a fresh model and run it under :func:`ampdoctor.diagnose`; the caller's RNG
    states are restored afterwards (the factory and the replayed step draw from them). Source lines come from the
    replayed step's own code only, never from the loop or CLI that called the replay (``frame_boundary``)."""
    with _preserved_rng(), frame_boundary():
        return _replay(payload, model_factory, loss_fn, train_step, origin, trust_source)


def replay(path: str | os.PathLike[str] | dict[str, Any], model_factory: Callable[[], nn.Module] | None = None, *,
           loss_fn: Any = None, train_step: Any = None, trust_source: bool = False) -> Report:
    """Rebuild the step a watch recorded and run it under full diagnosis (:func:`ampdoctor.diagnose`).

    >>> report = replay("repro/step000012-nonfinite-grads.pt", model_factory=build_model)  # doctest: +SKIP
    >>> report.findings[0].code, report.findings[0].module                                # doctest: +SKIP
    ('overflow', 'encoder.block.0.layer.1.DenseReluDense.wo')

    ``model_factory()`` must return the trained model's architecture (weights are loaded from the reproducer).
    Without it, a Hugging Face model is rebuilt from the recorded config and ``transformers`` class (no code from
    any file runs); otherwise the recorded ``source`` (a scenario file defining ``make()``) is imported ONLY with
    ``trust_source=True``: a reproducer is data, and naming a file in it never executes that file. The optimizer
    (``torch.optim`` classes) and GradScaler are rebuilt with their recorded state, the RNG is set to the step's
    state and restored afterwards, the precision is the one seen during the forward. ``loss_fn``/``train_step`` follow
    :func:`ampdoctor.diagnose`. Raises :class:`ReproducerError` for unreadable files or a mismatching model.
    """
    payload = path if isinstance(path, dict) else load_reproducer(path)
    report = replay_payload(payload, model_factory, loss_fn=loss_fn, train_step=train_step,
                            origin="" if isinstance(path, dict) else os.fspath(path), trust_source=trust_source)
    return _with_unreproduced(report, payload, train_step is not None or bool(payload.get("step_method")))


def _with_unreproduced(report: Report, payload: dict[str, Any], custom_step: bool) -> Report:
    """A replay of a non-finite step that found no inf/NaN says so (why, what to do) in a finding of its own: the
    recorded anomaly is real, only its origin was not reproduced (``_rules.not_reproduced``)."""
    info = not_reproduced(report, str(payload["anomaly"]), int(payload["step"]), custom_step)
    if info is None:
        return report
    phase = "forward" if info["anomaly"] == "nonfinite-loss" else "backward"
    generic = Finding("overflow", "error", "", "", phase,
                      f"step {info['step']} ({info['anomaly']}) was not reproduced by the replay",
                      f"The reproducer records {info['anomaly']} at step {info['step']}.",
                      {"step": info["step"], "anomaly": info["anomaly"]}, (), info["step"])
    summary = dict(report.summary)
    summary["replay"] = {**summary.get("replay", {}), "reproduced": False, "not_reproduced": info}
    return Report((*with_unreproduced([generic], info), *report.findings), report.precision, summary,
                  report.layers, report.source)


__all__ = [
    "FORMAT",
    "VERSION",
    "ReproducerError",
    "batch_from_call",
    "is_replaying",
    "load_reproducer",
    "replay",
    "replay_payload",
    "save_reproducer",
    "to_saveable",
]
