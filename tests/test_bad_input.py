"""Bad input gives a clear error that says what to do, raised before anything changes.

Each case names the exception type and a phrase of the remedy that must be in the message. ``docs/bad-input.md``
is the table of these cases; :func:`test_docs_table_matches_the_errors` checks every row's fragment against the
real error. Cases the core does not handle yet are ``xfail(strict=True)`` with the reason, so they flip when fixed.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.precision import ScenarioError
from tests._models import TinyLinear as Net

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"


class IntOnly(nn.Module):
    """A lookup table of int buffers only (e.g. an integer-quantized or index model)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(10))

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.table[i]


def x() -> torch.Tensor:
    return torch.randn(3, 4)


def mean(o, b):  # noqa: ANN001, ANN201
    return o.mean()


@dataclass
class Case:
    """``run(tmp_path, model)`` triggers the error; ``model`` (if any) is checked unchanged afterwards."""

    id: str
    run: Callable[[Path, nn.Module], Any]
    exc: type[BaseException]
    fragment: str
    xfail: str = ""
    files: dict[str, str] = field(default_factory=dict)


def d(model: Any, batch: Any = None, **kw: Any) -> Callable[[Path, nn.Module], Any]:
    """diagnose(model or the case's Net, batch, **kw)."""

    def run(tmp: Path, net: nn.Module) -> Any:
        return ampdoctor.diagnose(net if model is None else model, x() if batch is None else batch, **kw)

    return run


def f(name: str, **overrides: Any) -> Callable[[Path, nn.Module], Any]:
    """diagnose_file(tmp/name, **overrides)."""

    def run(tmp: Path, net: nn.Module) -> Any:
        return ampdoctor.diagnose_file(str(tmp / name), **overrides)

    return run


HEAD = "import torch\nfrom torch import nn\n\n"
GOOD = HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'batch': torch.randn(3, 4), 'precision': 'fp16'}\n"

