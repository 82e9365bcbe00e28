"""The package reads as its architecture: no import cycles, no upward imports, small modules and functions.

Layers, lowest first (a module may import its own layer and the ones below; ``docs/architecture.md`` draws them):

    0  errors, trace, scenarios   the base error; op-level observation and the op/dtype registries; demo models
    1  precision                  the step runner: a step in a target precision next to an fp32 reference
    2  findings, diagnose(_generate)  rules, ranking and the diagnosis pipelines that run them
    3  fixes                      actions that change a model or setup, each re-verified (through diagnose)
    4  watch                      the always-on guard, reproducers and their replay (through diagnose)
    5  report                     terminal, JSON and HTML renderers of a Report
    6  integrations               HF, Lightning, accelerate, script runner: thin adapters over watch
    7  cli, ampdoctor (the root)  the command line and the public facade

Imports inside functions count (a lazy import that goes upward or closes a cycle is the same design problem);
imports under ``if TYPE_CHECKING:`` do not (they never run). Sizes: modules at most 500 lines, functions at most
60 lines, unless the function carries a ``# long:`` comment saying why; :data:`LONG_ALLOWED` lists today's
exceptions with the area that owns them, and only shrinks (an entry that is no longer needed is harmless, so
splitting a function never breaks this test; the lead prunes the lists).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ampdoctor"

LAYERS: dict[str, int] = {
    "errors": 0, "trace": 0, "scenarios": 0,
    "precision": 1,
    "findings": 2, "diagnose": 2, "diagnose_generate": 2,
    "fixes": 3,
    "watch": 4,
    "report": 5,
    "integrations": 6,
    "cli": 7, "": 7,
}

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

#: modules over the size limit today, with the area whose issue splits them (remove an entry once it is done)
BIG_MODULES_ALLOWED: dict[str, str] = {}

#: functions over the size limit today without a ``# long:`` comment, with the owning area (only shrinks)
LONG_ALLOWED: dict[str, str] = {}

#: modules whose docstring examples run as they are (``doctest``)
DOCTEST_MODULES = (
    "ampdoctor",
    "ampdoctor.errors",
    "ampdoctor.findings._payloads",
    "ampdoctor.findings._types",
    "ampdoctor.precision._cuda_policy",
    "ampdoctor.precision.emulation",
    "ampdoctor.precision.fp8",
    "ampdoctor.scenarios",
    "ampdoctor.trace",
    "ampdoctor.trace._autocast",
    "ampdoctor.trace._dtypes",
    "ampdoctor.trace._ops",
    "ampdoctor.watch",
)


def _modname(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: dict[str, pathlib.Path] = {_modname(p): p for p in sorted(ROOT.rglob("*.py"))}


def _layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else ""
    assert top in LAYERS, f"{mod}: its package {top!r} has no layer in tests/test_structure.py LAYERS; add it"
    return LAYERS[top]


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """``(module imported, line)`` for every ampdoctor module ``path`` imports, TYPE_CHECKING blocks excluded."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.If) and isinstance(ch.test, ast.Name) and ch.test.id == "TYPE_CHECKING":
                continue
            if isinstance(ch, ast.Import):
                out.extend((a.name, ch.lineno) for a in ch.names if a.name in MODULES)
            elif isinstance(ch, ast.ImportFrom) and ch.module and ch.level == 0:
                subs = [f"{ch.module}.{a.name}" for a in ch.names if f"{ch.module}.{a.name}" in MODULES]
                if subs:  # ``from pkg import submodule``: the submodule is what is imported
                    out.extend((s, ch.lineno) for s in subs)
                elif ch.module in MODULES:
                    out.append((ch.module, ch.lineno))
            visit(ch)

    visit(ast.parse(path.read_text()))
    return out


GRAPH: dict[str, list[tuple[str, int]]] = {m: _imports(p) for m, p in MODULES.items()}


