"""The typed payloads of a finding and a report: :class:`Evidence` and :class:`LayerStat`.

Both are frozen records whose common fields are typed attributes and whose JSON view is a read-only mapping in
the order the keys were given: ``finding.evidence["ref_absmax"]`` and ``finding.evidence.ref_absmax`` are the same
number, and ``dict(evidence)`` is what :meth:`~ampdoctor.Finding.to_dict` writes. A key whose value does not have
its field's type (a malformed or older JSON file) is kept as given in ``extra``, so nothing is lost or reordered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

_NO = object()  # a value that does not fit the field's type
_R = TypeVar("_R", bound="_TypedMapping")


def _text(v: Any) -> Any:
    return v if isinstance(v, str) else _NO


def _count(v: Any) -> Any:
    return v if isinstance(v, int) and not isinstance(v, bool) else _NO


def _number(v: Any) -> Any:
    """ints and floats as given (so the JSON text stays the same); JSON's ``"inf"``/``"-inf"``/``"nan"`` as floats."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    return _NO


def _texts(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v) else _NO


def _json_value(v: Any) -> Any:
    """The mapping view of a typed value: sequences read as the lists JSON holds."""
    return list(v) if isinstance(v, tuple) else v


class _TypedMapping(Mapping[str, Any]):
    """A frozen dataclass read as an ordered mapping: its set typed fields, then ``extra``, in the given order.

    Subclasses declare ``_TYPES`` (field name -> coercer returning the typed value or ``_NO``) and the fields
    ``extra`` and ``order``. Typed fields left ``None`` are absent from the mapping.
    """

    _TYPES: ClassVar[dict[str, Callable[[Any], Any]]]
    extra: Mapping[str, Any]
    order: tuple[str, ...]

    def __post_init__(self) -> None:
        for name, coerce in self._TYPES.items():
            value = getattr(self, name)
            if value is None:
                continue
            typed = coerce(value)
            if typed is _NO:
                raise TypeError(f"{type(self).__name__}.{name} = {value!r} does not have the field's type; "
                                f"pass it with {type(self).__name__}.of(...), which keeps it in 'extra'")
            object.__setattr__(self, name, typed)
        clash = sorted(k for k in self.extra if k in self._TYPES and getattr(self, k) is not None)
        if clash:
            raise ValueError(f"{type(self).__name__}: {clash} given both as typed fields and in 'extra'")
        present = [k for k in self._TYPES if getattr(self, k) is not None] + list(self.extra)
        if not self.order or sorted(self.order) != sorted(present):
            object.__setattr__(self, "order", tuple(present))
        object.__setattr__(self, "extra", dict(self.extra))

    @classmethod
    def of(cls: type[_R], raw: Mapping[str, Any] | None) -> _R:
        """The record of a mapping (a record passes through): well-typed common keys become fields, every
        other key goes to ``extra``; the key order is kept."""
        if isinstance(raw, cls):
            return raw
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise TypeError(f"{cls.__name__} needs a mapping of str keys, not {type(raw).__name__}")
        typed: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            coerce = cls._TYPES.get(key)
            v = coerce(value) if coerce is not None and value is not None else _NO
            if v is _NO:
                extra[str(key)] = value
            else:
                typed[key] = v
        make: Any = cls  # a dataclass subclass: its generated __init__ takes the fields
        return make(**typed, extra=extra, order=tuple(str(k) for k in raw))  # type: ignore[no-any-return]

    def __getitem__(self, key: str) -> Any:
        if key in self._TYPES:
            value = getattr(self, key)
            if value is not None:
                return _json_value(value)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a mapping, equal to dicts with the same items

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"

    def replace(self: _R, **changes: Any) -> _R:
        """A copy with some keys set (typed or not); new keys go last."""
        return type(self).of({**dict(self.items()), **changes})


