"""CUDA autocast policy data and its emulation on CPU.

The reference for "what CUDA autocast does" is torch's own CUDA autocast kernels: a CPU-only build still registers
them (``AutocastCUDA``), and ``FakeTensorMode`` can make tensors that claim to live on ``cuda``, so those kernels
run here without a GPU (no data, dtypes only; no autograd on fake CUDA tensors).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode

from ampdoctor.precision._cuda_policy import (
    BANNED_MESSAGE,
    CPU_POLICY,
    CUDA_CUDNN_ONLY,
    CUDA_POLICY,
    TORCH_VERSION,
    policy_for,
    policy_table_markdown,
    registered_overloads,
)
from ampdoctor.precision.emulation import cuda_autocast, torch_op_name

ROOT = Path(__file__).resolve().parents[2]
mirrors_installed_torch = pytest.mark.skipif(
    not torch.__version__.startswith(TORCH_VERSION),
    reason=f"the policy data mirrors torch {TORCH_VERSION}; installed {torch.__version__}")


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


@contextlib.contextmanager
def real_cuda_autocast(dtype=torch.float16):
    """torch's own CUDA autocast kernels (torch.autocast("cuda") refuses to start without a GPU)."""
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


def autocast_state(device="cpu"):
    return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), len(_get_current_function_mode_stack())


# --- the data -------------------------------------------------------------------------------------------------------

@mirrors_installed_torch
def test_cuda_lists_equal_the_dispatchers_autocast_cuda_registrations():
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    ours = registered_overloads("cuda") - {f"aten::{op}" for op in CUDA_CUDNN_ONLY}
    assert ours == registered
    assert len(registered) == 119


@mirrors_installed_torch
def test_cpu_lists_equal_the_dispatchers_autocast_cpu_registrations():
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    assert registered_overloads("cpu") == registered
    assert len(registered) == 127


def test_policy_for_names_overloads_and_devices():
    assert policy_for("linear") == "lower"
    assert policy_for("softmax") == "fp32_set_opt_dtype"
    assert policy_for("softmax", "cpu") is None
    assert policy_for("aten.pow.Tensor_Scalar") == "fp32"
    assert policy_for("aten::pow.Scalar") == "fp32"
    assert policy_for("pow", "cpu") is None
    assert policy_for("aten.mm.default") == "lower"
    assert policy_for("aten.sum.dim_IntList") == "fp32_set_opt_dtype"
    assert policy_for("aten.sum.dim_DimnameList") is None      # overload not registered
    assert policy_for("aten.exp.out") is None
    assert policy_for("exp_") is None                          # in-place ops are never autocast
    assert policy_for("norm") == "fp32_append_dtype"
    assert policy_for("addcmul") == "promote"
    assert policy_for("cat") is None and policy_for("cat", "cpu") == "promote"
    assert policy_for("binary_cross_entropy") == "banned"
    assert policy_for("binary_cross_entropy", "cpu") == "fp32"
    assert policy_for("layer_norm") == "fp32" and policy_for("layer_norm", "cpu") is None
    assert policy_for("scaled_dot_product_attention") == "lower"
    assert policy_for("gelu") is None


def test_policy_for_rejects_unknown_device_kinds_and_non_strings():
    with pytest.raises(ValueError, match="expected one of 'cuda', 'cpu'"):
        policy_for("linear", "tpu")
    with pytest.raises(TypeError, match="op_name must be a non-empty str"):
        policy_for(None)


def _measure_cpu(op):
    """Output dtype of ``op`` under native CPU autocast (fp16), inputs fp32 or fp16 as ``op`` builds them."""
    with torch.autocast("cpu", dtype=torch.float16):
        return op()


