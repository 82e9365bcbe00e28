"""Crashes explained, not re-raised (issue 13 item 4): when the target run raises in an op that validates its
input, the root cause is the numerics origin that fed it, with the exception in evidence; each failing model has
a healthy twin that must run clean. ``DiagnosisError`` only when the trace holds no numerics explanation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.errors import DiagnosisError
from ampdoctor.precision import ScenarioError


class Scores(nn.Module):
    """Unnormalised probabilities ``exp(z) / sum(exp(z))`` written by hand (no max subtraction)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = torch.exp(z)
        return e / e.sum(-1, keepdim=True)


class Sampler(nn.Module):
    """proj -> scores -> torch.multinomial: fp16's exp overflows at logits above ~11, inf/inf = NaN probs."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.scores = Scores()
        with torch.no_grad():
            self.proj.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.scores(self.proj(x))
        return torch.multinomial(p.float(), 1)


def _sampler(scale: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Sampler(scale), torch.randn(4, 16)


def test_multinomial_on_overflowed_logits_names_the_exp() -> None:
    model, x = _sampler(20.0)  # logits up to ~36: exp(36) = 4e15 in fp32, inf in fp16
    ref_logits = model.proj(x)
    assert ref_logits.abs().max() > 11.1 and torch.exp(ref_logits).isfinite().all()
    r = ampdoctor.diagnose(model, x, precision="fp16")
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("overflow", "scores", "aten.exp.default", "forward")
    exc = f.evidence["exception"]
    assert exc["type"] == "RuntimeError" and "probability tensor" in exc["message"]
    assert exc["op"] == "aten.multinomial.default" and exc["step"] == 0
    assert exc["inputs"] and exc["inputs"][0]["n_nan"] > 0  # the NaN probabilities it was given
    assert "raised RuntimeError in aten.multinomial.default" in f.explanation


def test_multinomial_healthy_twin_is_clean() -> None:
    model, x = _sampler(1.0)  # logits |max| ~ 3: exp fits fp16
    r = ampdoctor.diagnose(model, x, precision="fp16")
    assert r.ok and not [f for f in r.findings if f.severity == "error"], r.findings
    assert "exception" not in r.summary


class Gate(nn.Module):
    """A hand-written sigmoid ``e / (1 + e)``: inf/inf = NaN once exp overflows."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        with torch.no_grad():
            self.lin.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.lin(x))
        return e / (1 + e)


def _bce(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy(out.float(), torch.ones_like(out, dtype=torch.float32))


@pytest.mark.parametrize("scale,bad", [(40.0, True), (1.0, False)])
def test_binary_cross_entropy_of_nan_names_the_overflow(scale: float, bad: bool) -> None:
    torch.manual_seed(1)
    model, x = Gate(scale), torch.randn(16, 8)
    r = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=_bce)
    if not bad:
        assert r.ok and "exception" not in r.summary, r.findings
        return
    assert model.lin(x).abs().max() > 12  # exp of it overflows fp16
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("overflow", "", "aten.exp.default", "forward"), f
    assert f.evidence["exception"]["op"].startswith("aten.binary_cross_entropy")


class Bucketer(nn.Module):
    """``idx = (sigmoid(h) * n).long()`` into an n-row table: fp32 keeps sigmoid(9.5) = 0.99993 < 1, fp16 rounds
    it to 1.0 and the index to n, out of range."""

    def __init__(self, offset: float, n: int = 16) -> None:
        super().__init__()
        self.n = n
        self.score = nn.Linear(4, 1)
        self.table = nn.Embedding(n, 8)
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.score(x))
        return self.table((p * self.n).long().squeeze(-1))


@pytest.mark.parametrize("offset,bad", [(9.5, True), (2.0, False)])
def test_index_rounded_out_of_range_names_the_rounding_op(offset: float, bad: bool) -> None:
    torch.manual_seed(2)
    model, x = Bucketer(offset), torch.randn(4, 4)
    r = ampdoctor.diagnose(model, x, precision="fp16")
    if not bad:
        assert r.ok and "exception" not in r.summary, r.findings
        return
    p32 = torch.sigmoid(torch.tensor(offset))
    assert p32 < 1 and p32.half() == 1  # the rounding the finding must name
    f = r.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == ("precision-loss", "error", "", "aten.sigmoid.default",
                                                             "forward"), f
    assert f.evidence["absmax"] == 1.0 and f.evidence["ref_absmax"] < 1.0
    assert f.evidence["exception"]["type"] in ("IndexError", "RuntimeError")
    assert f.evidence["exception"]["op"].startswith("aten.embedding")


def test_deberta_masked_fill_constant_under_autocast() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DebertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.DebertaForMaskedLM(cfg)
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    r = ampdoctor.diagnose(model, batch, precision="bf16-amp")
    f = r.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("constant-out-of-range", "deberta.encoder.layer.0.attention.self",
                                                 "aten.masked_fill.Scalar", "forward")
    assert f.evidence["constants"][0] < -torch.finfo(torch.bfloat16).max  # float32's min, past bf16's max
    assert "without overflow" in f.evidence["exception"]["message"]
    healthy = ampdoctor.diagnose(model, batch, precision="bf16")  # the same model cast to bf16: finfo(bf16).min
    assert healthy.ok and "exception" not in healthy.summary, healthy.findings


class Fp16Only(nn.Module):
    """Raises for fp16 inputs with no numerics behind it (a dtype check in user code)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.dtype == torch.float16:
            raise TypeError("this kernel has no float16 path")
        return y


def test_crash_without_numerics_is_a_diagnosis_error() -> None:
    with pytest.raises(DiagnosisError, match="no numerics cause") as info:
        ampdoctor.diagnose(Fp16Only(), torch.randn(2, 4), precision="fp16")
    assert "TypeError" in str(info.value) and "no float16 path" in str(info.value)


def test_reference_crash_is_a_clear_error() -> None:
    model, x = _sampler(400.0)  # exp overflows even in fp32: the fp32 run raises too
    with pytest.raises(ScenarioError, match="float32"):
        ampdoctor.diagnose(model, x, precision="fp16")
