"""Can ``ampdoctor.diagnose`` handle a T5-large-sized model? Wall time and peak RSS against a plain training step.

    python bench/scale.py                          # large (750M params), 3 diagnose variants (~20 min, idle machine)
    python bench/scale.py --configs base           # t5-v1_1-base sized (220M params), ~4 min
    python bench/scale.py --configs large --variants fp16-amp      # one variant
    python bench/scale.py --configs small --extra  # + the target step without trace, and the traced fp32 step
    python bench/scale.py --configs tiny --out /tmp/scale   # smoke test (seconds)

Every measurement runs in its own fresh subprocess (``python bench/scale.py --child KIND ...``) that builds the model
from the same seed, so a peak RSS is the whole process's, never a leftover of an earlier measurement. Kinds:

    plain      fp32 AdamW training step (zero_grad, forward with labels, backward, optimizer.step()), twice
    diagnose   ampdoctor.diagnose(model, batch, precision=..., optimizer=AdamW, scaler=GradScaler for fp16-amp) on
               the same fresh model: float32 reference run + target run (both traced op by op) + analysis
    amp        (--extra) the step in the first variant's precision as ampdoctor's target run does it (CUDA-policy
               emulation, GradScaler), no trace
    trace      (--extra) the fp32 step inside ampdoctor.trace(model, opt, full=True) + result(): the tracing alone

Variants (``--variants``): ``fp16-amp``, ``bf16-amp``, either with ``:native-gemm`` = run the diagnose with
``AMPDOCTOR_GEMM=native`` (torch's own CPU fp16/bf16 GEMM kernels instead of the library's default
:class:`ampdoctor.precision.emulation.cuda_gemm`, fp32 accumulation and one rounding as on CUDA; torch's CPU fp16
GEMM is ~10-100x slower than fp32 on CPUs without AVX512-FP16/AMX-FP16 and dominates such a target run).

The parent runs ``plain, diagnose(v1), plain, diagnose(v2), ..., plain`` one after the other; each diagnose is
compared with the two plain processes around it (bracketing cancels slow drift of the machine's load): time against
their first steps (a fresh process's first step allocates and page-faults AdamW's state, as the diagnose's copies
do) and, as *steady*, against their second steps; memory against their peak RSS (``VmHWM``, max over both steps).
Inside the diagnose child the peak RSS is read per phase (``/proc/self/clear_refs`` resets the high-water mark at
each phase), and at the start of the second run (the reference: the library runs the target first) the child counts
live model objects with ``gc.get_objects()`` (which also lists unreachable cycles not yet collected): the first
run's copy must be gone by then. Phases are
logged as they happen. The parent samples the load average every 2 s. Results go to ``bench/results/scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ampdoctor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402
from _memory import reset_peak, status_gib  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: diagnose / a plain **steady** (second) fp32 step, and peak RSS / the plain process's
TARGETS = {"memory": 1.25, "time": 3.0}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: T5 v1.1 (gated-gelu) shapes; batch 1, 128 source / 128 target tokens, vocabulary 32128.
CONFIGS: dict[str, _models.BenchConfig] = {
    "tiny": _models.BenchConfig("tiny", d_model=64, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=32,
                                vocab_size=500, batch=1, source_len=16, target_len=16),
    "large": _models.BenchConfig("large", d_model=1024, d_ff=2816, num_layers=24, num_decoder_layers=24, num_heads=16,
                                 d_kv=64, vocab_size=32128, batch=1, source_len=128, target_len=128),
    "base": _models.BenchConfig("base", d_model=768, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12,
                                d_kv=64, vocab_size=32128, batch=1, source_len=128, target_len=128),
    "small": _models.BenchConfig("small", d_model=512, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6,
                                 d_kv=64, vocab_size=32128, batch=1, source_len=128, target_len=128),
}


# -- memory --------------------------------------------------------------------------------------------------------
def _gib(x: float) -> float:
    return round(x, 3)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- children ------------------------------------------------------------------------------------------------------
def _build(cfg: _models.BenchConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = _models.t5_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, _models.t5_batch(cfg, seed=1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any], amp: Any = None,
          scaler: Any = None) -> float:
    opt.zero_grad(set_to_none=True)
    if amp is None:
        loss = model(**batch).loss
    else:
        with amp:
            loss = model(**batch).loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    return float(loss.detach())


def _amp_context(precision: str, policy: str) -> Any:
    dtype = {"fp16-amp": torch.float16, "bf16-amp": torch.bfloat16}[precision]
    if policy == "cuda":
        from ampdoctor.precision.emulation import cuda_autocast

        return cuda_autocast(dtype, device_type="cpu")
    return torch.autocast("cpu", dtype=dtype)


def child(kind: str, cfg: _models.BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"kind": kind, "config": cfg.name, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    model, opt, batch = _build(cfg)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["build_s"] = round(time.perf_counter() - t0, 2)
    out["rss_after_build_gib"] = _gib(status_gib("VmRSS"))
    peaks = [status_gib("VmHWM")]
    can_reset = reset_peak()
    out["phase_peaks_exact"] = can_reset
    _log(f"  [{kind}] built {out['params'] / 1e6:.0f}M params in {out['build_s']} s, "
         f"RSS {out['rss_after_build_gib']} GiB")
    scaler = torch.amp.GradScaler("cpu") if args.precision == "fp16-amp" else None
    if kind in ("plain", "amp", "trace"):
        amp = _amp_context(args.precision, args.policy) if kind == "amp" else None
        from ampdoctor.precision.emulation import cuda_gemm

        gemm = cuda_gemm(args.gemm == "cuda" and kind == "amp")
        steps = []
        for i in range(2 if kind == "plain" else 1):
            t = time.perf_counter()
            if kind == "trace":
                import ampdoctor

                with ampdoctor.trace(model, opt, full=True) as tr:
                    _step(model, opt, batch)
                res = tr.result()
                out["records"] = len(res.records)
                del tr, res
            else:
                with gemm:
                    _step(model, opt, batch, amp=amp, scaler=scaler if kind == "amp" else None)
            steps.append(round(time.perf_counter() - t, 3))
            peaks.append(status_gib("VmHWM"))
            _log(f"  [{kind}] step {i + 1}: {steps[-1]:.1f} s, peak RSS so far {max(peaks):.2f} GiB")
        out["step_s"] = steps
        out["time_s"] = steps[0]
    else:
        import ampdoctor

        phases: list[dict[str, Any]] = []
        cls = type(model)
        t_start = time.perf_counter()

        def progress(phase: str) -> None:
            now = time.perf_counter()
            peak = status_gib("VmHWM")
            if phases:
                phases[-1]["s"] = round(now - phases[-1]["t0"], 2)
                phases[-1]["peak_gib"] = _gib(peak)
                _log(f"  [diagnose] {phases[-1]['phase']} done: {phases[-1]['s']:.1f} s, phase peak RSS "
                     f"{peak:.2f} GiB")
            peaks.append(peak)
            entry: dict[str, Any] = {"phase": phase, "t0": now, "rss_at_start_gib": _gib(status_gib("VmRSS"))}
            if len(phases) == 1:  # the second run (the library runs the target, then the reference)
                # the first run's deep copy must be gone before the second's is made (cycles included)
                entry["live_models"] = sum(1 for o in gc.get_objects() if type(o) is cls)
            if phase != "done":
                _log(f"  [diagnose] {phase} ... (RSS {entry['rss_at_start_gib']} GiB"
                     + (f", live {cls.__name__} objects: {entry['live_models']}" if "live_models" in entry else "")
                     + ")")
            phases.append(entry)
            reset_peak()

        from ampdoctor.precision.emulation import GEMM_ENV

        os.environ[GEMM_ENV] = args.gemm
        report = ampdoctor.diagnose(model, batch, precision=args.precision, optimizer=opt, scaler=scaler,
                                    policy=args.policy, progress=progress)
        out["time_s"] = round(time.perf_counter() - t_start, 3)
        for p in phases:
            p.pop("t0")
        out["phases"] = phases[:-1]
        out["ops_traced"] = report.summary.get("ops_traced")
        out["findings"] = [f"{f.code}:{f.severity}:{f.module}" for f in report.findings[:5]]
        out["loss_target"] = report.summary.get("loss_target")
        out["loss_reference"] = report.summary.get("loss_reference")
        out["scales"] = report.summary.get("scales")
    peaks.append(status_gib("VmHWM"))
    out["peak_rss_gib"] = _gib(max(peaks))
    # getrusage's ru_maxrss is this process's high-water mark too, but the per-phase resets above lower it
    out["ru_maxrss_gib"] = _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return out


# -- parent --------------------------------------------------------------------------------------------------------
class _LoadSampler:
    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(2.0)

    def __enter__(self) -> _LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        s = self.samples or [os.getloadavg()[0]]
        return {"mean": round(sum(s) / len(s), 2), "max": round(max(s), 2)}


def run_child(kind: str, cfg: str, args: argparse.Namespace, precision: str | None = None,
              gemm: str = "cuda") -> dict[str, Any]:
    precision = precision or args.precision
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--configs", cfg, "--threads",
           str(args.threads), "--precision", precision, "--policy", args.policy, "--gemm", gemm]
    label = kind if kind in ("plain", "trace") else f"{kind} {precision}{'+native-gemm' if gemm == 'native' else ''}"
    _log(f"[{cfg}] {label}: starting a fresh process")
    t = time.perf_counter()
    with _LoadSampler() as load:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            stdout = None
    base = {"kind": kind, "label": label, "precision": precision, "gemm": gemm, "config": cfg}
    if stdout is None or proc.returncode != 0:
        err = f"timed out after {args.timeout} s" if stdout is None else f"exit code {proc.returncode}"
        _log(f"[{cfg}] {label}: {err}")
        return {**base, "error": err, "load": load.summary()}
    res = {**base, **json.loads(stdout.strip().splitlines()[-1])}
    res["process_s"] = round(time.perf_counter() - t, 1)
    res["load"] = load.summary()
    _log(f"[{cfg}] {label}: {res['time_s']:.1f} s, peak RSS {res['peak_rss_gib']:.2f} GiB, load {res['load']}")
    return res


def machine() -> dict[str, Any]:
    import transformers

    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "ram_gib": round(mem, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def _variants(spec: str) -> list[tuple[str, str]]:
    out = []
    for v in spec.split(","):
        precision, _, gemm = v.partition(":")
        if precision not in ("fp16-amp", "bf16-amp") or gemm not in ("", "native-gemm"):
            raise SystemExit(f"bad variant {v!r}: expected fp16-amp or bf16-amp, optionally with :native-gemm")
        out.append((precision, "native" if gemm else "cuda"))
    return out


def measure(cfg: str, args: argparse.Namespace) -> dict[str, Any]:
    """``plain, diagnose(v1), plain, diagnose(v2), plain, ...``: each diagnose between two plain steps."""
    runs = [run_child("plain", cfg, args)]
    for precision, gemm in _variants(args.variants):
        runs.append(run_child("diagnose", cfg, args, precision, gemm))
        runs.append(run_child("plain", cfg, args))
    if args.extra:
        precision, gemm = _variants(args.variants)[0]
        runs.append(run_child("amp", cfg, args, precision, gemm))
        runs.append(run_child("trace", cfg, args))
    c = CONFIGS[cfg]
    out: dict[str, Any] = {"config": {k: getattr(c, k) for k in c.__dataclass_fields__}, "runs": runs,
                           "variants": []}
    ok_plains = [r for r in runs if r["kind"] == "plain" and "error" not in r]
    for i, r in enumerate(runs):
        if r["kind"] not in ("diagnose", "amp", "trace"):
            continue
        near = [x for x in (runs[i - 1], runs[i + 1] if i + 1 < len(runs) else None)
                if x is not None and x["kind"] == "plain" and "error" not in x] or ok_plains
        if not near:
            continue
        first = sum(x["step_s"][0] for x in near) / len(near)
        steady = sum(x["step_s"][1] for x in near) / len(near)
        peak = max(x["peak_rss_gib"] for x in near)
        v: dict[str, Any] = {"label": r["label"], "kind": r["kind"], "plain_first_step_s": round(first, 2),
                             "plain_steady_step_s": round(steady, 2), "plain_peak_gib": peak}
        if "error" in r:
            v["error"] = r["error"]
        else:
            v.update(time_s=r["time_s"], peak_gib=r["peak_rss_gib"], time_ratio=round(r["time_s"] / first, 2),
                     time_ratio_steady=round(r["time_s"] / steady, 2),
                     memory_ratio=round(r["peak_rss_gib"] / peak, 3))
            if r["kind"] == "diagnose":
                v["meets"] = {"time": v["time_ratio_steady"] <= TARGETS["time"],
                              "memory": v["memory_ratio"] <= TARGETS["memory"]}
            _log(f"[{cfg}] {r['label']}: time {v['time_ratio_steady']}x a steady plain step (target <= "
                 f"{TARGETS['time']}; {v['time_ratio']}x a fresh process's first step), memory "
                 f"{v['memory_ratio']}x (target <= {TARGETS['memory']})")
        out["variants"].append(v)
    return out


def derived_notes(results: dict[str, Any]) -> list[str]:
    """Sentences computed from the measurements (nothing hand-written): verdicts and where the time went."""
    argv = " ".join(results.get("argv", []))
    notes = [f"Generated by `{results.get('script', 'bench/scale.py')}` with argv `{argv}`."]
    for name, r in results["configs"].items():
        runs = {x["label"]: x for x in r["runs"] if x["kind"] == "diagnose" and "error" not in x}
        for v in r["variants"]:
            if v["kind"] != "diagnose" or "error" in v:
                continue
            run = runs.get(v["label"])
            phases = ", ".join(f"{p['phase']} {p['s']:.1f} s ({p['s'] / v['plain_steady_step_s']:.2f}× a steady step)"
                               for p in (run or {}).get("phases", []) if "s" in p)
            verdict = "meets" if all(v["meets"].values()) else "misses " + ", ".join(k for k, ok in v["meets"].items()
                                                                                    if not ok)
            notes.append(f"{name}, {v['label']}: {verdict} the targets: {v['time_ratio_steady']}× a steady plain "
                         f"step ({v['time_ratio']}× a fresh first step), {v['memory_ratio']}× its peak RSS; "
                         f"{phases}.")
    return notes


def write(results: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump(results, f, indent=2)
    m, a = results["machine"], results["args"]
    lines = [
        "# ampdoctor.diagnose at scale (T5 v1.1 gated-gelu, batch 1, 128/128 tokens, CPU)",
        "",
        f"Machine: {m['nproc']} CPU cores, {m['ram_gib']} GiB RAM, torch {m['torch']} ({a['threads']} intra-op "
        f"thread(s)), transformers {m['transformers']}, Python {m['python']}, {m['platform']}. Date and load "
        "average per config below, per process in the tables.",
        "",
        "Diagnose: `ampdoctor.diagnose(model, batch, precision=..., optimizer=AdamW, scaler=GradScaler (fp16-amp), "
        f"policy={a['policy']!r})`: target run + fp32 reference run (which leaves out the last update when "
        "nothing reads it: `summary['reference_updates_not_run']`), both traced op by op (full statistics), + "
        "analysis. Plain: an fp32 step (zero_grad, forward with labels, backward, AdamW step) on the same model and "
        "batch. Every measurement is a fresh process building the model from seed 0, run one after the other: "
        "plain, diagnose, plain, diagnose, ..., plain. Time ratio = diagnose / mean of the two plain processes' "
        "**first** steps around it (a fresh process's step allocates and page-faults AdamW's state, as the diagnose's "
        "copies do); *steady* = the same against their **second** steps. Memory ratio = peak RSS (VmHWM) of the "
        "diagnose process / that of the plain processes around it (max over both plain steps: the steady-state step "
        f"holds AdamW's state through forward and backward). Targets: time ≤ {TARGETS['time']}× a **steady** step, "
        f"memory ≤ {TARGETS['memory']}×. fp16/bf16 GEMMs of the target run are the library's default `cuda_gemm` "
        "(fp32 accumulation, one rounding, as on CUDA); `+native-gemm` runs them on torch's own CPU kernels "
        "(`AMPDOCTOR_GEMM=native`).",
        "",
        "**Caveat:** the machine is shared with other jobs (load averages below), so absolute times are inflated and "
        "noisy; bracketing each diagnose between two plain processes cancels slow drift, not bursts. Memory is not "
        "affected by load.",
        "",
    ]
    for name, r in results["configs"].items():
        c = r["config"]
        params = next((x["params"] for x in r["runs"] if "params" in x), 0)
        lines += [f"## {name}: {params / 1e6:.0f}M parameters: d_model {c['d_model']}, d_ff {c['d_ff']}, "
                  f"{c['num_layers']}+{c['num_decoder_layers']} layers, {c['num_heads']} heads, vocab "
                  f"{c['vocab_size']}", "",
                  f"Measured {r['machine']['date']}; load average at start {r['machine']['loadavg_start']}, at end "
                  f"{r['machine']['loadavg_end']}.", "",
                  "| run | time | / plain first step | / plain steady step | peak RSS | / plain peak | meets "
                  "(time, memory) |", "|---|---|---|---|---|---|---|"]
        for v in r["variants"]:
            if "error" in v:
                lines.append(f"| {v['label']} | {v['error']} | | | | | |")
                continue
            meets = f"{v['meets']['time']}, {v['meets']['memory']}" if "meets" in v else ""
            lines.append(f"| {v['label']} | {v['time_s']:.1f} s | **{v['time_ratio']}×** ({v['plain_first_step_s']} s)"
                         f" | {v['time_ratio_steady']}× ({v['plain_steady_step_s']} s) | {v['peak_gib']:.2f} GiB | "
                         f"**{v['memory_ratio']}×** ({v['plain_peak_gib']:.2f} GiB) | {meets} |")
        lines += ["", "| process | time | peak RSS | RSS after build | load avg (mean/max) | notes |",
                  "|---|---|---|---|---|---|"]
        for run in r["runs"]:
            load = f"{run['load']['mean']}/{run['load']['max']}"
            if "error" in run:
                lines.append(f"| {run['label']} | | | | {load} | {run['error']} |")
                continue
            notes = ""
            if run["kind"] == "plain":
                notes = f"steps {run['step_s']} s"
            elif run["kind"] == "diagnose":
                notes = "; ".join(
                    f"{p['phase']} {p['s']:.1f} s (peak {p['peak_gib']:.2f} GiB"
                    + (f", live model objects at its start: {p['live_models']}" if "live_models" in p else "") + ")"
                    for p in run["phases"])
                found = ", ".join(run["findings"][:2]) + (", ..." if len(run["findings"]) > 2 else "")
                notes += (f"; {run['ops_traced']} records; loss scale after the step {run.get('scales') or '-'}; "
                          f"findings: {found or 'none'}")
            elif run["kind"] == "trace":
                notes = f"{run['records']} records"
            lines.append(f"| {run['label']} | {run['time_s']:.1f} s | {run['peak_rss_gib']:.2f} GiB | "
                         f"{run['rss_after_build_gib']:.2f} GiB | {load} | {notes} |")
        lines.append("")
    lines += ["## Derived from the data above", ""] + [f"- {n}" for n in derived_notes(results)] + [""]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="large", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--variants", default="fp16-amp,bf16-amp",
                    help="diagnose runs, comma-separated: fp16-amp, bf16-amp, each optionally with :native-gemm")
    ap.add_argument("--policy", default="cuda", choices=["cuda", "native"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: a shared 2-core machine)")
    ap.add_argument("--extra", action="store_true",
                    help="also time the first variant's step without trace (amp) and the traced fp32 step (trace)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    ap.add_argument("--out", default=os.path.join(RESULTS, "scale"), help="output path without extension")
    ap.add_argument("--append", action="store_true", help="keep the other configs in --out's JSON")
    ap.add_argument("--render", action="store_true", help="only rewrite --out's .md from its .json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp16-amp", choices=["fp16-amp", "bf16-amp"], help=argparse.SUPPRESS)
    ap.add_argument("--gemm", default="cuda", choices=["cuda", "native"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}, expected some of {sorted(CONFIGS)}")
    if args.child:
        print(json.dumps(child(args.child, CONFIGS[names[0]], args)))
        return
    if args.render:
        with open(args.out + ".json") as f:
            write(json.load(f), args.out)
        return
    _variants(args.variants)
    kept = {k: (os.path.relpath(v, REPO) if k == "out" else v) for k, v in vars(args).items() if k != "child"}
    results: dict[str, Any] = {"script": "bench/scale.py", "argv": sys.argv[1:], "machine": machine(), "args": kept,
                               "configs": {}}
    if args.append and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            results["configs"] = json.load(f).get("configs", {})
    for name in names:
        m = machine()
        results["configs"][name] = measure(name, args)
        m["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        results["configs"][name]["machine"] = m
        results["configs"][name]["args"] = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write(results, args.out)
    _log(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
    main()