X32 = torch.rand(4, 4) + 0.5
X16 = X32.half()
CPU_CASES = {  # aten op -> call; every floating input fp32 for "lower" candidates, fp16 otherwise
    "mm": lambda: torch.mm(X32, X32),
    "linear": lambda: F.linear(X32, X32),
    "matmul": lambda: X32 @ X32,
    "bmm": lambda: torch.bmm(X32[None], X32[None]),
    "addmm": lambda: torch.addmm(X32, X32, X32),
    "conv2d": lambda: F.conv2d(X32[None, None], X32[None, None, :3, :3]),
    "prelu": lambda: F.prelu(X32, torch.ones(1)),
    "mse_loss": lambda: F.mse_loss(X16, X16),
    "l1_loss": lambda: F.l1_loss(X16, X16),
    "nll_loss": lambda: F.nll_loss(X16, torch.zeros(4, dtype=torch.long)),
    "binary_cross_entropy": lambda: F.binary_cross_entropy(X16.sigmoid(), X16.sigmoid()),
    "cdist": lambda: torch.cdist(X16, X16),
    "prod": lambda: X16.prod(),
    "kl_div": lambda: F.kl_div(X16, X16, reduction="batchmean"),
    "softmax": lambda: X16.softmax(-1),
    "log_softmax": lambda: X16.log_softmax(-1),
    "pow": lambda: X16.pow(2),
    "exp": lambda: X16.exp(),
    "log1p": lambda: X16.log1p(),
    "layer_norm": lambda: F.layer_norm(X16, (4,)),
    "group_norm": lambda: F.group_norm(X16, 2),
    "sum": lambda: X16.sum(),
    "norm": lambda: X16.norm(p=2, dim=-1),
    "cumsum": lambda: X16.cumsum(-1),
    "logsumexp": lambda: X16.logsumexp(-1),
    "rsqrt": lambda: X16.rsqrt(),
    "softplus": lambda: F.softplus(X16),
    "cat": lambda: torch.cat([X16, X32]),
}


def test_cpu_policy_data_matches_what_cpu_autocast_does_here():
    for op, call in CPU_CASES.items():
        expected = {"lower": torch.float16, "fp32": torch.float32, "promote": torch.float32, None: torch.float16}
        assert _measure_cpu(call).dtype == expected[policy_for(op, "cpu")], op
    # the ops CUDA runs in fp32 but CPU autocast keeps in fp16 (design notes: measured on torch 2.13)
    kept_fp16 = sorted(op for op in CPU_CASES if policy_for(op, "cpu") is None)
    assert kept_fp16 == ["cumsum", "exp", "group_norm", "layer_norm", "log1p", "log_softmax", "logsumexp", "norm",
                         "pow", "rsqrt", "softmax", "softplus", "sum"]
    assert all(policy_for(op) in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype") for op in kept_fp16)


def test_policy_table_in_docs_is_the_generated_one():
    table = policy_table_markdown()
    assert table.count("\n") == len(set(CUDA_POLICY) | set(CPU_POLICY)) + 2  # one row per op, two header lines
    assert "| `softmax` | `fp32_set_opt_dtype` (int) | - |" in table
    assert table in (ROOT / "docs" / "precision.md").read_text(), \
        "docs/precision.md is stale: paste ampdoctor.precision._cuda_policy.policy_table_markdown() into it"


# --- the emulation against torch's own CUDA kernels (fake CUDA tensors) --------------------------------------------

def _parity_cases(x, y, v, y3, idx):
    """(label, call) with x fp16 [4, 4], y fp32 [4, 4], v fp32 [4], y3 fp32 [1, 4, 4], idx int64 [4], one device."""
    return [
        ("F.linear fp32", lambda: F.linear(y, y)), ("matmul", lambda: x @ y), ("rmatmul", lambda: y.__rmatmul__(x)),
        ("Tensor.mm", lambda: y.mm(y)), ("baddbmm", lambda: torch.baddbmm(y3, y3, y3)),
        ("einsum", lambda: torch.einsum("ij,jk->ik", y, y)),
        ("linalg.multi_dot", lambda: torch.linalg.multi_dot([y, y])),
        ("linear double", lambda: F.linear(y.double(), y.double())),
        ("softmax", lambda: x.softmax(-1)), ("F.softmax", lambda: F.softmax(x, -1)),
        ("softmax explicit fp16", lambda: torch.softmax(x, -1, dtype=torch.float16)),
        ("log_softmax", lambda: F.log_softmax(x, -1)), ("softmin", lambda: F.softmin(x, -1)),
        ("pow", lambda: x.pow(2)), ("x**2", lambda: x ** 2), ("2**x", lambda: 2 ** x), ("square", lambda: x.square()),
        ("exp", lambda: x.exp()), ("exp_ in place", lambda: x.clone().exp_()), ("exp bf16", lambda: x.bfloat16().exp()),
        ("log1p", lambda: torch.log1p(x)), ("special.expm1", lambda: torch.special.expm1(x)),
        ("arccos", lambda: torch.arccos(x.clamp(-1, 1))), ("rsqrt", lambda: x.rsqrt()),
        ("layer_norm", lambda: F.layer_norm(x, (4,), v, v)), ("rms_norm", lambda: F.rms_norm(x, (4,))),
        ("group_norm", lambda: F.group_norm(x, 2)), ("sum", lambda: x.sum()), ("sum dim", lambda: x.sum(-1)),
        ("sum int", lambda: idx.sum()), ("mean", lambda: x.mean()), ("cumsum", lambda: x.cumsum(0)),
        ("norm", lambda: x.norm()), ("norm dim", lambda: torch.norm(x, dim=-1)),
        ("linalg.norm", lambda: torch.linalg.norm(x)),
        ("normalize", lambda: F.normalize(x, dim=-1)), ("logsumexp", lambda: x.logsumexp(-1)),
        ("softplus", lambda: F.softplus(x)), ("gelu", lambda: F.gelu(x, approximate="tanh")),
        ("add mixed", lambda: x + y), ("cat mixed", lambda: torch.cat([x, y])),
        ("addcmul promote", lambda: torch.addcmul(x, y, x)), ("atan2 promote", lambda: torch.atan2(x, x)),
        ("mse_loss", lambda: F.mse_loss(x, x)), ("smooth_l1", lambda: F.smooth_l1_loss(x, x)),
        ("cross_entropy", lambda: F.cross_entropy(x, idx)), ("nll_loss", lambda: F.nll_loss(x, idx)),
        ("bce_with_logits", lambda: F.binary_cross_entropy_with_logits(x, x)),
        ("cosine_similarity", lambda: F.cosine_similarity(x, y)), ("cdist", lambda: torch.cdist(x, x)),
        ("pairwise_distance", lambda: F.pairwise_distance(x, x)), ("tensordot", lambda: torch.tensordot(x, y, 1)),
    ]


def _dtypes(device, ctx):
    if device == "cuda":  # fake CUDA tensors are created, not computed (views and casts of them need a GPU)
        x = torch.empty(4, 4, device="cuda", dtype=torch.float16)
        y, v, y3 = torch.empty(4, 4, device="cuda"), torch.empty(4, device="cuda"), torch.empty(1, 4, 4, device="cuda")
        idx = torch.zeros(4, dtype=torch.long, device="cuda")
    else:
        y = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) + 0.5
        x, v, y3, idx = y.half(), y[0].clone(), y[None].clone(), torch.tensor([0, 1, 2, 3])
    out = {}
    for label, call in _parity_cases(x, y, v, y3, idx):
        with ctx():
            out[label] = call().dtype
    return out


