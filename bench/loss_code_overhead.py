"""What recording the loop's loss code costs (``Watch.record_loss_code``, on under ``ampdoctor run``).

    python bench/loss_code_overhead.py                 # 7 rounds x 40 steps per variant
    python bench/loss_code_overhead.py --rounds 3 --steps 20

One process, interleaved per round: the same fp16-autocast training loop (an MLP, a focal loss written in the loop:
8 torch calls between the model's output and ``backward()``) plain, under ``ampdoctor.watch`` and under the watch
with the loss recorder. Ratio = median over rounds of (variant time / plain time of the same round). Two sizes:
``small`` (the loss code's Python cost dominates a tiny step) and ``medium`` (a step of a few ms). Writes
``results/loss_code_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ampdoctor
import ampdoctor  # noqa: E402

SIZES = {"small": (16, 32, 4, 8), "medium": (256, 1024, 64, 64)}


def _loop(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            p = torch.sigmoid(model(x))
            loss = (-(1 - p) ** 2.0 * torch.log(p.clamp_min(1e-4))).mean()
        loss.backward()
        opt.step()


def _time(variant: str, size: str, steps: int) -> float:
    d_in, hidden, d_out, batch = SIZES[size]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = [torch.randn(batch, d_in) for _ in range(steps)]
    _loop(model, opt, xs[:2])                                   # warm-up outside the timing
    t0 = time.perf_counter()
    if variant == "plain":
        _loop(model, opt, xs)
    else:
        with ampdoctor.watch(model, opt) as w:
            if variant == "watch+loss-code":
                w.record_loss_code()
            _loop(model, opt, xs)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    variants = ("plain", "watch", "watch+loss-code")
    out: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "torch": torch.__version__, "rounds": a.rounds, "steps": a.steps,
                           "load": os.getloadavg()[0], "sizes": {}}
    for size in SIZES:
        per: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(a.rounds):
            for v in variants:
                per[v].append(_time(v, size, a.steps))
        ratio = {v: statistics.median(t / p for t, p in zip(per[v], per["plain"], strict=True)) for v in variants}
        extra = statistics.median(t / w for t, w in zip(per["watch+loss-code"], per["watch"], strict=True))
        out["sizes"][size] = {"plain_ms": 1e3 * statistics.median(per["plain"]), "ratio_vs_plain": ratio,
                              "loss_code_vs_watch": extra}
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    with open(os.path.join(here, "loss_code_overhead.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# Loss-code recorder overhead (`bench/loss_code_overhead.py`)", "",
             f"{out['date']}, torch {out['torch']}, {a.rounds} interleaved rounds x {a.steps} steps, 1 thread, "
             f"load average {out['load']:.1f} (shared CPU: noisy; ratios within one round).", "",
             "| size | plain step | watch / plain | watch+loss-code / plain | loss-code / watch |",
             "|---|---|---|---|---|"]
    for size, r in out["sizes"].items():
        q = r["ratio_vs_plain"]
        lines.append(f"| {size} | {r['plain_ms']:.2f} ms | {q['watch']:.2f}x | {q['watch+loss-code']:.2f}x | "
                     f"{r['loss_code_vs_watch']:.2f}x |")
    with open(os.path.join(here, "loss_code_overhead.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
