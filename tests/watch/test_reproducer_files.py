"""The reliability audit's 24 reproducer-file rows (shared/reviews/reliability.md, Appendix B): each bad file is one
clear :class:`ampdoctor.AmpDoctorError` (or, for harmless oddities, a replay that still works), and no file ever
executes code."""

from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch

import ampdoctor
from ampdoctor.watch import ReproducerError, load_reproducer, replay

from .test_reproducer import Net, run_until_nonfinite


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    d = tmp_path_factory.mktemp("repro")
    run_until_nonfinite(d)
    path = d / "step000003-nonfinite-grads.pt"
    return path, load_reproducer(path)


def _craft(tmp_path, payload, **fields):
    p = dict(payload)
    p.update(fields)
    out = tmp_path / "crafted.pt"
    torch.save(p, out)
    return out


def _bytes(tmp_path, genuine, kind):
    data = genuine[0].read_bytes()
    out = tmp_path / "bad.pt"
    if kind == "directory":
        out.mkdir()
        return out
    content = {
        "empty": b"",
        "first-10-bytes": data[:10],
        "truncated-half": data[: len(data) // 2],
        "bit-flips": bytes(b ^ 0xFF if 200 <= i < 400 else b for i, b in enumerate(data)),
        "text": b"hello, this is not a reproducer\n",
    }.get(kind)
    if kind == "non-torch-zip":
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("readme.txt", "just a zip")
        return out
    out.write_bytes(content)
    return out


@pytest.mark.parametrize("kind", ["empty", "first-10-bytes", "truncated-half", "bit-flips", "text", "non-torch-zip",
                                  "directory"])
def test_unreadable_files_are_clear_errors(tmp_path, genuine, kind) -> None:
    with pytest.raises(ReproducerError, match="reproducer"):
        load_reproducer(_bytes(tmp_path, genuine, kind))


@pytest.mark.parametrize("how", ["raw-pickle", "torch-zip-pickle"])
def test_malicious_pickles_are_blocked(tmp_path, how) -> None:
    marker = tmp_path / "pwned"
    out = tmp_path / "evil.pt"
    if how == "raw-pickle":
        out.write_bytes(pickle.dumps({"format": "ampdoctor-reproducer", "x": _Evil(str(marker))}))
    else:
        torch.save({"format": "ampdoctor-reproducer", "x": _Evil(str(marker))}, out)
    with pytest.raises(ReproducerError, match="not a readable ampdoctor reproducer"):
        load_reproducer(out)
    assert not marker.exists()


@pytest.mark.parametrize("field, value, message", [
    ("model_state", "x", "field 'model_state' must be"),
    ("precision", 5, "field 'precision' must be"),
    ("rng", {"cpu": torch.zeros(3, dtype=torch.uint8)}, "field 'rng' must be"),
    ("optimizer_state", {"state": 3}, "field 'optimizer_state' must be"),
    ("scaler_state", "x", "field 'scaler_state' must be"),
    ("step", "3", "field 'step' must be an int"),
    ("step_method", "__init__", "field 'step_method' must be"),
    ("version", "1", "not an integer"),
])
def test_crafted_fields_are_clear_errors(tmp_path, genuine, field, value, message) -> None:
    with pytest.raises(ReproducerError, match=message) as ei:
        replay(_craft(tmp_path, genuine[1], **{field: value}), model_factory=Net)
    assert "write a new one" in str(ei.value)


@pytest.mark.parametrize("crafted", ["wrong-state-shapes", "unknown-precision", "batch-wrong-shape"])
def test_crafted_content_is_a_clear_error(tmp_path, genuine, crafted) -> None:
    payload = genuine[1]
    fields = {
        "wrong-state-shapes": {"model_state": {k: torch.zeros(1) for k in payload["model_state"]}},
        "unknown-precision": {"precision": {**payload["precision"], "name": "fp12"}},
        "batch-wrong-shape": {"batch": torch.zeros(3, 5), "call": None},
    }[crafted]
    with pytest.raises(ampdoctor.AmpDoctorError):
        replay(_craft(tmp_path, payload, **fields), model_factory=Net)


@pytest.mark.parametrize("crafted", ["optimizer-params-mismatch", "bogus-scaler-device", "optimizer-class-os-system"])
def test_harmless_oddities_still_replay(tmp_path, genuine, crafted) -> None:
    fields = {
        "optimizer-params-mismatch": {"optimizer_params": [["no.such.param"]]},
        "bogus-scaler-device": {"scaler_device": "quantum"},
        "optimizer-class-os-system": {"optimizer_class": "os.system"},
    }[crafted]
    report = replay(_craft(tmp_path, genuine[1], **fields), model_factory=Net)
    assert report.findings and report.findings[0].code == "nonfinite-input"  # the recorded inf batch, as recorded


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_the_source_field_never_executes(tmp_path, genuine, monkeypatch, where) -> None:
    marker = tmp_path / "pwned"
    script = tmp_path / "scenario.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\ndef make():\n    return {{}}\n")
    monkeypatch.chdir(tmp_path)
    source = str(script) if where == "absolute" else "scenario.py"
    with pytest.raises(ReproducerError, match="--trust-source"):
        replay(_craft(tmp_path, genuine[1], source=source, hf_config=None))
    assert not marker.exists()
