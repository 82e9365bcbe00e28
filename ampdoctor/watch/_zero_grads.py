"""Gradients exactly zero in a reduced-precision backward: unused, or flushed to zero (underflow)?

The coverage check (``_rules.coverage_findings``) sees parameters whose gradients were exactly zero through the
first coverage steps. Such a parameter has a gradient tensor: the autograd graph reaches it, so it is not unused
when the zeros are values that flushed below the format's smallest subnormal. The guard cannot tell the two apart
(it has no fp32 gradient); the replay of the ``zero-grads`` anomaly (``_detectors._coverage``) runs the step next
to an fp32 reference, and :func:`with_zero_replay` takes its verdict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ampdoctor.findings import Finding, FixProposal, Report
from ampdoctor.trace import dtype_info
from ampdoctor.watch._rules import _shorten


def _subnormal(dtype: str) -> str:
    info = dtype_info(dtype)
    return f"{info.smallest_subnormal:.2g}" if info is not None else "its smallest subnormal"


_UNDERFLOW_FIXES = (
    FixProposal("scale the loss so that small gradients stay representable",
                "scaler = torch.amp.GradScaler(device_type)\nscaler.scale(loss).backward()\nscaler.step(optimizer)\n"
                "scaler.update()"),
    FixProposal("train in bf16 (fp32's exponent range: no underflow at these magnitudes)",
                "with torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = model(batch)"),
)


def with_zero_replay(findings: Sequence[Finding], replay: Report | None, dtype: str | None) -> list[Finding]:
    """The coverage findings "gradients are exactly zero" of a reduced-precision backward (``dtype``), judged
    against fp32 by the replay of the ``zero-grads`` anomaly.

    Those parameters have gradient tensors (the graph reaches them), so they are not unused when the zeros are
    flushed values: a replay that finds ``underflow`` puts its findings (the op where the values flushed) in their
    place (after any error located at an op, before the other findings), naming the zero-gradient parameters; a
    replay whose fp32 gradients are zero too keeps them, saying so; without a replay (``locate=False``, or it
    failed) they become a suspected ``underflow`` warning per module.
    """
    zero = [f for f in findings if f.code == "unused-parameters" and f.evidence.get("zero_gradients")]
    if not zero or dtype is None:
        return list(findings)
    rest = [f for f in findings if not any(f is z for z in zero)]
    params = [p for f in zero for p in f.evidence["parameters"]]
    steps = zero[0].evidence["steps_observed"]
    flushed = [f for f in replay.findings if f.code == "underflow"] if replay is not None else []
    seen = (f"The watch saw the gradients of {len(params)} parameter(s) ({_shorten(params)}) exactly zero in each of "
            f"the first {steps} step(s) of the {dtype} backward although the graph reaches them; the replay against "
            "fp32 shows where they flush to zero.")
    if flushed:
        extra = {"zero_gradient_parameters": params[:64], "zero_gradient_steps": steps}
        located = [dataclasses.replace(f, explanation=f"{f.explanation} {seen}", evidence=f.evidence.replace(**extra))
                   for f in flushed]
        at = next((i for i, f in enumerate(rest) if not (f.severity == "error" and f.module and f.op)), len(rest))
        return rest[:at] + located + rest[at:]     # after the errors another replay located, before the rest
    if replay is not None:
        note = (" The replay of this step against fp32 finds no underflow: the gradients are zero in fp32 too, so "
                "no precision setting causes them.")
        return rest + [dataclasses.replace(f, explanation=f.explanation + note,
                                           evidence=f.evidence.replace(fp32_checked=True)) for f in zero]
    out = []
    for f in zero:
        where, names = f.module or "<root>", list(f.evidence["parameters"])
        out.append(Finding(
            "underflow", "warning", f.module, "", "backward",
            f"{where}: gradients are exactly zero in {dtype} (underflow suspected)",
            f"The gradients of {len(names)} parameter(s) of {where} ({_shorten(names)}) were exactly zero in each of "
            f"the first {steps} step(s) of a {dtype} backward, although the graph reaches them (they have gradient "
            f"tensors). In {dtype} a value below the smallest subnormal ({_subnormal(dtype)}) flushes to 0: "
            "without loss scaling, small gradients vanish before they reach these weights. Not compared with fp32 "
            "(no replay ran): ampdoctor.diagnose(model, batch, precision=...) names the op where they flush.",
            {**dict(f.evidence), "dtype": dtype, "confirmed": False}, _UNDERFLOW_FIXES, 0))
    return rest + out


__all__ = ["with_zero_replay"]
