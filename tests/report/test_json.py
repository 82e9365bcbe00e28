import importlib
import json
import os
import stat
import sys

import pytest

from ampdoctor import CODES, AmpDoctorError, Report
from ampdoctor.findings._types import PHASES, SCHEMA_VERSION, SEVERITIES
from ampdoctor.report import SCHEMA_PATH, ReportFormatError, load_report, render_json, write_json

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _strict_loads(text: str):
    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=reject)


def test_schema_matches_the_data_types(validator):
    schema = validator.schema
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["schema_version"] == {"const": SCHEMA_VERSION}
    assert tuple(schema["$defs"]["code"]["enum"]) == CODES
    assert tuple(schema["$defs"]["phase"]["enum"]) == PHASES
    from ampdoctor.precision import PRECISIONS  # a report of every precision validates (fp8-e4m3 did not)

    assert tuple(schema["$defs"]["precision"]["enum"]) == PRECISIONS
    assert tuple(schema["$defs"]["finding"]["properties"]["severity"]["enum"]) == SEVERITIES
    # every key to_dict() writes is described, so additionalProperties=false cannot reject real output
    assert set(schema["properties"]) == set(Report().to_dict())


def test_fixtures_validate(any_report, validator):
    _, report = any_report
    doc = _strict_loads(render_json(report))
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    assert doc["schema_version"] == "1.0"
    assert doc["ok"] is report.ok


def test_non_finite_numbers_are_strings(t5):
    doc = _strict_loads(render_json(t5))
    wo = next(x for x in doc["layers"] if x["depth"] == 11 and x["phase"] == "forward")
    assert (wo["ref_absmax"], wo["target_absmax"], wo["rel_error"]) == (105000.0, "inf", "inf")
    assert doc["summary"]["loss_target"] == ["nan"]
    assert doc["findings"][0]["evidence"]["target_absmax"] == "inf"
    assert doc["findings"][0]["fixes"][2]["verification"]["loss_fixed"] == "nan"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("findings", 0, "severity"), "fatal"),
        (("findings", 0, "code"), "overflowed"),
        (("findings", 0, "fixes", 0, "verified"), "yes"),
        (("layers", 0, "target_absmax"), "Infinity"),
        (("layers", 0, "flush_fraction"), 1.5),
        (("summary", "first_nan", "phase"), "fwd"),
        (("schema_version",), "2.0"),
    ],
)
def test_schema_rejects_malformed_documents(t5, validator, path, value):
    doc = t5.to_dict()
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert not validator.is_valid(doc)


def test_layer_without_module_is_rejected(t5, validator):
    doc = t5.to_dict()
    del doc["layers"][0]["module"]
    assert not validator.is_valid(doc)


def test_write_and_load_round_trip(any_report, tmp_path):
    _, report = any_report
    path = write_json(report, tmp_path / "report.json")
    assert path == tmp_path / "report.json"
    loaded = load_report(path)
    assert loaded.to_dict() == report.to_dict()
    assert loaded.codes() == report.codes()
    assert os.listdir(tmp_path) == ["report.json"]


def test_write_is_atomic_and_keeps_old_file_on_failure(t5, bert, tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    write_json(bert, path)
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_json(t5, path)
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["report.json"]  # the temporary file was removed


def test_write_permissions(t5, tmp_path):
    fresh = write_json(t5, tmp_path / "new.json")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask
    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    write_json(t5, private)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


def test_load_rejects_non_json(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("loss went NaN at step 3\n")
    with pytest.raises(ReportFormatError, match=r"not valid JSON.*write_json") as info:
        load_report(path)
    assert isinstance(info.value, AmpDoctorError) and isinstance(info.value, ValueError)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2, 3], "not an ampdoctor report: expected a JSON object with 'schema_version' and 'findings'"),
        ({"findings": []}, "not an ampdoctor report"),
        ({"schema_version": "2.0", "findings": []}, "schema_version '2.0'; this ampdoctor reads '1.0'"),
        ({"schema_version": "1.0", "findings": [{"code": "oops", "severity": "error", "phase": "forward"}]},
         "not a valid ampdoctor report: unknown finding code 'oops'"),
        ({"schema_version": "1.0", "findings": [{"code": "overflow", "severity": "error"}]},
         "not a valid ampdoctor report: missing key 'phase'"),
    ],
)
def test_load_rejects_documents_that_are_not_reports(tmp_path, doc, message):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError) as info:
        load_report(path)
    assert message in str(info.value)


def test_load_accepts_a_newer_minor_version(t5, tmp_path):
    doc = t5.to_dict()
    doc["schema_version"] = "1.3"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert load_report(path).codes() == ["overflow", "must-stay-fp32"]


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_report(tmp_path / "absent.json")


def test_json_needs_no_optional_package(t5, tmp_path, monkeypatch):
    # a fresh import of ampdoctor.report with rich, jinja2 and plotly unimportable: JSON still works
    import ampdoctor

    monkeypatch.setattr(ampdoctor, "report", ampdoctor.report)  # restored afterwards, like sys.modules
    for name in [m for m in sys.modules if m == "ampdoctor.report" or m.startswith("ampdoctor.report.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("rich", "jinja2", "plotly"):
        monkeypatch.setitem(sys.modules, name, None)
    fresh = importlib.import_module("ampdoctor.report")
    path = fresh.write_json(t5, tmp_path / "r.json")
    assert fresh.load_report(path).to_dict() == t5.to_dict()
    with pytest.raises(ImportError, match=r"ampdoctor\[html\]"):
        fresh.render_html(t5)