def test_emulated_output_dtypes_equal_torchs_cuda_autocast_kernels():
    with _fake_mode():
        real = _dtypes("cuda", real_cuda_autocast)
        emulated_on_fake_cuda = _dtypes("cuda", lambda: cuda_autocast(torch.float16, device_type="cuda"))
    emulated_on_cpu = _dtypes("cpu", lambda: cuda_autocast(torch.float16))
    assert emulated_on_fake_cuda == real
    assert emulated_on_cpu == real
    # the policy at work, as CUDA does it
    assert real["softmax"] == real["pow"] == real["layer_norm"] == real["sum"] == real["square"] == torch.float32
    assert real["F.linear fp32"] == real["matmul"] == torch.float16
    assert real["linear double"] == torch.float64 and real["exp_ in place"] == torch.float16
    assert real["softmax explicit fp16"] == real["gelu"] == real["mean"] == torch.float16
    assert real["add mixed"] == real["addcmul promote"] == real["cross_entropy"] == torch.float32


class TinyBlock(nn.Module):
    """Attention + MLP block with a residual stream, as in a transformer (no SDPA: fake CUDA cannot pick a kernel)."""

    def __init__(self, d=8, n_classes=5):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        h = self.ln(x + self.out(a @ v))
        h = h + self.proj(F.gelu(self.fc(h), approximate="tanh"))
        return self.head(h)


