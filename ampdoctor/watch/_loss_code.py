"""The loss a training loop computes from the model's output, recorded call by call so a replay can run it.

When the watched model returns no loss (``logits = model(x); loss = focal(logits, y); loss.backward()``), the
in-process replay would run the forward alone and miss an inf/NaN made by the loop's loss code. While the watch
is told to (``ampdoctor run``), each training step's torch calls between the root module's return and
``backward()`` are recorded at the ``__torch_function__`` level (``torch.sigmoid``, ``Tensor.__rsub__``,
``torch.log``, ...: what the script called, before autocast, so a replay in fp32 runs them in fp32), with the
tensors they read either the model's output, an earlier call's result, or a tensor from outside (targets, class
weights: kept by reference for that step) that requires no grad: a loss that adds another forward's loss or reads a
parameter is not recorded (a replay would backpropagate into the live graph or the user's parameter).
:meth:`LossProgram.loss_fn` runs the same calls on a replay's output:
nothing from the script's source runs, only the torch functions it called, in its order, with its arguments.

The recorder is a :class:`~torch.overrides.TorchFunctionMode` pushed when the root module returns and popped as
soon as ``backward()`` returns or raises (:func:`_leave_on_return`; else at the optimizer step, the next forward, the
watch's exit): a step whose loss uses a
``TorchFunctionMode`` of its own, or more than :data:`MAX_CALLS` calls, is not recorded (the replay then says it
ran the forward alone).
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import sys
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ampdoctor.precision import default_loss
from ampdoctor.trace import user_frame
from ampdoctor.watch._hooks import Health, Hook, guarded
from ampdoctor.watch._payload import MAX_STEP_CALLS as MAX_MICRO  # a reproducer keeps as many calls
from ampdoctor.watch._reproducer import is_replaying

log = logging.getLogger("ampdoctor.watch")

#: a loss computed in more torch calls than this is not recorded (the recorder stops)
MAX_CALLS = 512
#: a loss reading more forwards of the root module than this is not recorded
MAX_FORWARDS = 8

_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)
_CALL = (lambda func, args, kwargs: func(*args, **kwargs)).__code__


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn`` applied to each tensor/``Ref`` in nested tuples, lists and dicts (arguments are small and flat)."""
    if isinstance(x, (torch.Tensor, Ref)):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, v) for v in x) if type(x) in (tuple, list) else x
    if type(x) is dict:
        return {k: _map(fn, v) for k, v in x.items()}
    return x


