"""Every Python-API bad input of the reliability audit (``shared/reviews/reliability.md``, Appendix A), re-created.

Each row is one of three verdicts:

* ``Err(type, fragment)``: one exception of that type whose message holds ``fragment`` (what was wrong and what
  to do), raised before anything the caller owns changed;
* ``Ok(check)``: accepted, and the report is correct (``check(result)`` asserts what it must say: "OK" only for a
  run that trained or was meant to be forward-only);
* ``Propagates(type)``: the user's ``KeyboardInterrupt``/``SystemExit`` passes through unchanged.

The caller's objects (model, optimizer, scaler) and the global RNG are hashed before and after every call
(``tests/conftest.py::state_digest``) except for the watch rows that train on purpose. ``docs/bad-input.md`` lists
every row (section "The audit's bad inputs"); :func:`test_docs_list_every_audit_row` keeps the two in step.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdoctor
from ampdoctor.diagnose import DiagnosisError
from ampdoctor.fixes import NoFixError, diagnose_and_fix
from ampdoctor.fixes import fix as apply_fix
from ampdoctor.precision import MAX_STEPS, ScenarioError
from tests._models import TinyLinear as Net
from tests.conftest import state_digest

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"


# ------------------------------------------------------------------------------------------- tiny models
class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Returns(nn.Module):
    """forward returns ``kind``: a dict, a tuple, a dataclass, None or a dict holding the loss."""

    @dataclass
    class Out:
        logits: torch.Tensor

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc, self.kind = nn.Linear(4, 2), kind

    def forward(self, x: torch.Tensor) -> Any:
        y = self.fc(x)
        return {"dict": {"logits": y}, "tuple": (y, y * 2), "dataclass": Returns.Out(y), "None": None,
                "loss-dict": {"loss": y.pow(2).mean(), "logits": y}}[self.kind]


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.fc, self.head, self.reentrant = nn.Linear(4, 4), nn.Linear(4, 2), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.fc, x, use_reentrant=self.reentrant))


def rand(*shape: int) -> torch.Tensor:
    """Random inputs from a private generator: building a case's batch draws nothing from the global RNG, which
    the rows hash to prove the library draws nothing either."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def x() -> torch.Tensor:
    return rand(3, 4)


def mean(o: Any, b: Any) -> torch.Tensor:
    return o.float().mean()


def sq(o: Any, b: Any) -> torch.Tensor:
    return o.float().pow(2).mean()


def logits_mean(o: Any, b: Any) -> torch.Tensor:
    return o.logits.float().mean()


def fp16_only_fails(o: Any, b: Any) -> torch.Tensor:
    if o.dtype == torch.float16:
        raise ValueError("boom")
    return o.mean()


def ts_raises(model: nn.Module, batch: Any) -> Any:
    raise RuntimeError("user train_step bug")


def ts_raises_after_backward(model: nn.Module, batch: Any) -> Any:
    model(batch).float().mean().backward()
    raise RuntimeError("user train_step bug after backward")


def ts_one_arg(model: nn.Module) -> Any:
    return model(rand(3, 4)).mean()


def ts_returns_float(model: nn.Module, batch: Any, optimizer: Any = None) -> Any:
    loss = model(batch).float().pow(2).mean()
    loss.backward()
    return loss.item()


def ts_interrupt(model: nn.Module, batch: Any) -> Any:
    raise KeyboardInterrupt


def ts_exit(model: nn.Module, batch: Any) -> Any:
    raise SystemExit(3)


def quantized() -> nn.Module:
    return torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 2)), {nn.Linear}, dtype=torch.qint8)


def partly_meta() -> nn.Module:
    m = Two()
    m.b = nn.Linear(4, 2, device="meta")
    return m


# ------------------------------------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class Err:
    exc: type[BaseException]
    fragment: str


@dataclass(frozen=True)
class Ok:
    check: Callable[[Any], None]
    says: str


@dataclass(frozen=True)
class Propagates:
    exc: type[BaseException]


@dataclass
class Case:
    """``setup()`` -> the caller's objects (``model``/``optimizer``/``scaler`` are hashed); ``call(objs, tmp)``."""

    id: str
    setup: Callable[[], dict[str, Any]]
    call: Callable[[dict[str, Any], Path], Any]
    verdict: Err | Ok | Propagates
    files: dict[str, str | bytes] = field(default_factory=dict)
    trains: bool = False  # a watch row: training inside it changes the objects by design
    marks: tuple[Any, ...] = ()


