"""A BatchNorm's running statistics and the noise-level updates of biases before it are not "blown-up updates".

At initialisation a running mean moves by momentum x a batch mean near 0: the fp32 reference's update is tiny and
the bf16 one differs by a large factor because the activations it averages do (the precision rules judge those).
The blown-up test of ``low-precision-params`` (16-bit update > 8x fp32's same write) is about parameter updates;
a buffer's ratio says nothing. Found by the zoo: MobileNetV2 and MobileViT in bf16 got errors at
``native_batch_norm`` after the blown-up rule landed. And a conv bias followed by a BatchNorm has a true gradient of
0: Adam moves it by ~lr * g / eps in fp32 (g ~1e-10, update ~7e-6) and by ~lr in bf16 (its g is rounding noise,
above eps) -- 100x fp32's own write, but no larger than a healthy step of the run. Blown up means beyond both; the
fp16-Adam blow-up the rule was built for (m / eps, 300-5700x a healthy step) is still found
(``test_adam_fp16_update_size``).
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    for _ in range(6):   # depthwise-separable blocks: 1x1 expand, BatchNorm, as MobileNetV2's
        layers += [nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU6(), nn.Conv2d(32, 16, 1), nn.BatchNorm2d(16)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def test_bf16_batchnorm_running_stats_are_not_blown_up_updates() -> None:
    model = _net()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(model, x, precision="bf16", steps=2,
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                loss_fn=lambda out, b: out.float().pow(2).mean())
    blown = [f for f in report.findings if f.code == "low-precision-params"
             and f.evidence.get("update_is") == "blown_up"]
    assert not blown, [(f.module, f.op, f.evidence.get("name")) for f in blown]
    assert not [f for f in report.findings if f.severity == "error" and f.op == "aten.native_batch_norm.default"]
