"""Architecture zoo: healthy runs and faults injected by mechanism, on tiny models of many families.

    python bench/zoo.py                        # every family, every mechanism -> bench/results/zoo.{json,md}
    python bench/zoo.py --only llama,bert      # a few families (results not written unless --out)
    python bench/zoo.py --fast                 # the subset the test suite runs

For each family (``bench/_zoo_families.py``, built from configs, no downloads):
(a) healthy: ``diagnose`` under fp16-amp (with a GradScaler), bf16-amp and bf16 with AdamW; a run is *ok*
    when it has no error finding and does not crash;
(b) injected: each registered mechanism (``bench/_zoo_inject.py``) damages one module chosen at random
    (seeded by family and mechanism) and runs in the mechanism's precision; it is *named* when
    ``findings[0]`` names the injected module and one of the mechanism's acceptable codes.
A crash is ``diagnose`` raising. The results end with one line
``ZOO families=N healthy_ok=A/B injected_named=C/D crashes=E``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import sys
import time
import traceback
import warnings
import zlib
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the bench helpers and this checkout's ampdoctor

import torch  # noqa: E402
from _zoo_families import FAMILIES, FAST, Built, loss_for  # noqa: E402
from _zoo_inject import MECHANISMS, probe  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.precision import call_model, default_loss  # noqa: E402

HEALTHY_PRECISIONS = ("fp16-amp", "bf16-amp", "bf16")
#: what a not-ok healthy run was, checked by hand without ampdoctor (shown in the results)
NOTES = {
    "deberta": "not a false alarm: transformers 5.24's DeBERTa (v1) raises the same \"value cannot be converted "
               "to type c10::BFloat16 without overflow\" under plain torch.autocast (no ampdoctor): its attention "
               "masks fp16/bf16 scores with torch.finfo(float32).min. The crash pre-empts every injected fault in "
               "an autocast run of this family.",
    "longt5": "not a false alarm (checked by hand without ampdoctor): under plain torch.autocast(fp16) transformers "
              "5.24's LongT5 local attention gives NaN gradients in shared.weight and the attention's k, v and "
              "relative_attention_bias (loss finite, fp32 clean): `scores += position_bias` writes the mask's -1e10 "
              "into fp16 scores (-inf), and the padded query rows of the 128-token block are then fully masked, so "
              "their softmax is NaN; the rows are sliced off in forward but the NaN comes back through softmax's "
              "backward (0 * NaN).",
    "mobilevit": "not a false alarm (checked by hand without ampdoctor): under plain torch.autocast(fp16) with a "
                 "GradScaler (scale 65536) the tiny random-init MobileViT's layer-2 attention query/key weights and "
                 "biases get all-zero gradients (query.weight 256/256, key.weight 256/256 zero where fp32 is "
                 "nonzero): its attention scores reach only |max| 6e-10 in fp32, below fp16's smallest subnormal "
                 "6e-8, so the forward bmm returns exact zeros. The weights' fp32 gradients are tiny (|max| 1e-15) and "
                 "the underflow rule judges their loss negligible, but the zero-initialised q/k biases' fp32 "
                 "gradients (up to 1.8e-11) would move them from 0 by ~2e-6 under AdamW, so it stays an error.",
}
log = logging.getLogger("zoo")


def _seed(*parts: str) -> int:
    return zlib.crc32("/".join(parts).encode())


def build(family: str, seed: int = 0) -> Built:
    torch.manual_seed(seed)
    return FAMILIES[family].build()


def _diagnose(built: Built, family: str, precision: str, lr: float = 1e-3) -> ampdoctor.Report:
    model = built.model
    # whole-model bf16/fp16 runs forward + backward without an optimizer step: AdamW on bf16 weights loses its small
    # steps (LayerNorm gains at 1.0 ignore updates below 2**-8), which ampdoctor rightly reports as
    # low-precision-params -- the low-precision-update mechanism tests exactly that
    opt = None if precision in ("bf16", "fp16") else torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-amp" else None
    return ampdoctor.diagnose(model, built.batch, precision=precision, loss_fn=loss_for(family, built),
                              optimizer=opt, scaler=scaler)


def _root(report: ampdoctor.Report) -> dict[str, Any] | None:
    f = report.findings[0] if report.findings else None
    return None if f is None else {"code": f.code, "module": f.module, "op": f.op, "phase": f.phase,
                                   "severity": f.severity}


def run_healthy(family: str, precision: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"family": family, "precision": precision}
    try:
        report = _diagnose(build(family), family, precision)
        out.update(ok=report.ok, crash=None, root=_root(report),
                   errors=[(f.code, f.module, f.op) for f in report.findings if f.severity == "error"][:5],
                   codes=report.codes()[:8])
    except Exception as e:  # noqa: BLE001 - a crash is a result
        out.update(ok=False, crash=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                   trace=traceback.format_exc(limit=4)[-1500:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _loss_of(family: str, built: Built) -> Any:
    lf = loss_for(family, built)

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        out = call_model(model, built.batch)
        loss = lf(out, built.batch) if lf is not None else default_loss(out)
        assert loss is not None, f"{family}: no loss"
        return loss
    return loss_of


def run_injected(family: str, mech: str) -> dict[str, Any]:
    m = MECHANISMS[mech]
    t0 = time.perf_counter()
    out: dict[str, Any] = {"family": family, "mechanism": mech, "precision": m.precision}
    built = build(family)
    try:
        p = probe(copy.deepcopy(built.model), built.batch, _loss_of(family, built))
        inj = m.inject(built.model, p, random.Random(_seed(family, mech)))
    except LookupError as e:
        out.update(skipped=str(e), named=None, crash=None)
        return out
    out["module"] = inj.module
    out["note"] = inj.note
    try:
        report = _diagnose(built, family, m.precision, lr=inj.overrides.get("lr", 1e-3))
        root = _root(report)
        out.update(root=root, crash=None, codes=report.codes()[:8],
                   named=bool(root and root["module"] == inj.module and root["code"] in m.codes),
                   found_anywhere=any(f.module == inj.module and f.code in m.codes for f in report.findings))
    except Exception as e:  # noqa: BLE001 - a crash is a result
        out.update(named=False, crash=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                   trace=traceback.format_exc(limit=4)[-1500:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def sweep(families: list[str], mechanisms: list[str], healthy: bool = True) -> dict[str, Any]:
    rows_h, rows_i = [], []
    for fam in families:
        if healthy:
            for prec in HEALTHY_PRECISIONS:
                r = run_healthy(fam, prec)
                rows_h.append(r)
                log.info("healthy %-18s %-8s ok=%s %s %.1fs", fam, prec, r["ok"], r.get("crash") or r.get("errors"),
                         r["seconds"])
        for mech in mechanisms:
            r = run_injected(fam, mech)
            rows_i.append(r)
            log.info("inject  %-18s %-20s named=%s %s -> %s", fam, mech, r.get("named"), r.get("module"),
                     r.get("crash") or r.get("root"))
    return {"healthy": rows_h, "injected": rows_i}


def zoo_line(res: dict[str, Any], n_families: int) -> str:
    h = res["healthy"]
    inj = [r for r in res["injected"] if r.get("named") is not None]
    crashes = sum(1 for r in h + inj if r.get("crash"))
    return (f"ZOO families={n_families} healthy_ok={sum(1 for r in h if r['ok'])}/{len(h)} "
            f"injected_named={sum(1 for r in inj if r['named'])}/{len(inj)} crashes={crashes}")


def markdown(res: dict[str, Any], families: list[str], seconds: float) -> str:
    h, inj = res["healthy"], [r for r in res["injected"] if r.get("named") is not None]
    lines = ["# Architecture zoo", "",
             "Generated by `python bench/zoo.py` (torch " + torch.__version__ + "): tiny models of "
             f"{len(families)} families built from configs (no downloads), healthy runs under "
             f"{', '.join(HEALTHY_PRECISIONS)} and faults injected by mechanism at a seeded random module. "
             f"Sweep time {seconds / 60:.1f} min on a shared 2-core CPU.", "",
             "## Families", "", ", ".join(f"`{f}` ({FAMILIES[f].kind})" for f in families), "",
             "## Healthy runs", "", "| precision | ok | not ok |", "|---|---|---|"]
    for prec in HEALTHY_PRECISIONS:
        rs = [r for r in h if r["precision"] == prec]
        bad = [f"{r['family']} ({r.get('crash') or r.get('errors')})" for r in rs if not r["ok"]]
        lines.append(f"| {prec} | {sum(1 for r in rs if r['ok'])}/{len(rs)} | {'; '.join(bad) or '-'} |")
    lines += ["", "## Injected faults", "", "| mechanism | precision | named | misses |", "|---|---|---|---|"]
    for mech, m in MECHANISMS.items():
        rs = [r for r in inj if r["mechanism"] == mech]
        miss = [f"{r['family']}:{r['module']} -> {r.get('crash') or _short(r.get('root'))}" for r in rs
                if not r["named"]]
        lines.append(f"| `{mech}` | {m.precision} | {sum(1 for r in rs if r['named'])}/{len(rs)} | "
                     f"{'; '.join(miss) or '-'} |")
    notes = [f"- `{f}`: {NOTES[f]}" for f in families if f in NOTES]
    if notes:
        lines += ["", "## Notes", "", *notes]
    skipped = [f"{r['family']}/{r['mechanism']}" for r in res["injected"] if r.get("named") is None]
    if skipped:
        lines += ["", f"Not applicable (no module fits the mechanism): {', '.join(skipped)}."]
    lines += ["", zoo_line(res, len(families))]
    return "\n".join(lines) + "\n"


def _short(root: dict[str, Any] | None) -> str:
    return "no finding" if root is None else f"{root['code']} @ {root['module'] or '<root>'} {root['op']}"


def merge(paths: list[str], out: str) -> int:
    """Combine shard results (same code, run as parallel processes) into one results file, families in order."""
    parts = [json.load(open(p, encoding="utf-8")) for p in paths]
    order = {f: i for i, f in enumerate(FAMILIES)}
    families = sorted((f for p in parts for f in p["families"]), key=order.__getitem__)
    res = {k: sorted((r for p in parts for r in p[k]), key=lambda r: order[r["family"]])
           for k in ("healthy", "injected")}
    seconds = max(p["seconds"] for p in parts)
    with open(out + ".json", "w", encoding="utf-8") as fh:
        json.dump({"families": families, "seconds": seconds, "shards": len(parts), **res}, fh, indent=1, default=str)
    with open(out + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(res, families, seconds))
    print(zoo_line(res, len(families)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated family names")
    ap.add_argument("--mechanisms", default="", help="comma-separated mechanism names")
    ap.add_argument("--fast", action="store_true", help="the test-suite subset")
    ap.add_argument("--no-healthy", action="store_true")
    ap.add_argument("--out", default="", help="results prefix (default bench/results/zoo for a full sweep)")
    ap.add_argument("--shard", default="", help="I/N: run every N-th family starting at I (parallel processes)")
    ap.add_argument("--merge", default="", help="comma-separated shard JSON files: write the combined results")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge.split(","), args.out or os.path.join(_HERE, "results", "zoo"))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ampdoctor").setLevel(logging.WARNING)
    families = [f for f in args.only.split(",") if f] or (list(FAST) if args.fast else list(FAMILIES))
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        families = families[i::n]
    mechs = [m for m in args.mechanisms.split(",") if m] or list(MECHANISMS)
    t0 = time.perf_counter()
    res = sweep(families, mechs, healthy=not args.no_healthy)
    seconds = time.perf_counter() - t0
    out = args.out or ("" if (args.only or args.fast or args.mechanisms) else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "zoo"))
    if out:
        with open(out + ".json", "w", encoding="utf-8") as fh:
            json.dump({"families": families, "seconds": round(seconds, 1), **res}, fh, indent=1, default=str)
        with open(out + ".md", "w", encoding="utf-8") as fh:
            fh.write(markdown(res, families, seconds))
    print(zoo_line(res, len(families)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