def objs(model: Any = None, opt: bool = False, scaler: Any = None, **extra: Any) -> Callable[[], dict[str, Any]]:
    """The caller's objects, built fresh for each run: ``model`` is a factory (or a plain value)."""

    def setup() -> dict[str, Any]:
        m = model() if callable(model) and not isinstance(model, nn.Module) else model
        out: dict[str, Any] = {"model": m}
        if opt and isinstance(m, nn.Module):
            out["optimizer"] = torch.optim.SGD(m.parameters(), lr=0.1)
        if scaler is not None:
            out["scaler"] = scaler()
        out.update({k: (v() if callable(v) else v) for k, v in extra.items()})
        return out

    return setup


def D(batch: Any = None, **kw: Any) -> Callable[[dict[str, Any], Path], Any]:
    """``diagnose(objs['model'], batch, optimizer=..., scaler=..., **kw)``; ``batch`` a factory or a value."""

    def call(o: dict[str, Any], tmp: Path) -> Any:
        b = batch() if callable(batch) else (x() if batch is None else batch)
        extra = {k: o[k] for k in ("optimizer", "scaler") if k in o}
        return ampdoctor.diagnose(o["model"], b, **extra, **kw)

    return call


def F(name: str, **overrides: Any) -> Callable[[dict[str, Any], Path], Any]:
    return lambda o, tmp: ampdoctor.diagnose_file(str(tmp / name), **overrides)


def ok(check: Callable[[Any], bool], says: str) -> Ok:
    def run(result: Any) -> None:
        assert check(result), f"{says}: {getattr(result, 'summary', result)!r} codes={_codes(result)}"

    return Ok(run, says)


def _codes(result: Any) -> Any:
    return result.codes() if hasattr(result, "codes") else None


def trained(r: Any) -> bool:
    return r.ok and not r.summary["forward_only"] and all(v is not None for v in r.summary["loss_target"])


def forward_only(r: Any) -> bool:
    return r.ok and r.summary["forward_only"]


def has(code: str) -> Callable[[Any], bool]:
    return lambda r: code in r.codes()


HEAD = "import torch\nfrom torch import nn\n\n"
GOOD = HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'batch': torch.randn(3, 4), 'precision': 'fp16'}\n"
NET = Net
CHECK_TS = "Check the batch's keys, shapes and dtypes"
PREC = "expected one of None, 'fp16', 'bf16'"

