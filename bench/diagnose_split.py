"""Where a diagnosis's time goes, per run and per phase (issue 18 item 2), next to a plain step's phases.

    python bench/diagnose_split.py --configs base --kind plain       # plain fp32 AdamW steps: forward/backward/step
    python bench/diagnose_split.py --configs base --kind diagnose    # diagnose, each run split into its phases

One fresh process per call (the caller interleaves them); the model is bench/scale.py's config. The split is taken
with wall-clock timers wrapped around the runner's and the trace's own functions (a bench-only instrument; the
library has none): per run, the copy (``prepare``), forward, backward and optimizer step (between the observer
points), inside them the trace's statistics (``_full_row``/``_lite_row``), the step-0 samples, the write log
(``WriteLog.before``/``after``), the heap trims and the runner's pre-optimizer hooks (coverage, gradient norm),
then the read-back (``Trace.result``); every timer and phase also counts its minor page faults and system CPU time
(``getrusage``: fresh heap pages the kernel zeroes), and a timer's key names the step phase it ran in (``fw``, ``bw``,
``opt``). ``handler`` = the rest of the trace's per-op bookkeeping is not separable
from the op with timers: compare a phase with the plain step's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402
from _memory import status_gib  # noqa: E402

T: dict[str, float] = defaultdict(float)  # wall seconds
C: dict[str, float] = defaultdict(float)  # CPU seconds of this process (robust against the shared machine's load)
N: dict[str, int] = defaultdict(int)
F: dict[str, int] = defaultdict(int)  # minor page faults (fresh pages the heap hands out: the kernel zeroes them)
S: dict[str, float] = defaultdict(float)  # system CPU seconds (page faults, munmap), part of C
PHASE = [""]  # the step phase the timers are in (set by the observer points): a timer's key names it


def _usage() -> tuple[int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_stime


def _timed(owner: Any, name: str, key: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t, c, (f, st) = time.perf_counter(), time.process_time(), _usage()
        try:
            return fn(*a, **k)
        finally:
            k = f"{key} ({PHASE[0]})" if PHASE[0] else key
            T[k] += time.perf_counter() - t
            C[k] += time.process_time() - c
            N[k] += 1
            f2, st2 = _usage()
            F[k] += f2 - f
            S[k] += st2 - st

    setattr(owner, name, wrapper)


class _Clock:
    """Phase boundaries from the observer points: the time since the last mark goes to the named phase."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t, self.c = time.perf_counter(), time.process_time()
        self.f, self.s = _usage()

    def mark(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        f, st = _usage()
        T[phase] += now - self.t
        C[phase] += cpu - self.c
        F[phase] += f - self.f
        S[phase] += st - self.s
        self.t, self.c, self.f, self.s = now, cpu, f, st


def instrument(clock: _Clock) -> None:
    """Wrap the runner's and the trace's internals with timers. A measuring instrument, not a use of the library:
    it looks the internals up by module name (as bench/trace_reads.py does) and only wraps them."""
    import importlib

    from ampdoctor.trace import Trace

    _runner = importlib.import_module("ampdoctor.precision._runner")
    RecordingMode = importlib.import_module("ampdoctor.trace._mode").RecordingMode  # noqa: N806
    Sketches = importlib.import_module("ampdoctor.trace._sample").Sketches  # noqa: N806
    WriteLog = importlib.import_module("ampdoctor.trace._writes").WriteLog  # noqa: N806

    for owner, name, key in [(RecordingMode, "_full_row", "  stats full"), (RecordingMode, "_lite_row", "  stats lite"),
                             (Sketches, "sample", "  samples"), (WriteLog, "before", "  writes before"),
                             (WriteLog, "after", "  writes after"),
                             (_runner, "release_free_heap", "  heap trim (in step, after run)"),
                             (_runner._TraceObserver, "_snapshot", "  coverage"),
                             (_runner._TraceObserver, "_grad_norm", "  grad norm"),
                             (Trace, "result", "read-back")]:
        _timed(owner, name, key)
    prepare = _runner.prepare

    def timed_prepare(*a: Any, **k: Any) -> Any:
        clock.mark("(between runs)")
        out = prepare(*a, **k)
        clock.mark("copy (prepare)")
        return out

    _runner.prepare = timed_prepare
    obs = _runner._TraceObserver
    _NEXT = {None: "fw", "forward": "bw", "backward": "opt"}  # noqa: N806 - the phase each point starts
    hooks = {"step_start": None, "forward_done": "forward", "grads_ready": "backward", "step_end": "optimizer step"}
    for name, phase in hooks.items():
        orig = getattr(obs, name)

        def hook(self: Any, *a: Any, _orig: Any = orig, _phase: str | None = phase, **k: Any) -> Any:
            clock.mark(_phase or "(observer setup)")
            PHASE[0] = _NEXT.get(_phase, "")
            return _orig(self, *a, **k)

        setattr(obs, name, hook)
    finish = obs.finish

    def timed_finish(self: Any, loop: Any) -> Any:
        clock.mark("loss read")
        out = finish(self, loop)
        clock.mark("finish (read-back, coverage read)")
        return out

    obs.finish = timed_finish


def snapshot(label: str, runs: dict[str, dict[str, float]]) -> None:
    runs[label] = {k: round(v, 2) for k, v in sorted(T.items())}
    runs[label + " cpu"] = {k: round(v, 2) for k, v in sorted(C.items())}
    runs[label + " calls"] = dict(N)  # type: ignore[assignment]
    runs[label + " minflt"] = dict(F)  # type: ignore[assignment]
    runs[label + " sys"] = {k: round(v, 2) for k, v in sorted(S.items())}
    for d in (T, C, N, F, S):
        d.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="base")
    ap.add_argument("--kind", choices=["plain", "diagnose"], default="diagnose")
    ap.add_argument("--precision", default="fp16-amp", choices=["fp16-amp", "bf16-amp"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt, batch = scale._build(scale.CONFIGS[args.configs])
    out: dict[str, Any] = {"config": args.configs, "kind": args.kind, "precision": args.precision,
                           "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""), "load": os.getloadavg()[0]}
    runs: dict[str, dict[str, float]] = {}
    if args.kind == "plain":
        for i in range(2):
            t = [(time.perf_counter(), time.process_time(), *_usage())]
            opt.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            t.append((time.perf_counter(), time.process_time(), *_usage()))
            loss.backward()
            t.append((time.perf_counter(), time.process_time(), *_usage()))
            opt.step()
            t.append((time.perf_counter(), time.process_time(), *_usage()))
            float(loss.detach())
            names = ("forward", "backward", "optimizer step")
            for suffix, col, nd in (("", 0, 2), (" cpu", 1, 2), (" minflt", 2, None), (" sys", 3, 2)):
                row: dict[str, Any] = {n: round(b[col] - a[col], nd) for n, a, b in zip(names, t, t[1:])}
                row["total"] = round(t[-1][col] - t[0][col], nd)
                runs[f"step {i + 1}{suffix}"] = row
    else:
        import ampdoctor

        clock = _Clock()
        instrument(clock)
        marks: list[tuple[str, float, float]] = []

        def progress(phase: str) -> None:
            marks.append((phase, time.perf_counter(), time.process_time()))
            if len(marks) > 1:  # the previous phase ended (runs in the library's order: target, reference, ...)
                clock.mark("(between runs)")
                snapshot(marks[-2][0], runs)
            clock.reset()

        scaler = torch.amp.GradScaler("cpu") if args.precision == "fp16-amp" else None
        report = ampdoctor.diagnose(model, batch, precision=args.precision, optimizer=opt, scaler=scaler,
                                    policy="cuda", progress=progress)
        # what must not change between settings (THP, code versions): the losses and the findings, bit for bit
        out["result"] = {k: report.summary.get(k) for k in ("loss_reference", "loss_target", "ops_traced")}
        found = [f"{f.code}:{f.module}:{f.op}:{f.phase}:{f.step}:{f.evidence}" for f in report.findings]
        out["findings"] = {"n": len(found), "sha1": hashlib.sha1("\n".join(found).encode()).hexdigest()}
        out["phase_s"] = {a[0]: round(b[1] - a[1], 2) for a, b in zip(marks, marks[1:])}
        out["phase_cpu_s"] = {a[0]: round(b[2] - a[2], 2) for a, b in zip(marks, marks[1:])}
    out["runs"] = runs
    out["peak_gib"] = round(status_gib("VmHWM"), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