@dataclass(frozen=True, eq=False, repr=False)
class Evidence(_TypedMapping):
    """The numbers behind a finding: the common facts as typed fields, rule-specific ones in ``extra``.

    Rules build it with :func:`ampdoctor.findings._common.base_evidence` plus their own keys; :class:`Finding`
    turns any mapping into one. ``absmax`` is the target's |max|, ``ref_absmax`` the fp32 reference's,
    ``format_max`` the largest finite value of ``dtype``; ``n_nan``/``n_inf`` count the target's non-finite
    values; ``source`` is ``file.py:line`` of the user's code; ``step`` the step a per-step fact is about.

    >>> ev = Evidence.of({"dtype": "float16", "ref_absmax": 1.2e5, "format_max": 65504.0, "tiles": 3})
    >>> ev.ref_absmax / ev.format_max > 1, ev["tiles"], ev.extra, list(ev)
    (True, 3, {'tiles': 3}, ['dtype', 'ref_absmax', 'format_max', 'tiles'])
    >>> ev == {"dtype": "float16", "ref_absmax": 1.2e5, "format_max": 65504.0, "tiles": 3}
    True
    """

    _TYPES: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "dtype": _text, "numel": _count, "input_dtypes": _texts, "source": _text, "autograd_node": _text,
        "absmax": _number, "ref_absmax": _number, "format_max": _number, "ratio_to_max": _number,
        "n_nan": _count, "n_inf": _count, "unit_roundoff": _number, "relative_error": _number, "step": _count,
    }

    dtype: str | None = None
    numel: int | None = None
    input_dtypes: tuple[str, ...] | None = None
    source: str | None = None
    autograd_node: str | None = None
    absmax: float | None = None
    ref_absmax: float | None = None
    format_max: float | None = None
    ratio_to_max: float | None = None
    n_nan: int | None = None
    n_inf: int | None = None
    unit_roundoff: float | None = None
    relative_error: float | None = None
    step: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    order: tuple[str, ...] = ()


def _fraction(v: Any) -> Any:
    x = _number(v)
    return x if x is _NO or math.isnan(x) or 0 <= x <= 1 else _NO


@dataclass(frozen=True, eq=False, repr=False)
class LayerStat(_TypedMapping):
    """One row of :attr:`Report.layers`: per module and phase, the op with the largest |max| in the target.

    ``depth`` is the order of first execution, ``target_absmax``/``ref_absmax`` the target's and the fp32
    reference's |max| (``inf`` when the target overflowed), ``format_max`` the largest finite value of ``dtype``,
    ``flush_fraction`` the share of elements the target flushed to 0 beyond the reference, ``rel_error`` the
    relative error of the norm, ``nonfinite`` the count of inf/NaN.

    >>> row = LayerStat.of({"module": "fc1", "depth": 0, "dtype": "float16", "target_absmax": "inf"})
    >>> row.module, row.target_absmax, row["target_absmax"]
    ('fc1', inf, inf)
    """

    _TYPES: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "module": _text, "depth": _count, "phase": _text, "op": _text, "dtype": _text,
        "ref_absmax": _number, "target_absmax": _number, "min_nonzero": _number, "flush_fraction": _fraction,
        "rel_error": _number, "nonfinite": _count, "format_max": _number,
    }

    module: str | None = None
    depth: int | None = None
    phase: str | None = None
    op: str | None = None
    dtype: str | None = None
    ref_absmax: float | None = None
    target_absmax: float | None = None
    min_nonzero: float | None = None
    flush_fraction: float | None = None
    rel_error: float | None = None
    nonfinite: int | None = None
    format_max: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    order: tuple[str, ...] = ()


def layer_stats(layers: Any) -> tuple[LayerStat, ...]:
    """The typed rows of a ``layers`` sequence; entries that are not mappings are skipped."""
    return tuple(LayerStat.of(x) for x in layers or () if isinstance(x, Mapping))


__all__ = ["Evidence", "LayerStat", "layer_stats"]
