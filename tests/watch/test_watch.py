"""The always-on guard: no side effects, one host read per step, and the findings it derives from real loops."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.findings._types import Report
from ampdoctor.watch import AnomalyError, Watch, WatchOptions, watch

WATCH_LOGGER = "ampdoctor.watch"


class Net(nn.Module):
    """body -> relu -> head; ``extra`` is planted: it never takes part in the loss."""

    def __init__(self, extra: bool = False, gate: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 1)
        self.extra = nn.Linear(8, 8) if extra else None
        self.gate = nn.Linear(16, 32) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.gate is not None:
            h = h + 0.0 * self.gate(x)         # in the graph, but the gradient that reaches it is exactly zero
        return self.head(torch.relu(h))


def batches(n: int, seed: int = 1, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(8, 16, generator=g) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor], w: Watch | None = None,
          scaler: torch.amp.GradScaler | None = None, loss_mul: dict[int, float] | None = None) -> list[torch.Tensor]:
    losses = []
    for i, x in enumerate(xs):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = model(x).float().pow(2).mean() * (loss_mul or {}).get(i, 1.0)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if w is not None:
            w.step(loss)
        losses.append(loss.detach())
    return losses


def fresh(extra: bool = False, gate: bool = False, lr: float = 1e-2) -> tuple[Net, torch.optim.AdamW]:
    torch.manual_seed(0)
    m = Net(extra=extra, gate=gate)
    return m, torch.optim.AdamW(m.parameters(), lr=lr)


# ---------------------------------------------------------------------------------------------- side effects
@pytest.mark.parametrize("use_scaler", [False, True], ids=["fp32", "fp16-amp+GradScaler"])
def test_twenty_steps_bitwise_identical_with_and_without_watch(use_scaler: bool) -> None:
    xs = batches(20)
    m0, o0 = fresh(extra=True)
    s0 = torch.amp.GradScaler("cpu") if use_scaler else None
    l0 = train(m0, o0, xs, scaler=s0)
    m1, o1 = fresh(extra=True)
    s1 = torch.amp.GradScaler("cpu") if use_scaler else None
    with watch(m1, o1, s1) as w:
        l1 = train(m1, o1, xs, w, scaler=s1)
    assert torch.equal(torch.stack(l0), torch.stack(l1))
    for (n, a), (_, b) in zip(m0.state_dict().items(), m1.state_dict().items()):
        assert torch.equal(a, b), n
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        for k, v in o0.state[p0].items():
            assert torch.equal(v, o1.state[p1][k]), k
    if use_scaler:
        assert s0.get_scale() == s1.get_scale()
    assert w.report().summary["steps"] == 20


def hooks_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Entries in every hook dictionary of the model, its parameters and the optimizer, and global hooks."""
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_backward_hooks"):
            out[f"{name}.{attr}"] = len(getattr(mod, attr))
    for name, p in model.named_parameters():
        out[f"{name}.post_accumulate"] = len(p._post_accumulate_grad_hooks or {})
        out[f"{name}.backward"] = len(p._backward_hooks or {})
    out["opt.pre"], out["opt.post"] = len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
    out["global.forward_pre"] = len(module_mod._global_forward_pre_hooks)
    out["global.opt_pre"] = len(optimizer_mod._global_optimizer_pre_hooks)
    return out


def test_hooks_removed_on_exit_and_on_exception() -> None:
    m, opt = fresh()
    sc = torch.amp.GradScaler("cpu")
    before = hooks_of(m, opt)
    with watch(m, opt, sc) as w:
        assert m._forward_pre_hooks and opt._optimizer_step_pre_hooks and opt._optimizer_step_post_hooks
        assert m.body.weight._post_accumulate_grad_hooks
        train(m, opt, batches(1), w, scaler=sc)
    assert hooks_of(m, opt) == before
    with pytest.raises(KeyError, match="user error"):
        with watch(m, opt, sc):
            train(m, opt, batches(1), scaler=sc)
            raise KeyError("user error")
    assert hooks_of(m, opt) == before
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()


def test_one_host_read_per_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self):
        counts["tolist"] += 1
        return real_tolist(self)

    def item(self):
        counts["item"] += 1
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    xs = batches(7)
    for use_scaler in (False, True):
        m, opt = fresh()
        sc = torch.amp.GradScaler("cpu") if use_scaler else None
        counts.update(tolist=0, item=0)
        train(m, opt, xs, scaler=sc)
        plain = dict(counts)
        m, opt = fresh()
        sc = torch.amp.GradScaler("cpu") if use_scaler else None
        counts.update(tolist=0, item=0)
        with watch(m, opt, sc) as w:
            train(m, opt, xs, w, scaler=sc)
        watched = dict(counts)
        # one read per step; the loss given after step k travels with step k+1's read, the last one with the
        # single read at exit
        assert watched["tolist"] - plain["tolist"] == len(xs) + 1
        assert watched["item"] == plain["item"]         # GradScaler's own .item() per step is all there is


