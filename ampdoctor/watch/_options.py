"""The options of a watch, typed and validated at construction (a typo raises before training starts)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

from ampdoctor.errors import AnomalyError

OnAnomaly = Literal["warn", "raise", "skip", "replay"]
#: The values of ``on_anomaly``.
ON_ANOMALY: tuple[str, ...] = get_args(OnAnomaly)
Kind = Literal["nonfinite-loss", "nonfinite-grads", "grad-spike", "loss-scale-collapse", "zero-grads"]
#: Anomaly kinds the guard reacts to (``zero-grads``: gradients exactly zero through the coverage steps in a
#: reduced-precision backward; only located by a replay, never raised or skipped).
KINDS: tuple[str, ...] = get_args(Kind)


def _int_option(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class WatchOptions:
    """Options of :func:`watch` (validated on construction; see :func:`watch` for their meaning).

    ``collapse_skip_rate``: over a run of at least ``collapse_min_steps`` steps, GradScaler skipping more than this
    fraction of all steps is a chronic loss-scale collapse (an error in the final report), even when no single run
    of skips reaches ``collapse_steps``. ``collapse_scale_bits``: a scale that fell this many powers of two below
    its peak and is still there at the end is a collapse too. ``locate``: replay the first anomalous step in process
    under the full trace to name its op (see :func:`watch`). ``ranks``: on a DDP/FSDP model in a process group of
    2+ ranks, exchange one tiny table per optimizer step so every rank's report names the rank that saw the first
    non-finite value (``origin_rank``) and ``raise``/``skip`` are agreed (:mod:`ampdoctor.watch._ranks`); every
    rank must then enter the watch. ``ranks=False``: each rank reports alone (a watch on one rank only).
    ``loss_code``: when the model returns no loss (the loop computes it from the output), record each step's loss
    code so that the replay runs it too (:meth:`Watch.record_loss_code`; the integrations turn it on).
    """

    on_anomaly: OnAnomaly = "warn"
    reproducer_dir: str | None = None
    coverage_steps: int = 3
    grad_spike_factor: float = 10.0
    tensorboard: str | None = None
    collapse_steps: int = 3
    spike_window: int = 50
    source: str = ""
    collapse_skip_rate: float = 0.5
    collapse_min_steps: int = 8
    collapse_scale_bits: int = 12
    locate: bool = True
    ranks: bool = True
    loss_code: bool = False

    def __post_init__(self) -> None:
        if self.on_anomaly not in ON_ANOMALY:
            raise ValueError(f"invalid on_anomaly {self.on_anomaly!r}, expected one of "
                             f"{', '.join(repr(v) for v in ON_ANOMALY)}")
        for name in ("coverage_steps", "collapse_steps", "spike_window", "collapse_min_steps",
                     "collapse_scale_bits"):
            _int_option(name, getattr(self, name))
        if self.coverage_steps < 0:
            raise ValueError(f"coverage_steps must be >= 0 (0 turns coverage checks off), got {self.coverage_steps}")
        if self.collapse_steps < 1 or self.spike_window < 1 or self.collapse_min_steps < 1:
            raise ValueError("collapse_steps, collapse_min_steps and spike_window must be >= 1")
        if self.collapse_scale_bits < 1:
            raise ValueError(f"collapse_scale_bits must be >= 1, got {self.collapse_scale_bits}")
        for name in ("grad_spike_factor", "collapse_skip_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        if not self.grad_spike_factor > 1.0:
            raise ValueError(f"grad_spike_factor must be > 1 (a norm this many times the running median is a "
                             f"spike), got {self.grad_spike_factor}")
        if not 0.0 < self.collapse_skip_rate <= 1.0:
            raise ValueError(f"collapse_skip_rate must be in (0, 1], got {self.collapse_skip_rate}")
        for name in ("reproducer_dir", "tensorboard"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a directory path or None, got {type(v).__name__}")
        for name in ("locate", "ranks", "loss_code"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.source, str):
            raise TypeError(f"source must be a str (a scenario or script path), got {type(self.source).__name__}")

    def check_environment(self) -> None:
        """Clear errors, before training starts, for directories that cannot be written and a missing TensorBoard."""
        for name in ("reproducer_dir", "tensorboard"):
            v = getattr(self, name)
            if v is not None:
                _check_writable_dir(name, os.fspath(v))
        if self.tensorboard is not None:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError as e:
                raise ValueError(f"tensorboard={self.tensorboard!r} needs TensorBoard: pip install tensorboard "
                                 "(or pass tensorboard=None)") from e


def _check_writable_dir(name: str, path: str) -> None:
    probe = path
    while probe and not os.path.exists(probe):          # the nearest existing ancestor decides
        parent = os.path.dirname(probe)
        probe = parent if parent != probe else ""
    probe = probe or "."
    if not os.path.isdir(probe):
        raise ValueError(f"{name}={path!r}: {probe!r} is a file, not a directory; pass a directory path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={path!r}: {probe!r} is not writable; pass a directory you can write to")


__all__ = ["KINDS", "ON_ANOMALY", "AnomalyError", "Kind", "OnAnomaly", "WatchOptions"]