# ----------------------------------------------------------------------------------- diagnose(model, ...)
API = [
    Case("d-model-dict", objs({"a": 1}), D(), Err(ScenarioError, "pass the model object itself")),
    Case("d-model-no-params", objs(nn.ReLU), D(), ok(forward_only, "ok, forward-only")),
    Case("d-model-no-params-fp16", objs(nn.ReLU), D(precision="fp16"), ok(forward_only, "ok, forward-only")),
    Case("d-model-quantized-dynamic", objs(quantized), D(precision="fp16-amp", loss_fn=mean),
         Err(ScenarioError, "needs a floating-point model")),
    Case("d-model-meta", objs(lambda: nn.Linear(4, 2, device="meta")), D(), Err(ScenarioError,
                                                                                "materialise the weights first")),
    Case("d-model-partly-meta", objs(partly_meta), D(), Err(ScenarioError, "materialise the weights first")),
    Case("d-model-compiled", objs(lambda: torch.compile(Net())), D(), Err(ScenarioError,
                                                                          "Pass the original module")),
    Case("d-model-eval-mode", objs(lambda: Net().eval(), opt=True), D(loss_fn=sq, precision="fp16"),
         ok(trained, "ok, trained")),
    Case("d-model-requires-grad-false", objs(lambda: Net().requires_grad_(False), opt=True),
         D(loss_fn=sq, precision="fp16"), Err(ScenarioError, "none of its parameters requires grad")),
    Case("d-model-grad-checkpoint", objs(lambda: Checkpointed(False), opt=True), D(loss_fn=sq, precision="fp16"),
         ok(trained, "ok, trained")),
    Case("d-model-grad-checkpoint-reentrant", objs(lambda: Checkpointed(True), opt=True),
         D(loss_fn=sq, precision="fp16"), ok(has("unused-parameters"), "unused-parameters (reentrant, no input grad)")),
    Case("d-model-fp16-with-fp16-amp", objs(lambda: Net().half(), opt=True),
         D(lambda: x().half(), loss_fn=sq, precision="fp16-amp"), ok(lambda r: r.summary["forward_only"] is False,
                                                                     "runs, trained")),
    Case("d-model-nested-dataparallel", objs(lambda: nn.DataParallel(nn.DataParallel(Net())), opt=True),
         D(loss_fn=sq, precision="fp16"), ok(trained, "ok, trained")),
    *[Case(f"d-forward-returns-{k}", objs(lambda k=k: Returns(k)), D(precision="fp16"),
           ok(forward_only, "ok, forward-only (an inference diagnosis)"))
      for k in ("dict", "tuple", "dataclass", "None")],
    Case("d-forward-returns-loss-dict", objs(lambda: Returns("loss-dict"), opt=True), D(precision="fp16"),
         ok(trained, "trained with out['loss']")),
    Case("d-forward-returns-dataclass-with-loss_fn", objs(lambda: Returns("dataclass"), opt=True),
         D(precision="fp16", loss_fn=logits_mean), ok(trained, "trained")),
    Case("d-forward-returns-None-with-loss_fn", objs(lambda: Returns("None"), opt=True),
         D(precision="fp16", loss_fn=mean), Err(ScenarioError, "the error is in loss_fn")),
    # -- the batch
    Case("d-batch-None-forward-needs-x", objs(Net), lambda o, t: ampdoctor.diagnose(o["model"], None),
         Err(ScenarioError, CHECK_TS)),
    Case("d-batch-wrong-shape", objs(Net), D(lambda: rand(3, 5)), Err(ScenarioError, CHECK_TS)),
    Case("d-batch-ints", objs(Net), D(lambda: torch.ones(3, 4, dtype=torch.long)), Err(ScenarioError, CHECK_TS)),
    Case("d-batch-with-nan", objs(Net, opt=True),
         D(lambda: torch.tensor([[1.0, float("nan"), 0.0, 1.0]] * 3), loss_fn=sq, precision="fp16"),
         ok(has("nonfinite-input"), "nonfinite-input")),
    Case("d-batch-with-inf-fp32", objs(Net, opt=True),
         D(lambda: torch.tensor([[1.0, float("inf"), 0.0, 1.0]] * 3), loss_fn=sq), ok(has("nonfinite-input"),
                                                                                     "nonfinite-input")),
    Case("d-batch-empty-tensor", objs(Net, opt=True), D(lambda: rand(0, 4), loss_fn=sq, precision="fp16"),
         Err(ScenarioError, "pass at least one sample")),
    Case("d-batch-string", objs(Net), D("some text"), Err(ScenarioError, CHECK_TS)),
    Case("d-batch-generator", objs(Net), D(lambda: (t for t in [rand(3, 4)])),
         Err(ScenarioError, "pass materialised inputs")),
    Case("d-batch-numpy", objs(Net), D(lambda: rand(3, 4).numpy()), Err(ScenarioError, CHECK_TS)),
    Case("d-batch-0d", objs(Net), D(lambda: torch.tensor(1.0)), Err(ScenarioError, CHECK_TS)),
    # -- the loss
    Case("d-loss-non-scalar", objs(Net), D(loss_fn=lambda o, b: o), Err(ScenarioError,
                                                                        "return a floating-point scalar")),
    Case("d-loss-float", objs(Net), D(loss_fn=lambda o, b: o.sum().item()), Err(ScenarioError,
                                                                                "must return a scalar Tensor")),
    Case("d-loss-None", objs(Net), D(loss_fn=lambda o, b: None), Err(ScenarioError, "must return a scalar Tensor")),
    Case("d-loss-no-grad", objs(Net, opt=True), D(loss_fn=lambda o, b: o.detach().float().mean(), steps=3),
         Err(ScenarioError, "no backward or optimizer step would run")),
    Case("d-loss-wrong-arity", objs(Net), D(loss_fn=lambda o: o.mean()), Err(ScenarioError,
                                                                             "the error is in loss_fn")),
    Case("d-loss-raises-in-target-only", objs(Net), D(loss_fn=fp16_only_fails, precision="fp16"),
         Err(DiagnosisError, "ampdoctor found no numerics cause for it")),
    Case("d-loss-nan-literal", objs(Net, opt=True), D(loss_fn=lambda o, b: o.mean() * float("nan"), precision="fp16"),
         ok(lambda r: not r.ok and "nonfinite-reference" in r.codes(), "nonfinite-reference: not a precision problem")),
    Case("d-loss-complex", objs(Net), D(loss_fn=lambda o, b: o.mean().to(torch.complex64)),
         Err(ScenarioError, "return a floating-point scalar")),
    # -- options
    *[Case(f"d-precision-{p}", objs(Net), D(precision=p), Err(ScenarioError, PREC))
      for p in ("fp12", "FP16", "fp16_amp", "float16", "as-given")],
    *[Case(f"d-steps-{s}", objs(Net), D(steps=s), Err(ScenarioError, "steps must be a positive int"))
      for s in (0, -1, 1.5, 2.0)],
    Case("d-steps-huge", objs(Net), D(steps=10**12), Err(ScenarioError, f"steps must be at most {MAX_STEPS}")),
    Case("d-policy-bad", objs(Net), D(policy="CUDA"), Err(ValueError, "expected 'cuda' or 'native'")),
    # -- optimizer and scaler
    Case("d-optimizer-other-model", objs(Net, optimizer=lambda: torch.optim.SGD(Net().parameters(), lr=0.1)),
         D(loss_fn=sq), Err(ScenarioError, "build the optimizer from model.parameters()")),
    Case("d-optimizer-model-plus-extra", lambda: _plus_extra(), D(loss_fn=sq),
         Err(ScenarioError, "build the optimizer from model.parameters()")),
    Case("d-optimizer-subset", lambda: _subset(), D(loss_fn=sq, precision="fp16"),
         ok(has("unused-parameters"), "unused-parameters (not in the optimizer)")),
    Case("d-optimizer-class-not-instance", objs(Net, optimizer=lambda: torch.optim.SGD), D(loss_fn=sq),
         Err(ScenarioError, "must be a torch.optim.Optimizer")),
    Case("d-scaler-disabled", objs(Net, opt=True, scaler=lambda: torch.amp.GradScaler("cpu", enabled=False)),
         D(loss_fn=sq, precision="fp16-amp"), ok(trained, "ok, trained")),
    Case("d-scaler-cuda-on-cpu", objs(Net, opt=True, scaler=lambda: _quiet(lambda: torch.amp.GradScaler("cuda"))),
         D(loss_fn=sq, precision="fp16-amp"), ok(trained, "ok (torch disables the CUDA scaler off-GPU)")),
    Case("d-scaler-legacy-class", objs(Net, opt=True, scaler=lambda: _quiet(torch.cuda.amp.GradScaler)),
         D(loss_fn=sq, precision="fp16-amp"), ok(trained, "ok")),
    Case("d-scaler-without-optimizer", objs(Net, scaler=lambda: torch.amp.GradScaler("cpu")),
         D(loss_fn=sq, precision="fp16-amp"), ok(lambda r: r.ok and not r.summary["forward_only"],
                                                 "ok, backward ran")),
    # -- train_step
    Case("d-train_step-raises", objs(Net), D(train_step=ts_raises), Err(ScenarioError,
                                                                        "the error is in train_step")),
    Case("d-train_step-raises-after-backward", objs(Net), D(train_step=ts_raises_after_backward, precision="fp16"),
         Err(DiagnosisError, "ampdoctor found no numerics cause for it")),
    Case("d-train_step-wrong-signature", objs(Net), D(train_step=ts_one_arg), Err(ScenarioError,
                                                                                  "the error is in train_step")),
    Case("d-train_step-returns-float", objs(Net, opt=True), D(train_step=ts_returns_float, precision="fp16"),
         ok(lambda r: r.ok and r.summary["loss_target"] == [None], "ok, loss not recorded")),
    Case("d-train_step-keyboardinterrupt", objs(Net), D(train_step=ts_interrupt), Propagates(KeyboardInterrupt)),
    Case("d-train_step-systemexit", objs(Net), D(train_step=ts_exit), Propagates(SystemExit)),
]


