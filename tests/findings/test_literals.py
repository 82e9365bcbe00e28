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
    if not all_padding:  # -inf on a row that keeps keys: softmax gives fp32's probabilities; a latent hazard only
        assert report.ok and [(f.code, f.severity, f.module, f.op) for f in report.findings] == [
            ("constant-out-of-range", "warning", "attn", "aten.mul.Tensor")]
        assert report.findings[0].evidence["mechanism"] == "latent"
        return
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "error", "attn", "aten.mul.Tensor", "forward")
    assert f.evidence["constant"] == pytest.approx(float(torch.finfo(torch.float32).min))
    assert "masked-row-nan" in report.codes()  # the symptom comes after its cause


# ------------------------------------------------------------------ a literal whose damage raises much later (item 3)
class Ban(nn.Module):
    """Bans tokens by adding a large negative literal to their logits (``-1e9`` is -inf in fp16)."""

    def __init__(self, literal: float) -> None:
        super().__init__()
        self.literal = literal

    def forward(self, logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        return logits + banned.to(logits.dtype) * self.literal


class Temperature(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z - z.amax(-1, keepdim=True)) / 0.7  # -inf - -inf = NaN on a row with every token banned


class Sample(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(torch.softmax(z.float(), -1), 1)  # raises on NaN probabilities


class Generator(nn.Module):
    def __init__(self, literal: float) -> None:
        super().__init__()
        self.head = nn.Linear(16, 32)
        self.ban = Ban(literal)
        self.temp = Temperature()
        self.sample = Sample()

    def forward(self, x: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        return self.sample(self.temp(self.ban(self.head(x), banned)))


def _generate(literal: float, ban_a_whole_row: bool) -> ampdoctor.Report:
    torch.manual_seed(0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    banned = torch.zeros(4, 32, dtype=torch.bool)
    banned[:, :8] = True
    if ban_a_whole_row:
        banned[2] = True
    return ampdoctor.diagnose(Generator(literal), (x, banned), precision="fp16")


def test_literal_that_overflows_early_and_crashes_three_modules_later():
    report = _generate(-1e9, ban_a_whole_row=True)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "error", "ban", "aten.mul.Tensor", "forward")
    assert f.evidence["constant"] == -1e9
    exc = f.evidence["exception"]  # the crash, in the sampler, two modules downstream
    assert exc["op"] == "aten.multinomial.default" and exc["module"] == "sample" and exc["inputs"][0]["n_nan"] > 0
    assert "raised RuntimeError in aten.multinomial.default" in f.explanation
    assert "nan-from-inf" in report.codes()  # the symptom (inf - inf in temp) ranks after its cause


def test_literal_the_dtype_holds_is_clean_even_on_a_fully_banned_row():
    report = _generate(-1e4, ban_a_whole_row=True)  # fp16 holds -1e4: the banned row is uniform, as in fp32
    assert report.ok and not report.findings, [(f.code, f.module) for f in report.findings]


# ------------------------------------------------------------------ a literal that overflows with no symptom (item 4)
class Gate(nn.Module):
    """``sigmoid(r + (1 - keep) * -1e9)``: the masked gates are 0 whether the literal is -1e9 or -inf."""

    def __init__(self, literal: float) -> None:
        super().__init__()
        self.literal = literal
        self.receptance = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.receptance(x)
        keep = (torch.arange(8) % 4 != 0).to(r.dtype)  # the mask in the activations' dtype (fp16 under autocast)
        return torch.sigmoid(r + (1.0 - keep) * self.literal) * x.to(r.dtype)


class GateNet(nn.Module):
    def __init__(self, literal: float) -> None:
        super().__init__()
        self.gate = Gate(literal)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(x))


@pytest.mark.parametrize("precision", ["fp16", "fp16-amp"])
def test_literal_that_is_inf_in_fp16_without_symptom_is_a_latent_warning(precision):
    torch.manual_seed(0)
    report = ampdoctor.diagnose(GateNet(-1e9), _x(), precision=precision, loss_fn=_loss)
    assert report.ok  # the result is fp32's: a warning, not an error
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == (
        "constant-out-of-range", "warning", "gate", "aten.mul.Tensor", "forward")
    ev = f.evidence
    assert ev["constant"] == -1e9 and ev["constant_in_dtype"] == float("-inf") and ev["mechanism"] == "latent"
    assert ev["n_inf"] > 0 and ev["absorbed_by"]["op"] == "aten.sigmoid.default"
    assert "finfo(x.dtype).min" in f.fixes[0].snippet


@pytest.mark.parametrize("literal", [float(torch.finfo(torch.float16).min), float("-inf"), -1e4])
def test_finfo_min_and_deliberate_inf_masks_stay_clean(literal):
    torch.manual_seed(0)
    # in fp16 finfo(fp16).min fits; -inf is -inf in fp32 too (deliberate); -1e4 fits
    report = ampdoctor.diagnose(GateNet(literal), _x(), precision="fp16", loss_fn=_loss)
    assert "constant-out-of-range" not in report.codes(), [(f.code, f.module) for f in report.findings]
    assert report.ok


def test_dtype_own_min_in_amp_stays_clean():
    class OwnMin(Gate):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            r = self.receptance(x)
            keep = (torch.arange(8) % 4 != 0).to(r.dtype)
            return torch.sigmoid(r + (1.0 - keep) * torch.finfo(r.dtype).min) * x.to(r.dtype)

    torch.manual_seed(0)
    net = GateNet(0.0)
    net.gate = OwnMin(0.0)
    report = ampdoctor.diagnose(net, _x(), precision="fp16-amp", loss_fn=_loss)
    assert report.ok and "constant-out-of-range" not in report.codes(), report.codes()
