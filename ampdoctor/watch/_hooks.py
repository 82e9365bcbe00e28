"""The watch's hooks: marked as ampdoctor's, never deep-copied, and isolated (an internal error disables the
watch with one warning; the user's training goes on)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ampdoctor.watch._options import AnomalyError

log = logging.getLogger("ampdoctor.watch")
F = TypeVar("F", bound=Callable[..., Any])


class Health:
    """Whether the watch is entered, set up and not disabled by an internal error."""

    def __init__(self) -> None:
        self.disabled: str | None = None
        self.active = False
        self.ready = False

    @property
    def working(self) -> bool:
        return self.disabled is None and self.active and self.ready

    def disable(self, exc: BaseException) -> None:
        if self.disabled is None:
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.warning("ampdoctor.watch disabled itself after an internal error (%s); training continues "
                        "unobserved. Please report this with the traceback.", self.disabled, exc_info=exc)


def guarded(method: F) -> F:
    """Run a hook body; an unexpected error disables the watch with one warning and training goes on."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.health.working:
            return None
        try:
            return method(self, *args, **kwargs)
        except AnomalyError:
            raise
        except Exception as exc:  # noqa: BLE001 - the guard must never break the user's training
            self.health.disable(exc)
            return None

    return wrapper  # type: ignore[return-value]


class Hook:
    """A hook callable that is ampdoctor's: copies of a module share it (no deep copy of the watch) and
    ``precision``'s copy function strips it."""

    _ampdoctor_hook = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Hook:
        return self


__all__ = ["Health", "Hook", "guarded"]
