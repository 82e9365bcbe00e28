"""Lost updates at any write into module state (EMA, running statistics, manual SGD, gradient accumulation, a
decaying learning rate), step by step; updates that read gradients still multiplied by the loss scale; ops of
the training-step code outside every module attributed to ``""`` with their source line. Each with a healthy
twin that must stay clean."""

from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict

import torch
from torch import nn

import ampdoctor
from ampdoctor.precision._runner import run
from ampdoctor.precision._spec import make_spec


def _line(fn, text: str) -> str:  # noqa: ANN001
    """``file:line`` of the line of ``fn``'s source holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    n = next(i for i, s in enumerate(lines) if text in s)
    return f"{inspect.getsourcefile(fn).rsplit('/', 1)[-1]}:{start + n}"


def _mlp() -> nn.Sequential:
    return nn.Sequential(OrderedDict(fc=nn.Linear(16, 16), act=nn.Tanh(), head=nn.Linear(16, 1)))


# -- EMA / teacher model ------------------------------------------------------------------------------------------
class EmaPair(nn.Module):
    """A student trained by the optimizer and a frozen teacher that follows it by an exponential moving average."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = _mlp()
        self.teacher = _mlp()
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def ema_step(m, batch, optimizer):  # noqa: ANN001, ANN201
    optimizer.zero_grad()
    loss = m(batch).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for pe, p in zip(m.teacher.parameters(), m.student.parameters()):
            pe.mul_(0.999).add_(p, alpha=0.001)
    return loss


def _diagnose_ema(precision: str) -> ampdoctor.Report:
    m = EmaPair()
    return ampdoctor.diagnose(m, torch.randn(8, 16), precision=precision, train_step=ema_step,
                              optimizer=torch.optim.SGD(m.student.parameters(), lr=0.1))


def test_bf16_ema_update_is_lost_at_the_write() -> None:
    report = _diagnose_ema("bf16")
    f = report.findings[0]
    assert (f.code, f.phase) == ("low-precision-params", "optimizer") and f.module.startswith("teacher.")
    assert f.op in ("aten.mul_.Tensor", "aten.add_.Tensor")
    ev = f.evidence
    assert ev["parameter"].startswith(f.module + ".") and ev["dtype"] == "bfloat16" and ev["step"] == 0
    # 0.001 * w is below half an ulp of every bf16 w (2**-9 relative at least): the elements keep their value
    assert ev["fraction_lost"] > 0.95 and ev["fraction_lost_fp32"] == 0.0 and ev["applied_ratio"] < 0.05
    assert ev["op_module"] == "" and ev["owner"] == f.module  # loop code; the owner is the written tensor's
    assert ev["source"] == _line(ema_step, "pe.mul_(0.999)")
    assert {x.module for x in report.findings if x.code == "low-precision-params"} == {"teacher.fc", "teacher.head"}


def test_ema_with_fp32_master_weights_is_healthy() -> None:
    report = _diagnose_ema("bf16-amp")
    assert report.ok and "low-precision-params" not in report.codes(), report.codes()


def test_ema_into_fp32_shadow_is_healthy() -> None:
    """A bf16 run whose teacher is kept in fp32 (the shadow): the same writes land."""
    def fp32_teacher(model, opt, scaler):  # noqa: ANN001, ANN202
        model.teacher.float()

    m = EmaPair()
    spec = dataclasses.replace(make_spec(m, torch.randn(8, 16), precision="bf16", train_step=ema_step,
                                         optimizer=torch.optim.SGD(m.student.parameters(), lr=0.1)),
                               transforms=(fp32_teacher,))
    res = run(spec, reference=False)
    teacher = [w for w in res.trace.writes if w.owner.startswith("teacher")]
    assert len(teacher) == 8 and all(w.dtype == "float32" and w.fraction_lost == 0.0 for w in teacher)
    assert all(w.stats["changed"] == w.stats["numel"] for w in teacher)