class _OpLog(TorchDispatchMode):
    """(aten op, output dtypes) of every aten op, casts left out (CUDA autocast caches weight casts; we do not)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and func is not torch.ops.aten._to_copy.default:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.log.append((str(func), tuple(o.dtype for o in outs if isinstance(o, torch.Tensor))))
        return out


def _block_ops(device, ctx, loss_kwargs):
    torch.manual_seed(0)
    model = TinyBlock()
    if device == "cuda":  # fake CUDA parameters (no data, no autograd)
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                setattr(mod, name, nn.Parameter(torch.empty(p.shape, device="cuda"), requires_grad=False))
        x = torch.empty(2, 3, 8, device="cuda")
        target = torch.zeros(6, dtype=torch.long, device="cuda")
    else:
        x, target = torch.randn(2, 3, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    with torch.no_grad(), _OpLog() as log, ctx():
        F.cross_entropy(model(x).flatten(0, 1), target, **loss_kwargs)
    return log.log


@pytest.mark.parametrize("loss_kwargs", [{}, {"label_smoothing": 0.1}])
def test_aten_op_sequence_of_a_transformer_block_equals_cuda_autocast(loss_kwargs):
    with _fake_mode():
        real = _block_ops("cuda", real_cuda_autocast, loss_kwargs)
    emulated = _block_ops("cpu", lambda: cuda_autocast(torch.float16), loss_kwargs)
    assert emulated == real
    # CUDA keeps cross_entropy's log_softmax in fp16 (it passes dtype=self.scalar_type()), nll_loss is fp32
    ops = dict(real)
    assert ops["aten._log_softmax.default"] == (torch.float16,)
    assert ops["aten.nll_loss_forward.default"] == (torch.float32, torch.float32)
    assert ops["aten._softmax.default"] == (torch.float32,)
    assert ops["aten.native_layer_norm.default"][0] == torch.float32


def test_banned_binary_cross_entropy_raises_cudas_error():
    p = torch.rand(3)
    with _fake_mode(), real_cuda_autocast():
        with pytest.raises(RuntimeError) as real:
            F.binary_cross_entropy(torch.empty(3, device="cuda"), torch.empty(3, device="cuda"))
    with cuda_autocast(torch.float16), pytest.raises(RuntimeError) as emulated:
        F.binary_cross_entropy(p, p)
    assert str(emulated.value) == str(real.value) == BANNED_MESSAGE
    assert "binary_cross_entropy_with_logits" in str(emulated.value)  # the remedy


def test_promote_of_two_different_low_dtypes_raises_like_cuda():
    with cuda_autocast(torch.float16), pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
        torch.addcmul(X16, X16, X16.bfloat16())


# --- the emulation on CPU numbers ------------------------------------------------------------------------------------

class PowNet(nn.Module):
    """Projection then RMSNorm: activations ~300, so ``pow(2)`` gives 90000, beyond fp16's 65504."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4) * 300.0)

    def forward(self, x):
        h = self.proj(x)
        var = h.pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(var + 1e-6)


def test_fp32_ops_run_in_fp32_where_cpu_autocast_keeps_fp16_and_overflow_disappears():
    x = torch.ones(2, 4)
    model = PowNet()
    seen, outs = {}, {}
    for name, ctx in (("native", lambda: torch.autocast("cpu", dtype=torch.float16)),
                      ("emulated", lambda: cuda_autocast(torch.float16))):
        with ctx():
            h = model.proj(x)
            sq = h.pow(2)
            seen[name] = {
                "proj": h.dtype, "pow": sq.dtype, "pow_finite": bool(torch.isfinite(sq).all()),
                "softmax": h.softmax(-1).dtype, "exp": (h / 300).exp().dtype, "layer_norm": F.layer_norm(h, (4,)).dtype,
                "matmul": (x @ x.t()).dtype,
            }
            outs[name] = model(x)
    assert seen["native"] == {"proj": torch.float16, "pow": torch.float16, "pow_finite": False,
                              "softmax": torch.float16, "exp": torch.float16, "layer_norm": torch.float16,
                              "matmul": torch.float16}
    assert seen["emulated"] == {"proj": torch.float16, "pow": torch.float32, "pow_finite": True,
                                "softmax": torch.float32, "exp": torch.float32, "layer_norm": torch.float32,
                                "matmul": torch.float16}
    # CPU policy: var = inf, rsqrt(inf) = 0, the normalised activations silently become 0; CUDA policy: 300/300 = 1
    assert torch.equal(outs["native"], torch.zeros(2, 4, dtype=torch.float16))
    assert outs["emulated"].dtype == torch.float32
    torch.testing.assert_close(outs["emulated"], torch.ones(2, 4), rtol=1e-6, atol=0)


def test_residual_add_of_fp16_and_fp32_is_fp32_under_both():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for ctx in (lambda: torch.autocast("cpu", dtype=torch.float16), lambda: cuda_autocast(torch.float16)):
        with ctx():
            h = lin(x)
            assert h.dtype == torch.float16
            assert (x + h).dtype == torch.float32


