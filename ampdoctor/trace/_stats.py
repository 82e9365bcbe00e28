"""On-device statistics of one tensor, computed without a host sync.

Each function returns a 1-D float64 tensor on the tensor's device; rows are stacked and read back once per
step. The field order is fixed by :data:`FULL_FIELDS` / :data:`CHEAP_FIELDS`.
"""

from __future__ import annotations

import math

import torch

#: Full statistics, one float64 each. ``absmax``/``min_nonzero`` are over finite values only; ``n_at_max``
#: counts values whose magnitude equals the dtype's largest finite value (clipped by a clamp or a saturating
#: cast); ``n_subnormal`` counts nonzero finite values below the dtype's smallest normal; ``norm`` is the
#: L2 norm of the finite values (computed in fp32).
FULL_FIELDS: tuple[str, ...] = (
    "absmax",
    "min_nonzero",
    "n_nan",
    "n_posinf",
    "n_neginf",
    "n_zero",
    "n_subnormal",
    "n_at_max",
    "numel",
    "norm",
    "n_at_limit",
)

#: The cheap tier: ``torch.aminmax`` of the tensor. inf and NaN propagate through min/max, so these two
#: numbers tell both the range and whether anything is non-finite.
CHEAP_FIELDS: tuple[str, ...] = ("min", "max")

_FP8 = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

#: Ops whose output is bounded; ``n_at_limit`` counts outputs that reached the bound exactly.
BOUNDED_OPS: dict[str, str] = {
    "tanh": "abs1",
    "sigmoid": "01",
    "_softmax": "1",
    "softmax": "1",
}


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def full_stats(t: torch.Tensor, bounded: str | None = None) -> torch.Tensor:
    """Full statistics of ``t`` as a float64 vector in :data:`FULL_FIELDS` order (no host sync)."""
    x = t.detach()
    if x.dtype in _FP8:
        finfo = torch.finfo(x.dtype)
        x = x.float()
    else:
        finfo = torch.finfo(x.dtype)
    if x.is_complex():  # pragma: no cover - complex tensors are not traced
        x = x.abs()
    n = x.numel()
    dev = x.device
    if n == 0:
        return torch.tensor([0.0, math.inf, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64, device=dev)
    a = x.abs()
    finite = torch.isfinite(x)
    af = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=dev))
    absmax = af.amax()
    pos = af > 0
    min_nz = torch.where(pos, af, torch.full((), math.inf, dtype=a.dtype, device=dev)).amin()
    n_nan = torch.isnan(x).sum()
    n_posinf = (x == math.inf).sum()
    n_neginf = (x == -math.inf).sum()
    n_zero = (x == 0).sum()
    n_sub = (pos & (af < finfo.tiny)).sum()
    n_at_max = (a == finfo.max).sum()
    norm = torch.linalg.vector_norm(af, dtype=torch.float64 if af.dtype == torch.float64 else torch.float32)
    if bounded == "abs1":
        n_lim = (a == 1).sum()
    elif bounded == "01":
        n_lim = ((x == 0) | (x == 1)).sum()
    elif bounded == "1":
        n_lim = (x == 1).sum()
    else:
        n_lim = torch.zeros((), dtype=torch.int64, device=dev)
    parts = [absmax, min_nz, n_nan, n_posinf, n_neginf, n_zero, n_sub, n_at_max]
    out = torch.stack([p.to(torch.float64) for p in parts])
    tail = torch.stack([torch.tensor(float(n), dtype=torch.float64, device=dev), norm.to(torch.float64),
                        n_lim.to(torch.float64)])
    return torch.cat([out, tail])


#: Flush thresholds per format (half the smallest subnormal: anything below rounds to zero), in this order.
HEADROOM_FORMATS: tuple[tuple[str, float, float], ...] = (
    ("fp16", 65504.0, 2.0 ** -25),
    ("bf16", 3.3895313892515355e38, 2.0 ** -134),
    ("e4m3", 448.0, 2.0 ** -10),
    ("e5m2", 57344.0, 2.0 ** -17),
)


def flush_counts(t: torch.Tensor) -> torch.Tensor:
    """Per format of :data:`HEADROOM_FORMATS`: count of nonzero finite values that would round to zero."""
    x = t.detach().float()
    a = x.abs()
    nz = (a > 0) & torch.isfinite(a)
    return torch.stack([(nz & (a < th)).sum() for _, _, th in HEADROOM_FORMATS]).to(torch.float64)


def cheap_stats(t: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of ``t`` as float64 (no host sync). Empty tensors give ``[0, 0]``."""
    x = t.detach()
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=x.device)
    if x.dtype in _FP8:
        x = x.float()
    mn, mx = torch.aminmax(x)
    return torch.stack([mn, mx]).to(torch.float64)


def dtype_limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(max, smallest normal, smallest subnormal)`` of a floating dtype."""
    fi = torch.finfo(dtype)
    return float(fi.max), float(fi.tiny), float(fi.tiny) * float(fi.eps)
