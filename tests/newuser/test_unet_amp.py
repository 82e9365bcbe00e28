"""An unseen family in fp16-amp training: a diffusers ``UNet2DModel`` whose mid-block conv outputs 7.2e4 (fp32).

As in Stable Diffusion's VAE in fp16: one conv's output passes 65504, and the GroupNorm after it (fp32 under
CUDA autocast) turns the inf into NaN. Checked through the CLI (a scenario file) and the Python API; the truth (the
conv's fp32 |max|) is computed here, and the healthy twin (the same UNet, unscaled) must be clean.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from diffusers import UNet2DModel

import ampdoctor
from ampdoctor.cli import main

SCENARIO = '''
import torch
from tests.newuser.test_unet_amp import make_case

def make():
    return make_case(bad={bad})
'''


def _unet(bad: bool) -> UNet2DModel:
    torch.manual_seed(0)
    m = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                    norm_num_groups=8, attention_head_dim=8)
    if bad:
        with torch.no_grad():
            m.mid_block.resnets[0].conv2.weight.mul_(4e4)
    return m


def make_case(bad: bool) -> dict:
    model = _unet(bad)
    g = torch.Generator().manual_seed(1)
    x, noise = torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 3, 16, 16, generator=g)

    def loss_fn(out, batch):  # noqa: ANN001, ANN202 - a diffusion loss on the predicted noise
        return torch.nn.functional.mse_loss(out.sample.float(), noise)

    return {"model": model, "batch": {"sample": x, "timestep": torch.tensor([10, 500])}, "loss_fn": loss_fn,
            "precision": "fp16-amp", "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
            "scaler": torch.amp.GradScaler("cpu")}


def test_truth_the_mid_block_conv_passes_fp16_max() -> None:
    case = make_case(True)
    seen: list[float] = []
    case["model"].mid_block.resnets[0].conv2.register_forward_hook(lambda m, a, o: seen.append(float(o.abs().max())))
    with torch.no_grad():
        case["model"](**case["batch"])
    assert seen[0] > 65504 > seen[0] / 1.2


def test_python_api_names_the_conv_and_the_group_norm_nan() -> None:
    report = ampdoctor.diagnose(**make_case(True))
    got = [(f.code, f.module, f.op, f.phase) for f in report.findings[:2]]
    assert got == [("overflow", "mid_block.resnets.0.conv2", "aten.convolution.default", "forward"),
                   ("nan-from-inf", "mid_block.attentions.0.group_norm", "aten.native_group_norm.default",
                    "forward")]
    assert ampdoctor.diagnose(**make_case(False)).ok


def test_cli_scenario_file_exits_1_on_the_failing_unet_and_0_on_its_twin(tmp_path: Path) -> None:
    runner = CliRunner()
    for bad, code in ((True, 1), (False, 0)):
        path = tmp_path / f"unet_{bad}.py"
        path.write_text(SCENARIO.format(bad=bad))
        out = tmp_path / f"unet_{bad}.json"
        res = runner.invoke(main, ["diagnose", str(path), "--json", str(out)])
        assert res.exit_code == code, res.output
        findings = json.loads(out.read_text())["findings"]
        if bad:
            assert (findings[0]["code"], findings[0]["module"]) == ("overflow", "mid_block.resnets.0.conv2")
        else:
            assert not [f for f in findings if f["severity"] == "error"]
