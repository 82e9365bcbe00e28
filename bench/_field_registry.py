"""The field-case registry: one ``Case`` per publicly reported failure, registered with ``@case`` (a name twice
raises). The cases live in ``bench/_field_cases.py`` (rounds 1-3), ``bench/_field_cases_r4.py`` (round 4),
``bench/_field_cases_r5.py`` (round 5), ``bench/_field_cases_r6.py`` (round 6) and
``bench/_field_cases_r7.py`` (round 7);
``_field_cases.CASES`` holds them all, in registration order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # issue / PR URL and title
    expect: tuple[str, str, str, str]  # code, module, op, phase of findings[0]
    build: Callable[[bool], dict[str, Any]]


CASES: dict[str, Case] = {}


def case(name: str, source: str, expect: tuple[str, str, str, str]) -> Callable[..., Any]:
    def deco(fn: Callable[[bool], dict[str, Any]]) -> Callable[[bool], dict[str, Any]]:
        if name in CASES:
            raise ValueError(f"field case {name!r} is already registered")
        CASES[name] = Case(name, source, expect, fn)
        return fn
    return deco


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
