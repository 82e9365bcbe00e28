"""ampdoctor against the tools people reach for today, on every known case.

    python bench/compare.py                       # all cases of ../shared/cases + built-in scenarios
    python bench/compare.py --only t5,gelu        # cases whose name contains one of the words
    python bench/compare.py --overhead            # + step-time overhead of each tool (small T5 config)

Tools, each run on its own fresh ``make()`` of the case, in the case's precision (the same preparation as
ampdoctor's target run: low-precision casts, autocast with the same op policy, the case's train_step/scaler):

    ampdoctor     ampdoctor.diagnose_file(path): the root-cause finding (findings[0]) names code and module
    hf-debug      transformers' DebugUnderflowOverflow: forward hooks checking weights/inputs/outputs of every
                  module for inf/NaN; it raises at the first module whose frame has one (forward only)
    anomaly       torch.autograd.detect_anomaly(check_nan=True): raises at the first backward node returning
                  NaN (not inf). It names a node (e.g. PowBackward0) and prints the forward traceback that
                  created it; we read that node's owner module from a node -> module map (the innermost module
                  whose forward created it) and call it "<loss>" when no module created it (loss code)
    hooks         a plain NaN checker: forward hooks on every module + hooks on their outputs' gradients; the
                  first module whose output or grad_output holds inf/NaN (one host sync per tensor)

Scores per case and tool: detected (any alarm; for healthy controls an alarm is a false alarm), right module
(== EXPECT module), right cause (ampdoctor only: findings[0].code in EXPECT codes; the anchors cannot name
causes). Results: bench/results/compare.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models  # noqa: E402
import trace_overhead  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.precision import (  # noqa: E402
    Observer,
    ScenarioError,
    StepLoop,
    load_scenario_module,
    prepare,
    saved_rng,
    spec_from_module,
)
from ampdoctor.trace import (
    ModuleAttribution,  # noqa: E402
    iter_tensors,  # noqa: E402
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CASES_DIR = os.path.normpath(os.path.join(REPO, "..", "shared", "cases"))
RESULTS = os.path.join(HERE, "results")
TOOLS = ("ampdoctor", "hf-debug", "anomaly", "hooks")
LOSS = "<loss>"


# -- cases -----------------------------------------------------------------------------------------------------
def discover(only: list[str] | None = None) -> list[dict[str, Any]]:
    """Cases of ../shared/cases and the built-in scenarios (when ``ampdoctor.scenarios`` has them)."""
    cases = []
    for path in sorted(glob.glob(os.path.join(CASES_DIR, "*.py"))):
        cases.append({"name": os.path.basename(path)[:-3], "origin": "shared/cases", "path": path})
    try:
        from ampdoctor.scenarios import list_scenarios, load_scenario
    except ImportError:
        list_scenarios = None
    if list_scenarios is not None:
        for name in list_scenarios():
            try:
                mod = load_scenario(name)
            except Exception as e:  # noqa: BLE001 - a scenario that cannot load is listed as such
                cases.append({"name": name, "origin": "ampdoctor.scenarios", "path": None,
                              "load_error": f"{type(e).__name__}: {e}"})
                continue
            cases.append({"name": name, "origin": "ampdoctor.scenarios", "path": mod.__file__})
    if only:
        cases = [c for c in cases if any(w in c["name"] for w in only)]
    return cases


def _expect(module: Any) -> dict[str, Any]:
    exp = getattr(module, "EXPECT", None)
    return dict(exp) if isinstance(exp, dict) else {}


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"


# -- running a case's step the way its precision says ------------------------------------------------------------
class Prepared:
    """A copy of the case's objects prepared for its precision: ampdoctor's own target run, minus the trace."""

    def __init__(self, spec: Any, policy: str) -> None:
        self.spec, self.policy = spec, policy
        self.prep = prepare(spec, reference=False)
        self.model = self.prep.model

    def run(self, before_backward: Callable[[torch.Tensor], None] | None = None) -> None:
        """All ``spec.steps`` steps; exceptions propagate (the tools raise to report)."""
        observers = [_BeforeBackward(before_backward)] if before_backward is not None else []
        StepLoop(self.spec, self.prep, policy=self.policy, observers=observers, raise_errors=True).run(self.spec.steps)


class _BeforeBackward(Observer):
    def __init__(self, fn: Callable[[torch.Tensor], None]) -> None:
        self.fn = fn

    def before_backward(self, loop: Any, step: int, loss: torch.Tensor) -> None:
        self.fn(loss)


def _fresh_spec(case: dict[str, Any]) -> tuple[Any, Any]:
    module = load_scenario_module(case["path"])
    return module, spec_from_module(module, source=case["path"])


def _verdict(module: str | None, detected: bool, exp: dict[str, Any]) -> dict[str, Any]:
    healthy = bool(exp.get("healthy"))
    out: dict[str, Any] = {"detected": detected, "module": module}
    if healthy:
        out["correct"] = not detected
    else:
        out["right_module"] = detected and module == exp.get("module")
    return out


# -- the tools -------------------------------------------------------------------------------------------------
def run_ampdoctor(case: dict[str, Any], exp: dict[str, Any], policy: str) -> dict[str, Any]:
    try:
        report = ampdoctor.diagnose_file(case["path"], policy=policy)
    except Exception as e:  # noqa: BLE001
        return {"detected": False, "module": None, "error": _short(e), "crashed": True}
    alarms = [f for f in report.findings if f.severity in ("error", "warning")]
    top = report.findings[0] if report.findings else None
    if exp.get("healthy"):  # on a healthy control only an error is a false alarm; warnings are listed
        res = _verdict(top.module if top and not report.ok else None, not report.ok, exp)
        res["warnings"] = [f"{f.code} {_mod(f.module)}" for f in report.findings if f.severity == "warning"]
    else:
        res = _verdict(top.module if top and alarms else None, bool(alarms), exp)
    res.update(
        findings=[{"code": f.code, "severity": f.severity, "module": f.module, "op": f.op, "phase": f.phase}
                  for f in report.findings],
        code=top.code if top else None,
        phase=top.phase if top else None,
        op=top.op if top else None,
    )
    if not exp.get("healthy"):
        res["right_cause"] = bool(alarms) and top is not None and top.code in exp.get("codes", [])
        res["module_in_any_finding"] = any(f.module == exp.get("module") for f in alarms)
        res["cause_in_any_finding"] = any(f.code in exp.get("codes", []) for f in alarms)
    return res


def run_hf_debug(case: dict[str, Any], exp: dict[str, Any], policy: str) -> dict[str, Any]:
    from transformers.debug_utils import DebugUnderflowOverflow

    _, spec = _fresh_spec(case)
    prep = Prepared(spec, policy)
    first: dict[str, Any] = {}
    out = io.StringIO()
    try:
        debug = DebugUnderflowOverflow(prep.model)
    except Exception as e:  # noqa: BLE001
        return {"detected": False, "module": None, "error": _short(e), "crashed": True}
    orig = debug.create_frame

    def create_frame(module: Any, inputs: Any, output: Any) -> None:
        orig(module, inputs, output)
        if debug.detected_overflow and not first:
            first["module"] = debug.module_names.get(module, "?")
            first["class"] = type(module).__name__

    debug.create_frame = create_frame
    err = None
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            prep.run()
        except ValueError as e:
            if "DebugUnderflowOverflow" not in str(e):
                err = e
        except Exception as e:  # noqa: BLE001
            err = e
    res = _verdict(first.get("module"), bool(first), exp)
    flagged = [ln.strip() for ln in out.getvalue().splitlines() if ln.endswith((" has nans", " has infs"))]
    if first:
        res["flagged"] = flagged[:3]
        res["class"] = first["class"]
    _record_error(res, err, lambda fr: fr.filename.endswith("debug_utils.py"))
    return res


def _record_error(res: dict[str, Any], err: BaseException | None, in_tool: Callable[[Any], bool]) -> None:
    """An exception during the run: a crash of the tool itself, or the case's own step raising."""
    if err is None:
        return
    frames = traceback.extract_tb(err.__traceback__)
    if any(in_tool(fr) for fr in frames):
        res["crashed"] = True
        res["error"] = _short(err)
    else:
        res["step_error"] = _short(err)


