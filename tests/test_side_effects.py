"""``diagnose`` and ``trace`` leave the caller's world exactly as found.

``diagnose`` works on copies: parameters, buffers, grads, ``requires_grad``, train flags, hooks, optimizer and
scaler state and the global RNG state hash the same before and after, also when the step raises. ``trace``
observes in place: results are bitwise those of an untraced run (AdamW step included), and no hook or mode
survives the ``with`` block, also when it exits by an exception.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import ampdoctor

MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class Net(nn.Module):
    """Dropout (consumes RNG), BatchNorm (buffers change in forward), a frozen parameter, a nested module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.body = nn.Sequential(OrderedDict(fc=nn.Linear(16, 16), act=nn.GELU()))
        self.head = nn.Linear(16, 1)
        self.head.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.drop(self.bn(self.fc1(x)))))


def mean_loss(out, batch):  # noqa: ANN001, ANN201
    return out.float().pow(2).mean()


@pytest.fixture
def setup():  # noqa: ANN201
    """A model mid-training: optimizer state from one step, grads present, a user hook, a used GradScaler."""
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(6, 8)
    scaler.scale(mean_loss(model(x), x)).backward()
    scaler.step(opt)
    scaler.update()
    mean_loss(model(x), x).backward()  # leave grads in place
    seen: list[int] = []
    model.body.register_forward_hook(lambda m, i, o: seen.append(1))
    return model, opt, scaler, x


@pytest.mark.parametrize("precision", [None, "fp16", "bf16"])
def test_diagnose_leaves_everything_as_found(setup, digest, precision):
    model, opt, scaler, x = setup
    before = digest(model, opt, scaler)
    try:
        report = ampdoctor.diagnose(model, x, precision=precision, loss_fn=mean_loss, optimizer=opt, scaler=scaler,
                                    steps=2)
    except ampdoctor.AmpDoctorError:
        # whether the low-precision step of this setup can run is tested elsewhere; here: nothing changed
        assert precision is not None
    else:
        assert report.summary["steps"] == 2
    assert digest(model, opt, scaler) == before


def test_diagnose_leaves_everything_when_the_loss_raises(setup, digest):
    model, opt, scaler, x = setup
    before = digest(model, opt, scaler)

    def broken_loss(out, batch):  # noqa: ANN001, ANN202
        raise ValueError("loss exploded in user code")

    with pytest.raises(ampdoctor.AmpDoctorError, match="loss exploded in user code"):
        ampdoctor.diagnose(model, x, precision="fp16", loss_fn=broken_loss, optimizer=opt, scaler=scaler)
    assert digest(model, opt, scaler) == before


def test_diagnose_leaves_everything_when_train_step_raises_after_updating(setup, digest):
    """The step changes the (copied) weights, optimizer and scaler, then raises: the originals stay."""
    model, opt, scaler, x = setup
    before = digest(model, opt, scaler)

    def train_step(model, batch, optimizer, scaler):  # noqa: ANN001, ANN202
        optimizer.zero_grad()
        scaler.scale(mean_loss(model(batch), batch)).backward()
        scaler.step(optimizer)
        scaler.update()
        raise RuntimeError("crash after the update")

    try:
        ampdoctor.diagnose(model, x, precision="fp16", train_step=train_step, optimizer=opt, scaler=scaler)
    except ampdoctor.AmpDoctorError:
        pass  # a crash no rule explains may be reported as an error; the state must be untouched either way
    assert digest(model, opt, scaler) == before


def test_diagnose_leaves_everything_on_bad_input(setup, digest):
    model, opt, scaler, x = setup
    before = digest(model, opt, scaler)
    with pytest.raises(ampdoctor.precision.ScenarioError):
        ampdoctor.diagnose(model, x, precision="fp16", loss_fn=lambda o, b: o, optimizer=opt)  # not a scalar
    assert digest(model, opt, scaler) == before


