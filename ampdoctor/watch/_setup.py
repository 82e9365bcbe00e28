"""A training set-up that cannot give the mixed precision a framework was asked for, judged before step 0.

Mixed precision (``Trainer(fp16=True)``, ``Accelerator(mixed_precision="fp16")``, Lightning ``"16-mixed"``) keeps
the parameters in float32 and casts per op under autocast; a GradScaler unscales float32 gradients. A model whose
parameters are already 16-bit (a checkpoint saved in bf16/fp16 and loaded with ``dtype="auto"``, or ``.half()``)
defeats that: the optimizer updates the 16-bit weights in place with no fp32 master copy, and
``GradScaler.unscale_`` refuses float16 gradients (``ValueError: Attempting to unscale FP16 gradients.``, raised at
the first step wherever a scaler is enabled, i.e. on a GPU). Judged from the parameters' dtypes only (no op runs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from ampdoctor.findings import Finding, FixProposal
from ampdoctor.trace import HALF_DTYPES, dtype_info, dtype_name


def _ulp_of_one(name: str) -> str:
    """ulp(1.0) of a 16-bit format as a power of two (``"2**-10"`` for float16), from the dtype registry."""
    info = dtype_info(name)
    assert info is not None
    return f"2**{round(math.log2(2 * info.unit_roundoff))}"


def mixed_setup_finding(requested: str, by: str, params: Sequence[tuple[str, torch.Tensor]]) -> Finding | None:
    """``low-precision-params`` at step 0 when ``by`` asked for ``requested`` (``"fp16"``/``"bf16"``) *mixed*
    precision and trainable ``params`` (``(name, tensor)``) are 16-bit; ``None`` when they are all fp32/fp64.

    An error when the parameters are float16 (a GradScaler refuses their gradients) or not the format asked for
    (bf16 weights under fp16 autocast); a warning for bf16 weights under bf16 mixed precision (pure bf16 training,
    often meant: the measured lost-update findings then say how much it costs)."""
    low = [(n, dtype_name(p.dtype)) for n, p in params if p.dtype in HALF_DTYPES]
    if not low:
        return None
    counts = Counter(d for _, d in low)
    main = counts.most_common(1)[0][0]
    fp16 = "float16" in counts
    error = fp16 or (requested == "fp16" and "bfloat16" in counts)
    held = ", ".join(f"{k} {v}" for k, v in counts.most_common())
    scaler = (" GradScaler.unscale_ refuses float16 gradients: wherever a scaler is enabled (Trainer and accelerate "
              "enable one for fp16 on a GPU) the first step raises `ValueError: Attempting to unscale FP16 "
              "gradients.`." if fp16 and requested == "fp16"
              else "")
    mismatch = (f" The weights are {main} while autocast computes in float16: every weight was rounded to a format "
                "other than the one the run uses." if requested == "fp16" and main == "bfloat16" else "")
    expl = (f"{by} asks for {requested} mixed precision, which keeps the parameters in float32 and casts per op "
            f"under autocast. {len(low)} of {len(params)} trainable parameters are already 16-bit ({held}): a "
            "checkpoint saved in 16 bits and loaded with dtype='auto' (or a 16-bit dtype), or a .half()/.to(...) "
            "before training. The optimizer then updates them in place with no fp32 master copy: an update below "
            f"half an ulp of the weight is lost ({main} ulp(1.0) = {_ulp_of_one(main)}).{scaler}{mismatch}")
    fixes = [FixProposal("load or keep the model in float32; mixed precision casts per op itself",
                         "model = AutoModel.from_pretrained(path, dtype=torch.float32)   # not dtype='auto'\n"
                         "# or, before building the Trainer / Accelerator / LightningModule: model = model.float()")]
    if requested == "fp16" and main == "bfloat16":
        fixes.append(FixProposal("or train in the checkpoint's format: ask for bf16 mixed precision instead of fp16",
                                 "TrainingArguments(bf16=True)  # Accelerator(mixed_precision='bf16'), "
                                 "precision='bf16-mixed'"))
    return Finding(
        "low-precision-params", "error" if error else "warning", "", "", "optimizer",
        f"{by} trains {len(low)} {main} parameter(s): {requested} mixed precision needs float32 parameters",
        expl, {"requested": requested, "by": by, "dtypes": dict(counts), "count": len(low),
               "trainable": len(params), "parameters": [n for n, _ in low[:16]], "setup": True},
        tuple(fixes), 0)


__all__ = ["mixed_setup_finding"]
