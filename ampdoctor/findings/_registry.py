"""One registered rule per cause code, and the documentation of every code.

A rule is a function ``rule(ctx) -> list[Candidate]`` registered with :func:`rule`. Registering two rules
for one code raises. ``CODE_INFO`` is the single source of the code table (severity, precedence, text);
``docs/codes.md`` is generated from it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Candidate:
    """A finding plus the trace position of the cause it explains (for ranking)."""

    finding: Finding
    order: float


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
