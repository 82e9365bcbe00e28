"""The op-semantics registry: declarations are unique, literal arguments are read from real calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampdoctor.trace import OPS, Kind, Literal, Role, literal_values, op_info, ops_with, trace
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