# ------------------------------------------------------------------------------------------------- coverage
def test_unused_module_is_named_with_its_parameters() -> None:
    m, opt = fresh(extra=True)
    with watch(m, opt) as w:
        train(m, opt, batches(5), w)
    r = w.report()
    assert r.codes() == ["unused-parameters"]
    f = r.findings[0]
    assert (f.module, f.phase, f.severity) == ("extra", "backward", "warning")
    assert f.evidence["parameters"] == ["extra.weight", "extra.bias"]
    assert f.evidence["steps_observed"] == 3
    assert r.ok


def test_zero_gradients_and_params_missing_from_optimizer() -> None:
    torch.manual_seed(0)
    m = Net(gate=True)
    opt = torch.optim.SGD([*m.body.parameters(), *m.gate.parameters()], lr=0.1)   # head left out
    with watch(m, opt, coverage_steps=2) as w:
        train(m, opt, batches(4), w)
    by = {(f.module, f.phase): f for f in w.report().findings}
    assert set(by) == {("gate", "backward"), ("head", "optimizer")}
    assert by[("gate", "backward")].evidence["parameters"] == ["gate.weight", "gate.bias"]
    assert by[("gate", "backward")].evidence["zero_gradients"] is True
    assert by[("head", "optimizer")].evidence["parameters"] == ["head.weight", "head.bias"]


def test_without_optimizer_each_root_forward_is_a_step() -> None:
    m, _ = fresh(extra=True)
    with watch(m, coverage_steps=2) as w:
        for x in batches(3):
            m(x).pow(2).mean().backward()
    r = w.report()
    assert r.summary["steps"] == 3
    assert [(f.code, f.module) for f in r.findings] == [("unused-parameters", "extra")]


def test_ddp_unused_pooler_is_an_error_and_survives_the_crash(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist

    if dist.is_initialized():  # a single-process group left by an earlier test (a shared case's make()): replace it
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32)
        model = nn.parallel.DistributedDataParallel(transformers.BertModel(cfg))
        ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
        with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
            with watch(model) as w:
                for _ in range(3):
                    model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    f = w.report().findings[0]
    assert (f.code, f.module, f.phase, f.severity) == ("unused-parameters", "module.pooler.dense", "backward", "error")
    assert f.evidence["parameters"] == ["module.pooler.dense.weight", "module.pooler.dense.bias"]


