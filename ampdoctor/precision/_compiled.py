"""Compiled vs eager in the target precision: does ``torch.compile`` change the numbers?

Compiled kernels fuse ops and may keep intermediates in float32 (or not), so a model can be fine eager and
wrong compiled, or the reverse. The op-level diagnosis always runs eager (every op visible); this compares the
outputs of ``torch.compile(copy)`` with those of the eager copy, both in the target precision on the same
inputs, and names the first output that differs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import shutil
from typing import Any

import torch
import torch._dynamo
from torch import nn

from ampdoctor.precision._contexts import LOW_DTYPES, _precision_context, call_model, cast_batch, device_of
from ampdoctor.trace import iter_tensors

log = logging.getLogger(__name__)

#: outputs whose max |compiled - eager| exceeds this share of the eager output's |max| are reported as differing
REL_TOL = 1e-2


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run here (a sentence), or ``None``."""
    if device.type == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None \
            and shutil.which("clang++") is None:
        return "torch.compile on CPU needs a C++ compiler (g++/clang++) on PATH, and none was found"
    return None


def _named_outputs(out: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [("output", out)]
    if isinstance(out, dict):
        items = list(out.items())
    elif isinstance(out, (tuple, list)):
        items = [(f"output[{i}]", v) for i, v in enumerate(out)]
    else:
        return [(f"output.{i}", t) for i, t in enumerate(iter_tensors(out))]
    res: list[tuple[str, torch.Tensor]] = []
    for k, v in items:
        if isinstance(v, torch.Tensor):
            res.append((str(k), v))
        elif isinstance(v, (tuple, list, dict)) or hasattr(v, "__dict__"):
            res.extend((f"{k}.{i}", t) for i, t in enumerate(iter_tensors(v)) if isinstance(t, torch.Tensor))
    return [(k, t) for k, t in res if t.is_floating_point()]


def compare_outputs(eager: Any, compiled: Any) -> dict[str, Any]:
    """Output by output: identical, within :data:`REL_TOL`, or differing (the first such named)."""
    rows = []
    e_out, c_out = _named_outputs(eager), dict(_named_outputs(compiled))
    first = None
    for name, e in e_out:
        c = c_out.get(name)
        if c is None or c.shape != e.shape:
            row: dict[str, Any] = {"output": name, "status": "missing" if c is None else "shape differs"}
        else:
            ef, cf = e.detach().float(), c.detach().float()
            same_nf = bool(torch.equal(torch.isfinite(ef), torch.isfinite(cf)))
            both = torch.isfinite(ef) & torch.isfinite(cf)
            diff = float((ef - cf).abs()[both].max()) if bool(both.any()) else 0.0
            scale = float(ef.abs()[both].max()) if bool(both.any()) else 0.0
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
            status = "identical" if torch.equal(ef, cf) or (same_nf and diff == 0) else (
                "differs" if (not same_nf or rel > REL_TOL) else "within tolerance")
            row = {"output": name, "status": status, "max_abs_diff": diff, "rel_diff": rel,
                   "eager_nonfinite": int((~torch.isfinite(ef)).sum()),
                   "compiled_nonfinite": int((~torch.isfinite(cf)).sum())}
        rows.append(row)
        if first is None and row["status"] not in ("identical", "within tolerance"):
            first = name
    if first is not None:
        verdict = "differs"
    elif all(r["status"] == "identical" for r in rows):
        verdict = "identical"
    else:
        verdict = "within tolerance"
    return {"verdict": verdict, "first_differing_output": first, "outputs": rows, "rel_tol": REL_TOL}


def compare_compiled(model: nn.Module, batch: Any, precision: str, policy: str = "cuda",
                     transforms: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Run a target-precision copy eager and compiled on ``batch``; :func:`compare_outputs` of the two.

    Returns ``{"verdict": "unavailable", "reason": ...}`` when compilation cannot run here (never raises for it).
    """
    m = copy.deepcopy(model)
    if precision in LOW_DTYPES:
        m.to(LOW_DTYPES[precision])
        batch = cast_batch(batch, LOW_DTYPES[precision])
    for tf in transforms:
        tf(m, None, None)
    m.eval()
    device = device_of(m)
    why = compile_unavailable(device)
    if why is not None:
        return {"verdict": "unavailable", "reason": why}

    def amp() -> Any:
        return _precision_context(precision, device, "native") if precision.endswith("-amp") else (
            contextlib.nullcontext())

    with torch.no_grad(), amp():
        eager = call_model(m, batch)
    try:
        compiled_model = torch.compile(m, backend="inductor", dynamic=False)
        with torch.no_grad(), amp():
            compiled = call_model(compiled_model, batch)  # type: ignore[arg-type]
    except Exception as e:  # a compiler that fails here is a fact to report, not a crash of the diagnosis
        log.info("torch.compile failed: %s", e)
        return {"verdict": "unavailable", "reason": f"torch.compile failed: {type(e).__name__}: "
                                                    f"{str(e).splitlines()[0] if str(e) else ''}"[:300]}
    finally:
        torch._dynamo.reset()
    out = compare_outputs(eager, compiled)
    if precision.endswith("-amp"):
        out["note"] = ("autocast ran with the device's native policy in both (the CUDA-policy emulation is a "
                       "Python mode that compiled graphs do not see)")
    return out


def compare_compiled_generation(model: nn.Module, input_ids: torch.Tensor, precision: str, policy: str,
                                tokens: list[int], transforms: tuple[Any, ...] = ()) -> dict[str, Any]:
    """:func:`compare_compiled` on the prompt followed by the reference's generated tokens (one forward)."""
    ids = torch.cat([input_ids, torch.tensor([tokens], dtype=input_ids.dtype)], dim=1) if tokens else input_ids
    return compare_compiled(model, {"input_ids": ids}, precision, policy, transforms)