CASES = [
    # -- the model
    Case("model-function", d(lambda t: t), ScenarioError, "pass the model object itself"),
    Case("model-string", d("bert-base-uncased"), ScenarioError, "pass the model object itself"),
    Case("model-int-only", d(IntOnly(), torch.tensor([1, 2])), ScenarioError, "needs a floating-point model"),
    Case("model-meta", d(nn.Linear(4, 2, device="meta")), ScenarioError, "materialise the weights first"),
    Case("model-compiled", lambda tmp, net: ampdoctor.diagnose(torch.compile(net), x()), ScenarioError,
         "Pass the original module (model._orig_mod)"),
    # -- the batch
    Case("batch-empty-dict", d(None, {}), ScenarioError, "pass the model's inputs"),
    Case("batch-empty-tuple", d(None, ()), ScenarioError, "pass the model's positional inputs"),
    Case("batch-wrong-keys", d(None, {"input_ids": torch.randn(3, 4)}), ScenarioError,
         "pass the inputs the model's forward takes"),
    Case("batch-too-many-positional", d(None, (torch.randn(3, 4), torch.randn(3, 4))), ScenarioError,
         "pass the inputs the model's forward takes"),
    Case("batch-wrong-shape", d(None, torch.randn(3, 5)), ScenarioError, "Check the batch's keys, shapes and dtypes"),
    Case("batch-wrong-dtype", d(None, torch.ones(3, 4, dtype=torch.long)), ScenarioError,
         "Check the batch's keys, shapes and dtypes"),
    # -- the loss
    Case("loss-not-scalar", d(None, loss_fn=lambda o, b: o), ScenarioError, "return a floating-point scalar"),
    Case("loss-float", d(None, loss_fn=lambda o, b: o.sum().item()), ScenarioError, "must return a scalar Tensor"),
    Case("loss-integer", d(None, loss_fn=lambda o, b: o.argmax()), ScenarioError, "floating-point"),
    Case("loss-not-callable", d(None, loss_fn="mse"), ScenarioError, "must be callable as loss_fn(output, batch)"),
    Case("train-step-not-callable", d(None, train_step="fit"), ScenarioError,
         "must be callable as train_step(model, batch)"),
    # -- options
    Case("precision-unknown", d(None, precision="fp12"), ScenarioError, "expected one of None, 'fp16', 'bf16'"),
    Case("precision-dtype", d(None, precision=torch.float16), ScenarioError, "expected one of None, 'fp16'"),
    Case("steps-zero", d(None, steps=0), ScenarioError, "steps must be a positive int"),
    Case("steps-string", d(None, steps="3"), ScenarioError, "steps must be a positive int"),
    Case("steps-bool", d(None, steps=True), ScenarioError, "steps must be a positive int"),
    Case("policy-unknown", d(None, policy="foo"), ValueError, "expected 'cuda' or 'native'"),
    # -- optimizer and scaler
    Case("optimizer-foreign", lambda tmp, net: ampdoctor.diagnose(
        net, x(), loss_fn=mean, optimizer=torch.optim.SGD(Net().parameters(), lr=0.1)), ScenarioError,
        "build the optimizer from model.parameters()"),
    Case("optimizer-not-optimizer", d(None, optimizer="adam"), ScenarioError, "must be a torch.optim.Optimizer"),
    Case("scaler-not-gradscaler", d(None, scaler=object()), ScenarioError, "must be a torch.amp.GradScaler"),
    # -- scenario files
    Case("file-missing", f("nowhere.py"), ScenarioError, "pass the path of a .py file that defines make()"),
    Case("file-is-a-directory", lambda tmp, net: ampdoctor.diagnose_file(str(tmp)), ScenarioError,
         "pass the path of a .py file that defines make()"),
    Case("file-path-not-str", lambda tmp, net: ampdoctor.diagnose_file(123), ScenarioError,
         "scenario path must be a string or path"),
    Case("file-not-python", f("notes.txt"), ScenarioError, "a scenario is a .py file that defines make()",
         files={"notes.txt": "model = 1\n"}),
    Case("file-syntax-error", f("broken.py"), ScenarioError, "traceback", files={"broken.py": "def make(:\n"}),
    Case("file-no-make", f("nomake.py"), ScenarioError, "must define make()", files={"nomake.py": HEAD}),
    Case("file-make-raises", f("raises.py"), ScenarioError, "traceback",
         files={"raises.py": "def make():\n    raise RuntimeError('needs a GPU')\n"}),
    Case("file-make-no-model", f("nomodel.py"), ScenarioError, "must return a dict with at least 'model'",
         files={"nomodel.py": HEAD + "def make():\n    return {'batch': torch.randn(3, 4)}\n"}),
    Case("file-make-not-dict", f("bare.py"), ScenarioError, "must return a dict with at least 'model'",
         files={"bare.py": HEAD + "def make():\n    return nn.Linear(4, 2)\n"}),
    Case("file-make-unknown-keys", f("extra.py"), ScenarioError, "allowed keys are",
         files={"extra.py": HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'lr': 1e-3}\n"}),
    Case("file-unknown-override", f("good.py", precison="fp16"), ScenarioError, "unknown override(s) ['precison']",
         files={"good.py": GOOD}),
    Case("file-policy-unknown", f("good.py", policy="foo"), ValueError, "expected 'cuda' or 'native'",
         files={"good.py": GOOD}),
]


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
            for c in cases]


def _raise(case: Case, tmp_path: Path, net: nn.Module) -> BaseException:
    for name, text in case.files.items():
        (tmp_path / name).write_text(textwrap.dedent(text), encoding="utf-8")
    with pytest.raises(BaseException) as info:
        case.run(tmp_path, net)
    return info.value


def test_enough_kinds_of_bad_input():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_says_what_to_do(case, tmp_path, digest):
    net = Net()
    before = digest(net, rng=False)
    err = _raise(case, tmp_path, net)
    assert isinstance(err, case.exc), f"{type(err).__name__}: {err}"
    if case.exc is ScenarioError:
        assert isinstance(err, ampdoctor.AmpDoctorError) and isinstance(err, ValueError)
    assert case.fragment in str(err), str(err)
    assert digest(net, rng=False) == before  # raised before anything changed


# ------------------------------------------------------------------------------------------------ the docs
ROW = re.compile(r"^\|\s*`(?P<id>[a-z0-9-]+)`\s*\|(?P<input>[^|]*)\|\s*`(?P<exc>\w+)`\s*\|\s*(?P<msg>.*?)\s*\|\s*$")


def _doc_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            frags = re.findall(r"“([^”]+)”", m["msg"])
            assert len(frags) == 1, f"row {m['id']}: put the message fragment in “...”: {line}"
            rows[m["id"]] = (m["exc"], frags[0])
    return rows


def test_docs_table_lists_every_case():
    assert sorted(_doc_rows()) == sorted(c.id for c in CASES)


@pytest.mark.parametrize("case", _params(CASES))
def test_docs_table_matches_the_errors(case, tmp_path):
    exc_name, fragment = _doc_rows()[case.id]
    err = _raise(case, tmp_path, Net())
    assert exc_name in {t.__name__ for t in type(err).__mro__}, f"{type(err).__name__}: {err}"
    assert fragment in str(err), str(err)