def _quiet(make: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def _plus_extra() -> dict[str, Any]:
    m = Net()
    return {"model": m, "optimizer": torch.optim.SGD([*m.parameters(), nn.Parameter(torch.ones(2))], lr=0.1)}


def _subset() -> dict[str, Any]:
    m = Two()
    return {"model": m, "optimizer": torch.optim.SGD(m.b.parameters(), lr=0.1)}


# ----------------------------------------------------------------------------------- scenario files
def made(body: str) -> str:
    return HEAD + "def make():\n    " + body + "\n"


FILES = [
    Case("file-syntax.py", objs(), F("syntax.py"), Err(ScenarioError, "to see the traceback and fix the file"),
         files={"syntax.py": "def make(:\n"}),
    Case("file-nomake.py", objs(), F("nomake.py"), Err(ScenarioError, "a scenario file must define make()"),
         files={"nomake.py": HEAD + "x = 1\n"}),
    Case("file-make_not_callable.py", objs(), F("notcallable.py"), Err(ScenarioError, "must define make()"),
         files={"notcallable.py": HEAD + "make = 5\n"}),
    Case("file-make_raises.py", objs(), F("raises.py"), Err(ScenarioError, "to see the traceback and fix make()"),
         files={"raises.py": made("raise RuntimeError('needs a GPU')")}),
    Case("file-make_nondict.py", objs(), F("nondict.py"), Err(ScenarioError, "must return a dict with at least"),
         files={"nondict.py": made("return [nn.Linear(4, 2)]")}),
    Case("file-make_recursion.py", objs(), F("rec.py"), Err(ScenarioError, "raised RecursionError"),
         files={"rec.py": made("return make()")}),
    Case("file-import_recursion.py", objs(), F("irec.py"), Err(ScenarioError, "RecursionError"),
         files={"irec.py": HEAD + "def f(n):\n    return f(n + 1)\n\nf(0)\n\ndef make():\n    return {}\n"}),
    Case("file-sys_exit.py", objs(), F("exit0.py"), Err(ScenarioError, "called sys.exit(0) while importing"),
         files={"exit0.py": "import sys\n" + GOOD + "sys.exit(0)\n"}),
    Case("file-make_sys_exit.py", objs(), F("exit7.py"), Err(ScenarioError, "called sys.exit(7) in make()"),
         files={"exit7.py": "import sys\n" + made("sys.exit(7)")}),
    Case("file-make_kbint.py", objs(), F("kbint.py"), Propagates(KeyboardInterrupt),
         files={"kbint.py": made("raise KeyboardInterrupt")}),
    Case("file-make_model_str.py", objs(), F("mstr.py"), Err(ScenarioError, "pass the model object itself"),
         files={"mstr.py": made("return {'model': 'bert-base-uncased'}")}),
    Case("file-make_cuda.py", objs(), F("cuda.py"), Err(ScenarioError, "to see the traceback and fix make()"),
         files={"cuda.py": made("return {'model': nn.Linear(4, 2).cuda()}")},
         marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="the case is a CPU-only box"),)),
    Case("file-make_precision_bad.py", objs(), F("pbad.py"), Err(ScenarioError, PREC),
         files={"pbad.py": made("return {'model': nn.Linear(4, 2), 'batch': torch.randn(3, 4), 'precision': 'FP16'}")}),
    Case("file-make_steps_str.py", objs(), F("sstr.py"), Err(ScenarioError, "steps must be a positive int"),
         files={"sstr.py": made("return {'model': nn.Linear(4, 2), 'batch': torch.randn(3, 4), 'steps': '2'}")}),
    Case("file-make_args.py", objs(), F("margs.py"), Err(ScenarioError, "missing 1 required positional argument"),
         files={"margs.py": HEAD + "def make(n):\n    return {}\n"}),
    Case("file-notes.txt", objs(), F("notes.txt"), Err(ScenarioError, "a scenario is a .py file that defines make()"),
         files={"notes.txt": "model = 1\n"}),
    Case("file-binary.py", objs(), F("binary.py"), Err(ScenarioError, "null bytes"),
         files={"binary.py": b"\x00\x01\x02def make():\n"}),
    Case("file-nonutf8.py", objs(), F("latin.py"), Err(ScenarioError, "must return a dict with at least 'model'"),
         files={"latin.py": b"# -*- coding: latin-1 -*-\n# caf\xe9\ndef make():\n    return {}\n"}),
    Case("file-missing", objs(), F("nowhere.py"), Err(ScenarioError, "pass the path of a .py file")),
    Case("file-directory", objs(), lambda o, tmp: ampdoctor.diagnose_file(str(tmp)),
         Err(ScenarioError, "pass the path of a .py file")),
    Case("file-None", objs(), lambda o, tmp: ampdoctor.diagnose_file(None), Err(ScenarioError,
                                                                              "scenario path must be a string")),
    Case("file-override-steps-0", objs(), F("good.py", steps=0), Err(ScenarioError, "steps must be a positive int"),
         files={"good.py": GOOD}),
    Case("file-override-model-None", objs(), F("good.py", model=None), Err(ScenarioError,
                                                                          "pass the model object itself"),
         files={"good.py": GOOD}),
]