# -- a running-statistic buffer -----------------------------------------------------------------------------------
class RunningNorm(nn.Module):
    """Normalises by a running mean/variance kept in buffers, updated with momentum 1e-3 (BatchNorm-like)."""

    def __init__(self, n: int, momentum: float = 1e-3) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.full((n,), 2.0))
        self.register_buffer("var", torch.full((n,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0).to(self.mean.dtype), self.momentum)
                self.var.mul_(1 - self.momentum).add_(x.var(0).to(self.var.dtype), alpha=self.momentum)
        return (x - self.mean) / (self.var + 1e-5).sqrt()


def _stats_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(proj=nn.Linear(16, 16), norm=RunningNorm(16), head=nn.Linear(16, 1)))


def test_running_stat_buffer_update_is_lost_in_bf16() -> None:
    model = _stats_model()
    report = ampdoctor.diagnose(model, torch.randn(32, 16), precision="bf16",
                                loss_fn=lambda o, b: o.float().pow(2).mean(),
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    f = report.findings[0]
    assert (f.code, f.module, f.phase) == ("low-precision-params", "norm", "forward")
    assert f.op in ("aten.lerp_.Scalar", "aten.mul_.Tensor", "aten.add_.Tensor")
    buf = f.evidence["buffer"]
    assert buf in ("norm.mean", "norm.var") and f.evidence["written"] == "buffer"
    assert f.evidence["fraction_lost"] > 0.9 and f.evidence["op_module"] == "norm"
    assert f.fixes[0].id == "keep_fp32_buffers" and f.fixes[0].params == {"buffers": [buf]}
    assert not [x for x in report.findings if x.module in ("proj", "head")]  # SGD at lr 0.1 moves them


def test_batchnorm_running_stats_lost_in_bf16() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(16, 16), bn=nn.BatchNorm1d(16, momentum=1e-3),
                                      head=nn.Linear(16, 1)))
    with torch.no_grad():
        model.bn.running_var.fill_(4.0)  # bf16 ulp at 4 is 2**-5: momentum 1e-3 moves it by ~3e-3
    report = ampdoctor.diagnose(model, torch.randn(32, 16), precision="bf16",
                                loss_fn=lambda o, b: o.float().pow(2).mean(), steps=1)
    f = next(f for f in report.findings if f.code == "low-precision-params")
    assert (f.module, f.phase) == ("bn", "forward") and "batch_norm" in f.op
    assert f.evidence["buffer"] == "bn.running_var" and f.evidence["fraction_lost"] > 0.9


