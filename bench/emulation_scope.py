"""What the step-wide CUDA-policy emulation scope costs a diagnose's target run (ca505b8).

    python bench/emulation_scope.py                 # bench T5 small, fp16-amp and bf16-amp, 5 rounds

The target run keeps the emulation's torch-function mode on the stack for the whole step (autocast off outside the
forward), so that a checkpoint's recompute in the backward is emulated too; every Python-level torch call of the
step outside the forward (the optimizer's; the trace's own work runs with torch functions off) passes through the
mode. This
compares, in one process and interleaved per round, a full-tier traced training step whose forward runs under
``cuda_autocast`` (what the target run does), inside and outside ``cuda_autocast(dtype, enabled=False)`` around the
whole step (the scope). Ratio = median over rounds of (with / without).
Writes ``results/emulation_scope.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ampdoctor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.precision import cuda_autocast  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NOTES = """## What the scope costs now, and why

The mode casts nothing outside the forward (the scope's autocast is off there); its cost is torch's torch-function
dispatch of every Python-level call made while it is on the stack. Until the trace ran its handler with torch functions
off, those included the trace's own work in the backward: the re-call of every op the autograd engine dispatched (which
without the trace never reaches a torch-function mode) and every Tensor method of its bookkeeping (`tensor_key`'s
storage/offset/stride reads, input/output walks, samples, module hooks): ~42,000 calls per traced step of this config,
1.156x fp16-amp and bf16-amp (measured on 60b71c4, load ~1). The trace's dispatch handler, its module hooks and its own
work between ops now run under `torch._C.DisableTorchFunction()`: a mode on the stack sees exactly the calls of the
untraced step (tested in `tests/test_side_effects.py`). What is left is the user's own step outside the forward
(AdamW's calls, `zero_grad`, `backward()`): the deterministic count in the table (cProfile, one traced step) is what a
CUDA-policy target run pays for its scope.
"""


def _traced_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict, dtype: torch.dtype,
                 scoped: bool) -> float:
    """One traced (full tier) training step with its forward under ``cuda_autocast``, as the target run does it;
    ``scoped``: inside the step-wide ``cuda_autocast(dtype, enabled=False)`` the runner now enters outside the trace."""
    t = time.perf_counter()
    with cuda_autocast(dtype, enabled=False) if scoped else contextlib.nullcontext():
        with ampdoctor.trace(model, opt, full=True) as tr:
            opt.zero_grad(set_to_none=True)
            with cuda_autocast(dtype):
                loss = model(**batch).loss
            loss.float().backward()
            opt.step()
    tr.result()
    return time.perf_counter() - t


def _mode_calls(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict, dtype: torch.dtype,
                scoped: bool) -> int:
    """Calls of the emulation's ``__torch_function__`` in one traced step (cProfile's count: deterministic)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        _traced_step(model, opt, batch, dtype, scoped)
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return sum(v[1] for (path, _, name), v in stats.items()
               if name == "__torch_function__" and path.replace(os.sep, "/").endswith("precision/emulation.py"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt, batch = _models.build(args.config)
    load0 = [round(x, 2) for x in os.getloadavg()]
    rows = {}
    for precision, dtype in (("fp16-amp", torch.float16), ("bf16-amp", torch.bfloat16)):
        _traced_step(model, opt, batch, dtype, True)  # warm-up
        times: dict[str, list[float]] = {"with": [], "without": []}
        for r in range(args.rounds):
            for scoped in ((True, False) if r % 2 == 0 else (False, True)):
                times["with" if scoped else "without"].append(_traced_step(model, opt, batch, dtype, scoped))
        ratios = [a / b for a, b in zip(times["with"], times["without"])]
        calls = {k: _mode_calls(model, opt, batch, dtype, k == "with") for k in ("with", "without")}
        rows[precision] = {"mode_calls": calls, "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                           "median_with": statistics.median(times["with"]),
                           "median_without": statistics.median(times["without"]),
                           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(precision, f"{rows[precision]['ratio']:.3f}x", flush=True)
    doc = {"config": args.config, "rounds": args.rounds, "argv": sys.argv[1:],
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "loadavg": [load0, [round(x, 2) for x in os.getloadavg()]], "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "emulation_scope.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = ["# The step-wide CUDA-policy emulation scope: cost to a diagnose", "",
             f"Generated by `bench/emulation_scope.py` (argv: `{' '.join(doc['argv'])}`) on {doc['date']}, torch "
             f"{doc['torch']}, 1 thread, bench T5 `{args.config}` config; load average {doc['loadavg'][0]} at start, "
             f"{doc['loadavg'][1]} at end (2 shared cores). {args.rounds} interleaved rounds per precision; "
             "ratio = median of (a traced target step inside the step-wide scope / the same step without it; "
             "the forward is under `cuda_autocast` in both, the trace is the full tier diagnose runs).", "",
             "| precision | with scope | without | ratio (min–max) | emulation calls per step, with / without |",
             "|---|---|---|---|---|"]
    for p, r in rows.items():
        lines.append(f"| {p} | {r['median_with']:.3f} s | {r['median_without']:.3f} s | {r['ratio']:.3f}× "
                     f"({r['ratio_min']:.3f}–{r['ratio_max']:.3f}) | {r['mode_calls']['with']} / "
                     f"{r['mode_calls']['without']} |")
    with open(os.path.join(RESULTS, "emulation_scope.md"), "w") as f:
        f.write("\n".join(lines) + "\n\n" + NOTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
