"""The data a diagnosis produces: :class:`Finding`, :class:`FixProposal`, :class:`Report`.

These are frozen, JSON-ready values. Behaviour (rules, ranking, rendering) lives in functions elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ampdoctor.findings._payloads import Evidence, LayerStat, layer_stats


class _StrEnum(str, Enum):
    """A string-valued enum that is its value everywhere a string is: ``==``, hashing, ``str``, f-strings, JSON."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Severity(_StrEnum):
    """How bad a finding is; ``Severity.ERROR == "error"``."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Phase(_StrEnum):
    """Where in a step a finding's cause acts; ``Phase.FORWARD == "forward"``."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    SETUP = "setup"


SEVERITIES: tuple[str, ...] = tuple(s.value for s in Severity)
PHASES: tuple[str, ...] = tuple(p.value for p in Phase)

#: Every cause code of the public contract, in the order of the documentation table.
CODES: tuple[str, ...] = (
    "overflow",
    "underflow",
    "nan-from-inf",
    "masked-row-nan",
    "constant-out-of-range",
    "precision-loss",
    "saturation",
    "must-stay-fp32",
    "unused-parameters",
    "low-precision-params",
    "loss-scale-collapse",
    "loss-scaling-misuse",
    "fp8-scale",
    "nonfinite-input",
    "nonfinite-reference",
    "reference-diverges",
)

#: Version of the JSON document produced by :meth:`Report.to_dict` (see ``ampdoctor/report/schema.json``).
SCHEMA_VERSION = "1.0"


