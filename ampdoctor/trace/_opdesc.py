"""What the recording mode needs to know about one op call: its overload's cached descriptor, and one walk over its
arguments for their tensors and Python numbers."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ampdoctor.trace._ops import Kind, op_info, ops_with
from ampdoctor.trace._stats import BOUNDED_OPS
from ampdoctor.trace._writes import HIDDEN_WRITES

#: ops whose single output holds exactly the elements of their first input: they reuse its statistics row
ALIASES = ops_with(Kind.SAME_ELEMENTS)
#: ops whose output memory is uninitialised: never read (their statistics would describe garbage)
UNINITIALISED = ops_with(Kind.UNINITIALISED)
#: ops whose output is all zeros: a lite statistics row is known without reading it
ZEROS = ops_with(Kind.ZEROS)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def flat(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            flat(o, out)


def gather(args: Any, kwargs: dict[str, Any], write_only: frozenset[str]) -> tuple[list[torch.Tensor], list[float]]:
    """One walk over an op's arguments: its tensors (nested in lists too; ``out=`` buffers are not inputs: their
    memory is not data yet) and its Python number arguments (``alpha``, ``scale``, ``eps``...), positional then
    keyword."""
    ins: list[torch.Tensor] = []
    scalars: list[float] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            ins.append(a)
        elif isinstance(a, (list, tuple)):
            flat(a, ins)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            scalars.append(float(a))
    for k, v in kwargs.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            scalars.append(float(v))
        elif k not in write_only:
            flat(v, ins)
    return ins, scalars


@dataclass(frozen=True, slots=True)
class OpDesc:
    """What the recording mode needs to know about one op overload, worked out once from its schema and the op
    registry (:mod:`ampdoctor.trace._ops`) and looked up once per call."""

    name: str  # ``aten.add.Tensor``
    base: str  # ``add``
    view: bool  # returns a view of an input
    mutable: bool  # the schema writes an argument
    write_only: frozenset[str]  # keyword-only arguments it writes into (``out=``): never read as inputs
    arg_names: tuple[str, ...]  # schema argument names (where its literals sit)
    literals: bool  # the registry declares literal arguments for it
    writes: bool  # mutates, or writes running statistics its schema does not mark (:data:`HIDDEN_WRITES`)
    uninit: bool  # its output memory is uninitialised
    alias: bool  # its single output holds exactly its first input's elements
    bounded: str | None  # the bound its outputs can reach (:data:`BOUNDED_OPS`)
    collective: bool  # a ``c10d`` collective
    zeros: bool  # its output is all zeros


#: id of an op overload -> (the overload, its descriptor). Keyed by identity, not by the overload: an OpOverload's
#: ``__hash__`` is a Python method, one Python call per lookup per op; the entry holds the overload, so its id is never
#: reused by another object.
_DESCS: dict[int, tuple[Any, OpDesc]] = {}


def op_desc(func: Any) -> OpDesc:
    """The :class:`OpDesc` of an op overload, cached."""
    hit = _DESCS.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    desc = _describe(func)
    _DESCS[id(func)] = (func, desc)
    return desc


def _describe(func: Any) -> OpDesc:
    schema = func._schema
    base = func.overloadpacket.__name__
    return OpDesc(
        name=str(func), base=base,
        view=not schema.is_mutable and len(schema.returns) == 1 and schema.returns[0].alias_info is not None,
        mutable=schema.is_mutable,
        write_only=frozenset(a.name for a in schema.arguments
                             if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write),
        arg_names=tuple(a.name for a in schema.arguments), literals=bool(op_info(base).literals),
        writes=schema.is_mutable or base in HIDDEN_WRITES, uninit=base in UNINITIALISED, alias=base in ALIASES,
        bounded=BOUNDED_OPS.get(base), collective=str(func).startswith("c10d."), zeros=base in ZEROS)
