"""One set of tensors for consecutive runs of one spec: the next run's copy takes over the last one's storage.

The diagnosis runs the target and then the float32 reference, each on its own deep copy of the user's model,
optimizer and scaler (:func:`ampdoctor.precision._step.prepare`). Where the two copies hold tensors of the same
dtype, shape and layout -- the amp precisions, whose parameters stay float32 -- a second copy
only allocates and page-faults memory that the first one has just given back (at 750M parameters ~3 GiB).

:class:`SharedCopy` avoids that. After a run, :meth:`SharedCopy.keep` remembers the storage of every parameter,
buffer and optimizer-state tensor of the finished copy whose user twin has the same dtype, shape, strides and
device. The next :func:`~ampdoctor.precision._step.prepare` calls :meth:`SharedCopy.take`: it copies the user's
values into those storages (byte for byte, no allocation) and returns a ``deepcopy`` memo that maps each user
tensor to a fresh tensor object over that storage. The deep copy made with it is the same deep copy as before --
fresh modules, Parameter objects (no gradient, no hooks), optimizer and scaler, every other tensor copied -- only
its large storages are recycled, so the next run starts from bitwise the same state.

Optimizer state that the user's optimizer does not hold yet (a fresh optimizer creates it lazily in its first
step) is not kept: the next run's optimizer creates it as the user's would. Not shared (today's path: a fresh
copy): 16-bit precisions (the target casts the model), specs with transforms (they may change the copy's
structure), DDP/FSDP wrappers, tensor subclasses, plain tensors with gradients or Python attributes, and tensors
whose storage another tensor of the model or optimizer also uses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampdoctor.precision import _distributed
from ampdoctor.precision._contexts import LOW_DTYPES
from ampdoctor.precision._spec import StepSpec


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.layout == torch.strided == b.layout
            and not (a.is_conj() or a.is_neg() or b.is_conj() or b.is_neg() or a.is_quantized))


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor whose deep copy is a tensor over a copy of its storage and nothing else."""
    return type(t) is torch.Tensor and not t.requires_grad and t.grad is None and not t.__dict__


def _storage_users(model: nn.Module, opt: Any) -> dict[int, int]:
    """Storage address -> how many distinct parameter, buffer and optimizer-state tensors use it."""
    ts = list(model.parameters()) + list(model.buffers())
    if isinstance(opt, torch.optim.Optimizer):
        ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out: dict[int, int] = {}
    for t in {id(t): t for t in ts}.values():
        ptr = t.untyped_storage().data_ptr()
        out[ptr] = out.get(ptr, 0) + 1
    return out


class SharedCopy:
    """The storages a finished run's copy hands over to the next run of the same spec (see the module doc)."""

    def __init__(self, spec: StepSpec) -> None:
        self.spec = spec
        #: (user tensor, the finished copy's tensor over the storage to reuse, is a parameter)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []

    def __len__(self) -> int:
        return len(self._pairs)

    def addresses(self) -> set[int]:
        """The storage addresses held for the next copy."""
        return {c.untyped_storage().data_ptr() for _, c, _ in self._pairs}

    def usable(self) -> bool:
        """Whether the spec's runs can share their copies at all."""
        spec = self.spec
        return (not spec.transforms and spec.precision not in LOW_DTYPES
                and _distributed.wrapper_kind(spec.model) is None)

    def keep(self, model: nn.Module, optimizer: Any) -> None:
        """Remember the finished copy's reusable tensors (``model``/``optimizer``: the copy, after its run)."""
        self._pairs = []
        if not self.usable():
            return
        user_p = list(self.spec.model.named_parameters())
        copy_p = list(model.named_parameters())
        user_b = list(self.spec.model.named_buffers())
        copy_b = list(model.named_buffers())
        if [n for n, _ in user_p] != [n for n, _ in copy_p] or [n for n, _ in user_b] != [n for n, _ in copy_b]:
            return  # the run changed the copy's structure
        pairs: list[tuple[torch.Tensor, torch.Tensor, bool]] = [
            (u, c, True) for (_, u), (_, c) in zip(user_p, copy_p) if type(u) is nn.Parameter]
        pairs += [(u, c, False) for (_, u), (_, c) in zip(user_b, copy_b) if _plain(u)]
        pairs += self._state_pairs(optimizer)
        users, copies = _storage_users(self.spec.model, self.spec.optimizer), _storage_users(model, optimizer)
        self._pairs = [(u, c.detach(), param) for u, c, param in pairs
                       if _same_layout(u, c) and users.get(u.untyped_storage().data_ptr()) == 1
                       and copies.get(c.untyped_storage().data_ptr()) == 1
                       and (param or u.untyped_storage().nbytes() == c.untyped_storage().nbytes())]

    def _state_pairs(self, optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        user = self.spec.optimizer
        if not isinstance(user, torch.optim.Optimizer) or not isinstance(optimizer, torch.optim.Optimizer):
            return []
        if type(user) is not type(optimizer) or len(user.param_groups) != len(optimizer.param_groups):
            return []
        out = []
        for ug, cg in zip(user.param_groups, optimizer.param_groups):
            if len(ug["params"]) != len(cg["params"]):
                return []
            for up, cp in zip(ug["params"], cg["params"]):
                ust, cst = user.state.get(up, {}), optimizer.state.get(cp, {})
                out += [(v, cst[k], False) for k, v in ust.items()
                        if isinstance(v, torch.Tensor) and isinstance(cst.get(k), torch.Tensor) and _plain(v)]
        return out

    def take(self) -> dict[Any, Any]:
        """Copy the user's values into the kept storages and return the ``deepcopy`` memo that reuses them (empty
        when nothing was kept). The pairs are handed over: a second call returns an empty memo."""
        memo: dict[Any, Any] = {}
        storages = memo.setdefault("torch", {})  # where ``UntypedStorage.__deepcopy__`` looks storages up
        with torch.no_grad():
            for u, c, param in self._pairs:
                if param:  # Parameter.__deepcopy__ clones the tensor itself (not its storage): a fresh Parameter
                    c.copy_(u.detach())
                    memo[id(u)] = nn.Parameter(c, requires_grad=u.requires_grad)
                else:  # a plain tensor's deep copy is a view of its storage's copy: other views of it follow
                    c.untyped_storage().copy_(u.untyped_storage())
                    memo[id(u)] = c
                    storages[u.untyped_storage()._cdata] = c.untyped_storage()
        if not self._pairs:
            memo.clear()
        self._pairs = []
        return memo
