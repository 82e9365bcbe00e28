"""``cuda_gemm``: fp16/bf16 GEMMs on CPU computed as CUDA computes them (fp32 accumulation, one rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.precision.emulation import GEMM_ENV, cuda_autocast, cuda_gemm, gemm_choice

LOW = [torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _rounded_once(fn, *xs: torch.Tensor, dtype: torch.dtype):  # noqa: ANN001, ANN202
    """The float32 result of ``fn`` on the exactly widened inputs, rounded once to ``dtype``."""
    out = fn(*(x.float() for x in xs))
    return out.to(dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_gemms_agree_bitwise_with_fp32_rounded_once(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(33, 70, generator=g).to(dtype), torch.randn(70, 45, generator=g).to(dtype)
    bias = torch.randn(45, generator=g).to(dtype)
    ba, bb = torch.randn(3, 17, 29, generator=g).to(dtype), torch.randn(3, 29, 11, generator=g).to(dtype)
    bc = torch.randn(3, 17, 11, generator=g).to(dtype)
    cases = [
        (torch.mm, (a, b)),
        (lambda x, y: x @ y, (a, b)),
        (lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), (bias, a, b)),
        (torch.bmm, (ba, bb)),
        (torch.baddbmm, (bc, ba, bb)),
        (torch.matmul, (ba, bb)),
        (lambda x, w, c: F.linear(x, w, c), (a, b.t().contiguous(), bias)),
    ]
    for fn, xs in cases:
        with cuda_gemm():
            got = fn(*xs)
        want = _rounded_once(fn, *xs, dtype=dtype)
        assert got.dtype == dtype
        assert torch.equal(_bits(got), _bits(want)), fn


def test_native_fp16_gemm_is_not_the_fp32_rounded_once_gemm() -> None:
    # the check above can fail: torch's CPU fp16 kernel rounds differently in the last bit of some elements
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 512, generator=g).half(), torch.randn(512, 64, generator=g).half()
    native = a @ b
    with cuda_gemm(enabled=False):
        off = a @ b
    assert torch.equal(_bits(native), _bits(off))
    assert not torch.equal(_bits(native), _bits(_rounded_once(torch.mm, a, b, dtype=torch.float16)))


@pytest.mark.parametrize("dtype", LOW)
def test_backward_gemms_and_convolutions_round_once(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 32, generator=g).to(dtype).requires_grad_()
    w = torch.randn(16, 32, generator=g).to(dtype).requires_grad_()
    with cuda_gemm():
        y = F.linear(x, w)
        y.backward(torch.ones_like(y))
    go = torch.ones(8, 16)
    assert torch.equal(_bits(x.grad), _bits((go @ w.detach().float()).to(dtype)))
    assert torch.equal(_bits(w.grad), _bits((go.t() @ x.detach().float()).to(dtype)))
    img, k = torch.randn(2, 3, 9, 9, generator=g).to(dtype), torch.randn(4, 3, 3, 3, generator=g).to(dtype)
    with cuda_gemm():
        out = F.conv2d(img, k, padding=1)
    assert torch.equal(_bits(out), _bits(F.conv2d(img.float(), k.float(), padding=1).to(dtype)))


def test_mixed_or_fp32_calls_run_unchanged() -> None:
    a32, b32 = torch.randn(5, 6), torch.randn(6, 7)
    with cuda_gemm():
        assert torch.equal((a32 @ b32), a32 @ b32)
        assert (a32.half() @ b32.half()).dtype == torch.float16
        assert (a32.double() @ b32.double()).dtype == torch.float64
    with pytest.raises(RuntimeError), cuda_gemm():  # mixed dtypes still fail as torch fails them
        torch.mm(a32, b32.half())


def test_trace_records_the_low_precision_gemm() -> None:
    model = nn.Sequential(nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3))
    x = torch.randn(4, 12)
    with cuda_gemm(), ampdoctor.trace(model) as t, cuda_autocast(torch.float16):
        model(x).float().sum().backward()
    gemms = [r for r in t.result().records if r.op.split(".")[1] in ("addmm", "mm")]
    assert gemms and all(r.dtype == torch.float16 for r in gemms)
    assert not any(r.op.startswith("aten._to_copy") and r.dtype == torch.float32 and r.inputs
                   and t.result().records[r.inputs[0]].op.split(".")[1] in ("addmm", "mm") for r in gemms)


def test_gemm_choice_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GEMM_ENV, raising=False)
    assert gemm_choice() == "cuda"
    monkeypatch.setenv(GEMM_ENV, "native")
    assert gemm_choice() == "native"
    assert gemm_choice("cuda") == "cuda"
    monkeypatch.setenv(GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="AMPDOCTOR_GEMM"):
        gemm_choice()


def test_cuda_policy_target_runs_use_cuda_gemms_and_native_stays_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-policy fp16 target run widens its GEMMs (forward and backward); AMPDOCTOR_GEMM=native does not."""
    from ampdoctor.precision import emulation
    from ampdoctor.precision._runner import run
    from ampdoctor.precision._spec import StepSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))
    batch = torch.randn(16, 256)
    spec = StepSpec(model=model, batch=batch, precision="fp16", loss_fn=lambda out, b: out.float().mean())
    rounded: list[str] = []
    real_round = emulation._round
    monkeypatch.setattr(emulation, "_round", lambda obj, dtype: rounded.append(str(dtype)) or real_round(obj, dtype))

    def traced_first_gemm(gemm: str, policy: str = "cuda") -> float:
        monkeypatch.setenv(GEMM_ENV, gemm)
        rounded.clear()
        res = run(spec, reference=False, policy=policy)
        rec = next(r for r in res.trace.records if r.kind == "op" and r.op.split(".")[1] in ("addmm", "mm"))
        assert rec.dtype == torch.float16
        return rec.stats["absmax"]

    w, b = model[0].weight.detach().half(), model[0].bias.detach().half()
    want = float(torch.addmm(b.float(), batch.half().float(), w.float().t()).half().abs().max())
    assert traced_first_gemm("cuda") == want
    assert len(rounded) >= 5 and set(rounded) == {"torch.float16"}  # 2 forward addmm, >= 3 backward mm
    traced_first_gemm("native")
    assert rounded == []
    traced_first_gemm("cuda", policy="native")  # the native autocast policy keeps native kernels too
    assert rounded == []
