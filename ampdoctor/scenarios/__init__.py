"""Built-in scenarios: small, runnable mixed-precision failures and healthy controls.

Each scenario is a module of this package in the scenario-file format: ``make()`` returns a dict with ``model``
and optionally ``batch``, ``loss_fn``, ``precision``, ``optimizer``, ``scaler``, ``train_step``, ``steps``;
the module-level ``EXPECT`` says what a diagnosis must find (``{"codes": [...], "module": ..., "phase": ...}``)
or ``{"healthy": True}``; the module docstring tells the real-world failure, the mechanism and the known fixes.
``ampdoctor demo`` runs :data:`DEMO`; the test suite uses the failing ones as injected faults and the healthy
ones as controls.

>>> from ampdoctor.scenarios import list_scenarios, load_scenario
>>> "bert_unused_pooler" in list_scenarios()
True
>>> load_scenario("mlp_fp16_overflow").EXPECT["module"]
'hidden'

Loading a scenario imports its module (and its dependencies: the T5 and BERT scenarios need ``transformers``,
``pip install ampdoctor[hf]``); ``make()`` builds fresh objects on every call, seeds its own RNG (the caller's
global RNG state is left as it was) and is deterministic.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Scenario name -> module that defines it.
BUILTIN: dict[str, str] = {
    name: f"{__name__}.{name}"
    for name in (
        "t5_fp16_amp_ff_overflow",
        "bert_unused_pooler",
        "fully_masked_row",
        "mask_constant_fp16",
        "nonfinite_input",
        "mlp_fp16_overflow",
        "healthy_t5_fp16_amp",
        "healthy_bert_fp16_masks",
        "healthy_partial_neg_inf_mask",
    )
}

#: The scenarios ``ampdoctor demo`` runs, in order.
DEMO: tuple[str, ...] = ("t5_fp16_amp_ff_overflow", "bert_unused_pooler")

#: Third-party modules some scenarios import, and the extra that installs each.
_EXTRAS = {"transformers": "hf"}


def list_scenarios() -> list[str]:
    """Names of the built-in scenarios, failing ones first, then the healthy controls."""
    return list(BUILTIN)


def load_scenario(name: str) -> ModuleType:
    """Import and return the module of the built-in scenario ``name`` (see :func:`list_scenarios`).

    Raises ``TypeError`` for a non-string, ``ValueError`` for an unknown name (listing the known ones) and
    ``ImportError`` naming the extra to install when the scenario needs an optional dependency.
    """
    if not isinstance(name, str):
        raise TypeError(f"scenario name must be a str, not {type(name).__name__}")
    if name not in BUILTIN:
        raise ValueError(f"unknown scenario {name!r}; expected one of: {', '.join(BUILTIN)}")
    try:
        return importlib.import_module(BUILTIN[name])
    except ModuleNotFoundError as e:
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        raise ImportError(
            f"scenario {name!r} needs the optional dependency {e.name!r}: pip install ampdoctor[{extra}]"
        ) from e


__all__ = ["BUILTIN", "DEMO", "list_scenarios", "load_scenario"]
