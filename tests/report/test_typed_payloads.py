"""Typed evidence and layer rows: the common facts as typed fields, the same JSON as the mapping they came from.

The diagnosed model is the fp16 MLP whose first Linear's fp32 output reaches ~1.2e5 (> 65504): its root finding
carries dtype, numel, ref_absmax and format_max, and its layer table has an ``inf`` target |max|.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.findings import Evidence, Finding, LayerStat, Report
from ampdoctor.report import render_json


@pytest.fixture(scope="module")
def overflow_report() -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        model[0].weight.mul_(2000.0)  # |x @ W| ~ 1e5: past fp16's 65504, fine in fp32
    x = torch.randn(8, 16) * 20
    return ampdoctor.diagnose(model, x, precision="fp16", loss_fn=lambda out, _: out.float().pow(2).mean())


def test_root_evidence_is_typed_and_reads_as_its_mapping(overflow_report: Report) -> None:
    root = overflow_report.findings[0]
    assert (root.code, root.module, root.phase) == ("overflow", "0", "forward")
    ev = root.evidence
    assert isinstance(ev, Evidence)
    assert ev.dtype == ev["dtype"] == "float16"
    assert ev.format_max == ev["format_max"] == 65504.0
    assert ev.ref_absmax is not None and ev.ref_absmax > ev.format_max  # the fp32 value does not fit
    assert ev.numel == ev["numel"] == 8 * 64
    assert ev["input_dtypes"] == list(ev.input_dtypes or ())  # the mapping view holds JSON's lists
    assert not set(ev.extra) & set(Evidence._TYPES)  # a well-typed common key is a field, not an extra
    assert list(ev) == list(root.to_dict()["evidence"])  # the order the rule gave


def test_json_of_evidence_and_layers_is_the_mapping_they_were_built_from(overflow_report: Report) -> None:
    doc = json.loads(render_json(overflow_report))
    for f, fd in zip(overflow_report.findings, doc["findings"]):
        assert fd["evidence"] == json.loads(json.dumps(ampdoctor.findings.jsonable(dict(f.evidence))))
    assert all(isinstance(row, LayerStat) for row in overflow_report.layers)
    first = overflow_report.layer_stats[0]
    assert (first.module, first.phase, first.dtype, first.target_absmax) == ("0", "forward", "float16", math.inf)
    assert doc["layers"][0]["target_absmax"] == "inf"
    assert doc["layers"][0] == {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                                for k, v in first.items()}


def test_the_schema_types_the_common_evidence_keys(overflow_report: Report) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from ampdoctor.report import SCHEMA_PATH

    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert set(schema["$defs"]["evidence"]["properties"]) == set(Evidence._TYPES)
    assert set(schema["$defs"]["layer"]["properties"]) == set(LayerStat._TYPES)
    validator = jsonschema.Draft202012Validator(schema)
    doc = json.loads(render_json(overflow_report))
    assert not list(validator.iter_errors(doc))
    doc["findings"][0]["evidence"]["numel"] = "512"  # a common key of the wrong type is rejected
    assert [e.validator for e in validator.iter_errors(doc)] == ["type"]


def test_a_json_round_trip_keeps_the_typed_fields(overflow_report: Report) -> None:
    loaded = Report.from_dict(json.loads(render_json(overflow_report)))
    ev, ev0 = loaded.findings[0].evidence, overflow_report.findings[0].evidence
    assert isinstance(ev, Evidence)
    assert (ev.dtype, ev.numel, ev.ref_absmax, ev.format_max) == (ev0.dtype, ev0.numel, ev0.ref_absmax,
                                                                  ev0.format_max)
    assert loaded.layer_stats[0].target_absmax == math.inf  # JSON's "inf" reads as the float again
    assert render_json(loaded) == render_json(overflow_report)


def test_malformed_values_stay_as_given_in_extra() -> None:
    ev = Evidence.of({"numel": "12", "dtype": None, "ref_absmax": "inf", "step": True, "tiles": [1, 2]})
    assert ev.numel is None and ev["numel"] == "12" and ev.extra["numel"] == "12"
    assert ev.dtype is None and ev["dtype"] is None
    assert ev.ref_absmax == math.inf
    assert ev.step is None and ev["step"] is True  # a bool is no step count
    assert list(ev) == ["numel", "dtype", "ref_absmax", "step", "tiles"]
    assert ampdoctor.findings.jsonable(ev) == {"numel": "12", "dtype": None, "ref_absmax": "inf", "step": True,
                                               "tiles": [1, 2]}
    with pytest.raises(KeyError):
        ev["absmax"]  # noqa: B018  (an unset typed field is absent from the mapping)
    assert "absmax" not in ev and ev.get("absmax", 0) == 0


def test_direct_construction_checks_types_and_clashes() -> None:
    ev = Evidence(dtype="bfloat16", input_dtypes=("bfloat16",), absmax=3, extra={"k": 1})
    assert dict(ev) == {"dtype": "bfloat16", "input_dtypes": ["bfloat16"], "absmax": 3, "k": 1}
    with pytest.raises(TypeError, match=r"Evidence.numel = '3'.*Evidence.of"):
        Evidence(numel="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both as typed fields and in 'extra'"):
        Evidence(dtype="float16", extra={"dtype": "float16"})


def test_evidence_equals_dicts_copies_and_pickles() -> None:
    raw = {"dtype": "float16", "format_max": 65504.0, "ratio": 1.8}
    ev = Evidence.of(raw)
    assert ev == raw and raw == ev and ev == Evidence.of(dict(reversed(list(raw.items()))))
    assert ev != {**raw, "ratio": 2.0}
    assert pickle.loads(pickle.dumps(ev)) == ev == copy.deepcopy(ev)
    assert Evidence.of(ev) is ev
    assert ev.replace(ratio=2.0, extra_key=1) == {**raw, "ratio": 2.0, "extra_key": 1}


def test_findings_turn_any_mapping_into_evidence() -> None:
    f = Finding("overflow", "error", "fc1", "aten.mm.default", "forward", "t", "e", {"dtype": "float16"})
    g = dataclasses.replace(f, evidence={"dtype": "bfloat16", "n_inf": 4})
    assert isinstance(g.evidence, Evidence) and (g.evidence.dtype, g.evidence.n_inf) == ("bfloat16", 4)
    assert Finding("overflow", "error", "", "", "forward", "", "").evidence == {}
    with pytest.raises(TypeError, match="needs a mapping"):
        Finding("overflow", "error", "", "", "forward", "", "", ["dtype"])  # type: ignore[arg-type]


def test_every_typed_key_is_a_field() -> None:
    for cls in (Evidence, LayerStat):
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(cls._TYPES) <= names, cls
        assert {"extra", "order"} <= names


def test_layer_rows_keep_non_mapping_entries_out_of_the_typed_view() -> None:
    report = Report(layers=({"module": "a", "depth": "x"}, "junk", LayerStat(module="b", nonfinite=2)))
    assert [row.module for row in report.layer_stats] == ["a", "b"]
    assert report.layer_stats[0].depth is None and report.layer_stats[0]["depth"] == "x"
    assert json.loads(render_json(report))["layers"] == [{"module": "a", "depth": "x"}, "junk",
                                                         {"module": "b", "nonfinite": 2}]
