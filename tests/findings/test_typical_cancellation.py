"""A difference whose norm hides its cancellation: a few large elements keep its norm and |max| close to fp32
while the typical element is rounding noise.

Second family for round 7's fix (the first: ``draft-kl-distill-bf16`` in bench/_field_cases_r7.py): a
hand-written Hinton distillation loss ``T**2 * sum(p_t * (log p_t - log p_s))`` for an image classifier over 1000
classes in pure bf16, the student close to its (cached) teacher. The log-probabilities (~ -7, bf16 spacing
0.03) differ by ~0.02 in most classes, so their difference is noise there, and the KL comes out wrong; a few
classes where student and teacher disagree more keep the norm close. The healthy twin computes the loss in
float32 from the same bf16 logits.
"""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Linear(16, 1000)

    def forward(self, images: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def _kd_loss(fp32: bool, temperature: float = 4.0) -> object:
    def loss(logits: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        s, t = b["teacher_logits"], logits
        if fp32:
            s, t = s.float(), t.float()
        log_pt = torch.log_softmax(s / temperature, -1)
        log_ps = torch.log_softmax(t / temperature, -1)
        return (temperature ** 2 * (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()).float()

    return loss


def _spec(fp32: bool) -> dict[str, object]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    m = Student()
    images = torch.randn(8, 3, 16, 16, generator=g)
    with torch.no_grad():
        m.head.weight.normal_(0, 1.0, generator=g)
        teacher = m(images, images) + 0.05 * torch.randn(8, 1000, generator=g)
        teacher[:, :8] += 3.0  # a few classes where the student still disagrees
    return {"model": m, "batch": {"images": images, "teacher_logits": teacher}, "precision": "bf16",
            "loss_fn": _kd_loss(fp32)}


def test_the_typical_element_is_noise_an_error_at_the_difference() -> None:
    spec = _spec(fp32=False)
    report = ampdoctor.diagnose(**spec)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == ("precision-loss", "error", "", "aten.sub.Tensor",
                                                              "forward"), report.findings[:3]
    ev, u = f.evidence, 2.0 ** -8
    assert ev["element_own_error"] >= 0.5 and ev["output_deviation"] >= 0.05
    assert ev["operand_absmax"] * u >= ev["typical_result"]
    # the numbers: the fp32 differences of the log-probabilities, recomputed
    b = spec["batch"]
    with torch.no_grad():
        s = spec["model"](**b) / 4.0
        log_pt = torch.log_softmax(b["teacher_logits"] / 4.0, -1)
        d = log_pt - torch.log_softmax(s, -1)
    assert d.abs().median().item() < ev["operand_absmax"] * u < 2 * log_pt.abs().max().item() * u
    # the norm hides it: the largest differences do not cancel (|operand| * u is far below the |max| result)
    assert d.abs().max().item() > 16 * ev["operand_absmax"] * u


def test_the_loss_in_float32_is_clean() -> None:
    report = ampdoctor.diagnose(**_spec(fp32=True))
    assert not [f for f in report.findings if f.severity == "error"], report.findings[:3]
