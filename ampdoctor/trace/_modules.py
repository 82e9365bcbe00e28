"""Which module runs an op: a module stack in forward, autograd-node ownership in backward.

Forward: forward pre/post hooks (removable handles) on every submodule keep a stack; the innermost module
on it runs the op. Backward: when a module's forward returns, the autograd nodes reachable from its
outputs that were created during that call and are not yet owned are assigned to it. Children return
before their parents, so each node is owned by the innermost module whose own code created it. Inside
``__torch_dispatch__`` during backward, ``torch._C._current_autograd_node()`` names the node being run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction

_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
              os.path.dirname(torch.nn.__file__))


#: frames above which :func:`user_frame` does not look (:class:`frame_boundary`: a replay's entry, whose callers --
#: the training loop that detected an anomaly, a CLI -- did not run the replayed step's ops)
_BOUNDARIES: list[Any] = []


class frame_boundary:  # noqa: N801 - used like a function: ``with frame_boundary():``
    """Inside ``with frame_boundary():`` :func:`user_frame` stops at the frame that entered it: an op whose
    code has no user frame below (a built-in module) gets no source line rather than its caller's."""

    def __enter__(self) -> None:
        _BOUNDARIES.append(sys._getframe(1))

    def __exit__(self, *exc: Any) -> None:
        _BOUNDARIES.pop()


def user_frame(depth: int = 3) -> tuple[str, int] | None:
    """``(file, line)`` of the innermost caller outside torch and ampdoctor: the user's statement that ran an op
    (a module's code or the training-step code outside every module), below the innermost :class:`frame_boundary`."""
    f: Any = sys._getframe(depth)
    stop = _BOUNDARIES[-1] if _BOUNDARIES else None
    while f is not None and f is not stop:
        fn = f.f_code.co_filename
        if not fn.startswith(_SKIP_DIRS) and not fn.startswith("<"):
            return fn, f.f_lineno
        f = f.f_back
    return None


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts/dataclasses/ModelOutput-like objects."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth > 6:
        return
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o, _depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), _depth + 1)


class ModuleAttribution:
    """Tracks the running module (forward) and owns autograd nodes (backward). A context manager."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        for name, mod in model.named_modules(remove_duplicate=True):
            self.names.setdefault(id(mod), name)
        self.param_owner: dict[int, str] = {}
        self.param_names: dict[int, str] = {}
        for mname, mod in model.named_modules(remove_duplicate=True):
            for pname, p in mod.named_parameters(recurse=False):
                self.param_owner.setdefault(id(p), mname)
                self.param_names.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
        self.stack: list[str] = []
        self._starts: list[int] = []
        self.node_owner: dict[Any, str] = {}
        self._max_seq = -1
        self._handles: list[Any] = []
        self.calls = 0  # root forward calls seen

    # -- hooks ---------------------------------------------------------------------------------------------
    def __enter__(self) -> ModuleAttribution:
        try:
            for mod in self.model.modules():
                name = self.names[id(mod)]
                self._handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self._handles.append(mod.register_forward_hook(self._post(name), with_kwargs=True, always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str):  # noqa: ANN202
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            start = self._max_seq
            with _NO_TORCH_FUNCTION():  # ours: no torch-function mode or subclass sees these reads
                for t in iter_tensors((args, kwargs)):
                    fn = t.grad_fn
                    if fn is not None:
                        start = max(start, fn._sequence_nr())
            if not self.stack:
                self.calls += 1
            self.stack.append(name)
            self._starts.append(start)

        return hook

    def _post(self, name: str):  # noqa: ANN202
        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self.stack or self.stack[-1] != name:
                # an exception unwound inner modules without their post hooks: resynchronise
                while self.stack and self.stack[-1] != name:
                    self.stack.pop()
                    self._starts.pop()
                if not self.stack:
                    return
            self.stack.pop()
            start = self._starts.pop()
            if torch.is_grad_enabled():
                with _NO_TORCH_FUNCTION():
                    self._own(output, name, start)

        return hook

    def _own(self, output: Any, name: str, start: int) -> None:
        # Walk back from the outputs through every node created during this call (sequence number above
        # ``start``), also through nodes a child already owns, so that inline math feeding a child is found;
        # claim only the unowned ones.
        todo = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
        owner = self.node_owner
        seen: set[Any] = set()
        while todo:
            fn = todo.pop()
            if fn in seen or type(fn).__name__ == "AccumulateGrad":
                continue  # parameters are attributed through their owner module
            seen.add(fn)
            seq = fn._sequence_nr()
            if seq <= start:
                continue
            if fn not in owner:
                owner[fn] = name
            if seq > self._max_seq:
                self._max_seq = seq
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    todo.append(nxt)

    # -- queries -------------------------------------------------------------------------------------------
    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def backward_owner(self, node: Any) -> str:
        """The module owning autograd ``node`` (``""`` when created outside every module)."""
        if node is None:
            return ""
        owner = self.node_owner.get(node)
        if owner is not None:
            return owner
        if type(node).__name__ == "AccumulateGrad":
            var = getattr(node, "variable", None)
            if var is not None:
                return self.param_owner.get(id(var), "")
        return ""
