"""Field benchmark: ampdoctor on tiny reproductions of publicly reported mixed-precision failures (bench/_field_cases).

    python bench/field.py --json after.json                       # this checkout's ampdoctor
    PYTHONPATH=/path/to/older/checkout python bench/field.py --json before.json --ampdoctor-from-path
    python bench/field.py --markdown bench/results/field.md --before before.json --after after.json

A case is a *hit* when ``findings[0]`` of the failing run has the expected code, module, op and phase and is an
error (as ``tests/field`` requires; until round 7 a warning counted), and its healthy twin has no error finding.
The markdown table lists both runs side by side and ends with one line ``FIELD cases=N before=A/N after=B/N``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("bench.field")


def _first(report: Any) -> list[str] | None:
    if not report.findings:
        return None
    f = report.findings[0]
    return [f.code, f.module, f.op, f.phase, f.severity]


def run_case(name: str) -> dict[str, Any]:
    from _field_cases import CASES

    import ampdoctor

    c = CASES[name]
    row: dict[str, Any] = {"case": name, "source": c.source, "expect": list(c.expect)}
    t0 = time.perf_counter()
    for label, bad in (("bad", True), ("healthy", False)):
        try:
            r = ampdoctor.diagnose(**c.build(bad))
            row[label] = {"first": _first(r),
                          "errors": [[f.code, f.module, f.op] for f in r.findings if f.severity == "error"][:3],
                          "warnings": [[f.code, f.module, f.op] for f in r.findings if f.severity == "warning"][:5]}
        except Exception as e:  # noqa: BLE001 - a crash is a result here
            row[label] = {"crash": f"{type(e).__name__}: {e}"[:300]}
    row["seconds"] = time.perf_counter() - t0
    bad, healthy = row["bad"], row["healthy"]
    # named: findings[0] is the expected code, module, op and phase, and an error (a warning leaves ``ok`` True)
    row["named"] = bool(bad.get("first")) and bad["first"][:4] == list(c.expect) and bad["first"][4] == "error"
    row["healthy_ok"] = "crash" not in healthy and not healthy["errors"]
    row["hit"] = row["named"] and row["healthy_ok"]
    return row


def _cell(run: dict[str, Any] | None) -> str:
    if run is None:
        return "-"
    bad, healthy = run["bad"], run["healthy"]
    if "crash" in bad:
        got = f"crash ({bad['crash'][:60]})"
    elif bad["first"] is None:
        got = "no finding"
    else:
        code, module, op, phase, sev = bad["first"]
        got = f"`{code}` `{module or '<root>'}` {op or '-'} {phase} ({sev})"
    twin = "twin ok" if run["healthy_ok"] else "twin: " + (healthy.get("crash") or "; ".join(
        f"{c} {m or '<root>'} {o}" for c, m, o in healthy["errors"]))
    warned = healthy.get("warnings") or []
    if run["healthy_ok"] and warned:
        twin += f" ({len(warned)} warning(s): " + "; ".join(f"{c} {m or '<root>'} {o}" for c, m, o in warned[:2]) + ")"
    return f"{'HIT' if run['hit'] else 'MISS'}: {got}; {twin}"


def markdown(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    b = {r["case"]: r for r in before}
    lines = ["| case | source | expected findings[0] | before | after |", "|---|---|---|---|---|"]
    for r in after:
        code, module, op, phase = r["expect"]
        lines.append(f"| {r['case']} | {r['source']} | `{code}` `{module or '<root>'}` {op or '-'} {phase} | "
                     f"{_cell(b.get(r['case']))} | {_cell(r)} |")
    hb = sum(1 for r in after if b.get(r["case"], {}).get("hit"))
    ha = sum(1 for r in after if r["hit"])
    lines += ["", f"FIELD cases={len(after)} before={hb}/{len(after)} after={ha}/{len(after)}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows of this run")
    p.add_argument("--ampdoctor-from-path", action="store_true",
                   help="import ampdoctor from PYTHONPATH (an older checkout) instead of this repository")
    p.add_argument("--markdown", help="write the before/after table (needs --before and --after)")
    p.add_argument("--before")
    p.add_argument("--after")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ampdoctor").setLevel(logging.WARNING)
    sys.path.insert(0, HERE)
    if a.markdown:
        with open(a.before) as fb, open(a.after) as fa:
            text = markdown(json.load(fb), json.load(fa))
        with open(a.markdown, "a") as f:
            f.write(text)
        log.info("%s", text)
        return 0
    if not a.ampdoctor_from_path:
        sys.path.insert(0, os.path.dirname(HERE))
    from _field_cases import CASES

    import ampdoctor

    log.info("ampdoctor from %s", os.path.dirname(ampdoctor.__file__))
    rows = []
    for name in CASES:
        row = run_case(name)
        rows.append(row)
        log.info("%-32s %s  %.1fs", name, _cell(row), row["seconds"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    log.info("hits %d/%d", sum(r["hit"] for r in rows), len(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