_NODE_RE = re.compile(r"Function '(\w+)' returned nan values in its (\d+)th output")


def run_anomaly(case: dict[str, Any], exp: dict[str, Any], policy: str) -> dict[str, Any]:
    _, spec = _fresh_spec(case)
    prep = Prepared(spec, policy)
    attribution = ModuleAttribution(prep.model)  # node -> module map, to read the node anomaly mode names
    loss_nodes: list[Any] = []

    def collect(loss: torch.Tensor) -> None:  # every node of the loss graph, to find one made outside modules
        todo, seen = [loss.grad_fn], set()
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            loss_nodes.append(fn)
            todo.extend(n for n, _ in fn.next_functions)

    err: BaseException | None = None
    with attribution, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                prep.run(before_backward=collect)
        except Exception as e:  # noqa: BLE001
            err = e
    if err is None:
        return _verdict(None, False, exp)
    m = _NODE_RE.search(str(err))
    if m is None:
        res = _verdict(None, False, exp)
        _record_error(res, err, lambda fr: False)
        return res
    node_name = m.group(1)
    stack = next((str(w.message) for w in caught if f"Error detected in {node_name}" in str(w.message)), "")
    candidates = [n for n in list(attribution.node_owner) + loss_nodes if n.name() == node_name]
    node = None
    for n in candidates:
        tb = n.metadata.get("traceback_") if hasattr(n, "metadata") else None
        if tb and "".join(tb).strip() and "".join(tb).strip()[-200:] in stack:
            node = n
            break
    if node is None and len({attribution.node_owner.get(n, LOSS) for n in candidates}) == 1:
        node = candidates[0]
    frames = [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]
    if node is None:
        module = "?"
    else:
        module = attribution.node_owner.get(node, LOSS)
        # the root's own code creating the node inside a loss function (HF models compute the loss in forward)
        if module == "" and any(re.search(r"loss|cross_entropy", f, re.I) for f in frames[-3:]):
            module = LOSS
    res = _verdict(module, True, exp)
    res["node"] = node_name
    res["forward_frame"] = frames[-1] if frames else ""
    return res