# ----------------------------------------------------------------------------------- watch(...)
def W(**kw: Any) -> Callable[[dict[str, Any], Path], Any]:
    def call(o: dict[str, Any], tmp: Path) -> Any:
        kw2 = {k: (str(tmp / v[4:]) if isinstance(v, str) and v.startswith("tmp:") else v) for k, v in kw.items()}
        return ampdoctor.watch(o["model"], o.get("optimizer"), **kw2)

    return call


def train(w: Any, model: nn.Module, opt: Any, steps: int = 3, nan_at: int = 1, enter: bool = True) -> Any:
    def loop() -> None:
        for i in range(steps):
            opt.zero_grad()
            loss = model(torch.randn(4, 4)).float().pow(2).mean() * (float("nan") if i == nan_at else 1.0)
            loss.backward()
            opt.step()
            w.step(loss)

    if enter:
        with w:
            loop()
    else:
        loop()
    return w.report()


def _tb_file(o: dict[str, Any], tmp: Path) -> Any:
    (tmp / "a_file").write_text("not a folder")
    return ampdoctor.watch(o["model"], o["optimizer"], tensorboard=str(tmp / "a_file")).__enter__()


def _without_with(o: dict[str, Any], tmp: Path) -> Any:
    return train(ampdoctor.watch(o["model"], o["optimizer"]), o["model"], o["optimizer"], enter=False)


