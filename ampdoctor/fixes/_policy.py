"""A minimal keep-in-fp32 policy: the smallest set of the implicated modules to run in float32 so the run verifies.

The candidates are the modules the diagnosis implicates (its error findings' modules). The search verifies
``keep_fp32`` on the whole set first (if that fails, no subset can be trusted to pass and the search stops),
then bisects (a half that verifies alone replaces the set) and finally removes modules greedily, one at a time,
keeping each removal that still verifies. Every candidate set is verified by :meth:`Session.verify` (the fixed
diagnosis has no error, every step finite, within the calibrated tolerance). The cost is the fraction of the
step's FLOPs (forward and backward, counted once in fp32 by ``torch.utils.flop_counter``) that the set moves to
float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ampdoctor.fixes._actions import build_plan
from ampdoctor.fixes._session import DEFAULT_STEPS, Session
from ampdoctor.fixes._verdict import Verification
from ampdoctor.fixes._verify import resolve_spec
from ampdoctor.precision import Observer, StepLoop, run_steps, saved_rng

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp32Policy:
    """The result of :func:`minimal_fp32_policy`.

    ``modules``: the smallest verified set found (qualified names), ``verified`` whether it verifies (False: even
    the whole implicated set does not, and ``modules`` is that set); ``fp32_flop_fraction``: the fraction of the
    step's FLOPs inside those modules (None when it could not be counted); ``tried``: every set verified, in order,
    with its verdict; ``verification``: the chosen set's :class:`Verification` as a dict.
    """

    modules: tuple[str, ...]
    verified: bool
    fp32_flop_fraction: float | None
    tried: tuple[tuple[tuple[str, ...], bool], ...]
    verification: dict[str, Any]

    @property
    def keep_in_fp32_modules(self) -> list[str]:
        """The ``_keep_in_fp32_modules``-style list (Hugging Face matches it against name components)."""
        return list(dict.fromkeys(m.rsplit(".", 1)[-1] for m in self.modules))

    def snippet(self) -> str:
        """Code to paste: the Hugging Face class attribute, and a plain-PyTorch autocast-disable wrapper."""
        names = ", ".join(repr(m) for m in self.modules)
        cost = "" if self.fp32_flop_fraction is None else f"  # {self.fp32_flop_fraction:.1%} of the step's FLOPs"
        return (
            f"# Hugging Face models: a class attribute matched against module-name components\n"
            f"_keep_in_fp32_modules = {self.keep_in_fp32_modules!r}{cost}\n\n"
            "# any model: run these modules in float32 with autocast disabled inside\n"
            "import torch\n\n"
            "def keep_in_fp32(module):\n"
            "    module.float()\n"
            "    forward = module.forward\n\n"
            "    def fp32_forward(*args, **kwargs):\n"
            "        up = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t\n"
            "        with torch.autocast(device_type=\"cuda\", enabled=False):\n"
            "            return forward(*map(up, args), **{k: up(v) for k, v in kwargs.items()})\n\n"
            "    module.forward = fp32_forward\n\n"
            f"for name in [{names}]:\n"
            "    keep_in_fp32(model.get_submodule(name))\n")


class _Search:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.tried: dict[tuple[str, ...], Verification] = {}

    def verifies(self, mods: tuple[str, ...]) -> bool:
        if mods not in self.tried:
            plan = build_plan("keep_fp32", {"modules": list(mods)}, self.session.context(mods[0]))
            self.tried[mods] = self.session.verify(plan)
            log.info("fp32 policy: %s -> %s", list(mods), self.tried[mods].verified)
        return self.tried[mods].verified

    def bisect(self, mods: tuple[str, ...]) -> tuple[str, ...]:
        while len(mods) > 1:
            half = len(mods) // 2
            for part in (mods[:half], mods[half:]):
                if self.verifies(part):
                    mods = part
                    break
            else:
                return mods
        return mods

    def greedy(self, mods: tuple[str, ...]) -> tuple[str, ...]:
        for m in list(mods):
            if len(mods) > 1:
                rest = tuple(x for x in mods if x != m)
                if self.verifies(rest):
                    mods = rest
        return mods


class _Flops(Observer):
    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.mode = FlopCounterMode(display=False)

    def context(self, loop: StepLoop) -> Any:
        return self.mode


def flop_fraction(spec: Any, modules: tuple[str, ...]) -> float | None:
    """The fraction of one fp32 step's FLOPs (forward + backward) spent inside ``modules`` (nested ones once)."""
    try:
        obs = _Flops()
        with saved_rng():
            run_steps(spec, reference=True, steps=1, observers=[obs], raise_errors=True)
        counts = {k: sum(v.values()) for k, v in obs.mode.get_flop_counts().items()}
    except Exception as e:  # noqa: BLE001 - the cost is an estimate; the policy stands without it
        log.info("fp32 policy: FLOPs not counted (%s: %s)", type(e).__name__, e)
        return None
    total = counts.get("Global", 0)
    root = type(spec.model).__name__
    outer = [m for m in modules if not any(m != o and m.startswith(o + ".") for o in modules)]
    inside = sum(counts.get(f"{root}.{m}", 0) for m in outer)
    return inside / total if total else None


def minimal_fp32_policy(scenario: Any, *, steps: int = DEFAULT_STEPS, policy: str = "cuda",
                        session: Session | None = None) -> Fp32Policy:
    """Search the smallest set of implicated modules to keep in float32 so that the run verifies.

    >>> p = minimal_fp32_policy("t5_fp16_amp_ff_overflow")     # doctest: +SKIP
    >>> p.modules, p.keep_in_fp32_modules                      # doctest: +SKIP
    (('encoder.block.0.layer.1.DenseReluDense.wo',), ['wo'])

    ``scenario``: as :func:`ampdoctor.fixes.verify`'s. Raises ValueError when the diagnosis implicates no module.
    Cost: one verification per set tried (at most about 2·log2(n) + n for n implicated modules).
    """
    session = session or Session(resolve_spec(scenario), steps=steps, policy=policy)
    mods = session.implicated()
    if not mods:
        raise ValueError("the diagnosis implicates no module (no error finding names one): there is nothing to "
                         "keep in float32")
    search = _Search(session)
    if search.verifies(mods):
        mods = search.greedy(search.bisect(mods))
    chosen = search.tried[mods]
    return Fp32Policy(mods, chosen.verified, flop_fraction(session.spec, mods),
                      tuple((k, v.verified) for k, v in search.tried.items()), chosen.to_dict())


__all__ = ["Fp32Policy", "flop_fraction", "minimal_fp32_policy"]
