"""What every rule shares: the op and dtype facts it reads (from the registries in ``ampdoctor.trace``),
statistics predicates, wording, evidence and the common fixes.

Rules import this module; it imports nothing from the rules, so the rule modules form no cycle.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from ampdoctor.findings._types import FixProposal
from ampdoctor.trace import (
    ALIAS_OPS,
    DTYPES,
    OPS,
    Bound,
    Kind,
    OpRecord,
    dtype_info,
    dtype_limits,
    dtype_name,
    feeders,
    is_nonfinite,
    op_base,
    ops_with,
    unit_roundoff,
)

#: the low-precision formats (the dtype table's ``low_precision``: fp16, bf16 and the fp8 formats)
LOW = frozenset(name for name, info in DTYPES.items() if info.low_precision)
#: the 16-bit formats (fp16, bf16): parameters held in them lose small updates (fp8 parameters are fp8-scale's)
HALF = frozenset(name for name, info in DTYPES.items() if info.low_precision and info.bits == 16)
#: ops whose output holds the values of their first input, unchanged (repeated at most)
SAME_VALUE_OPS = ops_with(Kind.SAME_ELEMENTS) | ops_with(Kind.REPEATS)
#: bounded activations by name: their backward op and what the bound means
BOUNDS: dict[str, Bound] = {name: info.bound for name, info in OPS.items() if info.bound is not None}
CASTS = ops_with(Kind.CAST)
CANCEL_OPS = ops_with(Kind.CANCELLING)


# ---------------------------------------------------------------------------------------------------- names
def limits(d: torch.dtype | str) -> tuple[float, float, float]:
    """``(max, smallest normal, smallest subnormal)``; ``(inf, 0, 0)`` for a name that is no floating format."""
    if not isinstance(d, str):
        return dtype_limits(d)
    info = dtype_info(d)
    if info is None:
        return math.inf, 0.0, 0.0
    return info.max, info.smallest_normal, info.smallest_subnormal


def is_low(dtype: torch.dtype | str) -> bool:
    return dtype_name(dtype) in LOW


def spacing_below_one(dtype: torch.dtype | str) -> float:
    """Distance between 1 and the largest representable value below 1 (fp16: 2**-11, bf16: 2**-8)."""
    return unit_roundoff(dtype)


# ---------------------------------------------------------------------------------------------------- statistics
_KNOWN = ("absmax", "n_zero", "numel", "norm", "n_nan")


def finite(r: OpRecord) -> bool:
    """Full statistics, all known (a failed statistic is a row of NaN), and no inf/NaN in the values."""
    s = r.stats
    if not s or "n_nan" not in s or any(s.get(k) != s.get(k) for k in _KNOWN):
        return False
    return not is_nonfinite(r)


def counts_known(s: dict[str, float]) -> bool:
    """False for the trace's lite tier (optimizer-phase outputs, parameter leaves): one ``aminmax`` pass, so zeros,
    subnormals and the norm are unknown (they read 0) and ``min_nonzero`` reads inf even though |max| > 0."""
    return not (s.get("absmax", 0.0) > 0 and s.get("min_nonzero") == math.inf)


def all_zero(s: dict[str, float]) -> bool:
    """Every value is exactly 0 (true in both tiers: |max| 0 and nothing non-finite)."""
    return s.get("absmax") == 0 and not (s.get("n_nan", 0) or s.get("n_posinf", 0) or s.get("n_neginf", 0))


def rel(a: float, b: float) -> float:
    """Relative error of ``a`` against ``b`` (inf when either is non-finite or only ``b`` is 0)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if b == 0:
        return 0.0 if a == 0 else math.inf
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------------------------------------------- wording
def fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def where(r: OpRecord) -> str:
    return f"{r.op} in {r.module or '<root>'} ({r.phase}, step {r.step})"


def src_text(r: OpRecord) -> str:
    if not r.src:
        return ""
    path, line = r.src
    return f"{os.path.basename(path)}:{line}"


def base_evidence(r: OpRecord) -> dict[str, Any]:
    """The common evidence of a finding at record ``r`` (dtype, numel, input dtypes, autograd node, source line):
    the one place rules start their evidence; they add their own keys, and :class:`Finding` turns the mapping into
    an :class:`~ampdoctor.findings.Evidence` (typed fields for the common keys, the rest in ``extra``)."""
    ev: dict[str, Any] = {"dtype": dtype_name(r.dtype), "numel": int(r.stats.get("numel", 0)),
                          "input_dtypes": list(r.input_dtypes)}
    if r.node:
        ev["autograd_node"] = r.node
    if r.src:
        ev["source"] = f"{os.path.basename(r.src[0])}:{r.src[1]}"
    return ev



# ---------------------------------------------------------------------------------------------------- fixes
def keep_fp32_fix(module: str, *, fp32_outputs: bool = False) -> FixProposal:
    """Run ``module`` in float32; ``fp32_outputs``: its outputs stay float32 after a whole-model cast (a module whose
    output is the model's: casting it back would redo the rounding)."""
    if fp32_outputs:
        return FixProposal(
            title=f"run `{module}` in float32 and return its output in float32 (it is the model's output)",
            snippet=f"ampdoctor.fix(model, report, which='keep_fp32')  # or: {module}.float() and call it on "
                    "x.float(), without casting its result back",
            id="keep_fp32", params={"modules": [module], "outputs": "float32"})
    return FixProposal(
        title=f"run `{module}` in float32 (autocast disabled inside it, inputs upcast)",
        snippet=f"ampdoctor.fix(model, report, which='keep_fp32')  # or wrap {module}.forward in "
                "torch.autocast(device_type, enabled=False) and call it on x.float()",
        id="keep_fp32", params={"modules": [module]})


def bf16_fix(precision: str | None) -> FixProposal:
    """bf16 autocast with fp32 weights: the exponent range of fp32 without losing small updates, which a
    whole-model bf16 cast would (its 8-bit mantissa rounds AdamW's updates away)."""
    del precision  # the same advice from fp16, fp16-amp or an as-given run
    return FixProposal(
        title="run in bfloat16 autocast with fp32 weights (same exponent range as fp32: max 3.39e38)",
        snippet="with torch.autocast(device_type, dtype=torch.bfloat16):  # no GradScaler needed\n    loss = ...",
        id="switch_precision", params={"precision": "bf16-amp"})




# ---------------------------------------------------------------------------------------------------- walks
def group_by_owner(names: Iterable[str], owners: dict[str, str]) -> dict[str, list[str]]:
    """Parameter names grouped by the module that registers them, in first-seen order."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(owners.get(n, n.rpartition(".")[0]), []).append(n)
    return out


__all__ = [
    "ALIAS_OPS", "BOUNDS", "CANCEL_OPS", "CASTS", "HALF", "LOW", "SAME_VALUE_OPS", "all_zero", "base_evidence",
    "bf16_fix",
    "counts_known", "dtype_name", "feeders", "finite", "fmt", "group_by_owner", "is_low", "keep_fp32_fix", "limits",
    "op_base", "rel", "spacing_below_one", "src_text", "unit_roundoff", "where",
]
