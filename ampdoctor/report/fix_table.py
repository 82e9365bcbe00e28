"""The before/after table of verified fixes: one row per fix, the numbers a reader compares."""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.findings import FixProposal, Report, jsonable
from ampdoctor.fixes import Verification


def _fmt(x: Any) -> Any:
    """A float rounded to 6 significant digits; inf/NaN as their JSON strings (:func:`~ampdoctor.findings.jsonable`)."""
    if not isinstance(x, float):
        return x
    return float(f"{x:.6g}") if math.isfinite(x) else jsonable(x)


def before_after_table(verifications: Any) -> list[dict[str, Any]]:
    """Rows for a before/after table: one per verification (a :class:`Verification`, its ``to_dict()``, an
    annotated :class:`FixProposal`, or every annotated proposal of a :class:`Report`).

    Keys: ``fix``, ``verified``, ``loss_fp32``, ``loss_broken``, ``loss_fixed``, ``max_rel_err_first_step``,
    ``max_rel_err_curve``, ``tolerance``, ``steps_finite`` ("fixed/K"), ``steps_finite_broken``, ``reason``.
    Numbers are rounded to 6 significant digits; inf/NaN become strings.
    """
    if isinstance(verifications, Report):
        items: list[Any] = [p for f in verifications.findings for p in f.fixes if p.verified is not None]
    elif isinstance(verifications, (Verification, FixProposal, dict)):
        items = [verifications]
    else:
        items = list(verifications)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for it in items:
        if isinstance(it, Verification):
            d = it.to_dict()
        elif isinstance(it, FixProposal):
            d = dict(it.verification)
        elif isinstance(it, dict):
            d = it
        else:
            raise TypeError(f"expected Verification, FixProposal, dict or Report, got {type(it).__name__}")
        if "fix_id" not in d:
            continue
        key = repr((d["fix_id"], d.get("params")))
        if key in seen:
            continue
        seen.add(key)
        steps = d.get("steps", 0)
        tol = d.get("tolerance", {})
        rows.append({
            "fix": d["fix_id"] + (f" {d['params'].get('modules') or d['params'].get('precision') or ''}".rstrip()
                                  if isinstance(d.get("params"), dict) and d["params"] else ""),
            "verified": bool(d.get("verified")),
            "loss_fp32": _fmt(_num(d.get("loss_fp32"))),
            "loss_broken": _fmt(_num(d.get("loss_broken"))),
            "loss_fixed": _fmt(_num(d.get("loss_fixed"))),
            "max_rel_err_first_step": _fmt(_num(d.get("max_rel_err_first_step"))),
            "max_rel_err_curve": _fmt(_num(d.get("max_rel_err_curve"))),
            "tolerance": _fmt(_num(tol.get("loss"))) if isinstance(tol, dict) else None,
            "steps_finite": f"{d.get('steps_finite', 0)}/{steps}",
            "steps_finite_broken": f"{d.get('steps_finite_broken')}/{steps}",
            "reason": d.get("reason", ""),
        })
    return rows


def _num(x: Any) -> Any:
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    return x


__all__ = ["before_after_table"]