def _leaves(x: Any) -> list[Any]:
    """The values of a result or model output, in order (tuples, lists, dicts and ModelOutput-like mappings)."""
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        return [leaf for v in x for leaf in _leaves(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    return [x]


def _reads_graph(x: Any) -> bool:
    """Whether recorded arguments hold a tensor from outside (not a ``Ref``) that requires grad."""
    found: list[bool] = []
    _map(lambda t: found.append(True) if isinstance(t, torch.Tensor) and t.requires_grad else None, x)
    return bool(found)


def _refs(x: Any) -> list[Ref]:
    out: list[Ref] = []
    _map(lambda r: out.append(r) if isinstance(r, Ref) else None, x)
    return out


def _at(where: tuple[str, int] | None) -> Callable[..., Any]:
    """A caller of a recorded function whose frame carries the script's file and line (so an op located in the
    replay names the script's statement, not this module); it runs only ``func(*args, **kwargs)``."""
    code = _CALL if where is None else _CALL.replace(co_filename=where[0], co_firstlineno=where[1])
    return types.FunctionType(code, {"__builtins__": builtins})


@dataclass(frozen=True)
class Ref:
    """A tensor a recorded call read: leaf ``leaf`` of the output of the step's ``k``-th recorded forward
    (``call == -1 - k``) or of call ``call``'s result."""

    call: int
    leaf: int


@dataclass(frozen=True)
class Call:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    where: tuple[str, int] | None = None


@dataclass(frozen=True)
class LossProgram:
    """The recorded loss code of one step: its calls and the reference of the tensor ``backward()`` ran on."""

    calls: tuple[Call, ...]
    loss: Ref
    #: the root module's forwards the loss reads (a GAN discriminator's loss: its real and its fake call)
    forwards: int = 1
    #: gradient accumulation: the loss code of the step's earlier micro-batches, in order (each read one forward)
    earlier: tuple[LossProgram, ...] = ()

    @property
    def micro_batches(self) -> tuple[LossProgram, ...]:
        """Each micro-batch's loss code, in order, this one last (one entry without accumulation)."""
        return (*self.earlier, dataclasses.replace(self, earlier=()))

    def loss_fn(self, output: Any, batch: Any = None) -> torch.Tensor:
        """The recorded calls run on ``output`` (the replay's model output); returns the loss."""
        return self.run([output])

    def run(self, outputs: list[Any]) -> torch.Tensor:
        """The recorded calls run on the outputs of the replay's last :attr:`forwards` forwards, in order."""
        if len(outputs) != self.forwards:
            raise ValueError(f"the recorded loss reads {self.forwards} forward(s), got {len(outputs)} output(s)")
        values: dict[int, list[Any]] = {-1 - k: _leaves(out) for k, out in enumerate(outputs)}

        def resolve(x: Any) -> Any:
            return values[x.call][x.leaf] if isinstance(x, Ref) else x

        for i, c in enumerate(self.calls):
            out = _at(c.where)(c.func, _map(resolve, c.args), _map(resolve, c.kwargs))
            values[i] = _leaves(out)
        loss = resolve(self.loss)
        if not isinstance(loss, torch.Tensor):
            raise TypeError("the recorded loss is not a tensor")
        return loss


class LossRecorder(TorchFunctionMode):
    """Records the torch calls of one step from the model's output to ``backward()``."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self._ids: dict[int, Ref] = {}
        self._alive: dict[Ref, Any] = {}     # keeps recorded tensors alive while recording: ids stay unique
        #: given the loss (before GradScaler's scaling) when backward() runs on it (``record_loss_code(losses=True)``)
        self.on_loss: Callable[[torch.Tensor], None] | None = None
        for i, leaf in enumerate(_leaves(output)):
            if isinstance(leaf, torch.Tensor):
                self._ids[id(leaf)] = self._keep(Ref(-1, i), leaf)
        self.calls: list[Call] = []
        self._reads_output: set[int] = set()     # the calls computed from the model's output
        self.program: LossProgram | None = None
        self.failed = not self._ids
        self.done = self.failed
        self.forwards = 1
        #: a further forward of the root module runs inside the loss code: its own ops are not loss code
        self.paused = False

    def add_output(self, output: Any) -> None:
        """The output of a further forward the loss may read (its leaves become ``Ref(-1 - k, i)``)."""
        if self.forwards >= MAX_FORWARDS:
            self.stop(f"the loss reads more than {MAX_FORWARDS} forwards")
            return
        for i, leaf in enumerate(_leaves(output)):
            if isinstance(leaf, torch.Tensor):
                self._ids[id(leaf)] = self._keep(Ref(-1 - self.forwards, i), leaf)
        self.forwards += 1

    def _spec(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self._ids.get(id(x), x)
        return x

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.done or self.paused:
            return func(*args, **kwargs)
        try:
            return self._handle(func, args, kwargs)
        except BaseException:          # the user's loss code or backward() failed: record nothing more
            if not self.done:
                self.stop("the loss code raised")
            raise
        finally:
            if self.done:              # leave the mode stack as soon as torch has put this mode back on it
                _leave_on_return(self, sys._getframe(1))

    def _handle(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if func in _BACKWARDS:
            self._finish(args[0] if args else kwargs.get("tensors"))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if len(self.calls) >= MAX_CALLS:
            self.stop(f"the loss code made more than {MAX_CALLS} torch calls")
            return out
        try:
            call = Call(func, _map(self._spec, tuple(args)), _map(self._spec, kwargs), user_frame(3))
            if not _refs((call.args, call.kwargs)):   # reads no forward's output: an input (a target, a detached
                return out                            # batch), kept by reference when a recorded call reads it
            if _reads_graph((call.args, call.kwargs)):
                self.stop("the loss reads a tensor with autograd history that is not computed from this forward's "
                          "output (another forward's loss, a parameter): a replay would backpropagate into it")
                return out
            self.calls.append(call)
            i = len(self.calls) - 1
            reads = [x for x in _refs((call.args, call.kwargs))]
            if any(x.call < 0 or x.call in self._reads_output for x in reads):
                self._reads_output.add(i)
            for j, leaf in enumerate(_leaves(out)):
                if isinstance(leaf, torch.Tensor):
                    self._ids[id(leaf)] = self._keep(Ref(i, j), leaf)
        except Exception as exc:  # noqa: BLE001 - recording must never break the user's step
            self.stop(f"{type(exc).__name__}: {exc}")
        return out

    def _finish(self, loss: Any) -> None:
        ref = self._ids.get(id(loss)) if isinstance(loss, torch.Tensor) else None
        if ref is None or (ref.call >= 0 and ref.call not in self._reads_output):
            self.stop("backward() ran on a tensor not computed from the model's output")
            return
        self.program = LossProgram(tuple(self.calls), ref, self.forwards)
        if self.on_loss is not None:
            try:
                self.on_loss(self._unscaled(ref, loss).detach())
            except Exception as exc:  # noqa: BLE001 - checking the loss must never break the user's backward()
                log.debug("the recorded loss is not checked: %s", exc)
        self._release()

    def _keep(self, ref: Ref, leaf: torch.Tensor) -> Ref:
        self._alive[ref] = leaf
        return ref

    def _unscaled(self, ref: Ref, loss: torch.Tensor) -> torch.Tensor:
        """The loss before ``scaler.scale(loss)`` (a product with a tensor the model's output does not reach)."""
        call = self.calls[ref.call] if ref.call >= 0 else None
        if call is not None and getattr(call.func, "__name__", "") in ("mul", "__mul__") and len(call.args) == 2:
            refs = [a for a in call.args if isinstance(a, Ref)]
            if len(refs) == 1 and any(isinstance(a, torch.Tensor) for a in call.args):
                return self._alive.get(refs[0], loss)
        return loss

    def stop(self, why: str) -> None:
        log.debug("the loss code is not recorded: %s", why)
        self.failed = True
        self._release()

    def _release(self) -> None:
        self.done = True
        self._ids, self._alive = {}, {}

    def pop(self) -> bool:
        """Leave the mode stack if this mode is on top (True when it is off the stack)."""
        stack = _get_current_function_mode_stack()
        if not stack or stack[-1] is not self:
            return self not in stack
        self.__exit__(None, None, None)
        self._release()
        return True


def _leave_on_return(rec: LossRecorder, caller: types.FrameType) -> None:
    """Pop ``rec`` off the mode stack right after the torch call it is handling returns (or raises).

    While a ``TorchFunctionMode`` handles a call, torch has taken it off the stack and puts it back when the handler
    returns (``handle_torch_function``'s ``_pop_mode_temporarily`` for Python functions such as
    ``Tensor.backward``, a C++ guard for C++ functions), so the handler cannot leave the stack itself. A profile
    function, set for this one return, does it at the first return event of ``caller`` (the frame that called the
    handler): the stack is restored by then. Left on the stack, the done recorder would be a pass-through frame in
    every later torch call, and torch's warnings would name ``_loss_code.py`` instead of the user's line. When a
    profiler is already installed (cProfile, a sampling profiler's hook) it stays untouched: the tap pops the
    recorder at its next hook instead (the optimizer step, the next forward, the watch's exit).
    """
    if sys.getprofile() is not None:
        return

    def on_event(frame: types.FrameType, event: str, arg: Any) -> None:
        if frame is not caller or event not in ("return", "c_return", "c_exception"):
            return
        stack = _get_current_function_mode_stack()
        if event != "return" and rec not in stack:     # a builtin the caller ran before torch restored the stack
            return
        sys.setprofile(None)
        try:
            rec.pop()
        except Exception as exc:  # noqa: BLE001 - never into the user's code; the tap pops it at its next hook
            log.debug("the loss recorder stays on the mode stack (%s)", exc)

    sys.setprofile(on_event)


class LossCodeTap:
    """Records each training step's loss code on ``model`` (a forward hook on the root module, a step pre-hook on
    the optimizer to leave the mode stack); keeps the last two steps' :class:`LossProgram` (a step that starts from
    inf/NaN weights replays the step before it), of each step its last micro-batch's (the inputs a replay has). A
    model that returns its loss itself is not recorded (a replay runs its forward, loss included)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step_of: Callable[[], int],
                 health: Health) -> None:
        self.health = health
        self._step_of = step_of
        self.recorder: LossRecorder | None = None
        self._step = -1
        self._programs: deque[tuple[int, LossProgram]] = deque(maxlen=2)
        self.optimizer = optimizer
        #: given the loss a model returns itself, each training forward (``record_loss_code(losses=True)``)
        self.on_loss: Callable[[torch.Tensor], None] | None = None
        self.handles = [model.register_forward_pre_hook(Hook(self.on_input)),
                        model.register_forward_hook(Hook(self.on_output))]
        if optimizer is not None:   # global: runs before the watch's own step hook, whose torch calls then skip
            self.handles.append(register_optimizer_step_pre_hook(Hook(self.on_step)))   # this mode

    @guarded
    def on_input(self, module: nn.Module, args: Any) -> None:
        rec = self.recorder
        if not is_replaying() and rec is not None and not rec.done:   # a further forward inside the loss code
            rec.paused = True

    @guarded
    def on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_replaying():         # a replay's copy shares this hook: its forward is not the script's
            return
        rec = self.recorder
        if rec is not None and not rec.done and rec.paused:   # the loss may read this forward too (a GAN's
            rec.paused = False                                # discriminator on the real and the fake batch)
            rec.add_output(output)
            return
        if rec is not None and not rec.done:
            rec.stop("a forward ran before backward() outside the recording")
        self.settle()
        if self.recorder is not None or not torch.is_grad_enabled():
            return
        loss = default_loss(output)
        if loss is not None:
            if self.on_loss is not None:
                self.on_loss(loss.detach())
            return
        rec = LossRecorder(output)
        rec.on_loss = self.on_loss
        if not rec.failed:
            rec.__enter__()
            self.recorder, self._step = rec, self._step_of()

    @guarded
    def on_step(self, optimizer: Any, *args: Any) -> None:
        if optimizer is self.optimizer:
            self.settle()

    def settle(self) -> None:
        """Keep a finished recording; leave the mode stack when on top (else try again at the next hook)."""
        rec = self.recorder
        if rec is None:
            return
        if rec.program is not None and not any(p.calls is rec.program.calls for _, p in self._programs):
            program = rec.program
            if self._programs and self._programs[-1][0] == self._step:   # gradient accumulation: one forward
                prev = self._programs.pop()[1]    # and backward per micro-batch; the step keeps each one's code
                micro = prev.micro_batches if prev.forwards == program.forwards == 1 else ()
                program = dataclasses.replace(program, earlier=micro if len(micro) < MAX_MICRO else ())
            self._programs.append((self._step, program))
        if not rec.done and self._step != self._step_of():
            rec.stop("the step ended before backward()")
        if rec.done and rec.pop():
            self.recorder = None

    def program(self, step: int) -> LossProgram | None:
        """The loss code recorded in ``step``, if any."""
        self.settle()
        return next((p for s, p in reversed(self._programs) if s == step), None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        rec = self.recorder
        if rec is not None:
            rec.stop("the watch is closing")
            if not rec.pop():
                log.warning("a TorchFunctionMode entered after the model's forward is still "
                            "active; the loss recorder stays below it as a pass-through")
        self.recorder = None


__all__ = ["MAX_CALLS", "Call", "LossCodeTap", "LossProgram", "LossRecorder", "Ref"]
