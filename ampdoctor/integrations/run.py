"""``ampdoctor run -- python train.py ARGS``: watch every optimizer an unmodified training script creates.

>>> report = run_script(["python", "train.py", "--epochs", "1"])      # doctest: +SKIP
>>> report.codes()                                                     # doctest: +SKIP
['unused-parameters']

The script runs in this process with :mod:`runpy` (as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` set
as Python would), under two global hooks with removable handles:

* ``torch.nn.modules.module.register_module_forward_pre_hook``: the first call of a module holding trainable
  parameters that an existing optimizer updates attaches :func:`ampdoctor.watch` to that module (the outermost
  module called) and those optimizers, with the script's GradScaler; with several enabled scalers (a GAN), each
  watch takes the one it sees stepping its optimizer (:meth:`~ampdoctor.watch.Watch.scaler_among`).
  Each outermost module is looked at once; the hook is removed once a watch is attached (or after 16 looks).
* ``torch.optim.optimizer.register_optimizer_step_pre_hook``: an optimizer created later (or whose model was
  never called as a module) is attached at its first step; its model is the largest module that owns its
  parameters. The new watch's own step hooks run in that very step.

Objects are found with :func:`gc.get_objects` once per attachment, not per step. Nothing is printed: the report
is returned (``summary["script"]`` says how the script ended). :class:`~ampdoctor.watch.AnomalyError`
(``on_anomaly="raise"``) stops the script and is recorded; ``SystemExit`` ends it normally; any other exception
is recorded in the report and logged.
"""

from __future__ import annotations

import gc
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ampdoctor.findings import Report
from ampdoctor.watch import AnomalyError, Watch, is_replaying, watch

log = logging.getLogger(__name__)

_MAX_FORWARD_TRIES = 16


def _inner(opt: Any) -> Any:
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


