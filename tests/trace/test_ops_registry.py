"""The op-semantics registry: declarations are unique, literal arguments are read from real calls."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

from ampdoctor.trace import (
    OPS,
    Family,
    Kind,
    Literal,
    Role,
    family_ops,
    literal_values,
    op_info,
    ops_with,
    ops_with_literal,
    torch_names,
    trace,
)
from ampdoctor.trace._ops import declare


def test_a_second_declaration_is_rejected() -> None:
    before = dict(OPS)
    with pytest.raises(ValueError, match="already declared"):
        declare("mm", Kind.CANCELLING)
    assert OPS == before and Kind.CANCELLING not in op_info("mm").kinds


def test_a_bound_without_the_bounded_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="bounded op"):
        declare("__not_an_op__", Kind.BOUNDED)
    assert "__not_an_op__" not in OPS


def test_two_literals_at_one_position_are_rejected() -> None:
    with pytest.raises(ValueError, match="two literals"):
        declare("__not_an_op__", literals=(Literal("a", 1, Role.FILL), Literal("b", 1, Role.EPS)))
    assert "__not_an_op__" not in OPS


def test_literal_positions_match_the_aten_schemas() -> None:
    """Every declared literal is an argument of the op, at its declared position in the main overloads."""
    checked = 0
    for name, info in OPS.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or not info.literals:
            continue
        schemas = [[a.name for a in getattr(packet, o)._schema.arguments] for o in packet.overloads()]
        ovs = [o for o in ("default", "Tensor", "Scalar") if o in packet.overloads()]
        main = [getattr(packet, o)._schema.arguments for o in ovs]
        main_names = [[a.name for a in args] for args in main if "Tensor" in str(args[0].type)] or schemas
        for lit in info.literals:
            assert any(lit.name in a for a in schemas), (name, lit, schemas)
            assert all(a[lit.position] == lit.name for a in main_names if lit.name in a), (name, lit, main_names)
            checked += 1
    assert checked >= 25


def test_an_overload_that_moves_a_literal_is_read_by_name() -> None:
    args = (None, None, None, True, 0.1, 1e-3)  # _native_batch_norm_legit.no_stats(input, w, b, training, m, eps)
    names = tuple(a.name for a in torch.ops.aten._native_batch_norm_legit.no_stats._schema.arguments)
    assert literal_values("_native_batch_norm_legit", args, {}, names) == ((Literal("eps", 7, Role.EPS), 1e-3),)


def test_literal_values_by_position_and_keyword() -> None:
    assert literal_values("clamp", (None, -3, 5.0), {}) == (
        (Literal("min", 1, Role.BOUND), -3.0), (Literal("max", 2, Role.BOUND), 5.0))
    assert literal_values("clamp", (None,), {"max": 2}) == ((Literal("max", 2, Role.BOUND), 2.0),)
    assert literal_values("masked_fill", (None, None, torch.tensor(1.0)), {}) == ()  # a tensor is no literal
    assert literal_values("add", (None, 1e-3, True), {}) == ((Literal("other", 1, Role.ADDEND), 1e-3),)
    assert literal_values("mm", (None, None), {}) == ()


def test_the_trace_records_each_ops_literals() -> None:
    torch.manual_seed(0)
    norm = nn.LayerNorm(8, eps=1e-5)
    x = torch.randn(4, 8)
    with trace(norm, full=True) as t:
        (norm(x).masked_fill(x > 0, -1e4).clamp(min=-3.0) + 1e-3).sum().backward()
    lits = {(r.op, lit.name, lit.role, v) for r in t.result().records for lit, v in r.literals}
    assert ("aten.native_layer_norm.default", "eps", Role.EPS, 1e-5) in lits
    assert ("aten.masked_fill.Scalar", "value", Role.FILL, -1e4) in lits
    assert ("aten.clamp.default", "min", Role.BOUND, -3.0) in lits
    assert ("aten.add.Tensor", "other", Role.ADDEND, 1e-3) in lits
    # ops without declared literals record none, even when they take numbers (softmax's dim, sum's dims)
    assert all(not r.literals for r in t.result().records if r.op.startswith(("aten.sum", "aten.mm")))


def test_kinds_are_unchanged_by_literal_only_declarations() -> None:
    """In-place arithmetic is declared for its literal only: it joins no kind's set."""
    assert "add_" in OPS and "add_" not in ops_with(Kind.CANCELLING) and "add" in ops_with(Kind.CANCELLING)


# ------------------------------------------------------------------------------------ one registry: a source scan
ROOT = pathlib.Path(__file__).resolve().parents[2] / "ampdoctor"
#: the modules that declare op and dtype knowledge
REGISTRIES = {"trace/_ops.py", "trace/_dtypes.py", "trace/_autocast.py"}
#: ``module: why`` for the loose tables that remain (only shrinks)
SCAN_ALLOWED: dict[str, str] = {
    "findings/_training_rules.py": "updates (issue 13): the clip-norm and scale-division op tuples of its rules",
}
_FLOAT_DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)
                 and getattr(torch, n).is_floating_point}


def _is_dtype(n: ast.AST) -> bool:
    return isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "torch" \
        and n.attr in _FLOAT_DTYPES


def _is_aten(n: ast.AST) -> bool:
    return isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier() \
        and hasattr(torch.ops.aten, n.value)


def loose_tables(source: str) -> list[str]:
    """Set/tuple/list/dict displays of two or more torch float dtypes, or of three or more aten op names (at
    least half of the display's elements): the tables the registries replace."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys, values = [k for k in node.keys if k is not None], node.values
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            keys, values = node.elts, []
        else:
            continue
        n_aten = sum(map(_is_aten, keys))
        if sum(map(_is_dtype, keys)) >= 2 or sum(map(_is_dtype, values)) >= 2:
            out.append(f"line {node.lineno}: a table of torch dtypes")
        elif n_aten >= 3 and 2 * n_aten >= len(keys):
            out.append(f"line {node.lineno}: a table of aten op names")
    return out


def test_no_module_outside_the_registries_declares_op_or_dtype_tables() -> None:
    found = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        if rel in REGISTRIES or rel in SCAN_ALLOWED or rel.startswith("scenarios/"):
            continue
        if hits := loose_tables(p.read_text()):
            found[rel] = hits
    assert not found, ("declare these in ampdoctor/trace/_ops.py (op kinds, families, literals) or read "
                       f"ampdoctor/trace/_dtypes.py (DTYPES, HALF_DTYPES, dtype_info): {found}")


def test_the_scan_sees_loose_tables() -> None:
    """The check can fail: a dtype tuple, a dtype-valued dict and an op-name set are each reported."""
    assert loose_tables("LOW = (torch.float16, torch.bfloat16)")
    assert loose_tables('M = {"fp16": torch.float16, "bf16": torch.bfloat16}')
    assert loose_tables('OPS = {"mm", "addmm", "bmm"}')
    assert not loose_tables('WORDS = ("the", "mm", "model", "x")') and not loose_tables("D = (torch.float16,)")
    assert all(rel in {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")} for rel in SCAN_ALLOWED)


def test_families_and_upcast_are_declared_together() -> None:
    with pytest.raises(ValueError, match="upcast"):
        declare("__not_an_op__", family=Family.NORM)
    assert family_ops(Family.TANH) == {"tanh": "input"} and family_ops(Family.NORM)["pow"] == "fp32"
    assert torch_names({"add"}) == {"add", "__add__", "__radd__"}
    assert ops_with_literal(Role.FILL) >= {"masked_fill", "fill_", "full"}
