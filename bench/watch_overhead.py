"""Cost of ``ampdoctor.watch`` on a real training step: T5 (gated-gelu), fp32 forward + backward + AdamW.

    python bench/watch_overhead.py                      # small and big, default rounds
    python bench/watch_overhead.py --config big --rounds 20

Two identical models (same init) train side by side in one process: one plain, one inside ``watch(model,
optimizer)`` entered once (its coverage steps fall in the warm-up). Each round times one plain and one
watched step, in alternating order (ABBA) so drift and neighbours' load hit both alike; warm-up rounds are
discarded. Reported: median step time of each, the ratio of medians with a bootstrap 95% interval, and the
per-round ratio's median and IQR. Host reads per watched step are counted in a separate pass (``tolist``/
``item`` calls; on CUDA also the synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports).
Results go to ``bench/results/watch_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ampdoctor.watch import watch

CONFIGS: dict[str, dict[str, Any]] = {
    "small": {"d_model": 256, "d_ff": 1024, "num_layers": 4, "num_decoder_layers": 4, "num_heads": 4, "d_kv": 64,
              "vocab_size": 1000, "batch": 4, "source_len": 32, "target_len": 16, "rounds": 60, "warmup": 5},
    "big": {"d_model": 512, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": 6, "num_heads": 8, "d_kv": 64,
            "vocab_size": 1000, "batch": 8, "source_len": 128, "target_len": 128, "rounds": 24, "warmup": 2},
}
OUT = Path(__file__).resolve().parent / "results"


def build(cfg: dict[str, Any], device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    conf = T5Config(d_model=cfg["d_model"], d_ff=cfg["d_ff"], num_layers=cfg["num_layers"],
                    num_decoder_layers=cfg["num_decoder_layers"], num_heads=cfg["num_heads"], d_kv=cfg["d_kv"],
                    vocab_size=cfg["vocab_size"], feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    model = T5ForConditionalGeneration(conf).to(device).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def make_batch(cfg: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg["vocab_size"], (cfg["batch"], cfg["source_len"]), generator=g)
    labels = torch.randint(1, cfg["vocab_size"], (cfg["batch"], cfg["target_len"]), generator=g)
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], w: Any = None) -> None:
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    if w is not None:
        w.step(loss)


def timed(fn: Any, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``. On a shared, oversubscribed CPU the CPU time of a
    single-threaded run (``--threads 1``) is the stable measure: it counts our own cycles only."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def summarize(plain: list[float], watched: list[float]) -> dict[str, Any]:
    per_round = [b / a for a, b in zip(plain, watched)]
    q1, qm, q3 = quartiles(per_round)
    lo, hi = bootstrap_ratio(plain, watched)
    mp, mw = statistics.median(plain), statistics.median(watched)
    return {"plain_median_s": mp, "watched_median_s": mw, "ratio_of_medians": mw / mp,
            "ratio_bootstrap_ci95": [lo, hi], "per_round_ratio": {"median": qm, "q1": q1, "q3": q3, "iqr": q3 - q1}}


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def bootstrap_ratio(plain: list[float], watched: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    k = len(plain)
    ratios = []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        ratios.append(statistics.median(watched[i] for i in idx) / statistics.median(plain[i] for i in idx))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def count_host_reads(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], w: Any,
                     device: torch.device, steps: int = 3) -> dict[str, Any]:
    """Host reads made during ``steps`` watched steps, per step (counted in a pass that is not timed)."""
    counts = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self):
        counts["tolist"] += 1
        return real_tolist(self)

    def item(self):
        counts["item"] += 1
        return real_item(self)

    torch.Tensor.tolist, torch.Tensor.item = tolist, item   # type: ignore[method-assign]
    syncs = None
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    step(model, opt, batch, w)
            torch.cuda.set_sync_debug_mode(0)
            syncs = sum(1 for c in caught if "synchroniz" in str(c.message)) / steps
        else:
            for _ in range(steps):
                step(model, opt, batch, w)
    finally:
        torch.Tensor.tolist, torch.Tensor.item = real_tolist, real_item   # type: ignore[method-assign]
    return {"tolist_per_step": counts["tolist"] / steps, "item_per_step": counts["item"] / steps,
            "cuda_syncs_per_step": syncs}


def bench(name: str, rounds: int | None, warmup: int | None, device: torch.device) -> dict[str, Any]:
    cfg = CONFIGS[name]
    rounds = rounds or cfg["rounds"]
    warmup = cfg["warmup"] if warmup is None else warmup
    batch = make_batch(cfg, device)
    m_plain, o_plain = build(cfg, device)
    m_watch, o_watch = build(cfg, device)
    n_params = sum(p.numel() for p in m_plain.parameters())
    samples: dict[str, list[float]] = {"plain_wall": [], "watched_wall": [], "plain_cpu": [], "watched_cpu": []}
    t_start = time.perf_counter()
    with watch(m_watch, o_watch) as w:
        for r in range(warmup + rounds):
            order = ("plain", "watched") if r % 2 == 0 else ("watched", "plain")
            times = {}
            for which in order:
                if which == "plain":
                    times[which] = timed(lambda: step(m_plain, o_plain, batch), device)
                else:
                    times[which] = timed(lambda: step(m_watch, o_watch, batch, w), device)
            if r >= warmup:
                for which in ("plain", "watched"):
                    samples[f"{which}_wall"].append(times[which][0])
                    samples[f"{which}_cpu"].append(times[which][1])
            print(f"  {name} round {r + 1}/{warmup + rounds}{' (warm-up)' if r < warmup else ''}: plain "
                  f"{times['plain'][0]:.3f}s (cpu {times['plain'][1]:.3f}s) watched {times['watched'][0]:.3f}s "
                  f"(cpu {times['watched'][1]:.3f}s)", file=sys.stderr, flush=True)
        watched_reads = count_host_reads(m_watch, o_watch, batch, w, device)
    plain_reads = count_host_reads(m_plain, o_plain, batch, None, device)
    reads = {"watched": watched_reads, "plain": plain_reads,
             "added_per_step": {k: (watched_reads[k] - plain_reads[k]) if watched_reads[k] is not None else None
                                for k in watched_reads}}
    report = w.report()
    return {
        "config": {k: v for k, v in cfg.items() if k not in ("rounds", "warmup")},
        "parameters": n_params,
        "rounds": rounds,
        "warmup_rounds_discarded": warmup,
        "wall": summarize(samples["plain_wall"], samples["watched_wall"]),
        "cpu": summarize(samples["plain_cpu"], samples["watched_cpu"]),
        "host_reads": reads,
        "watch_report_codes": report.codes(),
        "watch_steps_seen": report.summary["steps"],
        "wall_s": time.perf_counter() - t_start,
    }


def write(results: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "watch_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    env = results["environment"]
    lines = [
        "# `ampdoctor.watch` overhead (T5 gated-gelu, fp32 forward + backward + AdamW)",
        "",
        f"torch {env['torch']}, transformers {env['transformers']}, device {env['device']}, "
        f"{env['threads']} threads, {env['platform']}, load average at start {env['loadavg']}. Plain and watched "
        "steps interleaved (ABBA) in one process; `cpu` = process CPU time per step (stable on a shared CPU when "
        "single-threaded), `wall` = elapsed time.",
        "",
        "| config | params | rounds | clock | plain median (s) | watched median (s) | ratio of medians [95% CI] "
        "| per-round ratio median (IQR) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["configs"].items():
        for clock in ("cpu", "wall"):
            c = r[clock]
            pr = c["per_round_ratio"]
            lo, hi = c["ratio_bootstrap_ci95"]
            lines.append(
                f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['rounds']} | {clock} | {c['plain_median_s']:.4f} | "
                f"{c['watched_median_s']:.4f} | {c['ratio_of_medians']:.3f} [{lo:.3f}, {hi:.3f}] | "
                f"{pr['median']:.3f} ({pr['q1']:.3f}-{pr['q3']:.3f}) |")
    lines += ["", "| config | host reads / step added by watch | CUDA syncs / step added |", "|---|---|---|"]
    for name, r in results["configs"].items():
        hr = r["host_reads"]["added_per_step"]
        syncs = hr["cuda_syncs_per_step"]
        lines.append(f"| {name} | +{hr['tolist_per_step']:g} tolist, +{hr['item_per_step']:g} item | "
                     f"{'n/a (no CUDA)' if syncs is None else f'{syncs:g}'} |")
    lines += ["", "Target: ratio <= 1.03 on `big`; at most one host read per step.", ""]
    (OUT / "watch_overhead.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["small", "big", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per config (default: per config)")
    ap.add_argument("--warmup", type=int, default=None, help="discarded warm-up rounds (default: per config)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(args.device)
    names = ["small", "big"] if args.config == "both" else [args.config]
    results: dict[str, Any] = {
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
                        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "platform": platform.platform(terse=True),
                        "loadavg": [round(x, 2) for x in os.getloadavg()]},
        "configs": {},
    }
    for name in names:
        results["configs"][name] = bench(name, args.rounds, args.warmup, device)
        r = results["configs"][name]
        for clock in ("cpu", "wall"):
            c = r[clock]
            print(f"{name} [{clock}]: plain {c['plain_median_s']:.4f}s  watched {c['watched_median_s']:.4f}s  ratio "
                  f"{c['ratio_of_medians']:.3f} {c['ratio_bootstrap_ci95']}  per-round {c['per_round_ratio']}")
        print(f"{name}: host reads added per step {r['host_reads']['added_per_step']}")
    write(results)
    return results


if __name__ == "__main__":
    main()
