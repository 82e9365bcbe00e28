"""The watched parameters: names, owner modules, optimizer membership and low-precision ones."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampdoctor.trace import HALF_DTYPES

_LOW_DTYPES = HALF_DTYPES
#: path components wrappers insert into ``named_parameters()`` (FSDP1, activation checkpointing, torch.compile):
#: reports use the names of the user's own model
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def original_name(name: str) -> str:
    """``name`` without the path components wrappers insert (``_fsdp_wrapped_module.up.weight`` -> ``up.weight``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def local_grad(g: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a gradient: an FSDP2 (``DTensor``) gradient's own shard, any other one as is."""
    to_local = getattr(g, "to_local", None)
    return to_local() if callable(to_local) and type(g).__name__ == "DTensor" else g


def unwrap_optimizer(optimizer: Any) -> Any:
    """accelerate/transformers wrappers keep the real optimizer in ``.optimizer``; hooks belong on that one."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


class Parameters:
    """Names, owners and roles of the watched parameters (re-read when the optimizer's param groups change)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.names: dict[int, str] = {id(p): original_name(n) for n, p in model.named_parameters()}
        self.owners: dict[str, str] = {}
        for mod_name, mod in model.named_modules():
            for p in mod.parameters(recurse=False):
                n = self.names.get(id(p))
                if n is not None and n not in self.owners:
                    self.owners[n] = original_name(mod_name)
        self.trainable = [(self.names[id(p)], p) for _, p in model.named_parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.refresh()

    def refresh(self) -> None:
        opt = self.optimizer
        if opt is not None:
            self.opt_params = [p for g in opt.param_groups for p in g["params"]]
            self.opt_names = [self.names.get(id(p), f"optimizer.param_groups[{gi}][{i}]")
                              for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]
            self.signature = tuple(id(p) for p in self.opt_params)
        else:
            self.opt_params = [p for _, p in self.trainable]
            self.opt_names = [n for n, _ in self.trainable]
            self.signature = ()
        opt_ids = {id(p) for p in self.opt_params}
        self.not_in_optimizer = tuple(n for n, p in self.trainable if opt is not None and id(p) not in opt_ids)
        self.low = [(n, p) for n, p in zip(self.opt_names, self.opt_params)
                    if opt is not None and p.requires_grad and (p.dtype in _LOW_DTYPES or
                                                                (p.is_floating_point() and p.element_size() == 1))]

    def confirm_nonfinite(self, names: Any) -> tuple[str, ...]:
        """Exactly which of ``names`` hold inf/NaN gradients (a device read; only when a norm was not finite)."""
        by_name = dict(zip(self.opt_names, self.opt_params))
        grads = [None if by_name[n].grad is None else local_grad(by_name[n].grad) for n in names]
        flags = torch.stack([~torch.isfinite(g.coalesce().values() if g.is_sparse else g).all()
                             for g in grads if g is not None]).tolist()
        return tuple(n for n, f in zip(names, flags) if f)

    def drop_grads(self) -> None:
        """``on_anomaly="skip"``: built-in optimizers leave a parameter (and its state) alone when grad is None."""
        for p in self.opt_params:
            p.grad = None

    def changed(self) -> bool:
        """Whether the optimizer's param groups changed since the last read (``add_param_group``)."""
        opt = self.optimizer
        if opt is None:
            return False
        return sum(len(g["params"]) for g in opt.param_groups) != len(self.signature)   # O(groups) per step


__all__ = ["Parameters", "local_grad", "original_name", "unwrap_optimizer"]
