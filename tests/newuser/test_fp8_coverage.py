"""A new user runs ``precision="fp8"`` on a model whose GEMMs do not all go through ``F.linear``: transformers'
GPT-2 (``Conv1D``: an ``addmm`` with the weight as ``(in, out)``) and a ViT block built on ``nn.MultiheadAttention``
(its packed q/k/v and output projections run inside one torch function the fp8 block cannot see into).

The emulation quantises ``F.linear`` / ``nn.Linear`` calls only (as Transformer Engine and torchao convert
``nn.Linear`` modules); a clean fp8 report of such a model would say nothing about those layers. The run summary
lists every forward GEMM that multiplies by a weight parameter outside ``F.linear`` (``fp8_unquantised``: module,
op, weight) and a warning is logged; a model of plain ``nn.Linear`` layers lists none.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ampdoctor

transformers = pytest.importorskip("transformers")


class VitBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def _loss(out, batch):  # noqa: ANN001, ANN202
    return (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()


def _unquantised(model: nn.Module, batch) -> tuple[list[dict], set[str]]:  # noqa: ANN001
    report = ampdoctor.diagnose(model, batch, precision="fp8", loss_fn=_loss)
    return report.summary["fp8_unquantised"], {t["module"] for t in report.summary["fp8"]}


def test_gpt2_conv1d_layers_are_listed_as_not_quantised(caplog):
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        gemms, quantised = _unquantised(transformers.GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 64, (1, 8))})
    blocks = {f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert {(g["module"], g["op"]) for g in gemms} == {(m, "aten.addmm.default") for m in blocks}
    assert {g["weight"] for g in gemms} == {f"{m}.weight" for m in blocks}
    assert quantised == {"lm_head"} and not quantised & blocks       # only the head went through F.linear
    assert "transformer.h.0.attn.c_attn" in caplog.text and "F.linear" in caplog.text


def test_multihead_attention_projections_are_listed_and_the_mlp_is_quantised():
    torch.manual_seed(0)
    gemms, quantised = _unquantised(VitBlock(), torch.randn(2, 8, 32))
    assert {(g["module"], g["weight"]) for g in gemms} == {("attn", "attn.in_proj_weight"),
                                                           ("attn", "attn.out_proj.weight")}
    assert quantised == {"fc1", "fc2"}


def test_plain_linear_layers_leave_nothing_unquantised():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    gemms, quantised = _unquantised(model, torch.randn(4, 8))
    assert gemms == [] and quantised == {"0", "2"}
