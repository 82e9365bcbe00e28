"""fp16/bf16 GEMMs on CPU: CUDA's numerics (``cuda_gemm``, fp32 accumulation) against torch's own CPU kernels.

    python bench/gemm.py                      # bench models (small, big) + every case and built-in scenario
    python bench/gemm.py --configs small --only t5

Three questions, each answered side by side in one process:

1. **Numbers.** One fp16-amp / bf16-amp training step (CUDA-policy emulation, forward with labels + backward) of
   the bench T5 models with ``cuda_gemm`` and with torch's native kernels, from the same weights and batch: the
   loss, and each parameter gradient's relative error against the float32 step's gradient (median and max over
   parameters), plus the relative difference between the two low-precision runs' gradients.
2. **Speed.** The same step's wall time with either kernel (median of interleaved rounds).
3. **Diagnoses.** ``ampdoctor.diagnose_file`` of every case of ``../shared/cases`` and every built-in scenario with
   ``AMPDOCTOR_GEMM=cuda`` and ``=native``: the root-cause code and module must be the same.

Writes ``results/gemm.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ampdoctor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.precision.emulation import GEMM_ENV, cuda_autocast, cuda_gemm  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"fp16-amp": torch.float16, "bf16-amp": torch.bfloat16}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model: torch.nn.Module, batch: dict[str, Any], precision: str | None, gemm: bool) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    with cuda_gemm(gemm):
        if precision is None:
            loss = model(**batch).loss
        else:
            with cuda_autocast(DTYPES[precision]):
                loss = model(**batch).loss
        loss.float().backward()
    return float(loss.detach()), time.perf_counter() - t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


def model_numbers(name: str, rounds: int, precisions: list[str]) -> dict[str, Any]:
    model, _, batch = _models.build(name)
    loss32, _ = _step(model, batch, None, False)
    ref = _grads(model)
    out: dict[str, Any] = {"config": name, "loss_fp32": loss32, "precisions": {}}
    for precision in precisions:
        res: dict[str, Any] = {}
        grads = {}
        times: dict[str, list[float]] = {"cuda": [], "native": []}
        for r in range(rounds):
            for gemm in (("cuda", "native") if r % 2 == 0 else ("native", "cuda")):
                loss, dt = _step(model, batch, precision, gemm == "cuda")
                times[gemm].append(dt)
                if r == 0:
                    grads[gemm] = _grads(model)
                    res[f"loss_{gemm}"] = loss
        for gemm in ("cuda", "native"):
            errs = [_rel(grads[gemm][n], ref[n]) for n in ref if n in grads[gemm]]
            finite = [e for e in errs if e == e and e != float("inf")]
            res[f"grad_rel_err_{gemm}"] = {"median": statistics.median(finite) if finite else None,
                                           "max": max(finite) if finite else None,
                                           "non_finite": len(errs) - len(finite)}
            res[f"step_s_{gemm}"] = round(statistics.median(times[gemm]), 4)
        diffs = [_rel(grads["cuda"][n], grads["native"][n]) for n in grads["cuda"] if n in grads["native"]]
        res["grad_rel_diff_cuda_vs_native"] = {"median": statistics.median(diffs), "max": max(diffs)}
        res["speedup"] = round(res["step_s_native"] / res["step_s_cuda"], 2)
        out["precisions"][precision] = res
        print(f"[{name}] {precision}: {json.dumps(res)}", file=sys.stderr, flush=True)
    return out


def diagnoses(only: list[str] | None) -> list[dict[str, Any]]:
    import compare

    rows = []
    for case in compare.discover(only):
        if case.get("path") is None:
            rows.append({"name": case["name"], "error": case.get("load_error")})
            continue
        row: dict[str, Any] = {"name": case["name"], "origin": case["origin"]}
        for gemm in ("cuda", "native"):
            os.environ[GEMM_ENV] = gemm
            t = time.perf_counter()
            try:
                rep = ampdoctor.diagnose_file(case["path"])
                top = rep.findings[0] if rep.findings else None
                row[gemm] = {"code": top.code if top else None, "module": top.module if top else None,
                             "codes": sorted({f.code for f in rep.findings}), "s": round(time.perf_counter() - t, 2)}
            except Exception as e:  # noqa: BLE001 - a crash is a result here
                row[gemm] = {"error": f"{type(e).__name__}: {e}"}
        os.environ.pop(GEMM_ENV, None)
        c, n = row["cuda"], row["native"]
        row["same_root_cause"] = "error" not in c and (c.get("code"), c.get("module")) == (
            n.get("code"), n.get("module"))
        print(f"[case] {case['name']}: {row['same_root_cause']} {c} {n}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def write(res: dict[str, Any], path: str) -> None:
    with open(path + ".json", "w") as f:
        json.dump(res, f, indent=2)
    m = res["machine"]
    lines = [
        "# fp16/bf16 GEMMs on CPU: `cuda_gemm` (fp32 accumulation, one rounding) vs torch's native kernels", "",
        f"Generated by `bench/gemm.py` (argv: `{' '.join(res['argv'])}`) on {m['date']}, {m['nproc']} CPU cores, "
        f"torch {m['torch']}, 1 thread; load average at start {m['loadavg_start']}, at end {m['loadavg_end']}.",
        "",
        "Step: one forward (with labels) + backward of the bench T5 under `cuda_autocast` (CUDA policy), from the "
        "same weights and batch. Gradient error: ‖g − g_fp32‖ / ‖g_fp32‖ per parameter, median and max over "
        "parameters, against the same step in float32. Times: median of interleaved rounds (shared machine: "
        "noisy, compare within a row).", "",
        "| config | precision | loss fp32 | loss cuda-gemm | loss native | grad err cuda-gemm (median / max) | "
        "grad err native (median / max) | cuda vs native (median / max) | step cuda-gemm | step native | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mdl in res["models"]:
        for prec, r in mdl["precisions"].items():
            ec, en, d = r["grad_rel_err_cuda"], r["grad_rel_err_native"], r["grad_rel_diff_cuda_vs_native"]
            lines.append(
                f"| {mdl['config']} | {prec} | {mdl['loss_fp32']:.6f} | {r['loss_cuda']:.6f} | {r['loss_native']:.6f} "
                f"| {_fmt(ec['median'])} / {_fmt(ec['max'])} | {_fmt(en['median'])} / {_fmt(en['max'])} | "
                f"{_fmt(d['median'])} / {_fmt(d['max'])} | {r['step_s_cuda']:.3f} s | {r['step_s_native']:.3f} s | "
                f"{r['speedup']}× |")
    if res["cases"]:
        same = sum(1 for r in res["cases"] if r.get("same_root_cause"))
        lines += ["", f"## Diagnoses: same root cause (code, module) with both kernels: {same}/{len(res['cases'])}",
                  "", "| case | cuda-gemm | native | same |", "|---|---|---|---|"]
        for r in res["cases"]:
            cell = {g: (r[g].get("error") or f"`{r[g]['code']}` `{r[g]['module']}` ({r[g]['s']} s)")
                    if g in r else r.get("error", "-") for g in ("cuda", "native")}
            lines.append(f"| {r['name']} | {cell['cuda']} | {cell['native']} | {r.get('same_root_cause')} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="small,big")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", default=",".join(DTYPES), help="comma-separated: " + ", ".join(DTYPES))
    ap.add_argument("--only", default=None, help="comma-separated case-name substrings (default: all)")
    ap.add_argument("--no-cases", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "gemm"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res: dict[str, Any] = {
        "script": "bench/gemm.py", "argv": sys.argv[1:] if argv is None else argv,
        "machine": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "nproc": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
    }
    precisions = [p for p in args.precisions.split(",") if p]
    if any(p not in DTYPES for p in precisions):
        ap.error(f"--precisions: expected some of {', '.join(DTYPES)}")
    res["models"] = [model_numbers(c, args.rounds, precisions) for c in args.configs.split(",") if c]
    res["cases"] = [] if args.no_cases else diagnoses(args.only.split(",") if args.only else None)
    res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write(res, args.out)


if __name__ == "__main__":
    main()