def _after_exit(o: dict[str, Any], tmp: Path) -> Any:
    w = ampdoctor.watch(o["model"], o["optimizer"])
    train(w, o["model"], o["optimizer"], nan_at=-1)
    return train(w, o["model"], o["optimizer"], enter=False)


def _spike_inf(o: dict[str, Any], tmp: Path) -> Any:
    return train(ampdoctor.watch(o["model"], o["optimizer"], grad_spike_factor=float("inf")), o["model"],
                 o["optimizer"], nan_at=-1)


def _no_params(o: dict[str, Any], tmp: Path) -> Any:
    m = o["model"]
    with ampdoctor.watch(m) as w:
        for _ in range(3):
            m(torch.randn(2, 4))
            w.step()
    return w.report()


def _step_value(value: Any) -> Callable[[dict[str, Any], Path], Any]:
    def call(o: dict[str, Any], tmp: Path) -> Any:
        with ampdoctor.watch(o["model"], o["optimizer"]) as w:
            w.step(value)
        return w

    return call


WATCH = [
    Case("w-not-module", objs("model"), W(), Err(TypeError, "model must be a torch.nn.Module")),
    Case("w-optimizer-swapped-with-scaler", objs(Net, optimizer=lambda: torch.amp.GradScaler("cpu")),
         W(), Err(TypeError, "optimizer must be a torch.optim.Optimizer")),
    Case("w-optimizer-foreign", objs(Net, optimizer=lambda: torch.optim.SGD(Net().parameters(), lr=0.1)), W(),
         Err(ValueError, "updates none of the model's parameters")),
    Case("w-on_anomaly-bad", objs(Net, opt=True), W(on_anomaly="Raise"), Err(ValueError, "invalid on_anomaly")),
    Case("w-coverage_steps--1", objs(Net, opt=True), W(coverage_steps=-1), Err(ValueError, "coverage_steps must be")),
    Case("w-coverage_steps--1.5", objs(Net, opt=True), W(coverage_steps=-1.5), Err(TypeError,
                                                                                    "coverage_steps must be an int")),
    Case("w-grad_spike_factor-nan", objs(Net, opt=True), W(grad_spike_factor=float("nan")),
         Err(ValueError, "grad_spike_factor must be > 1")),
    Case("w-grad_spike_factor-inf", objs(Net, opt=True), _spike_inf, ok(lambda r: r.ok, "accepted: spikes off"),
         trains=True),
    Case("w-collapse_steps-0", objs(Net, opt=True), W(collapse_steps=0), Err(ValueError, "must be >= 1")),
    Case("w-reproducer_dir-int", objs(Net, opt=True), W(reproducer_dir=5),
         Err(TypeError, "reproducer_dir must be a directory path")),
    Case("w-tensorboard-is-a-file", objs(Net, opt=True), _tb_file, Err(ValueError, "tensorboard")),
    Case("w-step-loss-str", objs(Net, opt=True), _step_value("0.5"),
         Err(TypeError, "loss must be a tensor or a number")),
    Case("w-step-loss-numpy-float32", objs(Net, opt=True), _step_value(torch.ones(()).numpy()),
         Err(TypeError, "loss must be a tensor or a number")),
    Case("w-used-without-with", objs(Net, opt=True), _without_with, Err(RuntimeError, "with ampdoctor.watch("),
         trains=True),
    Case("w-model-no-params", objs(nn.ReLU), _no_params, ok(lambda r: r.ok and not r.findings, "no findings"),
         trains=True),
    Case("w-step-after-exit", objs(Net, opt=True), _after_exit, Err(RuntimeError, "with ampdoctor.watch("),
         trains=True),
]


