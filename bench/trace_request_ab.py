"""What the per-run statistics requests (``ampdoctor.trace.Request``) save, side by side (bench T5 small, CPU).

    python bench/trace_request_ab.py                 # 8 rounds
    python bench/trace_request_ab.py --rounds 12

Interleaved per round (order reversed every other round), one process: a plain fp32 step; ``headroom_spec`` with
its declared request (``HEADROOM_ONLY``) and with every statistic (``FULL``); the diagnosis's fp32 reference run
(``run(spec, reference=True)``) with ``REFERENCE`` and with ``FULL``. Ratio = median over rounds of time / that
round's plain step; the A/B figure is the median of the per-round ratio declared / FULL (IQR). Prints one JSON line
and a markdown table (pasted into ``results/trace_overhead.md`` by hand, with the load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ampdoctor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402

from ampdoctor.precision import make_spec, run, saved_rng  # noqa: E402
from ampdoctor.precision.headroom import headroom_run_spec  # noqa: E402
from ampdoctor.trace import FULL, HEADROOM_ONLY, REFERENCE  # noqa: E402


def _q(xs: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return qs[0], statistics.median(xs), qs[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt, batch = _models.build("small")
    spec = make_spec(model, batch, optimizer=opt)
    hspec = headroom_run_spec(spec)

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    def headroom(req: Any) -> None:
        with saved_rng():
            run(hspec, reference=True, headroom=True, request=req)

    def reference(req: Any) -> None:
        with saved_rng():
            run(spec, reference=True, request=req)

    fns = {"plain": plain, "headroom-declared": lambda: headroom(HEADROOM_ONLY),
           "headroom-full": lambda: headroom(FULL),
           "reference-declared": lambda: reference(REFERENCE), "reference-full": lambda: reference(FULL)}
    for f in fns.values():
        f()  # warm-up (AdamW's state, the sample plans)
    load0 = [round(x, 2) for x in os.getloadavg()]
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    out: dict[str, Any] = {"rounds": args.rounds, "loadavg": [load0, [round(x, 2) for x in os.getloadavg()]],
                           "plain_median_s": round(statistics.median(times["plain"]), 3)}
    rows = []
    for k in fns:
        if k == "plain":
            continue
        lo, med, hi = _q([a / b for a, b in zip(times[k], times["plain"])])
        out[k] = {"median_s": round(statistics.median(times[k]), 3), "ratio": round(med, 2)}
        rows.append(f"| {k} | {out[k]['median_s']} s | {med:.2f}x (IQR {lo:.2f}-{hi:.2f}) |")
    for which in ("headroom", "reference"):
        lo, med, hi = _q([a / b for a, b in zip(times[f"{which}-declared"], times[f"{which}-full"])])
        out[f"{which}_declared_over_full"] = [round(lo, 3), round(med, 3), round(hi, 3)]
        rows.append(f"| {which}: declared / FULL, per round | | {med:.3f} (IQR {lo:.3f}-{hi:.3f}) |")
    print(json.dumps(out))
    print("| run | median | ratio to plain step |\n|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