def test_gradients_flow_through_the_emulated_casts():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    with cuda_autocast(torch.float16):
        loss = F.layer_norm(lin(x), (3,)).pow(2).sum()
    loss.backward()
    got = (x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    # the same computation with the casts CUDA autocast makes, written out
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = lin.weight.detach().clone().requires_grad_(), lin.bias.detach().clone().requires_grad_()
    h = F.linear(x2.half(), w2.half(), b2.half())
    F.layer_norm(h.float(), (3,)).pow(2).sum().backward()
    assert loss.dtype == torch.float32
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], x2.grad) and torch.equal(got[1], w2.grad) and torch.equal(got[2], b2.grad)
    assert got[1].abs().sum() > 0


def test_state_is_restored_after_normal_exit_and_after_an_exception():
    before = autocast_state()
    with cuda_autocast(torch.float16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert len(_get_current_function_mode_stack()) == before[2] + 1
    assert autocast_state() == before
    with pytest.raises(KeyError, match="raised inside"), cuda_autocast(torch.bfloat16):
        F.linear(torch.ones(2, 2), torch.ones(2, 2)).softmax(-1)
        raise KeyError("raised inside")
    assert autocast_state() == before
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an enclosing native autocast comes back as it was
        outer = autocast_state()
        with cuda_autocast(torch.float16):
            assert torch.get_autocast_dtype("cpu") == torch.float16
        assert autocast_state() == outer == (True, torch.bfloat16, before[2])


def test_nested_cuda_autocast_blocks_share_one_mode():
    depth = len(_get_current_function_mode_stack())
    with cuda_autocast(torch.float16):
        with cuda_autocast(torch.bfloat16):
            assert len(_get_current_function_mode_stack()) == depth + 1
            assert F.linear(X32, X32).dtype == torch.bfloat16
        assert F.linear(X32, X32).dtype == torch.float16
    assert len(_get_current_function_mode_stack()) == depth


def test_user_autocast_inside_the_emulation_is_emulated_with_the_cuda_policy():
    with cuda_autocast(torch.float16):
        with torch.autocast("cpu", dtype=torch.float16):
            assert F.linear(X32, X32).dtype == torch.float16
            assert X16.softmax(-1).dtype == torch.float32   # CPU autocast alone would keep fp16
            assert X16.pow(2).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F.linear(X32, X32).dtype == torch.bfloat16
            assert X16.exp().dtype == torch.float32
        assert F.linear(X32, X32).dtype == torch.float16


def test_user_autocast_disabled_inside_turns_the_emulation_off_for_its_block():
    with cuda_autocast(torch.float16):
        with torch.autocast("cpu", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
            assert F.linear(X32, X32).dtype == torch.float32
            assert X16.softmax(-1).dtype == torch.float16
            assert X16.pow(2).dtype == torch.float16
        assert torch.is_autocast_enabled("cpu")
        assert X16.softmax(-1).dtype == torch.float32
    with cuda_autocast(torch.float16, enabled=False):
        assert F.linear(X32, X32).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.float16):  # still the CUDA policy when the user enables it
            assert X16.pow(2).dtype == torch.float32


def test_torch_op_name_maps_python_callables_to_aten_names():
    assert torch_op_name(F.linear) == ("linear", None)
    assert torch_op_name(torch.Tensor.__matmul__) == ("matmul", None)
    assert torch_op_name(torch.Tensor.__rpow__) == ("pow", None)
    assert torch_op_name(torch.Tensor.softmax) == ("softmax", None)
    assert torch_op_name(F.layer_norm) == ("layer_norm", None)
    assert torch_op_name(F.scaled_dot_product_attention) == ("scaled_dot_product_attention", None)
    assert torch_op_name(torch.ops.aten.sum.dim_IntList) == ("sum", "dim_IntList")
    assert torch_op_name(torch.ops.aten.mm.default) == ("mm", "")


def test_invalid_arguments_are_rejected_before_anything_changes():
    before = autocast_state()
    with pytest.raises(ValueError, match="torch.float16, torch.bfloat16"):
        cuda_autocast(torch.float32)
    with pytest.raises(ValueError, match="e.g. 'cpu' or 'cuda'"):
        cuda_autocast(torch.float16, device_type="gpu0")
    with pytest.raises(TypeError, match="enabled must be a bool"):
        cuda_autocast(torch.float16, enabled="yes")
    assert autocast_state() == before
