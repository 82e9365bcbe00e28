"""A :class:`~ampdoctor.findings.Report` as a JSON document (schema: ``ampdoctor/report/schema.json``).

>>> from ampdoctor.report import write_json, load_report
>>> write_json(report, "report.json")            # doctest: +SKIP
>>> load_report("report.json").codes()           # doctest: +SKIP
['overflow', 'must-stay-fp32']

Non-finite numbers are stored as the strings ``"inf"``, ``"-inf"`` and ``"nan"`` so the file is strict JSON.
Standard library only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ampdoctor.errors import ReportFormatError
from ampdoctor.findings import SCHEMA_VERSION, Report

#: The JSON Schema (draft 2020-12) of the document :func:`render_json` writes.
SCHEMA_PATH = Path(__file__).with_name("schema.json")


def render_json(report: Report) -> str:
    """The report as indented, strict JSON text (ends with a newline)."""
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(report: Report, path: str | os.PathLike[str]) -> Path:
    """Write :func:`render_json` to ``path`` atomically and return the path.

    The text goes to a temporary file in the same folder, which then replaces ``path`` (``os.replace``), so a
    reader never sees a half-written report and an existing file survives a failure.
    """
    return _write_atomic(Path(path), render_json(report))


def load_report(path: str | os.PathLike[str]) -> Report:
    """Read a report written by :func:`write_json` (or any :meth:`Report.to_dict` output).

    Raises :class:`ReportFormatError` when the file is not JSON, not an ampdoctor report, or has a schema
    major version this ampdoctor cannot read; ``FileNotFoundError`` when it does not exist.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportFormatError(
            f"{path} is not an ampdoctor report: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            "write reports with ampdoctor.report.write_json or `ampdoctor ... --json FILE`"
        ) from e
    if not isinstance(data, dict) or "schema_version" not in data or "findings" not in data:
        raise ReportFormatError(
            f"{path} is not an ampdoctor report: expected a JSON object with 'schema_version' and 'findings' "
            f"(schema {SCHEMA_PATH.name}); write reports with ampdoctor.report.write_json"
        )
    version = str(data["schema_version"])
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ReportFormatError(
            f"{path} has report schema_version {version!r}; this ampdoctor reads {SCHEMA_VERSION!r} "
            "(same major version): load it with the ampdoctor version that wrote it"
        )
    try:
        return Report.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ReportFormatError(f"{path} is not a valid ampdoctor report: {detail}") from e


def _write_atomic(path: Path, text: str) -> Path:
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _target_mode(path))  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _target_mode(path: Path) -> int:
    """Keep an existing file's permissions; a new file gets what ``open()`` would give it (0666 minus umask)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        pass
    umask = 0o022
    try:  # reading the umask without os.umask(), which would change it for every thread
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
                break
    except (OSError, ValueError, IndexError):
        pass
    return 0o666 & ~umask