def run_hooks(case: dict[str, Any], exp: dict[str, Any], policy: str) -> dict[str, Any]:
    _, spec = _fresh_spec(case)
    prep = Prepared(spec, policy)
    checker = NanHooks(prep.model)
    err = None
    with checker:
        try:
            prep.run()
        except Exception as e:  # noqa: BLE001
            err = e
    first = checker.first
    res = _verdict(first[0] if first else None, first is not None, exp)
    if first:
        res["where"] = first[1]
    _record_error(res, err, lambda fr: fr.filename == __file__ and fr.name in ("hook", "_bad"))
    return res


class NanHooks:
    """Forward hooks on every module + hooks on the gradients of their outputs: the first inf/NaN seen."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.first: tuple[str, str] | None = None
        self.handles: list[Any] = []

    def __enter__(self) -> NanHooks:
        for name, mod in self.model.named_modules():
            self.handles.append(mod.register_forward_hook(self._fwd(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _bad(self, t: torch.Tensor) -> bool:
        return t.is_floating_point() and not bool(torch.isfinite(t).all())

    def _fwd(self, name: str) -> Callable[..., None]:
        def hook(mod: Any, inputs: Any, output: Any) -> None:
            for t in iter_tensors(output):
                if self.first is None and self._bad(t):
                    self.first = (name, "forward output")
                if t.requires_grad and t.grad_fn is not None:
                    self.handles.append(t.register_hook(self._bwd(name)))

        return hook

    def _bwd(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            if self.first is None and self._bad(g):
                self.first = (name, "grad_output")

        return hook


RUNNERS: dict[str, Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]]] = {
    "ampdoctor": run_ampdoctor, "hf-debug": run_hf_debug, "anomaly": run_anomaly, "hooks": run_hooks,
}


def compare_case(case: dict[str, Any], policy: str) -> dict[str, Any]:
    row: dict[str, Any] = {"name": case["name"], "origin": case["origin"], "tools": {}}
    if case.get("load_error"):
        row["error"] = case["load_error"]
        return row
    try:
        module, spec = _fresh_spec(case)
    except ScenarioError as e:
        row["error"] = _short(e)
        return row
    exp = _expect(module)
    row["expect"] = exp
    row["precision"] = spec.precision
    del spec
    for tool in TOOLS:
        t0 = time.perf_counter()
        with saved_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                res = RUNNERS[tool](case, exp, policy)
            except Exception as e:  # noqa: BLE001 - a crash of the harness itself is recorded, not fatal
                res = {"detected": False, "module": None, "error": _short(e), "crashed": True, "harness": True}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        row["tools"][tool] = res
    return row


# -- overhead --------------------------------------------------------------------------------------------------
class AnomalyVariant(trace_overhead.Variant):
    name = "anomaly"
    label = "torch.autograd.detect_anomaly(check_nan=True)"

    @contextlib.contextmanager
    def context(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly(check_nan=True):
                yield


class HooksVariant(trace_overhead.Variant):
    name = "hooks"
    label = "forward + grad_output NaN hooks (one host sync per tensor)"

    def attach(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.checker = NanHooks(model).__enter__()

    def detach(self) -> None:
        self.checker.__exit__(None, None, None)


def overhead(rounds: int, warmup: int, budget: float | None) -> dict[str, Any]:
    model, opt, batch = _models.build("small")
    variants = [trace_overhead.Variant(), trace_overhead.TraceVariant(full=False), trace_overhead.TraceVariant(
        full=True), trace_overhead.HFDebug(), AnomalyVariant(), HooksVariant()]
    res = trace_overhead.measure(model, opt, batch, variants, rounds=rounds, warmup=warmup, budget_s=budget)
    res["config"] = dict(_models.CONFIGS["small"].__dict__)
    return res


# -- report ----------------------------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    failing = [r for r in rows if "expect" in r and not r["expect"].get("healthy")]
    healthy = [r for r in rows if "expect" in r and r["expect"].get("healthy")]
    for tool in TOOLS:
        s: dict[str, Any] = {"failing_cases": len(failing), "healthy_cases": len(healthy)}
        res = [r["tools"][tool] for r in failing if tool in r["tools"]]
        s["detected"] = sum(1 for x in res if x.get("detected"))
        s["right_module"] = sum(1 for x in res if x.get("right_module"))
        s["right_cause"] = sum(1 for x in res if x.get("right_cause")) if tool == "ampdoctor" else None
        if tool == "ampdoctor":
            s["cause_in_any_finding"] = sum(1 for x in res if x.get("cause_in_any_finding"))
        s["false_alarms"] = sum(1 for r in healthy if r["tools"].get(tool, {}).get("detected"))
        if tool == "ampdoctor":
            s["healthy_with_warnings"] = sum(1 for r in healthy if r["tools"].get(tool, {}).get("warnings"))
        s["crashed"] = sum(1 for r in failing + healthy if r["tools"].get(tool, {}).get("crashed"))
        s["seconds"] = round(sum(r["tools"].get(tool, {}).get("seconds", 0) for r in failing + healthy), 1)
        out[tool] = s
    return out


def _cell(tool: str, res: dict[str, Any], exp: dict[str, Any]) -> str:
    if res.get("crashed") and not res.get("detected"):
        return f"crash ({res.get('error', '')[:60]})".replace("|", "/")
    if exp.get("healthy"):
        if not res.get("detected"):
            warn = res.get("warnings")
            return "no alarm ✓" + (f" (warning: {'; '.join(warn)})" if warn else "")
        return f"alarm `{_mod(res.get('module'))}` ✗"
    if not res.get("detected"):
        return "— ✗" + (f" (step raised {res['step_error'].split(':')[0]})" if res.get("step_error") else "")
    mod = f"`{_mod(res.get('module'))}` {'✓' if res.get('right_module') else '✗'}"
    if tool == "ampdoctor":
        mod += f" · {res.get('code')} {'✓' if res.get('right_cause') else '✗'}"
    elif tool == "anomaly":
        mod += f" ({res.get('node')})"
    elif tool == "hooks" and res.get("where"):
        mod += f" ({res['where']})"
    return mod


def _mod(m: str | None) -> str:
    if m is None:
        return "?"
    return m if m else "(root)"


def to_markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# ampdoctor vs the usual tools",
        "",
        f"Run {doc['date']}, torch {doc['torch']}, transformers {doc['transformers']}, autocast policy "
        f"`{doc['policy']}`. Cell: the module the tool pointed at, ✓ = the EXPECT module (ampdoctor also: "
        "the root-cause code, ✓ = in EXPECT codes). `—` = no alarm. Anchors cannot name causes (no cause). "
        "Alarm = a finding of severity error or warning (ampdoctor), a raise (hf-debug, anomaly), a non-finite "
        "tensor seen (hooks); on healthy controls only an ampdoctor *error* counts as a false alarm.",
        "",
        "| case | expected | " + " | ".join(TOOLS) + " |",
        "|---|---|" + "---|" * len(TOOLS),
    ]
    for r in doc["cases"]:
        exp = r.get("expect", {})
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:80]} |" + " |" * len(TOOLS))
            continue
        e = "healthy" if exp.get("healthy") else f"`{_mod(exp.get('module'))}` · {'/'.join(exp.get('codes', []))}"
        cells = [_cell(t, r["tools"].get(t, {}), exp) for t in TOOLS]
        lines.append(f"| {r['name']} ({r.get('precision') or 'as given'}) | {e} | " + " | ".join(cells) + " |")
    lines += ["", "## Summary", ""]
    for tool, s in doc["summary"].items():
        cause = f", right cause {s['right_cause']}/{s['failing_cases']} (root-cause finding; in any finding " \
            f"{s['cause_in_any_finding']})" if s["right_cause"] is not None else ", no cause"
        lines.append(
            f"- **{tool}**: detected {s['detected']}/{s['failing_cases']}, right module "
            f"{s['right_module']}/{s['failing_cases']}{cause}; false alarms on healthy controls "
            f"{s['false_alarms']}/{s['healthy_cases']}"
            + (f" (warnings on {s['healthy_with_warnings']})" if s.get("healthy_with_warnings") else "")
            + f"; crashed {s['crashed']}; {s['seconds']} s in all")
    ov = doc.get("overhead")
    if ov:
        lines += [
            "",
            "## Overhead per training step (small T5 config, fp32, CPU, interleaved)",
            "",
            f"{ov['rounds']} rounds after {ov['warmup']} warm-up (measured {ov.get('measured', doc['date'])}), each "
            "tool bracketed by two plain steps, on a shared, loaded machine: read the IQR. See also "
            "`trace_overhead.md`.",
            "",
            "| tool | median step | ratio to plain (IQR) |",
            "|---|---|---|",
        ]
        for name, e in ov["variants"].items():
            med = f"{e['median_s']:.3f} s" if "median_s" in e else "-"
            ratio = "1.00×" if name == "plain" else trace_overhead._fmt_ratio(e)
            lines.append(f"| {name} — {e['label']} | {med} | {ratio} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated words; run the cases whose name contains one")
    ap.add_argument("--policy", default="cuda", choices=("cuda", "native"),
                    help="autocast op policy for amp precisions (ampdoctor's default: cuda)")
    ap.add_argument("--overhead", action="store_true", help="also time each tool on the small T5 config")
    ap.add_argument("--rounds", type=int, default=12, help="overhead rounds (with --overhead)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    torch.set_num_threads(args.threads)
    import transformers

    only = [w.strip() for w in args.only.split(",") if w.strip()]
    cases = discover(only)
    doc: dict[str, Any] = {
        "date": trace_overhead.machine_info()["date"], "torch": torch.__version__,
        "transformers": transformers.__version__, "policy": args.policy, "cases": [],
    }
    for case in cases:
        print(f"[{case['name']}]")
        row = compare_case(case, args.policy)
        for tool, res in row["tools"].items():
            err = res.get("error") or res.get("step_error")
            print(f"    {tool:10s} {_cell(tool, res, row.get('expect', {}))}  ({res['seconds']}s)"
                  + (f"  [{err[:100]}]" if err else ""))
        doc["cases"].append(row)
    doc["summary"] = summarize(doc["cases"])
    for tool, s in doc["summary"].items():
        print(f"{tool}: {s}")
    if args.overhead:
        print("[overhead] small T5 config")
        doc["overhead"] = overhead(args.rounds, 3, 240.0)
        for name, e in doc["overhead"]["variants"].items():
            if name != "plain":
                print(f"    {name:12s} {trace_overhead._fmt_ratio(e)}")
    if not args.no_write:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "compare.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
        with open(os.path.join(RESULTS, "compare.md"), "w") as f:
            f.write(to_markdown(doc))
        print(f"wrote {RESULTS}/compare.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
