"""Registered buffers as origins (issue #13 item 2): damage already in a buffer's stored value after the model cast.

Each failing model stores a float32 buffer that ``model.half()`` (precision ``fp16``) damages -- a mask built with
``torch.finfo(torch.float32).min`` becomes -inf, integer positions beyond 2048 tie, a frozen norm's tiny variances
flush to 0 -- and the finding is at phase ``setup`` on the owning module, ranked before the downstream symptom.
Each has a healthy twin that must stay clean. The buffers have neutral names: rules decide by mechanism only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

F32_MIN = torch.finfo(torch.float32).min


class MaskedAttention(nn.Module):
    """Attention with an additive mask buffer; query 0 is a padding row (every key masked)."""

    def __init__(self, dtype_aware: bool, pad_row: bool = True, d: int = 16, t: int = 8) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.dtype_aware = dtype_aware
        allowed = torch.ones(t, t).tril()
        if pad_row:
            allowed[0] = 0
        self.register_buffer("keep", allowed)
        self.register_buffer("table_a", (1 - allowed) * F32_MIN)  # finfo(float32).min: -inf once stored in fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4
        if self.dtype_aware:
            scores = scores.masked_fill(self.keep == 0, torch.finfo(scores.dtype).min)
        else:
            scores = scores + self.table_a
        return scores.softmax(-1) @ x


class AttnModel(nn.Module):
    def __init__(self, dtype_aware: bool, pad_row: bool = True) -> None:
        super().__init__()
        self.attn = MaskedAttention(dtype_aware, pad_row)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x))


class Positions(nn.Module):
    """Learned position embeddings looked up from a float buffer of integer positions."""

    def __init__(self, n: int, rows: int) -> None:
        super().__init__()
        self.register_buffer("table_b", torch.arange(n, dtype=torch.float32))
        self.rows = nn.Embedding(rows, 16)

    def forward(self, t: int) -> torch.Tensor:
        return self.rows(self.table_b[-t:].long())


class PosModel(nn.Module):
    def __init__(self, n: int, rows: int) -> None:
        super().__init__()
        self.pos = Positions(n, rows)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos(x.shape[0]))


class FrozenNorm(nn.Module):
    """A frozen batch norm (statistics as buffers, eps 0 as in older detection code bases)."""

    def __init__(self, c: int, var: float) -> None:
        super().__init__()
        self.register_buffer("table_c", torch.full((c,), var))
        self.register_buffer("table_d", torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.table_c.rsqrt()
        return (x - self.table_d) * scale


class NormModel(nn.Module):
    def __init__(self, var: float) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = FrozenNorm(16, var)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():  # activations at the scale of the stored variance (a real, tiny-valued channel)
            self.lin.weight.mul_(var ** 0.5)
            self.lin.bias.mul_(var ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.lin(x)))


def _diagnose(model: nn.Module, x: torch.Tensor) -> ampdoctor.Report:
    return ampdoctor.diagnose(model, x, precision="fp16")


def _setup(f: ampdoctor.Finding, code: str, module: str, buffer: str) -> None:
    assert (f.code, f.module, f.op, f.phase) == (code, module, "", "setup"), f
    assert f.evidence["buffer"] == buffer
    assert f.evidence["dtype"] == "float16"
    assert any(fx.id == "keep_fp32_buffers" and fx.params["buffers"] == [buffer] for fx in f.fixes)


def test_mask_buffer_of_float32_min_is_inf_at_setup_and_outranks_the_masked_row() -> None:
    torch.manual_seed(0)
    rep = _diagnose(AttnModel(dtype_aware=False), torch.randn(2, 8, 16))
    f = rep.findings[0]
    _setup(f, "overflow", "attn", "attn.table_a")
    assert f.severity == "error"
    assert f.evidence["n_inf"] == 28 + 1  # the strict upper triangle plus the padding row's diagonal
    assert f.evidence["ref_absmax"] == pytest.approx(-F32_MIN)
    assert f.evidence["symptom"]["module"] == "attn"  # the NaN of the fully masked row is downstream
    assert any(g.code == "masked-row-nan" for g in rep.findings[1:])


def test_mask_buffer_without_a_fully_masked_row_is_a_warning() -> None:
    torch.manual_seed(0)
    rep = _diagnose(AttnModel(dtype_aware=False, pad_row=False), torch.randn(2, 8, 16))
    assert rep.ok
    f = rep.findings[0]
    _setup(f, "overflow", "attn", "attn.table_a")
    assert f.severity == "warning" and "symptom" not in f.evidence


def test_dtype_aware_mask_twin_is_clean() -> None:
    torch.manual_seed(0)
    rep = _diagnose(AttnModel(dtype_aware=True), torch.randn(2, 8, 16))
    assert rep.findings == ()


def test_integer_positions_beyond_2048_tie_in_fp16_and_crash_the_lookup() -> None:
    torch.manual_seed(0)  # 4099 rounds to 4100 in fp16: the lookup raises; the buffer explains the crash
    rep = _diagnose(PosModel(4100, 4100), torch.randn(8, 16))
    f = rep.findings[0]
    _setup(f, "must-stay-fp32", "pos", "pos.table_b")
    assert f.severity == "error"
    assert f.evidence["integers_exact_up_to"] == 2048
    positions = torch.arange(4100, dtype=torch.float32)
    assert f.evidence["damaged"] == int((positions.half().float() != positions).sum()) == 1027
    assert f.evidence["exception"]["type"] == "IndexError"


def test_integer_positions_beyond_2048_read_wrong_rows() -> None:
    torch.manual_seed(0)  # room for the rounded positions: no crash, but rows of other positions are read
    rep = _diagnose(PosModel(4100, 4104), torch.randn(8, 16))
    f = rep.findings[0]
    _setup(f, "must-stay-fp32", "pos", "pos.table_b")
    assert f.severity == "error"
    assert f.evidence["symptom"]["module"].startswith("pos")


def test_positions_within_fp16_exact_range_twin_is_clean() -> None:
    torch.manual_seed(0)
    rep = _diagnose(PosModel(2000, 2000), torch.randn(8, 16))
    assert rep.ok and not any(f.phase == "setup" for f in rep.findings)


def test_tiny_variance_buffer_flushes_to_zero_and_is_the_origin_of_the_division_blow_up() -> None:
    torch.manual_seed(0)
    rep = _diagnose(NormModel(1e-8), torch.randn(8, 16))
    f = rep.findings[0]
    _setup(f, "underflow", "norm", "norm.table_c")
    assert f.severity == "error"
    assert f.evidence["damaged"] == 16
    assert f.evidence["symptom"]["op"] == "aten.rsqrt.default"
    assert "negligible" not in f.evidence  # an element-wise reader: each flushed variance matters by itself


def test_variance_in_fp16_range_twin_is_clean() -> None:
    torch.manual_seed(0)
    rep = _diagnose(NormModel(1e-2), torch.randn(8, 16))
    assert rep.findings == ()


def test_autocast_keeps_buffers_float32_so_nothing_is_reported_at_setup() -> None:
    torch.manual_seed(0)
    rep = ampdoctor.diagnose(NormModel(1e-8), torch.randn(8, 16), precision="fp16-amp")
    assert not any(f.phase == "setup" for f in rep.findings)


class DFTMixing(nn.Module):
    """FNet's token mixing as TPUs run it: the real part of a DFT along the sequence as a matmul with a stored
    ``cos(2 pi j k / n)`` matrix, whose ``cos(pi / 2)``-type entries are ~1e-17 in float32 (0 in fp16); then a
    hand-written softmax without the max (``exp`` of logits up to ~15 overflows in fp16) when ``hot``."""

    def __init__(self, hot: bool, n: int = 16, d: int = 8) -> None:
        super().__init__()
        j = torch.arange(n, dtype=torch.float64)
        self.register_buffer("basis", torch.cos(2 * torch.pi * j[:, None] * j[None] / n).float())
        self.head = nn.Linear(d, 4)
        if hot:
            with torch.no_grad():
                self.head.bias.fill_(15.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.basis @ x / 4)
        e = logits.exp()
        return e / e.sum(-1, keepdim=True)


def test_negligible_flush_into_a_gemm_kernel_does_not_outrank_the_real_origin() -> None:
    torch.manual_seed(0)
    m = DFTMixing(hot=True)
    lost = (m.basis != 0) & (m.basis.half() == 0)
    assert lost.any() and m.basis[lost].abs().max() < 1e-13  # the residues fp16 flushes: far below u * |max| = 1
    rep = _diagnose(m, torch.randn(2, 16, 8))
    f = rep.findings[0]
    assert (f.code, f.op, f.severity) == ("overflow", "aten.exp.default", "error"), rep.findings
    setup = [g for g in rep.findings if g.phase == "setup"]
    assert len(setup) == 1 and setup[0].severity == "warning" and setup[0].evidence["negligible"] is True
    assert setup[0].evidence["largest_flushed"] == pytest.approx(float(m.basis[lost].abs().max()))
    assert "changes no result" in setup[0].explanation


def test_negligible_flush_twin_without_the_overflow_has_no_error() -> None:
    torch.manual_seed(0)
    rep = _diagnose(DFTMixing(hot=False), torch.randn(2, 16, 8))
    assert not [f for f in rep.findings if f.severity == "error"], rep.findings