def test_running_stat_buffer_in_fp32_is_healthy() -> None:
    model = _stats_model()
    report = ampdoctor.diagnose(model, torch.randn(32, 16), precision="bf16-amp",
                                loss_fn=lambda o, b: o.float().pow(2).mean(),
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert report.ok and "low-precision-params" not in report.codes(), report.codes()


# -- manual SGD from the training step ----------------------------------------------------------------------------
def manual_sgd(m, batch):  # noqa: ANN001, ANN201
    loss = m(batch).float().pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p.data.add_(p.grad, alpha=-1e-3)
            p.grad = None
    return loss


def _big_weights() -> nn.Module:
    torch.manual_seed(0)
    m = _mlp()
    with torch.no_grad():
        m.fc.weight.mul_(40.0)  # trained-size weights (|w| ~ 4): lr * grad is far below half an ulp
    return m


def test_manual_sgd_in_bf16_loses_the_update() -> None:
    report = ampdoctor.diagnose(_big_weights(), torch.randn(8, 16), precision="bf16", train_step=manual_sgd)
    f = report.findings[0]
    assert (f.code, f.module, f.op, f.phase) == ("low-precision-params", "fc", "aten.add_.Tensor", "optimizer")
    assert f.evidence["parameter"] in ("fc.weight", "fc.bias") and f.evidence["fraction_lost"] > 0.9
    assert f.evidence["source"] == _line(manual_sgd, "p.data.add_")


def test_manual_sgd_in_fp32_is_healthy() -> None:
    report = ampdoctor.diagnose(_big_weights(), torch.randn(8, 16), precision="bf16-amp", train_step=manual_sgd)
    assert report.ok and "low-precision-params" not in report.codes(), report.codes()


# -- multi-step: a decaying learning rate, gradient accumulation ----------------------------------------------------
def decaying_lr(m, batch, optimizer):  # noqa: ANN001, ANN201
    for g in optimizer.param_groups:
        g["lr"] *= 0.1          # 1e-1, 1e-2, 1e-3, 1e-4: the updates fall below half an ulp on the way
    optimizer.zero_grad()
    loss = m(batch).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def _diagnose_decay(precision: str) -> ampdoctor.Report:
    torch.manual_seed(0)
    m = _mlp()
    return ampdoctor.diagnose(m, torch.randn(8, 16), precision=precision, train_step=decaying_lr, steps=4,
                              optimizer=torch.optim.SGD(m.parameters(), lr=1.0))


def test_updates_vanish_only_after_the_lr_decays() -> None:
    f = _diagnose_decay("bf16").findings[0]
    assert (f.code, f.module, f.phase) == ("low-precision-params", "fc", "optimizer")
    assert f.op.startswith("aten.add_") and f.evidence["parameter"] in ("fc.weight", "fc.bias")
    # step 0 (lr 0.1) keeps 84% of its updates; step 1 (lr 0.01) loses 84%: found there, not at the first step
    assert f.evidence["step"] == 1 and f.step == 1 and f.evidence["fraction_lost"] > 0.8


def test_decaying_lr_with_fp32_master_weights_is_healthy() -> None:
    report = _diagnose_decay("bf16-amp")
    assert report.ok and "low-precision-params" not in report.codes(), report.codes()


def accumulate(m, batch, optimizer):  # noqa: ANN001, ANN201
    optimizer.zero_grad()
    total = None
    for k in range(8):                       # 8 micro-batches; the first one carries a large loss
        loss = m(batch[k::8]).float().pow(2).mean() * (1.0 if k == 0 else 1e-3)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    optimizer.step()
    return total


def _diagnose_accumulation(precision: str) -> ampdoctor.Report:
    torch.manual_seed(0)
    m = _mlp()
    return ampdoctor.diagnose(m, torch.randn(64, 16), precision=precision, train_step=accumulate, steps=2,
                              optimizer=torch.optim.SGD(m.parameters(), lr=1e-2))


def test_gradient_accumulation_in_bf16_loses_micro_batches() -> None:
    report = _diagnose_accumulation("bf16")
    f = next(f for f in report.findings if f.code == "low-precision-params")
    assert (f.phase, f.evidence["written"]) == ("backward", "grad") and f.op.startswith("aten.add")
    assert f.module in ("fc", "head") and f.evidence["step"] == 0 and f.evidence["write"] >= 0
    assert f.evidence["fraction_lost"] > 0.5


def test_gradient_accumulation_in_fp32_is_healthy() -> None:
    report = _diagnose_accumulation("bf16-amp")
    assert report.ok and "low-precision-params" not in report.codes(), report.codes()


# -- updates on gradients still multiplied by the loss scale ---------------------------------------------------------
def no_scaler_step(m, batch, optimizer, scaler):  # noqa: ANN001, ANN201
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(batch).float().pow(2).mean()
    scaler.scale(loss).backward()
    optimizer.step()                      # wrong: scaler.step(optimizer) would unscale first
    return loss


def manual_before_unscale(m, batch, optimizer, scaler):  # noqa: ANN001, ANN201
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(batch).float().pow(2).mean()
    scaler.scale(loss).backward()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(p.grad, alpha=-1e-3)   # wrong: .grad is still multiplied by the scale
            p.grad = None
    return loss


def logged_norm(m, batch, optimizer, scaler):  # noqa: ANN001, ANN201
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(batch).float().pow(2).mean()
    scaler.scale(loss).backward()
    norm = torch.stack([p.grad.norm() for p in m.parameters()]).norm()  # for a log line, still scaled: harmless
    scaler.step(optimizer)
    scaler.update()
    return loss + 0 * norm.detach()


def _diagnose_scaled(step) -> ampdoctor.Report:  # noqa: ANN001
    torch.manual_seed(0)
    m = _mlp()
    return ampdoctor.diagnose(m, torch.randn(8, 16), precision="fp16-amp", train_step=step,
                              optimizer=torch.optim.SGD(m.parameters(), lr=1e-3),
                              scaler=torch.amp.GradScaler("cpu"))


def test_optimizer_step_on_scaled_gradients_is_misuse() -> None:
    report = _diagnose_scaled(no_scaler_step)
    f = report.findings[0]
    assert (f.code, f.severity, f.module, f.phase) == ("loss-scaling-misuse", "error", "", "optimizer")
    assert f.op.startswith("aten.") and f.evidence["step"] == 0 and f.evidence["loss_scale"] == 65536.0
    assert 32768 <= f.evidence["ratio"] <= 131072   # target gradients = 65536 x the fp32 (unscaled) ones


def test_manual_update_before_unscale_is_misuse() -> None:
    report = _diagnose_scaled(manual_before_unscale)
    f = next(f for f in report.findings if f.code == "loss-scaling-misuse")
    assert (f.module, f.op, f.phase) == ("fc", "aten.add_.Tensor", "optimizer")
    assert f.evidence["parameter"] == "fc.weight" and f.evidence["op_module"] == ""
    assert f.evidence["source"] == _line(manual_before_unscale, "p.add_(p.grad")
    assert 32768 <= f.evidence["ratio"] <= 131072


def test_gradient_norm_for_logging_is_not_misuse() -> None:
    report = _diagnose_scaled(logged_norm)
    assert "loss-scaling-misuse" not in report.codes() and report.ok, report.codes()


# -- attribution of the training-step code outside every module --------------------------------------------------
def masked_loss(m, batch, optimizer):  # noqa: ANN001, ANN201
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = m(batch)
        big = logits.masked_fill(logits < 0, -1e9)   # the literal is -inf in fp16, outside every module
        loss = big.float().clamp(min=-10).mean()
    loss.backward()
    optimizer.step()
    return loss


def test_loop_code_literal_is_attributed_to_no_module_with_its_line() -> None:
    torch.manual_seed(0)
    m = _mlp()
    report = ampdoctor.diagnose(m, torch.randn(8, 16), precision="fp16-amp", train_step=masked_loss,
                                optimizer=torch.optim.SGD(m.parameters(), lr=1e-3), policy="native")
    f = report.findings[0]
    assert (f.code, f.module, f.phase) == ("constant-out-of-range", "", "forward"), report.codes()
    assert f.op == "aten.masked_fill.Scalar" and f.evidence["source"].endswith(_line(masked_loss, "-1e9"))


def test_loop_code_write_to_a_parameter_is_attributed_to_no_module() -> None:
    m = EmaPair()
    spec = make_spec(m, torch.randn(8, 16), precision="bf16", train_step=ema_step,
                     optimizer=torch.optim.SGD(m.student.parameters(), lr=0.1))
    res = run(spec, reference=False)
    w = next(w for w in res.trace.writes if w.owner == "teacher.fc")
    rec = res.trace.records[w.index]
    assert rec.op == "aten.mul_.Tensor" and rec.module == "" and rec.phase == "optimizer"
    assert rec.src is not None and rec.src[1] == int(_line(ema_step, "pe.mul_").split(":")[1])
    # the optimizer's own writes stay with the module owning the parameter
    opt_write = next(w for w in res.trace.writes if w.owner == "student.fc")
    assert res.trace.records[opt_write.index].module == "student.fc"