def _jsonable(value: Any) -> Any:
    """Numbers that JSON cannot hold (inf, NaN) become strings; containers are converted recursively."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


@dataclass(frozen=True)
class FixProposal:
    """A remedy proposed for a finding.

    ``id`` names a registered fix action (see :mod:`ampdoctor.fixes`) or is ``""`` for advice that cannot be
    applied automatically; ``params`` are its arguments; ``snippet`` is code the user can paste.
    ``verified`` is ``None`` until a fix was re-run; then ``True``/``False`` with numbers in ``verification``.
    """

    title: str
    snippet: str = ""
    id: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    verified: bool | None = None
    verification: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "id": self.id,
                "title": self.title,
                "snippet": self.snippet,
                "params": self.params,
                "verified": self.verified,
                "verification": self.verification,
            }
        )


@dataclass(frozen=True, init=False)
class Finding:
    """One cause found in a run.

    ``module`` is the qualified name as in ``model.named_modules()`` (``""`` for the root or none), ``op``
    the aten overload (``"aten.pow.Tensor_Scalar"``) or ``""``, ``phase`` a :class:`Phase`, ``severity`` a
    :class:`Severity` (both also accepted as their string values, and equal to them).
    ``evidence`` holds the numbers behind the explanation: an :class:`Evidence` (any mapping given is turned
    into one), read as a mapping (``evidence["ref_absmax"]``) or through its typed fields (``evidence.ref_absmax``).

    >>> f = Finding("overflow", "error", "fc1", "aten.addmm.default", "forward", "fc1 overflows float16",
    ...             "fc1's matmul exceeds 65504", {"format_max": 65504.0, "ref_absmax": 1.2e5})
    >>> f.severity == "error", f.phase, f.to_dict()["evidence"]["ref_absmax"], f.evidence.format_max
    (True, <Phase.FORWARD: 'forward'>, 120000.0, 65504.0)
    >>> Finding("not-a-code", "error", "", "", "forward", "", "")
    Traceback (most recent call last):
    ...
    ValueError: unknown finding code 'not-a-code'; expected one of ...
    """

    code: str
    severity: Severity
    module: str
    op: str
    phase: Phase
    title: str
    explanation: str
    evidence: Evidence = field(default_factory=Evidence)
    fixes: tuple[FixProposal, ...] = ()
    step: int = 0

    def __init__(self, code: str, severity: Severity | str, module: str, op: str, phase: Phase | str, title: str,
                 explanation: str, evidence: Mapping[str, Any] | None = None, fixes: tuple[FixProposal, ...] = (),
                 step: int = 0) -> None:
        if code not in CODES:
            raise ValueError(f"unknown finding code {code!r}; expected one of {', '.join(CODES)}")
        if severity not in SEVERITIES:
            raise ValueError(f"invalid severity {severity!r}, expected one of {SEVERITIES}")
        if phase not in PHASES:
            raise ValueError(f"invalid phase {phase!r}, expected one of {PHASES}")
        values = {"code": code, "severity": Severity(severity), "module": module, "op": op, "phase": Phase(phase),
                  "title": title, "explanation": explanation, "evidence": Evidence.of(evidence),
                  "fixes": fixes, "step": step}
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "code": self.code,
                "severity": self.severity.value,
                "module": self.module,
                "op": self.op,
                "phase": self.phase.value,
                "step": self.step,
                "title": self.title,
                "explanation": self.explanation,
                "evidence": self.evidence,
                "fixes": [f.to_dict() for f in self.fixes],
            }
        )


def _num(v: Any) -> float | None:
    """A number as float (JSON's ``"nan"``/``"inf"``/``"-inf"`` strings too); ``None`` for anything else."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Site:
    """Where a value was seen: an op in a module, phase and step (``summary["first_nan"]`` and friends).

    >>> str(Site("aten.mm.default", "encoder.block.0", "forward", 0, 41))
    'aten.mm.default in encoder.block.0 (forward, step 0, op #41)'
    """

    op: str = ""
    module: str = ""
    phase: str = ""
    step: int | None = None
    index: int | None = None

    @classmethod
    def of(cls, raw: Any) -> Site | None:
        """The site of a ``{"op", "module", "phase", "step", "index"}`` mapping; ``None`` for anything else."""
        if not isinstance(raw, Mapping):
            return None
        return cls(str(raw.get("op") or ""), str(raw.get("module") or ""), str(raw.get("phase") or ""),
                   _int(raw.get("step")), _int(raw.get("index")))

    def __str__(self) -> str:
        where = f"{self.op or '?'} in {self.module or '<root>'}"
        extras = [self.phase] if self.phase else []
        if self.step is not None:
            extras.append(f"step {self.step}")
        if self.index is not None:
            extras.append(f"op #{self.index}")
        return f"{where} ({', '.join(extras)})" if extras else where


@dataclass(frozen=True)
class Link:
    """One step of the lineage chain ``summary["chain"]`` (origin -> first NaN -> loss): an op in a module and
    phase, and what happened there; absent or malformed fields read ``""``.

    >>> Link.of({"op": "aten.pow.Tensor_Scalar", "module": "mlp", "phase": "backward", "what": "inf * 0"}).what
    'inf * 0'
    """

    op: str = ""
    module: str = ""
    phase: str = ""
    what: str = ""

    @classmethod
    def of(cls, raw: Any) -> Link | None:
        """The link of a mapping; ``None`` for anything else."""
        if not isinstance(raw, Mapping):
            return None
        return cls(*(str(raw.get(k) or "") for k in ("op", "module", "phase", "what")))


def _floats(v: Any) -> tuple[float | None, ...] | None:
    return tuple(_num(x) for x in v) if isinstance(v, (list, tuple)) else None


@dataclass(frozen=True)
class RunSummary:
    """The run facts of :attr:`Report.summary` every renderer shows, typed once (:attr:`Report.run`).

    ``Report.summary`` stays the JSON mapping (with rule-specific extras: origins, chain, scales, fp8); this is
    its common part read once, tolerating reports loaded from older or partial JSON: an absent or malformed
    field is ``None`` (``forward_only``: ``False``, ``chain``: empty). ``loss_target``/``loss_reference`` are
    ``None`` when the report has no such key, else one float (or ``None``) per step. ``scales`` is the loss scale
    after each step, ``skipped`` the indices of skipped steps when the summary lists them, ``initial_scale`` the
    scale before step 0.

    >>> run = RunSummary.of({"precision": "fp16", "steps": 1, "loss_target": ["nan"], "elapsed_s": 0.2})
    >>> run.precision, run.steps, run.loss_target, run.loss_reference, run.first_nan
    ('fp16', 1, (nan,), None, None)
    """

    precision: str | None = None
    steps: int | None = None
    loss_target: tuple[float | None, ...] | None = None
    loss_reference: tuple[float | None, ...] | None = None
    forward_only: bool = False
    device: str | None = None
    torch_version: str | None = None
    elapsed_s: float | None = None
    ops_traced: int | None = None
    first_nonfinite: Site | None = None
    first_nan: Site | None = None
    skipped_steps: int | None = None
    chain: tuple[Link, ...] = ()
    scales: tuple[float | None, ...] | None = None
    skipped: tuple[int, ...] | None = None
    initial_scale: float | None = None

    @classmethod
    def of(cls, summary: Any, precision: str | None = None) -> RunSummary:
        """The typed facts of a summary mapping; ``precision`` (the report's own) wins over the summary's."""
        s = summary if isinstance(summary, Mapping) else {}

        def losses(key: str) -> tuple[float | None, ...] | None:
            if key not in s:
                return None
            v = s[key]
            return tuple(_num(x) for x in v) if isinstance(v, (list, tuple)) else (_num(v),)

        def text(key: str) -> str | None:
            v = s.get(key)
            return str(v) if v not in (None, "") else None

        elapsed = _num(s.get("elapsed_s"))
        skipped = s.get("skipped")
        chain = s.get("chain")
        return cls(
            precision=precision if precision is not None else text("precision"), steps=_int(s.get("steps")),
            loss_target=losses("loss_target"), loss_reference=losses("loss_reference"),
            forward_only=s.get("forward_only") is True, device=text("device"), torch_version=text("torch_version"),
            elapsed_s=elapsed if elapsed is not None and math.isfinite(elapsed) else None,
            ops_traced=_int(s.get("ops_traced")), first_nonfinite=Site.of(s.get("first_nonfinite")),
            first_nan=Site.of(s.get("first_nan")), skipped_steps=_int(s.get("skipped_steps")),
            chain=tuple(x for x in map(Link.of, chain if isinstance(chain, (list, tuple)) else ()) if x is not None),
            scales=_floats(s.get("scales")), initial_scale=_num(s.get("initial_scale")),
            skipped=tuple(sorted({x for x in skipped if _int(x) is not None})) if isinstance(skipped, (list, tuple))
            else None)


@dataclass(frozen=True)
class Report:
    """The result of :func:`ampdoctor.diagnose`: findings, most important first.

    ``findings[0]`` is the root cause. ``ok`` is true iff no finding has severity ``"error"``.
    ``summary`` carries run facts (precision, losses of target and reference, chronological first
    non-finite op, first NaN, lineage chain) and ``layers`` per-module range statistics for plots
    (:class:`LayerStat` rows as built; any mappings as given; :attr:`layer_stats` reads them typed).

    >>> f = Finding("overflow", "error", "fc1", "aten.addmm.default", "forward", "fc1 overflows float16", "")
    >>> report = Report((f,), precision="fp16")
    >>> report.ok, report.codes(), report.root_cause is f
    (False, ['overflow'], True)
    >>> Report.from_dict(report.to_dict()) == report
    True
    """

    findings: tuple[Finding, ...] = ()
    precision: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    layers: tuple[Mapping[str, Any], ...] = ()
    source: str = ""

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @property
    def run(self) -> RunSummary:
        """The common run facts of :attr:`summary`, typed (what renderers read)."""
        return RunSummary.of(self.summary, self.precision)

    @property
    def layer_stats(self) -> tuple[LayerStat, ...]:
        """:attr:`layers` as typed rows (what renderers read); entries that are not mappings are skipped."""
        return layer_stats(self.layers)

    @property
    def root_cause(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "ok": self.ok,
            "precision": self.precision,
            "source": self.source,
            "findings": [f.to_dict() for f in self.findings],
            "summary": _jsonable(self.summary),
            "layers": _jsonable(list(self.layers)),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """Rebuild a report from :meth:`to_dict` output (numbers stored as ``"inf"``/``"nan"`` stay strings)."""
        if not isinstance(data, dict) or "findings" not in data:
            raise ValueError("not an ampdoctor report: expected a JSON object with a 'findings' list")
        findings = tuple(
            Finding(
                code=f["code"],
                severity=f["severity"],
                module=f.get("module", ""),
                op=f.get("op", ""),
                phase=f["phase"],
                title=f.get("title", ""),
                explanation=f.get("explanation", ""),
                evidence=dict(f.get("evidence", {})),
                fixes=tuple(
                    FixProposal(
                        title=x.get("title", ""),
                        snippet=x.get("snippet", ""),
                        id=x.get("id", ""),
                        params=dict(x.get("params", {})),
                        verified=x.get("verified"),
                        verification=dict(x.get("verification", {})),
                    )
                    for x in f.get("fixes", [])
                ),
                step=int(f.get("step", 0)),
            )
            for f in data["findings"]
        )
        return cls(
            findings=findings,
            precision=data.get("precision"),
            summary=dict(data.get("summary", {})),
            layers=tuple(LayerStat.of(x) if isinstance(x, Mapping) else x for x in data.get("layers", [])),
            source=data.get("source", ""),
        )
