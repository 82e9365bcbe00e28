"""``check`` in two tiers (:mod:`ampdoctor.precision.triage`): each mechanism the full diagnosis judges sends a model
that has it to the full diagnosis, which then finds the cause; the healthy twin takes the quick pass only, and the
full diagnosis of that twin agrees that it is ok."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import nn

from ampdoctor.diagnose import headroom_and_check
from ampdoctor.precision import make_spec
from ampdoctor.precision.triage import QUICK, spec_reasons


class Net(nn.Module):
    """8 -> 16 -> 4; ``kind`` adds one mechanism between the layers (``healthy``: none)."""

    def __init__(self, kind: str = "healthy") -> None:
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        if kind == "unused":
            self.extra = nn.Linear(4, 4)  # never called: no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.kind == "log":  # 1e-10 is 0 in fp16: log(relu(h) + 0) = -inf
            return torch.log(torch.relu(h) + 1e-10).mean()
        if self.kind == "cancel":  # h + 1000 in fp16 has a spacing of 0.5: the loss moves by far more than 1%
            h = (h + 1000.0) - 1000.0
        elif self.kind == "put":  # a float32 buffer written from autocast's fp16 output: index_put_ raises
            out = torch.zeros(h.shape[0], 16)
            sel = torch.ones(h.shape[0], dtype=torch.bool)
            out[sel] = h[sel]
            h = out
        elif self.kind == "mask":  # a float32-min sentinel: -inf once autocast's fp16 scores hold it
            h = torch.softmax(h.masked_fill(torch.arange(16) > 12, torch.finfo(torch.float32).min), -1)
        elif self.kind == "pos":  # positions beyond 2048 cast to float: fp16 rounds them together
            pos = torch.arange(3000, 3000 + h.shape[0]).float().unsqueeze(-1)
            h = h + torch.sin(nn.functional.linear(pos, torch.full((16, 1), 0.01)))
        elif self.kind == "cumsum":  # integers computed from a float mask: 3001.. in float32
            h = h + (torch.ones(h.shape[0], 16).cumsum(-1) + 3000.0) * 1e-3
        elif self.kind == "absorbed":  # log(0) = -inf in float32 and in the target alike, absorbed by a where
            lg = torch.log(torch.arange(16).float())
            h = h + torch.where(torch.isinf(lg), 0.0, lg) * 0.01
        elif self.kind == "tanh":  # |z| in (5, 6): below 1 in float32, exactly 1 in fp16: no gradient reaches up
            h = torch.tanh(5.0 + torch.sigmoid(h))
        return self.down(h)


def _spec(kind: str = "healthy", precision: str = "fp16-amp", scale: float = 1.0, **kw: Any) -> Any:
    torch.manual_seed(0)
    model = Net(kind)
    with torch.no_grad():
        model.up.weight.mul_(scale)
    x = torch.randn(8, 8)
    return make_spec(model, x, loss_fn=lambda o, b: o if o.dim() == 0 else o.pow(2).mean(),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), precision=precision, **kw)


def _codes(report: Any) -> list[tuple[str, str]]:
    return [(f.code, str(f.severity.value if hasattr(f.severity, "value") else f.severity)) for f in report.findings]


@pytest.mark.parametrize(("kind", "precision"), [("healthy", p) for p in QUICK] + [("absorbed", "fp16-amp")])
def test_healthy_model_takes_the_quick_pass_and_the_full_diagnosis_agrees(kind: str, precision: str) -> None:
    """``absorbed``: an inf in the float32 forward that a ``where`` absorbs (T5's position buckets) is no reason by
    itself; the guard step finds the same -inf at the same op of the target and passes."""
    spec = _spec(kind, precision=precision)
    before = [p.detach().clone() for p in spec.model.parameters()]
    quick = headroom_and_check(spec)
    assert not quick.triage.full and quick.report is None and quick.ok, quick.triage
    assert quick.triage.guard["ops"] > 0 and quick.triage.guard["loss"] is not None
    assert all(torch.equal(a, b) for a, b in zip(before, spec.model.parameters()))  # copies only
    full = headroom_and_check(spec, full=True)
    assert full.triage.full and full.report is not None and full.report.ok, _codes(full.report)
    assert full.headroom.to_dict() == quick.headroom.to_dict()


def test_the_quick_pass_runs_no_full_target_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Healthy: one full-tier run (``ampdoctor headroom``'s fp32 run) and the guard step; no full-tier target run."""
    mod = importlib.import_module("ampdoctor.diagnose")
    calls: list[bool] = []
    real = mod.run

    def counting(s: Any, *, reference: bool, **kw: Any) -> Any:
        calls.append(reference)
        return real(s, reference=reference, **kw)

    monkeypatch.setattr(mod, "run", counting)
    assert headroom_and_check(_spec()).report is None
    assert calls == [True]
    calls.clear()
    res = headroom_and_check(_spec(scale=40000.0))  # flagged by the fp32 pass: the full diagnosis follows
    assert calls == [True, False, True] and res.report is not None  # the diagnosis runs its target first
    calls.clear()
    res = headroom_and_check(_spec(), full=True)  # flagged before anything runs: one fp32 run for both
    assert calls == [True, False] and res.report is not None


@pytest.mark.parametrize(("kind", "scale", "reason", "code", "module"), [
    ("healthy", 40000.0, "of fp16's max", "overflow", "down"),        # range within one bit of the format max
    ("log", 1.0, "the constant 1e-10 is 0 in fp16", "constant-out-of-range", ""),
    ("mask", 1.0, "fp16-amp step", "constant-out-of-range", ""),     # the guard step: fp32's min is -inf in fp16
    ("unused", 1.0, "get no gradient", "unused-parameters", "extra"),
    ("cancel", 1.0, "off float32's", "precision-loss", ""),            # the guard step: the loss moved
    ("tanh", 1.0, "all-zero or no gradient in the target", "saturation", ""),  # the guard step: dead gradients
])
def test_each_mechanism_runs_the_full_diagnosis_which_finds_the_cause(kind: str, scale: float, reason: str,
                                                                       code: str, module: str) -> None:
    res = headroom_and_check(_spec(kind, scale=scale))
    assert res.triage.full and any(reason in r for r in res.triage.reasons), res.triage.reasons
    assert res.report is not None
    assert any(f.code == code and f.module == module for f in res.report.findings), _codes(res.report)


def test_flush_in_backward_runs_the_full_diagnosis() -> None:
    """fp16-amp without a scaler: a loss scaled by 2**-24 (fp16's smallest subnormal: no constant that is 0) makes
    gradients that flush to 0 in the backward ops the target runs in fp16: the parameters get all-zero gradients (the
    underflow rule's error), which the guard step compares."""
    torch.manual_seed(0)
    model = Net()
    spec = make_spec(model, torch.randn(8, 8), loss_fn=lambda o, b: o.pow(2).mean() * 2.0 ** -24,
                     optimizer=torch.optim.AdamW(model.parameters()), precision="fp16-amp")
    res = headroom_and_check(spec)
    assert any("all-zero or no gradient in the target" in r for r in res.triage.reasons), res.triage.reasons
    assert res.report is not None and any(f.code == "underflow" for f in res.report.findings), _codes(res.report)


@pytest.mark.parametrize(("kind", "reason"), [
    ("pos", "the largest integer fp16 holds exactly"),
    ("cumsum", "the largest integer fp16 holds exactly"),
])
def test_conservative_mechanisms_run_the_full_diagnosis(kind: str, reason: str) -> None:
    """Integers beyond the format's exact range: the range pass cannot rule out that they reach a low-precision op,
    so the full diagnosis runs even where it then finds no error."""
    res = headroom_and_check(_spec(kind))
    assert any(reason in r for r in res.triage.reasons), res.triage.reasons
    assert res.report is not None


def test_a_target_only_crash_is_left_to_the_full_diagnosis() -> None:
    """The fp32 pass is clean; the fp16-amp step raises (a dtype mismatch under autocast): the guard step sees it
    and the full diagnosis judges the crash exactly as ``diagnose`` does."""
    from ampdoctor.diagnose import diagnose_spec

    res = headroom_and_check(_spec("put"))
    assert any("raised RuntimeError: Index put requires" in r for r in res.triage.reasons), res.triage.reasons
    assert res.report is not None and not res.report.ok
    assert _codes(res.report) == _codes(diagnose_spec(_spec("put")))


@pytest.mark.parametrize(("change", "reason"), [
    ({"precision": "fp16"}, "judged by its full run only"),
    ({"precision": "bf16"}, "judged by its full run only"),
    ({"steps": 2}, "2 steps"),
    ({"scaler": torch.amp.GradScaler("cpu")}, "GradScaler"),
])
def test_spec_features_the_quick_pass_cannot_stand_for(change: dict[str, Any], reason: str) -> None:
    from dataclasses import replace

    spec = replace(_spec(), **change)
    assert any(reason in r for r in spec_reasons(spec))


def test_sixteen_bit_state_and_declared_fp32_modules_are_spec_reasons() -> None:
    spec = _spec()
    spec.optimizer.param_groups[0]["params"] = spec.optimizer.param_groups[0]["params"][:2]
    assert any("not in the optimizer (down.weight" in r for r in spec_reasons(spec))
    spec = _spec()
    spec.model.down.half()
    assert any("float16 state" in r for r in spec_reasons(spec))
    spec = _spec()
    spec.model._keep_in_fp32_modules = ["down"]  # type: ignore[assignment]
    assert any("keep in float32 for fp16-amp (down)" in r for r in spec_reasons(spec))
    spec = _spec(precision="bf16-amp")
    spec.model._keep_in_fp32_modules = ["down"]  # type: ignore[assignment]
    assert spec_reasons(spec) == []  # the plain list guards fp16's range only
    spec = _spec(precision="bf16-amp")
    spec.model._keep_in_fp32_modules_strict = ["down"]  # type: ignore[assignment]
    assert any("keep in float32 for bf16-amp" in r for r in spec_reasons(spec))
    assert spec_reasons(_spec()) == []


def test_check_cli_says_which_tier_ran(tmp_path: Any) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    src = ("import torch\nfrom torch import nn\n\ndef make():\n    torch.manual_seed(0)\n"
           "    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))\n"
           "    with torch.no_grad():\n        m[0].weight.mul_(SCALE)\n"
           "    return {'model': m, 'batch': torch.randn(4, 8), 'loss_fn': lambda o, b: o.pow(2).mean(),\n"
           "            'precision': 'fp16-amp'}\n")
    for scale, code, text in ((1.0, 0, "quick check"), (40000.0, 1, "full diagnosis ran")):
        f = tmp_path / f"m{int(scale)}.py"
        f.write_text(src.replace("SCALE", str(scale)))
        res = CliRunner().invoke(main, ["check", str(f)], env={"NO_COLOR": "1", "COLUMNS": "200"})
        assert res.exit_code == code and text in res.output, res.output
    res = CliRunner().invoke(main, ["check", str(tmp_path / "m1.py"), "--full"], env={"NO_COLOR": "1"})
    assert res.exit_code == 0 and "full diagnosis ran: the full diagnosis was asked for" in res.output, res.output


class _Head(nn.Module):
    """Logits of |max| ~30 into a log_softmax: from a GEMM without a bias (an LM head: bf16's rounding there is
    relative to each logit, so it scales with the differences the softmax reads), or around a common offset 60 that
    a GEMM's bias adds (its rounding is absolute, the same for every logit)."""

    def __init__(self, offset: bool) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.head = nn.Linear(16, 64, bias=offset)
        with torch.no_grad():
            if offset:
                self.head.bias.fill_(60.0)
            else:
                self.head.weight.mul_(30.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(torch.relu(self.up(x))), -1)


def _head_spec(offset: bool) -> Any:
    torch.manual_seed(0)
    model = _Head(offset)
    return make_spec(model, torch.randn(8, 8), loss_fn=lambda o, b: -o[:, 0].mean(),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16-amp")


def test_large_logits_of_a_product_take_the_quick_pass_and_an_offset_does_not() -> None:
    """The rounded-argument reason needs a value the target held in bf16 that could be the precision-loss rule's
    rounding site: for a softmax one that adds an offset. An LM head's bias-free GEMM at |max| 31 does not (the full
    diagnosis agrees: no finding); a GEMM adding a bias of 60 does."""
    lm = _head_spec(offset=False)
    quick = headroom_and_check(lm)
    assert not quick.triage.full and quick.report is None, quick.triage.reasons
    full = headroom_and_check(_head_spec(offset=False), full=True)
    assert full.report is not None and not [f for f in full.report.findings if f.severity == "error"]
    flagged = headroom_and_check(_head_spec(offset=True))
    assert flagged.triage.full
    assert any("reads the absolute error of an argument of |max| 61" in r for r in flagged.triage.reasons), \
        flagged.triage.reasons