# ----------------------------------------------------------------------------------- fix / headroom
def _overflow_report() -> Any:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].weight.mul_(1e5)
    return ampdoctor.diagnose(m, torch.randn(3, 4), precision="fp16", loss_fn=mean)


def _healthy_report() -> Any:
    return ampdoctor.diagnose(Net(), x(), precision="fp16", loss_fn=mean)


FIX = [
    Case("fix-report-None", objs(Net), lambda o, t: apply_fix(o["model"], None),
         Err(TypeError, "report must be an ampdoctor Report")),
    Case("fix-report-dict", objs(Net), lambda o, t: apply_fix(o["model"], {"findings": []}),
         Err(TypeError, "report must be an ampdoctor Report")),
    Case("fix-which-unknown", objs(Net, report=_overflow_report), lambda o, t: apply_fix(
        o["model"], o["report"], which="make_it_work"), Err(ValueError, "invalid fix 'make_it_work'")),
    Case("fix-ok-report", objs(Net, report=_healthy_report), lambda o, t: apply_fix(o["model"], o["report"]),
         Err(NoFixError, "no fix that can be applied automatically")),
    Case("fix-model-not-module", objs(Net, report=_overflow_report), lambda o, t: apply_fix("model", o["report"]),
         Err(TypeError, "model must be a torch.nn.Module")),
    Case("fix-inplace-str", objs(Net, report=_overflow_report), lambda o, t: apply_fix(
        o["model"], o["report"], inplace="yes"), Err(TypeError, "inplace must be a bool")),
    Case("fix-report-of-other-model", objs(Net, report=_overflow_report), lambda o, t: apply_fix(
        o["model"], o["report"], which="keep_fp32"), Err(ValueError, "that the model does not have")),
    Case("diagnose_and_fix-str-not-file", objs(), lambda o, t: diagnose_and_fix("no_such_scenario"),
         Err(ScenarioError, "is neither a file nor a built-in scenario")),
    Case("diagnose_and_fix-steps-0", objs(), lambda o, t: diagnose_and_fix(str(t / "good.py"), steps=0),
         Err(ValueError, "steps must be a positive int"), files={"good.py": "import torch\ntorch.randn(5)\n" + GOOD}),
    Case("diagnose_and_fix-model", objs(Net), lambda o, t: diagnose_and_fix(o["model"]),
         Err(TypeError, "scenario must be a StepSpec")),
    Case("headroom-not-module", objs(), lambda o, t: ampdoctor.headroom("bert", x()), Err(ScenarioError,
                                                                                       "pass the model object itself")),
    Case("headroom-wrong-shape", objs(Net), lambda o, t: ampdoctor.headroom(o["model"], rand(3, 5)),
         Err(ScenarioError, CHECK_TS)),
    Case("headroom-format-bad", objs(Net), lambda o, t: ampdoctor.headroom(o["model"], x()).predicted_failures("fp12"),
         Err(ValueError, "unknown format 'fp12'")),
    Case("headroom-no-grad-loss", objs(Net), lambda o, t: ampdoctor.headroom(
        o["model"], x(), loss_fn=lambda out, b: out.detach().mean()),
        ok(lambda h: h.rows and {r.phase for r in h.rows} == {"forward"} and not h.notes, "forward rows")),
    Case("headroom-nan-batch", objs(Net), lambda o, t: ampdoctor.headroom(
        o["model"], torch.tensor([[float("nan"), 1.0, 1.0, 1.0]] * 3), loss_fn=mean),
        ok(lambda h: any("NaN" in n for n in h.notes), "a note: the fp32 run is non-finite from its input")),
]

