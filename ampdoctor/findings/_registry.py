"""One registered rule per cause code, and the documentation of every code.

A rule is a function ``rule(ctx) -> list[Candidate]`` registered with :func:`rule`. Registering two rules
for one code raises. ``CODE_INFO`` is the single source of the code table (severity, precedence, text);
``docs/codes.md`` is generated from it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from ampdoctor.findings._types import CODES, Finding

if TYPE_CHECKING:
    from ampdoctor.findings._context import Context


@dataclass(frozen=True)
class CodeInfo:
    """Documentation of one code. ``precedence``: lower wins when two codes explain the same origin."""

    code: str
    severity: str
    precedence: int
    summary: str
    doc: str


class Stage(IntEnum):
    """When a cause acts, coarsely: facts about the setup come before the traced ops, whole-run facts after them."""

    SETUP = 0
    TRACE = 1
    RUN = 2


@dataclass(frozen=True, order=True)
class Order:
    """Where a cause sits in the run, for ranking: ``stage`` first, then ``position`` within it (a record index in
    :attr:`Stage.TRACE`, the fixed rank of a setup or whole-run fact otherwise)."""

    stage: Stage
    position: int


def at(index: int) -> Order:
    """The order of a cause at trace record ``index``."""
    return Order(Stage.TRACE, index)


#: named ranks of the causes that are not one traced op (lower comes first)
SETUP_CRASHED_COVERAGE = Order(Stage.SETUP, 0)   # the run crashed on parameters the optimizer does not hold
SETUP_INPUT = Order(Stage.SETUP, 1)              # the batch itself is non-finite and that reaches the loss
SETUP_CRASH = Order(Stage.SETUP, 2)              # a crash before any traced op can explain it (finfo constant)
SETUP_BUFFER = Order(Stage.SETUP, 3)             # a registered buffer damaged by the model cast, harmful
#: trainable parameters the model's wiring never connects to the loss: a functional bug that holds in every
#: precision (fp32 too) and is certain, not measured -- it ranks before the numeric causes of the same severity
#: (a bf16 precision-loss warning is a degradation relative to fp32; these weights are never trained at all)
SETUP_UNWIRED = Order(Stage.SETUP, 4)
RUN_FP8_SCALES = Order(Stage.RUN, 0)             # fp8 scaling of the emulated layers (whole run)
RUN_END = Order(Stage.RUN, 2)                    # facts read at the end of the run (coverage, declarations)


@dataclass(frozen=True)
class Candidate:
    """A finding plus where the cause it explains sits in the run (for ranking): an :class:`Order` or, for a cause
    at one traced op, its record index."""

    finding: Finding
    order: Order | int

    @property
    def when(self) -> Order:
        return self.order if isinstance(self.order, Order) else at(self.order)


RuleFn = Callable[["Context"], list[Candidate]]

RULES: dict[str, RuleFn] = {}
CODE_INFO: dict[str, CodeInfo] = {}


def rule(code: str, *, severity: str, precedence: int, summary: str) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule for ``code``; its docstring is the code's documentation."""
    if code not in CODES:
        raise ValueError(f"unknown code {code!r}; expected one of {', '.join(CODES)}")

    def deco(fn: RuleFn) -> RuleFn:
        if code in RULES:
            raise ValueError(f"a rule for {code!r} is already registered ({RULES[code].__qualname__})")
        RULES[code] = fn
        CODE_INFO[code] = CodeInfo(code, severity, precedence, summary, inspect.cleandoc(fn.__doc__ or ""))
        return fn

    return deco


def codes_markdown() -> str:
    """The code table as Markdown (``docs/codes.md`` holds this text)."""
    lines = [
        "# Cause codes",
        "",
        "Generated from the rule registry (`ampdoctor.findings`); `ampdoctor explain CODE` prints one entry.",
        "When several codes explain the same origin, the lower precedence number is the root cause.",
        "When the target run raised (an op that validates its input: `multinomial`, `binary_cross_entropy`, an",
        "index), the values that fed the failing op are traced back like any other: the first error finding names",
        "their origin and carries `exception` in its evidence (`type`, `message`, `op`, `module`, `phase`, `step`,",
        "and `inputs`: the failing op's input records with `|max|`, NaN/inf counts); with no numerics origin the",
        "diagnosis raises `DiagnosisError` with the exception's message.",
        "",
        "| code | default severity | precedence | what it means |",
        "|---|---|---|---|",
    ]
    for code in CODES:
        info = CODE_INFO.get(code)
        if info is not None:
            lines.append(f"| `{code}` | {info.severity} | {info.precedence} | {info.summary} |")
    lines.append("")
    for code in CODES:
        info = CODE_INFO.get(code)
        if info is not None:
            lines += [f"## `{code}`", "", info.doc, ""]
    return "\n".join(lines)
