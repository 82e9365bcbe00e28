"""What the target run's copy over the reference's storages (``ampdoctor.precision.SharedCopy``) saves a diagnose.

    python bench/shared_copy.py --config scale-base --rounds 3            # the copy alone (default)
    python bench/shared_copy.py --config scale-small --warm 1             # a user optimizer that already has state
    python bench/shared_copy.py --config scale-small --diagnose --rounds 2  # whole diagnoses

Copy (default): per round, a reference-like fp32 step on a copy (``prepare`` + ``StepLoop``: its gradients and
AdamW state allocated, as the reference run leaves them), then the target's ``prepare`` either *shared* (the
finished copy handed over with ``SharedCopy.keep``) or *fresh* (the copy dropped first, as before): wall time of
that ``prepare`` and the RSS it adds (the heap is trimmed before it, as the runner does after a run).
``--diagnose``: ``ampdoctor.diagnose`` twice per round and precision, *shared* (the default) and *fresh*
(``SharedCopy.keep`` made a no-op), phases timed through ``progress``, peak RSS above the start (``VmHWM`` reset
through ``/proc/self/clear_refs``). Order alternates between rounds; one process. ``--warm N``: the user's
optimizer ran N steps first (its state is shared too). Results: ``bench/results/shared_copy.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402
from _memory import reset_peak, status_gib  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.precision import SharedCopy, StepLoop, make_spec, prepare  # noqa: E402


def _one(model: Any, opt: Any, batch: Any, precision: str, shared: bool) -> dict[str, Any]:
    keep = SharedCopy.keep
    if not shared:
        SharedCopy.keep = lambda self, model, optimizer: None  # type: ignore[method-assign]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-amp" else None
    phases: dict[str, float] = {}
    last = [time.perf_counter(), ""]

    def progress(phase: str) -> None:
        now = time.perf_counter()
        if last[1]:
            phases[str(last[1])] = round(now - float(last[0]), 3)
        last[0], last[1] = now, phase

    gc.collect()
    rss0 = status_gib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    try:
        report = ampdoctor.diagnose(model, batch, precision=precision, optimizer=opt, scaler=scaler,
                                    progress=progress)
    finally:
        SharedCopy.keep = keep  # type: ignore[method-assign]
    return {"precision": precision, "shared": shared, "s": round(time.perf_counter() - t0, 3), "phases": phases,
            "peak_above_start_gib": round(status_gib("VmHWM") - rss0, 3), "rss_start_gib": round(rss0, 3),
            "findings": [f.code for f in report.findings], "loss_target": report.summary.get("loss_target")}


def _trim() -> None:
    """What the runner does after each run on the host: the C heap's free pages back to the OS (glibc only)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _copy(model: Any, opt: Any, batch: Any, precision: str, shared: bool) -> dict[str, Any]:
    """The target's ``prepare`` after a reference-like step, over the finished copy (shared) or anew (fresh)."""
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-amp" else None
    spec = make_spec(model, batch, precision=precision, optimizer=opt, scaler=scaler, steps=1)
    ref = prepare(spec, reference=True)
    StepLoop(spec, ref).run(1)  # its gradients and optimizer state are allocated, as after the reference run
    box = SharedCopy(spec)
    if shared:
        box.keep(ref.model, ref.optimizer)
    del ref
    gc.collect()
    _trim()  # as the runner does when a run's copy is gone: the fresh copy then page-faults its memory anew
    kept = len(box)
    rss0 = status_gib("VmRSS")
    t0 = time.perf_counter()
    tgt = prepare(spec, reference=False, shared=box)
    s = time.perf_counter() - t0
    out = {"precision": precision, "shared": shared, "prepare_s": round(s, 3),
           "rss_added_gib": round(status_gib("VmRSS") - rss0, 3), "tensors_kept": kept}
    del tgt
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="scale-small",
                    help="a bench/_models.py config (small, big) or scale-NAME: one of bench/scale.py's (batch 1, "
                         "128/128 tokens, vocabulary 32128: parameters dominate, as at 750M)")
    ap.add_argument("--precisions", default="fp16-amp,bf16-amp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=0, help="optimizer steps the user ran before the diagnose")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--diagnose", action="store_true", help="whole diagnoses instead of the copy alone")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "shared_copy"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.config.startswith("scale-"):
        import scale

        cfg = scale.CONFIGS[args.config[len("scale-"):]]
        model = _models.t5_model(cfg, seed=0)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = _models.t5_batch(cfg, seed=1)
    else:
        model, opt, batch = _models.build(args.config)
    for _ in range(args.warm):
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    n_params = sum(p.numel() for p in model.parameters())
    runs: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for precision in args.precisions.split(","):
            for shared in ((True, False) if r % 2 == 0 else (False, True)):
                res = (_one if args.diagnose else _copy)(model, opt, batch, precision, shared)
                res["round"] = r
                runs.append(res)
                load.append(os.getloadavg()[0])
                print(json.dumps(res), file=sys.stderr, flush=True)
    out = {"kind": "diagnose" if args.diagnose else "copy", "config": args.config, "params": n_params,
           "warm": args.warm, "rounds": args.rounds, "runs": runs,
           "load": [round(x, 2) for x in load], "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    runs_so_far: list[Any] = []
    if os.path.exists(args.out + ".json"):  # one entry per invocation, as the .md has one section per invocation
        with open(args.out + ".json") as f:
            runs_so_far = json.load(f)
    with open(args.out + ".json", "w") as f:
        json.dump(runs_so_far + [out], f, indent=1)
    with open(args.out + ".md", "a") as f:  # one section per invocation
        f.write("\n" + render(out))


def render(out: dict[str, Any]) -> str:
    head = [f"## {out['kind']}: {out['config']} config, {out['params'] / 1e6:.1f}M parameters, user optimizer warm "
            f"steps {out['warm']}", "",
            f"{out['date']}, torch {out['torch']}, load average (1 min) per measurement {out['load']}; medians over "
            f"{out['rounds']} rounds, one process, order alternating; generated by `bench/shared_copy.py`.", ""]
    if out["kind"] == "copy":
        lines = head + ["| precision | copy | target's prepare | RSS it adds | tensors handed over |",
                        "|---|---|---|---|---|"]
        for precision in dict.fromkeys(r["precision"] for r in out["runs"]):
            for shared in (False, True):
                rs = [r for r in out["runs"] if r["precision"] == precision and r["shared"] == shared]
                lines.append(f"| {precision} | {'shared' if shared else 'fresh'} | "
                             f"{statistics.median(r['prepare_s'] for r in rs):.3f} s "
                             f"({', '.join(str(r['prepare_s']) for r in rs)}) | "
                             f"{statistics.median(r['rss_added_gib'] for r in rs):.3f} GiB | {rs[0]['tensors_kept']} |")
        return "\n".join(lines) + "\n"
    lines = head + ["| precision | copy | diagnose | reference | target | analysis | peak RSS above start | findings |",
             "|---|---|---|---|---|---|---|---|"]
    for precision in dict.fromkeys(r["precision"] for r in out["runs"]):
        for shared in (False, True):
            rs = [r for r in out["runs"] if r["precision"] == precision and r["shared"] == shared]

            def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
                return statistics.median(r["phases"].get(key, float("nan")) for r in rs)

            lines.append(f"| {precision} | {'shared' if shared else 'fresh'} | "
                         f"{statistics.median(r['s'] for r in rs):.2f} s | {med('reference'):.2f} s | "
                         f"{med('target'):.2f} s | {med('analysis'):.2f} s | "
                         f"{statistics.median(r['peak_above_start_gib'] for r in rs):.3f} GiB | "
                         f"{sorted(set(rs[0]['findings']))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