CASES = API + FILES + WATCH + FIX


def _param(c: Case) -> Any:
    return pytest.param(c, id=c.id, marks=list(c.marks))


def _write(case: Case, tmp: Path) -> None:
    for name, text in case.files.items():
        p = tmp / name
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text, encoding="utf-8")


def _digest(o: dict[str, Any]) -> dict[str, str]:
    model = o.get("model") if isinstance(o.get("model"), nn.Module) else None
    opt = o.get("optimizer") if isinstance(o.get("optimizer"), torch.optim.Optimizer) else None
    scaler = o.get("scaler") if isinstance(o.get("scaler"), torch.amp.GradScaler) else None
    if model is not None and any(p.is_meta for p in model.parameters()):
        return state_digest(None, None, scaler)  # meta tensors hold no data to hash
    return state_digest(model, opt, scaler)


def run_case(case: Case, tmp: Path) -> tuple[Any, BaseException | None]:
    _write(case, tmp)
    o = case.setup()
    before = _digest(o)
    result: Any = None
    err: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = case.call(o, tmp)
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt/SystemExit are verdicts too
        err = e
    if not case.trains:
        assert _digest(o) == before, f"{case.id} changed the caller's state"
    return result, err


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_audit_row(case: Case, tmp_path: Path) -> None:
    result, err = run_case(case, tmp_path)
    v = case.verdict
    if isinstance(v, Err):
        assert err is not None, f"{case.id}: expected {v.exc.__name__}, got a result {result!r}"
        assert isinstance(err, v.exc), f"{case.id}: {type(err).__name__}: {err}"
        assert v.fragment in str(err), f"{case.id}: {err}"
        if isinstance(err, ScenarioError):
            assert isinstance(err, ampdoctor.AmpDoctorError)
    elif isinstance(v, Propagates):
        assert isinstance(err, v.exc), f"{case.id}: {type(err).__name__ if err else None}: {err}"
    else:
        assert err is None, f"{case.id}: raised {type(err).__name__}: {err}"
        v.check(result)


def test_audit_counts() -> None:
    """Appendix A holds 117 Python-API inputs (the "(N)" rows expanded); every one is a row here."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(API) + len(FILES) + len(WATCH) + len(FIX) == len(CASES) >= 117 - 2  # see docs/bad-input.md


# ------------------------------------------------------------------------------------------- the docs
SECTION = "## The audit's bad inputs"
AROW = re.compile(r"^\|\s*`(?P<id>[A-Za-z0-9_.\-]+)`\s*\|(?P<input>[^|]*)\|\s*(?P<verdict>[^|]*?)\s*\|\s*(?P<says>.*?)"
                  r"\s*\|\s*$")


def _audit_rows() -> dict[str, tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/bad-input.md has no section {SECTION!r}"
    rows = {}
    for line in text.split(SECTION, 1)[1].splitlines():
        if line.startswith("## "):
            break
        m = AROW.match(line)
        if m:
            rows[m["id"]] = (m["verdict"], m["says"])
    return rows


def test_docs_list_every_audit_row() -> None:
    rows = _audit_rows()
    assert sorted(rows) == sorted(c.id for c in CASES)
    for c in CASES:
        verdict, says = rows[c.id]
        v = c.verdict
        if isinstance(v, Err):
            assert v.exc.__name__ in verdict, f"{c.id}: {verdict}"
            assert v.fragment in says.replace("\\|", "|"), f"{c.id}: the doc row must quote {v.fragment!r}: {says}"
        elif isinstance(v, Propagates):
            assert "propagates" in verdict and v.exc.__name__ in verdict, f"{c.id}: {verdict}"
        else:
            assert verdict.startswith("accepted"), f"{c.id}: {verdict}"


def test_max_steps_is_documented() -> None:
    assert f"at most {MAX_STEPS}" in DOC.read_text(encoding="utf-8")


