"""Cost of ``ampdoctor.trace`` on a T5 training step (forward + backward + AdamW step, fp32).

    python bench/trace_overhead.py                      # small and big config, default rounds / time budget
    python bench/trace_overhead.py --configs small --rounds 30
    python bench/trace_overhead.py --quick              # smoke run: small config, a few rounds
    python bench/trace_overhead.py --profile            # + cProfile of one cheap- and one full-tier step (small)
    python bench/trace_overhead.py --configs big --merge  # add/replace the big config in the committed results

Variants, run interleaved in one process on ONE model/optimizer: each round runs plain, v1, plain, v2, ...,
plain (the order of the variants rotated from round to round), warm-up rounds discarded:

    plain          the step as is
    noop-mode      a TorchDispatchMode whose __torch_dispatch__ only calls func (the floor of any dispatch mode)
    trace-cheap    with ampdoctor.trace(model, opt, full=False): step; t.result()
    trace-full     with ampdoctor.trace(model, opt, full=True): step; t.result()
    trace-ref      the same with request=ampdoctor.trace.REFERENCE: what a diagnosis's fp32 reference run computes
    hf-debug       transformers' DebugUnderflowOverflow (forward hooks on every module; attached before the timed
                   step, removed after, i.e. its steady-state per-step cost)

The figure of merit is the median over rounds of (variant time / mean of the two plain steps around it),
with the IQR of those per-round ratios as the spread. Results go to bench/results/trace_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ampdoctor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402

import ampdoctor  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"small": 3.0, "big": 1.5}  # cheap tier, max ratio
FULL_TARGETS = {"small": 3.0, "big": 1.2}  # full tier (what diagnose runs), max ratio: issue 18 item 1
#: the trace's own functions whose cumulative time the full-tier profile breaks down (``file:function``)
COMPONENTS = {
    "_mode.py:_full_op": "everything the full tier does per op (incl. the op itself)",
    "_mode.py:_record_output": "per output: record, statistics row, sample",
    "_mode.py:_full_row": "full statistics (forward/backward outputs, leaves)",
    "_mode.py:_lite_row": "lite statistics (optimizer outputs, parameter leaves)",
    "_mode.py:_leaf": "first sight of a tensor (parameters, optimizer state, batch)",
    "_mode.py:_input_index": "input lineage (incl. leaves)",
    "_sample.py:sample": "element-wise samples (step 0)",
    "_writes.py:before": "write log: old values before a write",
    "_writes.py:after": "write log: applied update, exact re-run where needed",
    "_mode.py:read": "the one read-back",
    "_identity.py:tensor_key": "tensor identity (storage, offset, shape, stride, dtype)",
    "_opdesc.py:gather": "the op's tensor and Python number arguments (one walk)",
    "_sample.py:index_sources": "integer inputs' numeric sources (crash explanation)",
    "_modules.py:user_frame": "the user's source line (forward)",
}


# -- the step --------------------------------------------------------------------------------------------------
def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> None:
    opt.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    opt.step()


# -- variants --------------------------------------------------------------------------------------------------
class Variant:
    """One way of running the step. ``attach``/``detach`` run outside the timed region, ``context`` inside."""

    name = "plain"
    label = "plain step"

    def attach(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        pass

    def detach(self) -> None:
        pass

    def context(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
        return contextlib.nullcontext()


class _NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


class NoopMode(Variant):
    name = "noop-mode"
    label = "do-nothing TorchDispatchMode"

    def context(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
        return _NoopMode()


class TraceVariant(Variant):
    def __init__(self, full: bool, reference: bool = False) -> None:
        from ampdoctor.trace import FULL, REFERENCE

        self.full = full
        self.request = REFERENCE if reference else FULL
        self.name = "trace-ref" if reference else "trace-full" if full else "trace-cheap"
        self.label = f"ampdoctor.trace(full={full}{', request=REFERENCE' if reference else ''}) incl. enter/exit and " \
            "result()"

    @contextlib.contextmanager
    def context(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
        with ampdoctor.trace(model, opt, full=self.full, request=self.request) as t:
            yield
        t.result()


class HFDebug(Variant):
    """transformers' DebugUnderflowOverflow. It registers hooks without handles, so we remove them ourselves."""

    name = "hf-debug"
    label = "transformers DebugUnderflowOverflow (forward hooks)"

    def attach(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        from transformers.debug_utils import DebugUnderflowOverflow

        before = {id(m): set(m._forward_hooks) for m in model.modules()}
        self.debug = DebugUnderflowOverflow(model)
        self.added = [(m, k) for m in model.modules() for k in m._forward_hooks if k not in before[id(m)]]

    def detach(self) -> None:
        for m, k in self.added:
            m._forward_hooks.pop(k, None)
        self.added = []


def default_variants() -> list[Variant]:
    return [Variant(), NoopMode(), TraceVariant(full=False), TraceVariant(full=True),
            TraceVariant(full=True, reference=True), HFDebug()]


# -- measurement -----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(variant: Variant, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any],
               step: Callable[..., None] = train_step) -> float:
    """Seconds of one step run the variant's way (attach/detach and a gc pass are not timed)."""
    device = next(model.parameters()).device
    variant.attach(model, opt)
    try:
        gc.collect()
        _sync(device)
        t0 = time.perf_counter()
        with variant.context(model, opt):
            step(model, opt, batch)
        _sync(device)
        return time.perf_counter() - t0
    finally:
        variant.detach()


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def measure(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any], variants: list[Variant], *,
            rounds: int, warmup: int, budget_s: float | None = None, min_rounds: int = 3,
            step: Callable[..., None] = train_step, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Interleaved, bracketed timing; returns per-variant stats.

    Every round runs ``plain, v1, plain, v2, ..., vk, plain`` (the order of the ``v`` rotated from round to
    round), and a variant's ratio is its time over the mean of the two plain steps around it, so a change of
    machine load during a round hits both sides. A variant that raises is dropped (its error is kept).
    ``budget_s`` stops after the round that exceeds it (but not before ``min_rounds`` measured rounds).
    """
    if variants[0].name != "plain":
        raise ValueError("the first variant must be the plain step (ratios are taken against it)")
    plain, others = variants[0], variants[1:]
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    ratios: dict[str, list[float]] = {v.name: [] for v in others}
    errors: dict[str, str] = {}
    alive = list(others)
    t_start = time.perf_counter()
    done = 0
    for r in range(warmup + rounds):
        k = r % max(len(alive), 1)
        order = alive[k:] + alive[:k]
        plains = [timed_step(plain, model, opt, batch, step)]
        got: dict[str, float] = {}
        for v in order:
            try:
                got[v.name] = timed_step(v, model, opt, batch, step)
            except Exception as e:  # noqa: BLE001 - a tool that cannot run this model is reported, not fatal
                errors[v.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log(f"  {v.name} failed: {errors[v.name]}")
            plains.append(timed_step(plain, model, opt, batch, step))
        alive = [v for v in alive if v.name not in errors]
        if r < warmup:
            log(f"  warm-up {r + 1}/{warmup}: plain {statistics.median(plains):.3f}s")
            continue
        done += 1
        times["plain"].extend(plains)
        for i, v in enumerate(order):
            if v.name in got:
                times[v.name].append(got[v.name])
                ratios[v.name].append(got[v.name] / (0.5 * (plains[i] + plains[i + 1])))
        log(f"  round {done}/{rounds}: plain {statistics.median(plains):.3f}s  "
            + "  ".join(f"{n} {t:.3f}s" for n, t in got.items()))
        if budget_s is not None and done >= min_rounds and time.perf_counter() - t_start > budget_s:
            log(f"  time budget {budget_s:.0f}s reached after {done} rounds")
            break
    out: dict[str, Any] = {"rounds": done, "warmup": warmup, "wall_s": round(time.perf_counter() - t_start, 1),
                           "variants": {}}
    for v in variants:
        entry: dict[str, Any] = {"label": v.label}
        if v.name in errors:
            entry["error"] = errors[v.name]
        ts = times[v.name]
        if ts:
            entry["median_s"] = statistics.median(ts)
            entry["times_s"] = [round(t, 5) for t in ts]
        rs = ratios.get(v.name, [])
        if rs:
            q1, med, q3 = _quantiles(rs)
            entry.update(ratio=med, ratio_q1=q1, ratio_q3=q3, ratio_iqr=q3 - q1, ratios=[round(x, 4) for x in rs])
        out["variants"][v.name] = entry
    return out


def count_ops(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> dict[str, int]:
    """Records of one cheap-tier traced step, by phase."""
    with ampdoctor.trace(model, opt, full=False) as t:
        train_step(model, opt, batch)
    res = t.result()
    by: dict[str, int] = {}
    for r in res.records:
        by[r.phase] = by.get(r.phase, 0) + 1
    by["total"] = len(res.records)
    return by


def _short_path(file: str) -> str:
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1]
    if file.startswith(REPO):
        return os.path.relpath(file, REPO)
    return file


def _components(st: pstats.Stats, total: float) -> list[dict[str, Any]]:
    """Cumulative time of the :data:`COMPONENTS` (summed over same-named functions of one file)."""
    agg: dict[str, list[float]] = {}
    for (file, _line, fn), (_cc, nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        key = f"{os.path.basename(file)}:{fn}"
        if key in COMPONENTS and "ampdoctor" in file:
            a = agg.setdefault(key, [0, 0.0])
            a[0] += nc
            a[1] += ct
    return [{"component": k, "what": COMPONENTS[k], "calls": int(v[0]), "cumtime_s": round(v[1], 4),
             "share": round(v[1] / total, 4)} for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])]


def profile_tiers(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any],
                  top: int = 25) -> dict[str, Any]:
    """cProfile of one plain, one cheap-tier and one full-tier step: where the extra time goes (per function,
    tottime; for the full tier also the trace's components, cumulative)."""
    buf = io.StringIO()

    def prof(fn: Callable[[], None]) -> pstats.Stats:
        gc.collect()
        p = cProfile.Profile()
        p.enable()
        fn()
        p.disable()
        return pstats.Stats(p, stream=buf)

    def tier(full: bool) -> Callable[[], None]:
        def run() -> None:
            with ampdoctor.trace(model, opt, full=full) as t:
                train_step(model, opt, batch)
            t.result()
        return run

    for _ in range(2):
        train_step(model, opt, batch)
        tier(False)()
        tier(True)()
    plain_st = prof(lambda: train_step(model, opt, batch))
    out: dict[str, Any] = {"plain_total_s": round(plain_st.total_tt, 4)}  # type: ignore[attr-defined]
    for name, full in (("cheap", False), ("full", True)):
        st = prof(tier(full))
        rows = []
        for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            rows.append({"function": f"({fn})" if file == "~" else f"{_short_path(file)}:{line}({fn})",
                         "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4),
                         "us_per_call": round(1e6 * tt / max(nc, 1), 2)})
        rows.sort(key=lambda r: -r["tottime_s"])
        total = st.total_tt  # type: ignore[attr-defined]
        out[name] = {"total_s": round(total, 4), "top_tottime": rows[:top]}
        if full:
            out[name]["components"] = _components(st, total)
        st.sort_stats("tottime").print_stats(top)
    out["text"] = buf.getvalue()
    return out


#: what :func:`cost_split` times separately inside the full tier's dispatch (``(module, class, method)``)
SPLIT_PARTS = {
    "statistics (full rows)": ("ampdoctor.trace._mode", "RecordingMode", "_full_row"),
    "statistics (lite rows)": ("ampdoctor.trace._mode", "RecordingMode", "_lite_row"),
    "write log (before + after)": ("ampdoctor.trace._writes", "WriteLog", "before", "after"),
    "element samples": ("ampdoctor.trace._sample", "Sketches", "sample"),
}


def cost_split(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any],
               rounds: int = 3) -> dict[str, Any]:
    """Process CPU time (not wall time: less sensitive to a loaded machine) of one full-tier step split into the ops
    themselves (timed inside a do-nothing dispatch mode's step), statistics, write log, samples, the rest of the
    dispatch handler (lineage, records, arguments: "bookkeeping") and everything outside the handler (module hooks,
    entering/leaving, the read-back, torch's dispatch glue). Wrapping adds a little to the parts it times. Median of
    ``rounds`` steps."""
    import importlib

    clock = time.process_time
    spent: dict[str, float] = {}
    originals: list[tuple[Any, str, Any]] = []

    def timed(label: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + clock() - t0
        return wrapper

    parts = {**SPLIT_PARTS, "dispatch": ("ampdoctor.trace._mode", "RecordingMode", "__torch_dispatch__")}
    for label, (mod, cls_name, *methods) in parts.items():
        cls = getattr(importlib.import_module(mod), cls_name)
        for m in methods:
            originals.append((cls, m, getattr(cls, m)))
            setattr(cls, m, timed(label, getattr(cls, m)))

    class OpsOnly(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            t0 = clock()
            try:
                return func(*args, **(kwargs or {}))
            finally:
                spent["ops"] = spent.get("ops", 0.0) + clock() - t0

    runs: list[dict[str, float]] = []
    try:
        for i in range(rounds + 1):
            spent.clear()
            t0 = clock()
            train_step(model, opt, batch)
            plain = clock() - t0
            with OpsOnly():
                train_step(model, opt, batch)
            ops = spent.pop("ops")
            t0 = clock()
            with ampdoctor.trace(model, opt, full=True) as t:
                train_step(model, opt, batch)
            t.result()
            total = clock() - t0
            if i == 0:
                continue  # warm-up
            row = {"plain": plain, "full": total, "ops": ops, **{k: spent.get(k, 0.0) for k in SPLIT_PARTS}}
            row["bookkeeping"] = spent.get("dispatch", 0.0) - ops - sum(spent.get(k, 0.0) for k in SPLIT_PARTS)
            row["outside the handler"] = total - spent.get("dispatch", 0.0)
            runs.append(row)
    finally:
        for cls, m, fn in originals:
            setattr(cls, m, fn)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"rounds": rounds, "seconds": {k: round(v, 4) for k, v in med.items()},
            "of_plain": {k: round(v / med["plain"], 3) for k, v in med.items()}}


# -- reporting -------------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ampdoctor": ampdoctor.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    with contextlib.suppress(OSError):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _fmt_ratio(e: dict[str, Any]) -> str:
    if "ratio" not in e:
        return f"failed ({e.get('error', '')})" if "error" in e else "-"
    return f"{e['ratio']:.2f}× (IQR {e['ratio_q1']:.2f}–{e['ratio_q3']:.2f})"


def to_markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        "# ampdoctor.trace overhead (T5 gated-gelu train step, fp32, CPU)",
        "",
        f"Measured {m['date']} on {m['cpu_count']} CPU cores ({m['processor']}), torch {m['torch']} "
        f"({m['torch_threads']} thread(s)), transformers {m['transformers']}, Python {m['python']}. "
        f"Load average at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}.",
        "",
        "Step = `zero_grad` + forward with labels + `loss.backward()` + `AdamW.step()`. Ratio = median over rounds "
        "of (variant time / mean of the two plain steps run just before and just after it); spread = interquartile "
        "range of those per-round ratios. Each round runs plain, v1, plain, v2, …, plain on one model (variant "
        "order rotated each round); warm-up rounds discarded. The trace "
        "variants include entering/leaving the context and `t.result()` (the one read-back).",
        "",
        "**Caveat:** this machine was shared with other jobs running tests at the same time (see the load "
        "average), so absolute times are inflated and noisy. Bracketing each variant between "
        "two plain steps cancels drift, not bursts: read the IQR before reading a difference of a few percent.",
        "",
    ]
    for cname, res in doc["configs"].items():
        cfg = res["config"]
        lines += [
            f"## {cname}: d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
            f"{cfg['num_layers']}+{cfg['num_decoder_layers']} layers, {cfg['num_heads']} heads, "
            f"batch {cfg['batch']}, {cfg['source_len']}/{cfg['target_len']} tokens",
            "",
            f"{res['rounds']} measured rounds after {res['warmup']} warm-up, {res['wall_s']} s. "
            f"Floating outputs traced per step: {res.get('ops', {})}.",
            "",
            "| variant | median step | ratio to plain (IQR) |",
            "|---|---|---|",
        ]
        for name, e in res["variants"].items():
            med = f"{e['median_s']:.3f} s" if "median_s" in e else "-"
            ratio = "1.00×" if name == "plain" else _fmt_ratio(e)
            lines.append(f"| {name} — {e['label']} | {med} | {ratio} |")
        tgt = res.get("target")
        if tgt:
            verdict = "meets" if tgt["met"] else "MISSES"
            lines += ["", f"Cheap tier target ≤ {tgt['max_ratio']}×: {verdict} ({tgt['ratio']:.2f}×)."]
        ft = res.get("full_target")
        if ft:
            verdict = "meets" if ft["met"] else "MISSES"
            lines += ["", f"Full tier target ≤ {ft['max_ratio']}× (issue 18): {verdict} ({ft['ratio']:.2f}×)."]
        if res.get("machine"):
            mm = res["machine"]
            lines += ["", f"This config finished {mm.get('date')}; load average when it started "
                      f"{mm.get('loadavg_start')}, at its end {mm.get('loadavg_end')}."]
        lines.append("")
    lines += _profile_markdown(doc.get("profile"))
    if doc.get("notes"):
        lines += ["## Notes", "", *doc["notes"], ""]
    return "\n".join(lines)