def test_no_upward_imports() -> None:
    bad = [f"{m}:{line} imports {t} (layer {_layer(m)} -> {_layer(t)})"
           for m, edges in GRAPH.items() for t, line in edges if _layer(t) > _layer(m)]
    assert not bad, "a lower layer imports a higher one:\n" + "\n".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), package-to-own-submodule edges
    excluded (a package ``__init__`` re-exporting its submodules is not a cycle)."""
    def edges(m: str) -> list[str]:
        return [t for t, _ in GRAPH[m] if t != m and not m.startswith(t + ".")]

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in MODULES:
        if m not in index:
            strong(m)
    return out


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_the_cycle_detector_sees_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a fake back edge findings._common -> findings._core_rules is reported."""
    fake = dict(GRAPH)
    fake["ampdoctor.findings._common"] = [*GRAPH["ampdoctor.findings._common"], ("ampdoctor.findings._core_rules", 1)]
    monkeypatch.setattr(__import__(__name__, fromlist=["GRAPH"]), "GRAPH", fake)
    assert any("ampdoctor.findings._common" in c and "ampdoctor.findings._core_rules" in c for c in _cycles())


def _private(parts: list[str]) -> bool:
    return any(s.startswith("_") and not s.startswith("__") for s in parts)


def _private_imports(path: pathlib.Path, own: str | None) -> list[str]:
    """``line: what`` for every import in ``path`` (lazy and TYPE_CHECKING ones too) of a ``_private`` ampdoctor
    module or name outside the package ``own`` (``None``: every private module or name is foreign)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            pairs = [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            pairs = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in pairs:
            parts = module.split(".")
            if parts[0] != "ampdoctor" or (own is not None and len(parts) > 1 and parts[1] == own):
                continue
            if _private(parts[1:]) or _private([name]):
                out.append(f"{node.lineno}: {module}{' import ' + name if name else ''}")
    return out


def _package(path: pathlib.Path) -> str | None:
    """The top-level package of an ampdoctor module (``None`` for the root modules: diagnose.py, errors.py, ...)."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else None


def test_no_private_imports_across_packages() -> None:
    """A module imports another package's public names only (private modules of its own package are fine)."""
    bad = [f"{p.relative_to(ROOT)}:{hit}" for p in MODULES.values() for hit in _private_imports(p, _package(p))]
    assert not bad, "private names imported across packages (give them a public home):\n" + "\n".join(bad)


def test_bench_uses_only_the_public_api() -> None:
    bench = sorted((ROOT.parent / "bench").glob("*.py"))
    assert bench
    bad = [f"bench/{p.name}:{hit}" for p in bench for hit in _private_imports(p, None)]
    assert not bad, "bench scripts import private ampdoctor modules or names:\n" + "\n".join(bad)


def test_the_private_import_check_can_fail(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from ampdoctor.findings._types import Report\nfrom ampdoctor.fixes import _x\n"
                   "def f():\n    import ampdoctor.trace._modules\nfrom ampdoctor.findings import Report\n")
    assert _private_imports(src, "report") == ["1: ampdoctor.findings._types import Report",
                                               "2: ampdoctor.fixes import _x", "4: ampdoctor.trace._modules"]
    assert _private_imports(src, "findings") == ["2: ampdoctor.fixes import _x", "4: ampdoctor.trace._modules"]


def _long_functions(path: pathlib.Path) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function longer than the limit without a ``# long:`` comment."""
    text = path.read_text()
    lines = text.splitlines()
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{ch.name}"
                if not isinstance(ch, ast.ClassDef):
                    first = min([ch.lineno, *(d.lineno for d in ch.decorator_list)])
                    n = (ch.end_lineno or ch.lineno) - first + 1
                    body = "\n".join(lines[first - 1:ch.end_lineno])
                    if n > MAX_FUNCTION_LINES and "# long:" not in body:
                        out.append((name, n))
                visit(ch, name + ".")

    visit(ast.parse(text), "")
    return out


def test_modules_are_small() -> None:
    big = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in MODULES.values()}
    over = {k: n for k, n in big.items() if n > MAX_MODULE_LINES and k not in BIG_MODULES_ALLOWED}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {over}"


def test_functions_are_short_or_say_why() -> None:
    found = {f"{p.relative_to(ROOT)}:{name}": n for p in MODULES.values() for name, n in _long_functions(p)}
    new = {k: n for k, n in found.items() if k not in LONG_ALLOWED}
    assert not new, (f"functions over {MAX_FUNCTION_LINES} lines: split them, or add a '# long: why' comment "
                     f"inside: {new}")


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_doctests_run(name: str) -> None:
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0, res


def test_architecture_doc_names_every_module() -> None:
    """``docs/architecture.md`` has one line per module: a new module must be added there."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in MODULES.values()
               if p.name != "__init__.py" and "scenarios" not in p.parts and p.name not in text]
    assert not missing, f"add these modules to docs/architecture.md: {missing}"
