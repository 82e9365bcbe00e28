"""``untraced()`` pauses every trace on the dispatch stack and is exception-safe: a pause that fails to enter
leaves no other trace paused and torch functions on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampdoctor.trace import RecordingMode, trace, untraced


class _Stubborn(RecordingMode):
    """A recording mode that refuses to pause (its ``enabled`` cannot be set to False)."""

    @property
    def enabled(self) -> bool:
        return True

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if not value:
            raise RuntimeError("cannot pause")


def test_a_failing_pause_leaves_no_trace_paused() -> None:
    model = nn.Linear(4, 2)
    with trace(model) as t:
        stubborn = _Stubborn(t.attribution, full=False)
        with stubborn:
            with pytest.raises(RuntimeError, match="cannot pause"):
                with untraced():
                    pass  # never reached
            assert t.mode.enabled  # the trace entered before the failing one is running again
            assert torch._C._is_torch_function_enabled()
        n = len(t.mode.records)
        model(torch.ones(1, 4))
        assert len(t.mode.records) > n  # still recording


def test_untraced_pauses_and_resumes_every_trace() -> None:
    model = nn.Linear(4, 2)
    with trace(model) as outer, trace(model) as inner:
        with untraced():
            assert not outer.mode.enabled and not inner.mode.enabled
            assert not torch._C._is_torch_function_enabled()
            n = (len(outer.mode.records), len(inner.mode.records))
            model(torch.ones(1, 4))
            assert (len(outer.mode.records), len(inner.mode.records)) == n
        assert outer.mode.enabled and inner.mode.enabled
        assert torch._C._is_torch_function_enabled()
