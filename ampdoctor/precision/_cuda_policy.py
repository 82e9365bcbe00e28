"""The autocast op policies of PyTorch read from the op registry: which aten ops CUDA (and CPU) autocast run in
which dtype.

The data (torch 2.13.0's ``autocast_mode.h`` / ``autocast_mode.cpp`` lists, their sources and the policies) is
declared once, at the bottom layer, in :mod:`ampdoctor.trace` (``declare_autocast``, ``autocast_class``); this
module is its lookup for the precision layer: :func:`policy_for`, the per-device views ``CUDA_POLICY`` /
``CUDA_OVERLOADS`` / ``CPU_POLICY`` / ``CPU_OVERLOADS`` of the registered ops (composites excluded, so they equal
the dispatcher's registrations: ``tests/precision/test_emulation.py``), and the generated policy table.

The policies (``"lower"``, ``"fp32"``, ``"fp32_set_opt_dtype"``, ``"fp32_append_dtype"``, ``"promote"``,
``"banned"``; ``None``: not registered, the op runs in its inputs' dtype) are described in
``ampdoctor/trace/_autocast.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ampdoctor.trace import (
    AUTOCAST,
    AUTOCAST_DEVICES,
    AUTOCAST_POLICIES,
    CUDA_CUDNN_ONLY,
    AutocastPolicy,
)

Policy = AutocastPolicy

#: Every policy name, in the order of the documentation table.
POLICIES: tuple[str, ...] = AUTOCAST_POLICIES

#: The device kinds :func:`policy_for` knows.
DEVICE_KINDS: tuple[str, ...] = AUTOCAST_DEVICES

TORCH_VERSION = "2.13.0"


def _registered(device: str) -> tuple[Mapping[str, str], Mapping[str, frozenset[str]]]:
    """The ops autocast registers on ``device`` (base name -> policy, base name -> overloads), composites left out."""
    entries = [c for c in AUTOCAST[device].values() if not c.composite]
    return (MappingProxyType({c.name: c.policy for c in entries}),
            MappingProxyType({c.name: c.overloads for c in entries}))


CUDA_POLICY, CUDA_OVERLOADS = _registered("cuda")
CPU_POLICY, CPU_OVERLOADS = _registered("cpu")

#: C++ composites the CUDA emulation gives the policy of their first inner op (torch-level names).
COMPOSITE_POLICY: Mapping[str, str] = MappingProxyType(
    {c.name: c.policy for c in AUTOCAST["cuda"].values() if c.composite})

#: The message CUDA autocast raises for ``binary_cross_entropy`` (``binary_cross_entropy_banned``), verbatim.
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def split_op_name(op_name: str) -> tuple[str, str | None]:
    """``"aten.pow.Tensor_Scalar"`` / ``"aten::pow.Tensor_Scalar"`` -> ``("pow", "Tensor_Scalar")``.

    ``"pow"`` -> ``("pow", None)`` (no overload given); ``"aten.mm.default"`` -> ``("mm", "")``.
    """
    if not isinstance(op_name, str) or not op_name:
        raise TypeError(f"op_name must be a non-empty str like 'softmax' or 'aten.pow.Tensor_Scalar', got {op_name!r}")
    name = op_name
    for prefix in ("aten::", "aten."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    base, dot, overload = name.partition(".")
    if not dot:
        return base, None
    return base, "" if overload == "default" else overload


def policy_for(op_name: str, device_kind: str = "cuda") -> str | None:
    """The autocast policy of an aten op on ``device_kind`` ("cuda" or "cpu"), or ``None`` if it is not autocast.

    >>> policy_for("softmax"), policy_for("softmax", "cpu"), policy_for("aten.pow.Tensor_Scalar")
    ('fp32_set_opt_dtype', None, 'fp32')

    ``op_name`` is a base name (``"linear"``) or an overload (``"aten.sum.dim_IntList"``, ``"aten::mm"``); an
    overload that autocast does not register (``"sum.dim_DimnameList"``, ``"exp.out"``) gives ``None``.
    Returns one of ``"lower"``, ``"fp32"``, ``"fp32_set_opt_dtype"``, ``"fp32_append_dtype"``, ``"promote"``,
    ``"banned"`` (CPU uses only ``"lower"``, ``"fp32"``, ``"promote"``) or ``None``. Pure lookup, no side effects.
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"invalid device_kind {device_kind!r}: expected one of {', '.join(map(repr, DEVICE_KINDS))}")
    base, overload = split_op_name(op_name)
    policy, overloads = (CUDA_POLICY, CUDA_OVERLOADS) if device_kind == "cuda" else (CPU_POLICY, CPU_OVERLOADS)
    found = policy.get(base)
    if found is None or (overload is not None and overload not in overloads[base]):
        return None
    return found


def registered_overloads(device_kind: str = "cuda") -> frozenset[str]:
    """Every registered overload as the dispatcher spells it (``"aten::pow.Tensor_Scalar"``, ``"aten::mm"``)."""
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"invalid device_kind {device_kind!r}: expected one of {', '.join(map(repr, DEVICE_KINDS))}")
    overloads = CUDA_OVERLOADS if device_kind == "cuda" else CPU_OVERLOADS
    return frozenset(f"aten::{op}.{ov}" if ov else f"aten::{op}" for op, ovs in overloads.items() for ov in ovs)


_POLICY_ORDER = {name: i for i, name in enumerate(POLICIES)}


def policy_table_markdown() -> str:
    """The CUDA and CPU autocast policies of every listed op as a Markdown table (generated into docs/precision.md).

    Rows are sorted by CUDA policy (ops only CPU autocasts last), then by name; overloads are shown when only some
    overloads are registered. Pure function of the data in this module.
    """

    def cell(policy: Mapping[str, str], overloads: Mapping[str, frozenset], op: str) -> str:
        if op not in policy:
            return "-"
        ovs = overloads[op]
        if ovs == frozenset({""}):
            return f"`{policy[op]}`"
        shown = ", ".join(ov or "default" for ov in sorted(ovs))
        return f"`{policy[op]}` ({shown})"

    ops = sorted(set(CUDA_POLICY) | set(CPU_POLICY),
                 key=lambda op: (_POLICY_ORDER.get(CUDA_POLICY.get(op, ""), len(POLICIES)), op))
    lines = [
        f"| aten op | CUDA autocast (torch {TORCH_VERSION}) | CPU autocast (torch {TORCH_VERSION}) |",
        "|---|---|---|",
    ]
    for op in ops:
        note = " (cuDNN builds)" if op in CUDA_CUDNN_ONLY else ""
        cuda, cpu = cell(CUDA_POLICY, CUDA_OVERLOADS, op), cell(CPU_POLICY, CPU_OVERLOADS, op)
        lines.append(f"| `{op}`{note} | {cuda} | {cpu} |")
    return "\n".join(lines) + "\n"