# ------------------------------------------------------------------------------------------ loss scaling
class GeluNewMLP(nn.Module):
    """GPT-2's MLP with gelu_new: under CPU fp16 autocast ``pow(x, 3)`` stays fp16; its backward (3x^2 * grad)
    overflows for pre-activations of O(200) and the gradients turn NaN on every step."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.activations import NewGELUActivation

        self.fc = nn.Linear(16, 64)
        self.act = NewGELUActivation()
        self.proj = nn.Linear(64, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc.weight.mul_(800.0)
            self.proj.weight.mul_(0.01)
            self.head.weight.mul_(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.act(self.fc(x))))


def collapse_run(steps: int = 10, **opts):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    m = GeluNewMLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    w0 = {k: v.clone() for k, v in m.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), 0.1 * torch.randn(8, 1, generator=g)
    w = watch(m, opt, sc, **opts)
    with w:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(m(x).float(), y)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    return w, m, w0, (x, y)


def test_loss_scale_collapse_is_seen_without_any_optimizer_step(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=WATCH_LOGGER):
        w, m, w0, _ = collapse_run(10)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in w0.items())        # GradScaler skipped every step
    r = w.report()
    assert r.codes() == ["loss-scale-collapse"]
    f = r.findings[0]
    assert (f.severity, f.phase, f.module, f.op) == ("error", "backward", "", "")
    assert f.evidence["scales"] == [2.0 ** (16 - k) for k in range(10)]
    assert f.evidence["scale_after"] == 64.0
    assert f.evidence["consecutive_skipped"] == 10 and f.evidence["ongoing"] is True
    assert r.summary["skipped_steps"] == 10 and r.summary["steps"] == 10
    assert r.precision == "fp16-amp"
    warned = [rec for rec in caplog.records if "consecutive optimizer steps" in rec.getMessage()]
    assert len(warned) == 1 and "(0..2)" in warned[0].getMessage()       # once, at the third skipped step


def test_raise_on_collapse_stops_at_the_next_forward() -> None:
    with pytest.raises(AnomalyError) as ei:
        collapse_run(10, on_anomaly="raise")
    assert ei.value.kind == "loss-scale-collapse" and ei.value.step == 2
    assert isinstance(ei.value, ampdoctor.AmpDoctorError)
    assert "bf16" in str(ei.value) and "replay" in str(ei.value)


def test_initial_scale_calibration_is_not_a_collapse() -> None:
    """A too-large initial scale makes GradScaler skip the first steps by design, then training proceeds."""
    m, opt = fresh()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with watch(m, opt, sc) as w:
        train(m, opt, batches(30), w, scaler=sc)
    r = w.report()
    k = r.summary["skipped_steps"]
    assert k >= 3                                               # the calibration really skipped several steps
    assert r.summary["loss_scales"][:k + 1] == [2.0 ** (40 - i) for i in range(k + 1)]
    assert "loss-scale-collapse" not in r.codes()


def test_collapse_mid_run_that_recovers_is_a_warning() -> None:
    m, opt = fresh()
    sc = torch.amp.GradScaler("cpu")
    xs = batches(12)
    for i in (5, 6, 7, 8):
        xs[i] = xs[i] * 1e5           # fp16 inputs overflow -> NaN grads -> skipped steps
    with watch(m, opt, sc, locate=False) as w:
        train(m, opt, xs, w, scaler=sc)
    r = w.report()
    assert r.codes() == ["overflow", "loss-scale-collapse"]       # the fp16 forward overflowed: the loss was NaN
    assert (r.findings[0].phase, r.findings[0].step) == ("forward", 5)
    f = r.findings[1]
    assert f.severity == "warning"
    assert (f.evidence["first_skipped_step"], f.evidence["consecutive_skipped"], f.evidence["ongoing"]) == (5, 4, False)
    assert f.evidence["scales"] == [65536.0, 32768.0, 16384.0, 8192.0]


# -------------------------------------------------------------------------------------- non-finite steps
def inf_at(step: int, n: int = 6) -> list[torch.Tensor]:
    xs = batches(n)
    xs[step][0, 0] = float("inf")
    return xs


def test_raise_before_the_weights_are_written() -> None:
    m, opt = fresh()
    xs = inf_at(3)
    with pytest.raises(AnomalyError) as ei:
        with watch(m, opt, on_anomaly="raise"):
            for x in xs:
                before = {k: v.clone() for k, v in m.state_dict().items()}
                opt.zero_grad()
                m(x).pow(2).mean().backward()
                opt.step()
    assert ei.value.kind == "nonfinite-grads" and ei.value.step == 3
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert "body.weight" in str(ei.value) and "replay" in str(ei.value)


def test_skip_leaves_parameters_and_adam_state_untouched() -> None:
    m, opt = fresh()
    xs = inf_at(3)
    with watch(m, opt, on_anomaly="skip") as w:
        for i, x in enumerate(xs):
            before = {k: v.clone() for k, v in m.state_dict().items()}
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
            if i == 3:
                assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert float(opt.state[m.body.weight]["step"]) == len(xs) - 1
    r = w.report()
    assert r.summary["steps_skipped_by_watch"] == 1
    f = r.findings[0]                     # located by the in-process replay of step 3 (the default)
    assert (f.code, f.phase, f.module, f.step) == ("nonfinite-input", "forward", "", 3)   # the batch itself, at the
    # run's step 3 (the replay's own step 0)
    assert r.summary["anomalies"][0]["kind"] == "nonfinite-grads"
    assert "nearest the origin first: head, body" in r.summary["anomalies"][0]["message"]


def test_skip_without_locate_names_the_parameters() -> None:
    m, opt = fresh()
    xs = inf_at(3)
    with watch(m, opt, on_anomaly="skip", locate=False) as w:
        train(m, opt, xs, w)
    f = next(f for f in w.report().findings if f.phase == "backward")
    assert (f.code, f.phase, f.module, f.step) == ("overflow", "backward", "", 3)
    assert f.evidence["parameters"] == ["body.weight", "body.bias", "head.weight", "head.bias"]


def test_warn_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    m, opt = fresh()
    xs = batches(8)
    xs[2][0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger=WATCH_LOGGER):
        with watch(m, opt) as w:
            train(m, opt, xs, w)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("non-finite gradients" in s for s in msgs) == 1
    assert sum("the loss is nan" in s for s in msgs) == 1
    kinds = [(a["kind"], a["step"]) for a in w.report().summary["anomalies"]]
    # step 2 wrote NaN into the weights (warn does not intervene): every later step is non-finite too
    assert kinds == [(k, s) for s in range(2, 8) for k in ("nonfinite-grads", "nonfinite-loss")]


def test_nonfinite_loss_with_finite_gradients() -> None:
    m, opt = fresh()
    with watch(m, opt) as w:
        for i, x in enumerate(batches(4)):
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            w.step(loss + (math.inf if i == 1 else 0.0))      # before optimizer.step(): read with that step
            opt.step()
    r = w.report()
    assert [(f.code, f.phase, f.step) for f in r.findings] == [("overflow", "forward", 1)]
    assert r.findings[0].evidence["loss"] == math.inf


def test_gradient_norm_spike() -> None:
    m, opt = fresh(lr=1e-4)
    with watch(m, opt) as w:
        train(m, opt, batches(14), w, loss_mul={11: 1e4})
    spikes = w.report().summary["grad_spikes"]
    assert [s["step"] for s in spikes] == [11]
    assert spikes[0]["grad_norm"] > 10 * spikes[0]["median"]


def test_closure_optimizer_is_checked_before_the_update() -> None:
    m, _ = fresh()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs = inf_at(2, 4)
    with pytest.raises(AnomalyError, match="non-finite gradients at step 2"):
        with watch(m, opt, on_anomaly="raise"):
            for x in xs:
                before = {k: v.clone() for k, v in m.state_dict().items()}

                def closure(x=x):
                    opt.zero_grad()
                    loss = m(x).pow(2).mean()
                    loss.backward()
                    return loss

                opt.step(closure)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


# --------------------------------------------------------------------------------- low-precision params
def test_bf16_parameters_without_master_copy_lose_their_updates() -> None:
    torch.manual_seed(0)

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(64)

        def forward(self, x):
            return self.norm(x.to(self.norm.weight.dtype))

    m = Norm().to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with watch(m, opt) as w:
        for _ in range(5):
            opt.zero_grad()
            (m(x).float() - 0.5).pow(2).mean().backward()
            opt.step()
    r = w.report()
    assert r.codes() == ["low-precision-params"]
    f = r.findings[0]
    assert (f.module, f.phase, f.severity) == ("norm", "optimizer", "error")
    # LayerNorm gains sit at 1.0 (bf16 ulp 2**-7); AdamW moves them by ~1e-3 < half an ulp: all lost. Biases at 0
    # move normally, so they are not named.
    assert f.evidence["parameters"] == ["norm.weight"]
    assert f.evidence["lost_updates"] == f.evidence["updates"] == 3 * 64
    assert r.precision == "bf16"


# ------------------------------------------------------------------------------------------- robustness
def test_internal_error_disables_the_failing_detector_with_one_warning(monkeypatch, caplog) -> None:
    from ampdoctor.watch import _detectors

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(_detectors, "is_spike", broken)
    xs = batches(6)
    m0, o0 = fresh()
    l0 = train(m0, o0, xs)
    m1, o1 = fresh()
    with caplog.at_level(logging.WARNING, logger=WATCH_LOGGER):
        with watch(m1, o1) as w:
            l1 = train(m1, o1, xs, w)
    assert torch.equal(torch.stack(l0), torch.stack(l1))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'spikes' detector failed" in warnings[0].getMessage()
    assert w.disabled is None             # only the failing part is off: the other checks go on
    assert w.report().summary["detectors_off"] == ["spikes"] and w.report().summary["steps"] == 6


def test_boundary_errors_name_the_allowed_values() -> None:
    m, opt = fresh()
    with pytest.raises(ValueError, match="'warn', 'raise', 'skip', 'replay'"):
        watch(m, opt, on_anomaly="explode")
    with pytest.raises(ValueError, match="grad_spike_factor must be > 1"):
        watch(m, opt, grad_spike_factor=1.0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        watch(None, opt)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="pass the optimizer built over"):
        watch(m, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="GradScaler"):
        watch(m, opt, scaler=object())
    assert WatchOptions(on_anomaly="skip").on_anomaly == "skip"
    w = watch(m, opt)
    with w:
        pass
    with pytest.raises(RuntimeError, match="already entered"), w:
        pass


def test_report_is_json_ready_and_round_trips() -> None:
    w, *_ = collapse_run(5)
    r = w.report()
    doc = json.loads(json.dumps(r.to_dict()))
    back = Report.from_dict(doc)
    assert back.codes() == r.codes() == ["loss-scale-collapse"]
    assert doc["summary"]["loss_scales"] == [65536.0, 32768.0, 16384.0, 8192.0, 4096.0]


def test_tensorboard_scalars(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m, opt = fresh()
    with watch(m, opt, tensorboard=tmp_path) as w:
        losses = train(m, opt, batches(4), w)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert {"ampdoctor/loss", "ampdoctor/grad_norm"} <= set(acc.Tags()["scalars"])
    got = [(e.step, e.value) for e in acc.Scalars("ampdoctor/loss")]
    assert got == [(i, pytest.approx(float(v))) for i, v in enumerate(losses)]


def test_ampdoctor_watch_is_the_function_and_its_module_the_namespace() -> None:
    import importlib

    # ``ampdoctor.watch`` the attribute is the function (it shadows the subpackage, so ``import ampdoctor.watch as
    # aw`` would bind the function too); the module stays reachable as an import path
    aw = importlib.import_module("ampdoctor.watch")
    assert ampdoctor.watch is aw.watch

    assert {"watch", "Watch", "WatchOptions", "load_reproducer", "replay", "AnomalyError"} <= set(aw.__all__)
    assert issubclass(aw.AnomalyError, ampdoctor.AmpDoctorError)
    m, opt = fresh()
    with ampdoctor.watch(m, opt, coverage_steps=1) as w:
        assert isinstance(w, Watch)
        train(m, opt, batches(2), w)
        with torch.no_grad():
            m(batches(1)[0])                   # an evaluation forward between steps is not a step
    assert w.report().summary["steps"] == 2
    assert ampdoctor.replay is aw.replay and ampdoctor.load_reproducer is aw.load_reproducer


# ------------------------------------------------------------------------------------------- loss-scale health
def _scaled_run(skips: set[int], n: int) -> Report:
    m, opt = fresh()
    sc = torch.amp.GradScaler("cpu")
    with watch(m, opt, sc, locate=False) as w:
        train(m, opt, batches(n), w, scaler=sc, loss_mul={i: math.inf for i in skips})
    return w.report()


def test_chronic_collapse_without_a_long_run_is_an_error_at_the_end() -> None:
    skips = {i for i in range(24) if i % 3 != 2}          # skip, skip, apply: never 3 in a row
    r = _scaled_run(skips, 24)
    f = next(f for f in r.findings if f.code == "loss-scale-collapse")
    assert f.severity == "error" and not r.ok
    assert (f.evidence["skipped_steps"], f.evidence["steps"], f.evidence["longest_skip_run"]) == (16, 24, 2)
    assert f.evidence["chronic"] and f.evidence["scale_trajectory"][0] == [0, 65536.0]
    assert r.summary["skipped_steps"] == 16


def test_early_long_collapse_that_recovers_late_is_still_an_error() -> None:
    # the newcomer review's run: steps 0-21 and 23-28 skipped, 28 of 30, scale 65536 -> ~2e-4
    r = _scaled_run(set(range(22)) | set(range(23, 29)), 30)
    f = r.findings[0]
    assert (f.code, f.severity) == ("loss-scale-collapse", "error")
    assert f.evidence["skipped_steps"] == 28 and f.evidence["longest_skip_run"] == 22
    assert f.evidence["scale_final"] < 1e-3
    assert f.evidence["calibration_skips"] == 22 and f.evidence["skip_rate_after_calibration"] == 0.75


def test_initial_calibration_is_healthy() -> None:
    r = _scaled_run({0, 1, 2, 3}, 16)                     # GradScaler finding its scale: normal
    assert "loss-scale-collapse" not in r.codes() and r.summary["skipped_steps"] == 4


def test_nan_in_fp32_too_is_not_a_precision_problem() -> None:
    """An fp32 run whose forward overflows fp32 itself: the default replay says nonfinite-reference at the op."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        m[0].weight.fill_(3e38)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with watch(m, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(3, 4).abs() + 1).pow(2).mean().backward()
            opt.step()
    r = w.report()
    f = r.findings[0]
    assert (f.code, f.severity, f.module, f.op, f.phase) == ("nonfinite-reference", "error", "0", "aten.addmm.default",
                                                           "forward")
    assert "overflow" not in r.codes()          # the watch's generic hint gives way to the located answer