class _Runner:
    """Attaches watches lazily while a script runs; one per optimizer."""

    def __init__(self, source: str, options: dict[str, Any]) -> None:
        self.source = source
        self.options = options
        self.watches: list[Watch] = []
        self.watched: set[int] = set()
        self._fwd_handle: Any = None
        self._opt_handle: Any = None
        self._tries = 0
        self._scanned: set[int] = set()
        self._extra_handles: list[Any] = []
        #: how the watches chose among several GradScalers, for the report
        self.scaler_note: str | None = None

    def __enter__(self) -> _Runner:
        self._opt_handle = register_optimizer_step_pre_hook(self._on_step)
        self._fwd_handle = nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in (self._fwd_handle, self._opt_handle, *self._extra_handles):
            if h is not None:
                h.remove()
        self._fwd_handle = self._opt_handle = None
        for w in reversed(self.watches):
            try:
                w.__exit__(None, None, None)
            except AnomalyError as e:      # raised at exit for an anomaly seen while closing
                log.warning("%s", e)

    # -- global hooks --------------------------------------------------------------------------------
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if is_replaying() or self._fwd_handle is None or id(module) in self._scanned:
            return
        if not any(p.requires_grad for p in module.parameters()):
            return
        self._scanned.update(id(m) for m in module.modules())   # its submodules' calls follow: one scan per root
        ids = {id(p) for p in module.parameters()}
        opts = [o for o in self._optimizers() if id(o) not in self.watched
                and any(id(p) in ids for g in o.param_groups for p in g["params"])]
        self._tries += 1
        if opts:
            rng = {"cpu": torch.get_rng_state(), "cuda": None}   # before this forward draws from it
            for o in opts:
                w = self._attach(self._owner(o, module), o)
                if w.model is module:
                    self._first_call(w, rng)
        # a GAN's second model is called later (and its optimizer may never step: GradScaler skips every step)
        if (opts and all(id(o) in self.watched for o in self._optimizers())) or self._tries >= _MAX_FORWARD_TRIES:
            self._fwd_handle.remove()
            self._fwd_handle = None

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_replaying() or id(optimizer) in self.watched:
            return
        if _inner(optimizer) is not optimizer:      # a wrapper: its inner optimizer's step is watched
            return
        model = self._owner(optimizer, None)
        if model is None:
            self.watched.add(id(optimizer))
            log.info("ampdoctor run: an optimizer updates no module's parameters; not watched")
            return
        self._attach(model, optimizer)

    def _owner(self, optimizer: torch.optim.Optimizer, default: nn.Module | None) -> Any:
        """The module to watch for ``optimizer``: the smallest one holding all its parameters (so parameters
        that never reach the loss, like an unused head beside the forwarded submodule, are covered), else the
        one holding most of them."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        best: tuple[int, int, int] | None = None
        choice = default
        for m in self._objects(nn.Module):
            own = {id(p) for p in m.parameters()}
            covered = len(params & own)
            if not covered:
                continue
            # most of the optimizer's parameters, then the tightest module, then (the same parameters) the module
            # being called or a DDP wrapper over it: the watch of a DDP job must see the wrapper (its ranks agree)
            outer = m is default or isinstance(m, nn.parallel.DistributedDataParallel)
            key = (-covered, len(own), 0 if outer else 1)
            if best is None or key < best:
                best, choice = key, m
        return choice

    # -- helpers -------------------------------------------------------------------------------------
    @staticmethod
    def _objects(kind: type) -> list[Any]:
        return [o for o in gc.get_objects() if issubclass(type(o), kind)]   # type(): no __class__ lookups

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        seen: dict[int, torch.optim.Optimizer] = {}
        for o in self._objects(torch.optim.Optimizer):
            o = _inner(o)
            seen[id(o)] = o
        return list(seen.values())

    def _scaler(self) -> list[torch.amp.GradScaler]:
        scalers = [s for s in self._objects(torch.amp.GradScaler) if s.is_enabled()]
        if len(scalers) > 1:        # unreachable ones from earlier code may linger in reference cycles
            gc.collect()
            scalers = [s for s in self._objects(torch.amp.GradScaler) if s.is_enabled()]
        if len(scalers) > 1:        # prefer the script's own (a global of its __main__)
            main = vars(sys.modules.get("__main__", sys))
            own = [s for s in scalers if any(v is s for v in main.values())]
            scalers = own if own else scalers
        if len(scalers) > 1 and self.scaler_note is None:
            self.scaler_note = (f"{len(scalers)} enabled GradScalers exist (one per optimizer, as in a GAN): each "
                                "optimizer's watch takes the scaler whose scaler.step(optimizer) it sees first, and "
                                "sees that scaler's skipped steps and scale from then on (a scaler that never steps "
                                "an optimizer is bound to none)")
            log.info("ampdoctor run: %s", self.scaler_note)
        return scalers

    def _requested_precision(self) -> tuple[str, str, bool] | None:
        """The precision the script asked a framework it already imported for (``TrainingArguments(fp16=True)``,
        ``Accelerator(mixed_precision=...)``, a Lightning ``Trainer(precision=...)``), as ``(fp16|bf16, by,
        mixed)``; None when it asked none. Nothing is imported here."""
        kinds = [k for k in (getattr(sys.modules.get("transformers.training_args"), "TrainingArguments", None),
                             getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None),
                             getattr(sys.modules.get("lightning.pytorch.trainer.trainer"), "Trainer", None))
                 if isinstance(k, type)]
        for o in (o for k in kinds for o in self._objects(k)):
            for flag in ("fp16", "bf16"):
                if getattr(o, flag, None) is True:
                    return flag, f"TrainingArguments({flag}=True)", True
            mp = str(getattr(o, "mixed_precision", ""))
            if mp in ("fp16", "bf16"):
                return mp, f"Accelerator(mixed_precision={mp!r})", True
            precision = str(getattr(o, "precision", "")) if hasattr(o, "precision_plugin") else ""
            if precision.startswith(("16", "bf16")):
                want = "bf16" if precision.startswith("bf16") else "fp16"
                return want, f"Trainer(precision={precision!r})", "mixed" in precision
        return None

    def _attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Watch:
        self.watched.add(id(optimizer))
        scalers = self._scaler()
        w = watch(model, optimizer, scalers[0] if len(scalers) == 1 else None, source=self.source, **self.options)
        if len(scalers) > 1:
            w.scaler_among(scalers)
        w.__enter__()
        w.record_loss_code(losses=True)   # its loss code: a replay runs it; the model's own loss is checked
        asked = self._requested_precision()
        if asked is not None:       # 16-bit weights under a mixed precision request: said before step 0
            w.expect_precision(asked[0], asked[1], mixed=asked[2])
        self.watches.append(w)
        log.info("ampdoctor run: watching %s with %s", type(model).__name__, type(optimizer).__name__)
        return w

    def _first_call(self, w: Watch, rng: dict[str, Any]) -> None:
        """The watch was attached inside its model's first forward, too late for its own pre-hook: record that
        forward's args/kwargs when it returns (a global hook sees kwargs only after the call), with the RNG state
        from before it, so a failure at step 0 has its inputs."""
        handle: list[Any] = []

        def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if module is w.model:
                handle[0].remove()
                w.observe_call(tuple(args), dict(kwargs), rng)

        handle.append(nn.modules.module.register_module_forward_hook(after, with_kwargs=True))
        self._extra_handles.append(handle[0])

    def report(self, ended: dict[str, Any]) -> Report:
        reports = [w.report() for w in self.watches]
        summary: dict[str, Any] = {"source": "run", "script": ended, "watches": len(reports)}
        if self.scaler_note is not None:
            summary["scaler_note"] = self.scaler_note
        if not reports:
            summary["note"] = "no optimizer step and no module holding an optimizer's parameters was seen"
            return Report((), None, summary, (), self.source)
        if len(reports) == 1:
            r = reports[0]
            return Report(r.findings, r.precision, {**r.summary, **summary}, r.layers, self.source)
        findings = tuple(f for r in reports for f in r.findings)
        summary["per_watch"] = [r.summary for r in reports]
        return Report(findings, reports[0].precision, summary, reports[0].layers, self.source)


def _split(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    args = [str(a) for a in argv]
    if args and args[0] == "--":
        args = args[1:]
    if args and os.path.basename(args[0]).startswith("python") and not args[0].endswith(".py"):
        args = args[1:]
    if not args:
        raise ValueError("run_script needs a command: ['train.py', ARGS...] or ['python', 'train.py', ARGS...] "
                         "or ['-m', 'package.module', ARGS...]")
    if args[0] == "-m":
        if len(args) < 2:
            raise ValueError("'-m' needs a module name, as in: ampdoctor run -- python -m package.train")
        return "module", args[1], args[2:]
    if not os.path.isfile(args[0]):
        raise ValueError(f"script not found: {args[0]!r}; pass the path of the training script, as in: "
                         "ampdoctor run -- python train.py ARGS")
    return "path", args[0], args[1:]


def run_script(argv: Sequence[str], **watch_options: Any) -> Report:
    """Run a training script unchanged under :func:`ampdoctor.watch` and return the report.

    ``argv`` is the command after ``ampdoctor run --``: ``["python", "train.py", *ARGS]``, ``["train.py",
    *ARGS]`` or ``["python", "-m", "pkg.train", *ARGS]``. ``watch_options`` go to every watch (``on_anomaly``,
    ``reproducer_dir``, ...). ``sys.argv`` and ``sys.path`` are restored afterwards; the global hooks are removed
    and every watch is closed, also when the script raises.
    """
    kind, target, rest = _split(argv)
    source = os.path.abspath(target) if kind == "path" else target
    old_argv, old_path = sys.argv[:], sys.path[:]
    ended: dict[str, Any] = {"status": "completed"}
    runner = _Runner(source if kind == "path" else "", dict(watch_options))
    try:
        with runner:
            try:
                if kind == "path":
                    sys.argv = [target, *rest]
                    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                    runpy.run_path(target, run_name="__main__")
                else:
                    sys.argv = [target, *rest]
                    sys.path.insert(0, os.getcwd())
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code
                ended = {"status": "completed" if code in (None, 0) else "exit", "code": code}
            except AnomalyError as e:
                ended = {"status": "anomaly", "kind": e.kind, "step": e.step, "message": str(e),
                         "reproducer": e.reproducer}
            except Exception as e:  # noqa: BLE001 - the script's own failure goes into the report
                log.error("ampdoctor run: the script raised %s: %s", type(e).__name__, e, exc_info=e)
                ended = {"status": "error", "exception": type(e).__name__, "message": str(e).splitlines()[0][:300]
                         if str(e) else ""}
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return runner.report(ended)


__all__ = ["run_script"]
