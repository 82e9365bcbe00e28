"""What every rule shares: names of ops and dtypes, statistics predicates, wording, evidence and the common fixes.

Rules import this module; it imports nothing from the rules, so the rule modules form no cycle.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from ampdoctor.findings._types import FixProposal
from ampdoctor.trace import OpRecord, dtype_limits
from ampdoctor.trace._lineage import is_nonfinite

LOW = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}

#: ops whose output holds (a subset of) the values of their input: a zero or a bound passes through unchanged.
ALIAS_OPS = {
    "detach", "alias", "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "squeeze", "unsqueeze", "clone", "contiguous", "select", "slice", "as_strided", "lift_fresh", "unfold",
    "flatten", "narrow", "split", "split_with_sizes", "chunk", "unbind", "cat", "stack",
}
#: bounded activations: their backward op, and what the bound means
BOUNDED = {
    "tanh": ("tanh_backward", "±1"),
    "sigmoid": ("sigmoid_backward", "0 or 1"),
    "_softmax": ("_softmax_backward_data", "1"),
    "softmax": ("_softmax_backward_data", "1"),
}
CASTS = {"_to_copy", "to", "_to_copy_", "copy_"}
MATMULS_A0 = {"mm", "bmm", "matmul", "linear", "_scaled_mm"}   # reduction length = inputs[0].shape[-1]
MATMULS_A1 = {"addmm", "baddbmm", "addbmm", "addmv"}           # inputs[1].shape[-1]
ROW_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "cumsum", "logsumexp",
           "_safe_softmax", "native_group_norm"}
CANCEL_OPS = {"sub", "add", "rsub", "addcmul", "addcdiv", "sum", "mean", "var", "lerp"}


# ---------------------------------------------------------------------------------------------------- names
_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)))}


def dtype_name(d: torch.dtype | str) -> str:
    return str(d).replace("torch.", "")


def limits(d: torch.dtype | str) -> tuple[float, float, float]:
    dt = _DTYPES.get(dtype_name(d)) if isinstance(d, str) else d
    if dt is None:
        return math.inf, 0.0, 0.0
    return dtype_limits(dt)


def op_base(op: str) -> str:
    """``"aten.mm.default"`` -> ``"mm"``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


def is_low(dtype: torch.dtype | str) -> bool:
    return dtype_name(dtype) in LOW


def unit_roundoff(dtype: torch.dtype | str) -> float:
    """u = half the spacing of the dtype at 1: fp16 2**-11, bf16 2**-8, fp32 2**-24, e4m3 2**-4, e5m2 2**-3."""
    name = dtype_name(dtype)
    try:
        dt = getattr(torch, name)
        return float(torch.finfo(dt).eps) / 2
    except (AttributeError, TypeError):
        return 2.0 ** -24


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
    ev: dict[str, Any] = {"dtype": dtype_name(r.dtype), "numel": int(r.stats.get("numel", 0)),
                          "input_dtypes": list(r.input_dtypes)}
    if r.node:
        ev["autograd_node"] = r.node
    if r.src:
        ev["source"] = f"{os.path.basename(r.src[0])}:{r.src[1]}"
    return ev



# ---------------------------------------------------------------------------------------------------- fixes
def keep_fp32_fix(module: str) -> FixProposal:
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


def feeders(records: list[OpRecord], record: OpRecord, depth: int, follow: Any = None) -> list[OpRecord]:
    """Records feeding ``record`` within ``depth`` hops, breadth first, each once. With ``follow``, only records for
    which ``follow(x)`` is true are returned and walked through."""
    out: list[OpRecord] = []
    frontier, seen = list(record.inputs), set()
    for _ in range(depth):
        nxt: list[int] = []
        for i in frontier:
            if i < 0 or i in seen:
                continue
            seen.add(i)
            x = records[i]
            if follow is not None and not follow(x):
                continue
            out.append(x)
            nxt.extend(x.inputs)
        frontier = nxt
    return out
