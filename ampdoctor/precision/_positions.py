"""Per-position range of a long-context forward: max |activation| per position bucket against the format max.

A forward hook on every module reduces each floating output that has a sequence dimension (the first dimension
after the batch whose size is the sequence length) to one |max| per position, on the device; the hooks fold
these into one vector per module and read everything back once. Position-dependent failures (rotary
embeddings in low precision, attention scores growing with length, a cache that grows) show as a curve that
climbs towards the format's maximum.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
from torch import nn

from ampdoctor.precision._contexts import (
    LOW_DTYPES,
    _gemm_context,
    _NoAutocast,
    _precision_context,
    call_model,
    cast_batch,
    device_of,
)
from ampdoctor.trace import dtype_limits, iter_tensors


class _Profile:
    """Forward hooks recording one |max| per position for every module's outputs (removed on exit)."""

    def __init__(self, model: nn.Module, seq_len: int) -> None:
        self.model, self.seq_len = model, seq_len
        self.curves: dict[str, torch.Tensor] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> _Profile:
        try:
            for name, mod in self.model.named_modules():
                self.handles.append(mod.register_forward_hook(self._hook(name)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            for t in iter_tensors(out):
                if not t.is_floating_point() or t.dim() < 2:
                    continue
                dim = next((d for d in range(1, t.dim()) if t.shape[d] == self.seq_len), None)
                if dim is None:
                    continue
                per = t.detach().abs().movedim(dim, 0).reshape(self.seq_len, -1).amax(dim=1).float()
                cur = self.curves.get(name)
                self.curves[name] = per if cur is None else torch.maximum(cur, per)  # NaN propagates
        return hook

    def read(self) -> dict[str, list[float]]:
        if not self.curves:
            return {}
        names = list(self.curves)
        values = torch.stack([self.curves[n].cpu() for n in names]).tolist()  # one host sync
        return dict(zip(names, values))


def position_profile(model: nn.Module, batch: dict[str, Any], *, precision: str | None, policy: str = "cuda",
                     reference: bool = False, transforms: tuple[Any, ...] = ()) -> dict[str, list[float]]:
    """Per module, the |max| of its outputs at each position of ``batch["input_ids"]`` (on a copy, no grad)."""
    seq_len = int(batch["input_ids"].shape[1])
    m = copy.deepcopy(model)
    if reference:
        m.to(torch.float32)
        batch = cast_batch(batch, torch.float32, only_low=True)
    elif precision in LOW_DTYPES:
        m.to(LOW_DTYPES[precision])
        batch = cast_batch(batch, LOW_DTYPES[precision])
    if not reference:
        for tf in transforms:
            tf(m, None, None)
    m.eval()
    device = device_of(m)
    amp = contextlib.nullcontext() if reference else _precision_context(precision, device, policy)
    no_autocast = _NoAutocast(device.type) if reference else contextlib.nullcontext()
    gemm = contextlib.nullcontext() if reference else _gemm_context(precision, device, policy)
    with gemm, _Profile(m, seq_len) as prof, torch.no_grad(), no_autocast, amp:
        call_model(m, batch)
    return prof.read()


def first_position(curve: list[float]) -> int | None:
    """The first position whose |max| is not finite, else the position of the largest |max| (``None``: empty)."""
    if not curve:
        return None
    bad = next((i for i, v in enumerate(curve) if not math.isfinite(v)), None)
    return bad if bad is not None else max(range(len(curve)), key=curve.__getitem__)


def headroom_curve(ref: dict[str, list[float]], target: dict[str, list[float]], precision: str,
                   buckets: int = 32) -> dict[str, Any]:
    """The per-position-bucket |max| over all modules (fp32 reference and target) against the format max."""
    fmt = "bfloat16" if precision.startswith("bf16") else "float16"
    if precision.startswith("fp8"):
        fmt = "float8_e4m3fn" if precision != "fp8-e5m2" else "float8_e5m2"
    fmax = dtype_limits(getattr(torch, fmt))[0]
    seq_len = len(next(iter(ref.values()), []))
    if seq_len == 0:
        return {"format": fmt, "format_max": fmax, "buckets": []}
    size = max(1, -(-seq_len // buckets))
    rows = []
    for start in range(0, seq_len, size):
        end = min(start + size, seq_len)
        best_m, best = "", -1.0
        for name, curve in ref.items():
            v = max(curve[start:end])
            if v > best or (math.isnan(v) and not math.isnan(best)):
                best_m, best = name, v
        t_vals = [x for c in target.values() for x in c[start:end]]
        t_max = max((math.inf if not math.isfinite(x) else x for x in t_vals), default=0.0)
        rows.append({"start": start, "end": end, "ref_absmax": best, "module": best_m, "target_absmax": t_max,
                     "target_nonfinite": any(not math.isfinite(x) for x in t_vals),
                     "margin_bits": math.log2(fmax / best) if best > 0 else None})
    return {"format": fmt, "format_max": fmax, "bucket_size": size, "seq_len": seq_len, "buckets": rows}