# --------------------------------------------------------------------------------------------------- trace
def _train(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    outs = []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        mean_loss(out, x).backward()
        opt.step()
        outs.append(out.detach().clone())
    return outs


def _bitwise(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_trace_changes_no_result_bit(full, dtype):
    torch.manual_seed(0)
    plain = Net().to(dtype).train()
    traced = copy.deepcopy(plain)
    xs = [torch.randn(6, 8, dtype=dtype) for _ in range(2)]
    opt_p = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    opt_t = torch.optim.AdamW([p for p in traced.parameters() if p.requires_grad], lr=1e-2, foreach=False)

    torch.manual_seed(1)
    out_p = _train(plain, opt_p, xs)
    rng_p = torch.get_rng_state()
    torch.manual_seed(1)
    with ampdoctor.trace(traced, opt_t, full=full) as t:
        out_t = _train(traced, opt_t, xs)
    assert len(t.result().records) > 100
    assert torch.equal(torch.get_rng_state(), rng_p)  # the trace consumed no random numbers
    assert all(_bitwise(a, b) for a, b in zip(out_p, out_t))
    for (n, a), b in zip(plain.named_parameters(), traced.parameters()):
        assert _bitwise(a, b), n
        assert _bitwise(a.grad, b.grad), n
    for (n, a), b in zip(plain.named_buffers(), traced.buffers()):
        assert _bitwise(a, b), n
    sp, st = opt_p.state_dict()["state"], opt_t.state_dict()["state"]
    assert sp.keys() == st.keys()
    for k in sp:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert _bitwise(sp[k][name], st[k][name]), (k, name)


def _leftovers(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    out = {"dispatch_modes": torch._C._len_torch_dispatch_stack()}
    for name, mod in model.named_modules():
        for attr in MODULE_HOOK_DICTS:
            if getattr(mod, attr):
                out[f"{name}.{attr}"] = len(getattr(mod, attr))
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if getattr(opt, attr):
            out[attr] = len(getattr(opt, attr))
    return {k: v for k, v in out.items() if v}


def test_trace_installs_hooks_and_removes_them_on_exit():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _leftovers(model, opt) == {}
    with ampdoctor.trace(model, opt, full=True):
        inside = _leftovers(model, opt)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert inside["dispatch_modes"] == 1 and "body.fc._forward_hooks" in inside  # sanity: it was installed
    assert _leftovers(model, opt) == {}


@pytest.mark.parametrize("where", ["in-forward", "in-backward", "in-block"])
def test_trace_removes_everything_after_an_exception(where):
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.armed = where == "in-forward"

        def forward(self, x):  # noqa: ANN001, ANN202
            h = self.fc(x)
            if self.armed:
                raise RuntimeError("boom")
            return h

    model = nn.Sequential(OrderedDict(inner=Boom(), head=nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def bad_grad(g):  # noqa: ANN001, ANN202
        raise RuntimeError("boom")

    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with ampdoctor.trace(model, opt, full=True):
            out = model(x)
            if where == "in-backward":
                out.register_hook(bad_grad)
                out.sum().backward()
            raise RuntimeError("boom")
    assert _leftovers(model, opt) == {}
    # and the model still works untraced, with no stale module stack
    model.inner.armed = False
    assert model(x).shape == (2, 1)


def test_diagnose_file_leaves_the_rng_state(tmp_path, digest):
    """A scenario's make() seeds and draws random numbers (every model init does); the caller's RNG state is
    restored all the same, as ``diagnose`` promises."""
    path = tmp_path / "seeded.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n"
        "    torch.manual_seed(1234)\n"
        "    return {'model': nn.Linear(4, 2), 'batch': torch.randn(3, 4), 'precision': 'fp16',\n"
        "            'loss_fn': lambda o, b: o.float().mean()}\n",
        encoding="utf-8")
    torch.manual_seed(7)
    torch.rand(3)  # an arbitrary position in the stream
    before = digest()
    report = ampdoctor.diagnose_file(str(path))
    assert report.ok
    assert digest() == before


class _CallLog(TorchFunctionMode):
    """Logs the name of every torch-level call it sees (a stand-in for the CUDA-policy emulation, a fix's scope)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls.append(getattr(func, "__qualname__", None) or str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("full", [False, True])
def test_trace_adds_no_call_to_a_torch_function_mode(full):
    """A torch-function mode on the stack for the whole step (as the emulation's step-wide scope is) sees exactly the
    calls of the untraced step: not the trace's bookkeeping, statistics or samples, nor a second pass of an op the
    autograd engine dispatched (without the trace no backward op reaches a torch-function mode)."""
    torch.manual_seed(0)
    plain = Net().train()
    traced = copy.deepcopy(plain)
    x = torch.randn(6, 8)
    logs = []
    for model, traced_run in ((plain, False), (traced, True)):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        torch.manual_seed(1)
        with _CallLog() as log:
            with ampdoctor.trace(model, opt, full=full) if traced_run else contextlib.nullcontext():
                _train(model, opt, [x])
        logs.append(log.calls)
    assert len(logs[0]) > 50  # sanity: the mode saw the user's forward, loss, backward() and AdamW's calls
    assert logs[1] == logs[0]
