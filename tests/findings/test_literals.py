"""Literal constants that do not survive their dtype, whatever the symptom (issue 13 item 3).

* a clamp bound ``1 - eps`` that is exactly 1 in fp16/bf16 lets tanh's ±1 through to ``atanh`` (inf): the root
  cause is the literal at the clamp, not the overflow at atanh;
* an offset ``+ 1e-4`` that rounds away against values >= 1 in bf16 (a no-op) leaves exact zeros for ``log``;
* a no-op offset with no consequence is info (an eps guard rounds away by design until its values get small);
each with a twin whose literal survives the dtype and stays clean.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


def _loss(out, batch):  # noqa: ANN001, ANN202
    return out.float().pow(2).mean()


def _x() -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


class Squash(nn.Module):
    """tanh, then clamp off ±1 by ``eps`` before the inverse (a tanh-squashed policy's log-prob)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x)).clamp(-1 + self.eps, 1 - self.eps)
        return self.head(torch.atanh(y))


class Policy(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.sq = Squash(eps)
        with torch.no_grad():
            self.sq.fc.weight.mul_(8)  # pre-activations ~17: tanh is ±1 in fp16/bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sq(x)


@pytest.mark.parametrize("precision,eps", [("fp16", 1e-6), ("bf16", 1e-4), ("fp16-amp", 1e-6)])
def test_clamp_bound_rounded_onto_one_is_the_root_cause(precision, eps):
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Policy(eps), _x(), precision=precision, loss_fn=_loss)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "error", "sq", "aten.clamp.default", "forward")
    ev = f.evidence
    assert ev["constant"] == pytest.approx(-1 + eps) and ev["constant_in_dtype"] == -1.0
    assert ev["mechanism"] == "rounded" and ev["consequence"]["op"] == "aten.atanh.default"
    assert "finfo(x.dtype).eps" in f.fixes[0].snippet
    assert "overflow" in report.codes()  # the downstream symptom is still listed, after its cause


@pytest.mark.parametrize("precision,eps", [("fp16", 1e-2), ("bf16", 1e-2)])
def test_bound_that_survives_the_dtype_is_clean(precision, eps):
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Policy(eps), _x(), precision=precision, loss_fn=_loss)
    assert "constant-out-of-range" not in report.codes() and "overflow" not in report.codes()
    assert not [f for f in report.findings if f.severity == "error"]


class LogBarrier(nn.Module):
    """``log(h + eps - 1)`` for ``h = 1 + relu(.)``: the eps keeps the log off 0 where ``h`` is exactly 1."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 1.0 + torch.relu(self.fc(x))
        return torch.log(h + self.eps - 1.0)


class Barrier(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.barrier = LogBarrier(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.barrier(x)


def test_noop_offset_that_leaves_zeros_for_log():
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Barrier(1e-4), _x(), precision="bf16", loss_fn=_loss)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "error", "barrier", "aten.add.Tensor", "forward")
    ev = f.evidence
    assert ev["mechanism"] == "no-op" and ev["constant"] == 1e-4 and ev["constant_in_dtype"] != 0
    assert ev["absmax"] >= 1.0 and ev["consequence"]["op"] == "aten.log.default"


def test_offset_that_survives_bf16_is_clean():
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Barrier(1e-2), _x(), precision="bf16", loss_fn=_loss)
    assert "constant-out-of-range" not in report.codes()
    assert not [f for f in report.findings if f.severity == "error"]


class Shift(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.sigmoid(self.fc(x)) + 4.0 + self.offset)


@pytest.mark.parametrize("offset,noop", [(1e-4, True), (0.5, False)])
def test_noop_offset_without_consequence_is_info(offset, noop):
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Shift(offset), _x(), precision="bf16", loss_fn=_loss)
    lits = [f for f in report.findings if f.code == "constant-out-of-range"]
    if not noop:
        assert not lits
        return
    assert [(f.severity, f.module, f.op) for f in lits] == [("info", "", "aten.add.Tensor")]
    assert lits[0].evidence["constant"] == pytest.approx(1e-4)


class Attn(nn.Module):
    """An additive padding mask built from another dtype's limit: ``torch.finfo(torch.float32).min`` is -inf in fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2).to(self.q.weight.dtype)
        scores = scores + (1.0 - mask.to(scores.dtype))[:, None, :] * torch.finfo(torch.float32).min
        return self.o(torch.softmax(scores, -1) @ x.to(scores.dtype))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attn(x, mask)


@pytest.mark.parametrize("precision", ["fp16", "fp16-amp"])
@pytest.mark.parametrize("all_padding", [True, False])
def test_fp32_limit_as_fp16_mask_literal(precision, all_padding):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 4)
    mask[1] = 0.0 if all_padding else torch.tensor([0.0, 0.0, 1.0, 1.0])
    report = ampdoctor.diagnose(Encoder(), (x, mask), precision=precision, loss_fn=_loss)
    if not all_padding:  # -inf on a row that keeps keys: softmax gives fp32's probabilities, nothing to report
        assert not report.findings
        return
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "error", "attn", "aten.mul.Tensor", "forward")
    assert f.evidence["constant"] == pytest.approx(float(torch.finfo(torch.float32).min))
    assert "masked-row-nan" in report.codes()  # the symptom comes after its cause
