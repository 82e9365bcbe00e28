"""The one table of floating-point formats: range, smallest normal/subnormal, unit roundoff, names.

Every layer reads dtype facts here (``ampdoctor.trace.dtype_info``); nothing re-declares them.

>>> from ampdoctor.trace import HALF_DTYPES, dtype_info
>>> fp16 = dtype_info("fp16")
>>> fp16.name, fp16.max, fp16.smallest_subnormal == 2.0 ** -24, fp16.unit_roundoff == 2.0 ** -11
('float16', 65504.0, True, True)
>>> dtype_info("torch.bfloat16").low_precision, dtype_info("float32").low_precision
(True, False)
>>> HALF_DTYPES
(torch.float16, torch.bfloat16)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DTYPES", "DTypeInfo", "FP8_DTYPES", "HALF_DTYPES", "HEADROOM_FORMATS", "dtype_info", "dtype_limits",
           "dtype_name", "flushes_to_zero", "unit_roundoff"]


@dataclass(frozen=True)
class DTypeInfo:
    """One floating-point format. ``unit_roundoff`` is half the spacing at 1 (fp16 2**-11, bf16 2**-8)."""

    name: str                 # torch's name without "torch.": "float16"
    short: str                # "fp16", "bf16", "fp32", "fp64", "e4m3", "e5m2", ...
    dtype: torch.dtype
    bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    unit_roundoff: float
    low_precision: bool       # narrower than fp32: what mixed precision runs in
    fp8: bool
    aliases: tuple[str, ...] = ()

    @property
    def flush_threshold(self) -> float:
        """Half the smallest subnormal: a nonzero value below it rounds to zero."""
        return self.smallest_subnormal / 2


def _info(name: str, short: str, *aliases: str) -> DTypeInfo:
    dt = getattr(torch, name)
    fi = torch.finfo(dt)
    return DTypeInfo(name, short, dt, fi.bits, float(fi.max), float(fi.tiny), float(fi.tiny) * float(fi.eps),
                     float(fi.eps) / 2, fi.bits < 32, name.startswith("float8"), aliases)


_FORMATS: tuple[tuple[str, ...], ...] = (
    ("float16", "fp16", "half"),
    ("bfloat16", "bf16"),
    ("float32", "fp32", "float"),
    ("float64", "fp64", "double"),
    ("float8_e4m3fn", "e4m3"),
    ("float8_e5m2", "e5m2"),
    ("float8_e4m3fnuz", "e4m3fnuz"),
    ("float8_e5m2fnuz", "e5m2fnuz"),
)
#: every format this torch build has, by torch name
DTYPES: dict[str, DTypeInfo] = {f[0]: _info(*f) for f in _FORMATS if hasattr(torch, f[0])}
_BY_NAME: dict[str, DTypeInfo] = {n: i for i in DTYPES.values() for n in (i.name, i.short, *i.aliases)}
#: the fp8 torch dtypes of this build
FP8_DTYPES: tuple[torch.dtype, ...] = tuple(i.dtype for i in DTYPES.values() if i.fp8)
#: the 16-bit formats (fp16, bf16): what autocast and ``model.half()`` / ``.bfloat16()`` run in
HALF_DTYPES: tuple[torch.dtype, ...] = tuple(i.dtype for i in DTYPES.values() if i.low_precision and i.bits == 16)
#: the formats the trace counts flushes for (``flush_<short>`` statistics), in this order: (short, max, threshold)
HEADROOM_FORMATS: tuple[tuple[str, float, float], ...] = tuple(
    (i.short, i.max, i.flush_threshold) for n in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    if (i := DTYPES.get(n)) is not None)


def dtype_name(d: torch.dtype | str) -> str:
    """``torch.float16`` or ``"torch.float16"`` -> ``"float16"`` (other names pass through)."""
    return str(d).replace("torch.", "")


def dtype_info(d: torch.dtype | str | None) -> DTypeInfo | None:
    """The format of a dtype or of one of its names (``"float16"``, ``"fp16"``, ``"half"``, ``"torch.float16"``);
    ``None`` for anything else (integer dtypes, unknown names)."""
    if d is None:
        return None
    return _BY_NAME.get(dtype_name(d).strip())


def dtype_limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(max, smallest normal, smallest subnormal)`` of a floating dtype (raises ``TypeError`` for others)."""
    fi = torch.finfo(dtype)
    return float(fi.max), float(fi.tiny), float(fi.tiny) * float(fi.eps)


def flushes_to_zero(v: float, dtype: torch.dtype) -> bool:
    """A nonzero ``v`` that is 0 in the listed format ``dtype`` (at most half its smallest subnormal: 1e-8 in
    fp16); False for formats outside the table. A host-side test, no tensor."""
    info = _BY_NAME.get(dtype_name(dtype))
    return info is not None and v != 0 and abs(v) <= info.smallest_subnormal / 2


def unit_roundoff(dtype: torch.dtype | str) -> float:
    """u = half the spacing of the dtype at 1: fp16 2**-11, bf16 2**-8, fp32 2**-24, e4m3 2**-4, e5m2 2**-3;
    2**-24 (fp32's) for anything that is not a floating dtype."""
    info = dtype_info(dtype)
    if info is not None:
        return info.unit_roundoff
    try:
        return float(torch.finfo(getattr(torch, dtype_name(dtype))).eps) / 2
    except (AttributeError, TypeError):
        return 2.0 ** -24
