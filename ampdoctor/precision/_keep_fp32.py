"""Keep named parameters in float32 in a low-precision run, as ``from_pretrained(dtype=float16)`` does.

A run casts its model copy as a whole (``model.to(float16)``, like ``.half()``); the transform made here then
puts the named tensors back in float32 with their *original* values (copied from the caller's model, not
upcast from the rounded copy), so the target run holds exactly what a low-precision load would hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ampdoctor.precision._spec import ScenarioError


def keep_fp32_transform(model: nn.Module, names: Iterable[str]) -> Callable[[nn.Module, Any, Any], None]:
    """A ``StepSpec`` transform ``fn(copy, optimizer, scaler)`` restoring ``names`` of ``model`` in float32.

    ``names`` are parameter or floating buffer names as in ``model.named_parameters()``/``named_buffers()``.
    Raises :class:`ScenarioError` for a name the model does not have. Changes nothing in ``model``.
    """
    wanted = list(dict.fromkeys(names))
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
    own.update((n, b) for n, b in model.named_buffers() if b.is_floating_point())
    missing = [n for n in wanted if n not in own]
    if missing:
        raise ScenarioError(f"keep_fp32: the model has no parameter or buffer {missing[0]!r}; use names from "
                            "model.named_parameters() / named_buffers()")
    originals = {n: own[n] for n in wanted}

    def transform(copy: nn.Module, optimizer: Any, scaler: Any) -> None:
        tensors: dict[str, torch.Tensor] = dict(copy.named_parameters())
        tensors.update(copy.named_buffers())
        with torch.no_grad():
            for n, src in originals.items():
                t = tensors[n]
                if t.dtype != torch.float32:
                    t.data = src.detach().to(device=t.device, dtype=torch.float32).clone()

    return transform