def _profile_markdown(prof: dict[str, Any] | None) -> list[str]:
    if not prof or "full" not in prof:
        return []
    full, cheap = prof["full"], prof["cheap"]
    lines = [
        "## Profile of one step per tier (small config, cProfile)",
        "",
        f"cProfile totals: plain {prof['plain_total_s']} s, cheap tier {cheap['total_s']} s, full tier "
        f"{full['total_s']} s (cProfile inflates Python-heavy code; read shares, not absolute cost).",
        "",
        "Full tier by component (cumulative; components nest, so shares do not add up):",
        "",
        "| component | what | calls | cum s | share of the traced step |",
        "|---|---|---|---|---|",
    ]
    for c in full.get("components", []):
        lines.append(f"| `{c['component']}` | {c['what']} | {c['calls']} | {c['cumtime_s']} | {c['share']:.1%} |")
    lines += ["", "Full tier, top functions by own time:", "", "| function | calls | tottime s | µs/call |",
              "|---|---|---|---|"]
    for r in full["top_tottime"][:20]:
        lines.append(f"| `{r['function']}` | {r['calls']} | {r['tottime_s']} | {r['us_per_call']} |")
    lines.append("")
    split = prof.get("split")
    if split:
        sec, rel = split["seconds"], split["of_plain"]
        lines += [f"Full tier, where one step's CPU time goes (`cost_split`: process time, median of {split['rounds']} "
                  "steps; each part as a multiple of the plain step's CPU time):", "",
                  "| part | CPU s | × plain step |", "|---|---|---|"]
        for k in sec:
            lines.append(f"| {k} | {sec[k]} | {rel[k]:.2f} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="small,big", help="comma-separated: small,big")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per config (default: small 20, big 6)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default: small 3, big 1)")
    ap.add_argument("--budget", type=float, default=None,
                    help="stop a config after this many seconds of rounds (default: small 150, big 300)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core box more threads thrash)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="smoke run: small config, 4 rounds, 1 warm-up")
    ap.add_argument("--profile", action="store_true", help="also cProfile one step per tier (small config)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the committed results of configs not run now (and their profile) and replace the rest")
    ap.add_argument("--variants", default="", help="comma-separated subset of: " + ", ".join(
        v.name for v in default_variants()[1:]) + " (default: all)")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    torch.set_num_threads(args.threads)
    configs = ["small"] if args.quick else [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in _models.CONFIGS:
            ap.error(f"unknown config {c!r}, expected some of {sorted(_models.CONFIGS)}")
    defaults = {"small": (20, 3, 150.0), "big": (6, 1, 300.0)}
    wanted = [w.strip() for w in args.variants.split(",") if w.strip()]
    known = [v.name for v in default_variants()]
    bad = [w for w in wanted if w not in known[1:]]
    if bad:
        ap.error(f"unknown variant(s) {bad}, expected some of {known[1:]}")
    doc: dict[str, Any] = {"machine": machine_info(), "configs": {}}
    for c in configs:
        rounds, warmup, budget = defaults[c]
        if args.quick:
            rounds, warmup, budget = 4, 1, None
        rounds = args.rounds if args.rounds is not None else rounds
        warmup = args.warmup if args.warmup is not None else warmup
        budget = args.budget if args.budget is not None else budget
        variants = [v for v in default_variants() if v.name == "plain" or not wanted or v.name in wanted]
        load0 = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
        print(f"[{c}] building model")
        model, opt, batch = _models.build(c, args.device)
        res = measure(model, opt, batch, variants, rounds=rounds, warmup=warmup, budget_s=budget)
        res["config"] = dict(_models.CONFIGS[c].__dict__)
        res["ops"] = count_ops(model, opt, batch)
        res["machine"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "loadavg_start": load0}
        with contextlib.suppress(OSError):
            res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        cheap = res["variants"].get("trace-cheap", {})
        if c in TARGETS and "ratio" in cheap:
            res["target"] = {"max_ratio": TARGETS[c], "ratio": cheap["ratio"], "met": cheap["ratio"] <= TARGETS[c]}
        full = res["variants"].get("trace-full", {})
        if c in FULL_TARGETS and "ratio" in full:
            res["full_target"] = {"max_ratio": FULL_TARGETS[c], "ratio": full["ratio"],
                                  "met": full["ratio"] <= FULL_TARGETS[c]}
        doc["configs"][c] = res
        print(f"[{c}] ratios to plain (median, IQR of per-round ratios), plain median "
              f"{res['variants']['plain'].get('median_s', float('nan')):.3f}s:")
        for name, e in res["variants"].items():
            if name != "plain":
                print(f"    {name:12s} {_fmt_ratio(e)}")
        del model, opt, batch
        gc.collect()
    if args.profile:
        print("[profile] cheap and full tier, small config")
        model, opt, batch = _models.build("small", args.device)
        doc["profile"] = profile_tiers(model, opt, batch)
        doc["profile"]["split"] = cost_split(model, opt, batch)
        print(doc["profile"]["text"])
    with contextlib.suppress(OSError):
        doc["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if not args.no_write:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, "trace_overhead.json")
        if args.merge and os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            doc["configs"] = {**{k: v for k, v in old.get("configs", {}).items() if k not in doc["configs"]},
                              **doc["configs"]}
            for key in ("profile", "notes"):
                if key not in doc and key in old:
                    doc[key] = old[key]
            runs = old.get("runs", [old.get("machine", {})])
            doc["runs"] = [r for r in runs if r] + [doc["machine"]]
        with open(os.path.join(RESULTS, "trace_overhead.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(RESULTS, "trace_overhead.md"), "w") as f:
            f.write(to_markdown(doc))
        print(f"wrote {RESULTS}/trace_overhead.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
