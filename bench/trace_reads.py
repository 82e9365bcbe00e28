"""Which parts of a traced record the analysis reads, per run (fp32 reference / target) and phase.

    python bench/trace_reads.py                       # shared cases + bench T5 small fp16-amp, bf16-amp
    python bench/trace_reads.py --only t5 --json out.json

Every record's ``stats`` becomes a dict that logs the keys read (``[]``, ``get``, ``in``, iteration), its ``sample`` a
tuple that logs being read, and the write log's and decisions' lists log being iterated, from the moment the two
runs are handed to ``build_context`` to the finished report (alignment, lineage, every rule, ranking, enrichment,
summary, layers). The table it prints is the read audit of ``bench/results/trace_overhead.md``. It observes only
the code paths these runs take: the request the runner passes to the trace (``ampdoctor.trace.Request``) is
guarded by ``tests/precision/test_trace_request.py``, which runs the findings on records whose dropped fields are
NaN and asserts identical reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib  # noqa: E402

import torch  # noqa: E402

import ampdoctor  # noqa: E402

_diag = importlib.import_module("ampdoctor.diagnose")

READS: dict[tuple[str, str, str], set[str]] = defaultdict(set)  # (run, phase, kind) -> fields read
SEEN: dict[tuple[str, str, str], int] = defaultdict(int)
#: (run, phase, kind, field) -> the ampdoctor functions that read it (first frame inside the package)
WHO: dict[tuple[str, str, str, str], set[str]] = defaultdict(set)


def _who(tag: tuple[str, str, str], name: str) -> None:
    f = sys._getframe(2)
    while f is not None and "/ampdoctor/" not in f.f_code.co_filename:
        f = f.f_back
    if f is not None:
        path = f.f_code.co_filename.split("/ampdoctor/", 1)[1].removesuffix(".py")
        WHO[(*tag, name)].add(f"{path}:{f.f_code.co_name}")


class _Stats(dict):  # type: ignore[type-arg]
    __slots__ = ("_tag",)

    def _log(self, k: Any) -> None:
        READS[self._tag].add(str(k))
        _who(self._tag, str(k))

    def __getitem__(self, k: Any) -> Any:
        self._log(k)
        return dict.__getitem__(self, k)

    def get(self, k: Any, default: Any = None) -> Any:
        self._log(k)
        return dict.get(self, k, default)

    def __contains__(self, k: Any) -> bool:
        self._log(k)
        return dict.__contains__(self, k)

    def __iter__(self) -> Any:
        for k in dict.keys(self):
            self._log(k)
        return dict.__iter__(self)

    def items(self) -> Any:  # type: ignore[override]
        for k in dict.keys(self):
            self._log(k)
        return dict.items(self)

    def values(self) -> Any:  # type: ignore[override]
        for k in dict.keys(self):
            self._log(k)
        return dict.values(self)


class _Sample(tuple):  # type: ignore[type-arg]
    tag: tuple[str, str, str]

    def _log(self) -> None:
        READS[self.tag].add("sample")
        _who(self.tag, "sample")

    def __getitem__(self, i: Any) -> Any:
        self._log()
        return tuple.__getitem__(self, i)

    def __iter__(self) -> Any:
        self._log()
        return tuple.__iter__(self)

    def __len__(self) -> int:
        self._log()
        return tuple.__len__(self)

    def __bool__(self) -> bool:
        self._log()
        return tuple.__len__(self) > 0


class _Logged(list):  # type: ignore[type-arg]
    tag: tuple[str, str, str]

    def __iter__(self) -> Any:
        if list.__len__(self):
            READS[self.tag].add("entries")
        return list.__iter__(self)

    def __getitem__(self, i: Any) -> Any:
        READS[self.tag].add("entries")
        return list.__getitem__(self, i)


def instrument(result: Any, run: str) -> None:
    """Wrap every record's ``stats`` and ``sample``, the write log and the decisions of ``result.trace``."""
    tr = result.trace
    if tr is None:
        return
    for r in tr.records:
        tag = (run, r.phase, r.kind)
        SEEN[tag] += 1
        s = _Stats(r.stats)
        s._tag = tag
        r.stats = s
        if r.sample:
            smp = _Sample(r.sample)
            smp.tag = tag
            r.sample = smp
    for name in ("writes", "decisions"):
        lst = _Logged(getattr(tr, name))
        lst.tag = (run, "*", name)
        setattr(tr, name, lst)


def _install() -> None:
    orig = _diag.build_context

    def build_context(spec: Any, target: Any, reference: Any) -> Any:
        instrument(target, "target")
        if reference is not None:
            instrument(reference, "reference")
        return orig(spec, target, reference)

    _diag.build_context = build_context  # type: ignore[assignment]


def _runs(only: list[str]) -> list[tuple[str, Any]]:
    from bench._models import build

    shared = Path(__file__).resolve().parents[2] / "shared" / "cases"
    out: list[tuple[str, Any]] = []
    for p in sorted(shared.glob("*.py")):
        out.append((p.stem, lambda p=p: ampdoctor.diagnose_file(str(p))))
    for prec in ("fp16-amp", "bf16-amp"):
        def t5(prec: str = prec) -> Any:
            model, opt, batch = build("small")
            return ampdoctor.diagnose(model, batch, precision=prec, optimizer=opt)
        out.append((f"t5-small-{prec}", t5))
    return [(n, f) for n, f in out if not only or any(w in n for w in only)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated words: runs whose name contains one")
    ap.add_argument("--json", default="", help="write the reads as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _install()
    for name, fn in _runs([w for w in args.only.split(",") if w]):
        print(f"[run] {name}", file=sys.stderr)
        fn()
    rows = sorted(set(READS) | set(SEEN))
    print("| run | phase | kind | records | read |")
    print("|---|---|---|---|---|")
    for tag in rows:
        print(f"| {tag[0]} | {tag[1]} | {tag[2]} | {SEEN.get(tag, '')} | {', '.join(sorted(READS.get(tag, ())))} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"|".join(k): sorted(v) for k, v in WHO.items()}, indent=1))


if __name__ == "__main__":
    main()
