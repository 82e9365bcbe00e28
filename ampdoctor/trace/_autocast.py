"""Which aten ops PyTorch's autocast runs in which dtype, declared once per device: the op registry's autocast part.

Mirrors **torch 2.13.0** (git ``cf30153c4c131c8164ee7798e5022d810682e2cb``, the build installed here).

Sources
    ``aten/src/ATen/autocast_mode.h`` as shipped in that build (``torch/include/ATen/autocast_mode.h``): the macros
    ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
    ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` (the ``fp32_append_dtype`` ops) and ``AT_FORALL_PROMOTE``.
    ``aten/src/ATen/autocast_mode.cpp`` (pytorch/pytorch, commit ``008ec6b1840c94ff6d0f685bc10fbf585167c673``):
    ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` registers those macros for CUDA with ``KERNEL_CUDA``, adds
    ``cudnn_convolution`` / ``cudnn_convolution_transpose`` (lower precision) and bans ``binary_cross_entropy``;
    ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` spells the CPU lists out op by op (that source also names
    ``prod.dim_Dimname`` and ``index_copy.dimname``, which the 2.13 dispatcher does not hold: left out here).
    ``aten/src/ATen/cudnn/AutocastRNN.cpp`` registers ``_cudnn_rnn`` (lower precision) in cuDNN builds only.

Verification
    The CPU-only build still compiles ``autocast_mode.cpp``, so the dispatcher knows the CUDA registrations:
    ``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")`` lists 119 op overloads and
    ``"AutocastCPU"`` 127; ``tests/precision/test_emulation.py`` asserts both equal the data below (``_cudnn_rnn`` is
    the one CUDA entry a CPU build cannot show). The CPU data is also checked by running ops under
    ``torch.autocast("cpu", dtype=torch.float16)`` and reading output dtypes.

Policies (the ``CastPolicy`` enum of ``autocast_mode.h``)
    ``"lower"``               cast floating inputs (not float64) to the autocast dtype (fp16 / bf16).
    ``"fp32"``                cast floating inputs (not float64) to float32.
    ``"fp32_set_opt_dtype"``  if the first tensor is eligible and no ``dtype=`` was given, pass ``dtype=float32``.
    ``"fp32_append_dtype"``   ``norm`` overloads without a dtype are redispatched with ``dtype=float32``.
    ``"promote"``             run in the widest floating dtype among the inputs (float64 ignored).
    ``"banned"``              raise (``binary_cross_entropy``: unsafe to autocast; use ``..._with_logits``).

Only the declared overloads are registered (``""`` is the default overload); ops called through another overload
(``sum.dim_DimnameList``, ``softmax.Dimname``, ``exp.out``, in-place ``exp_``) are not autocast.
:func:`declare_autocast` rejects an op declared twice for one device; :func:`declare_composite` declares the C++
composites whose first inner op is autocast on CUDA (they take its policy in the emulation).

>>> from ampdoctor.trace import autocast_class
>>> c = autocast_class("sum", "cuda"); c.policy, sorted(c.overloads)
('fp32_set_opt_dtype', ['', 'dim_IntList'])
>>> autocast_class("softmax", "cpu") is None, autocast_class("lstm", "cuda").composite
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = ["AUTOCAST", "AUTOCAST_DEVICES", "AUTOCAST_POLICIES", "AutocastClass", "AutocastPolicy",
           "CUDA_CUDNN_ONLY", "autocast_class", "declare_autocast", "declare_composite"]

AutocastPolicy = Literal["lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned"]

#: Every policy name, in the order of the documentation table.
AUTOCAST_POLICIES: tuple[str, ...] = ("lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote",
                                      "banned")
#: The device kinds the registry holds.
AUTOCAST_DEVICES: tuple[str, ...] = ("cuda", "cpu")


@dataclass(frozen=True)
class AutocastClass:
    """How autocast on ``device`` treats op ``name``: its ``policy`` for the registered ``overloads`` (``""`` the
    default one). ``composite``: a C++ composite (keyed by the name its torch-level callable carries) that is not
    registered itself but whose first inner op is, so it behaves with that op's policy; ``approximate``: such a
    composite whose fp32 op comes after elementwise ops (CUDA runs those in the input dtype)."""

    name: str
    device: str
    policy: str
    overloads: frozenset[str] = frozenset({""})
    composite: bool = False
    approximate: bool = False


#: device -> aten base name -> its class (read-only views; fill them with the declare functions)
_TABLES: dict[str, dict[str, AutocastClass]] = {d: {} for d in AUTOCAST_DEVICES}
AUTOCAST: MappingProxyType[str, MappingProxyType[str, AutocastClass]] = MappingProxyType(
    {d: MappingProxyType(t) for d, t in _TABLES.items()})


def _add(entry: AutocastClass) -> None:
    if entry.device not in _TABLES:
        raise ValueError(f"autocast device {entry.device!r}: expected one of {', '.join(AUTOCAST_DEVICES)}")
    if entry.policy not in AUTOCAST_POLICIES:
        raise ValueError(f"autocast policy {entry.policy!r}: expected one of {', '.join(AUTOCAST_POLICIES)}")
    table = _TABLES[entry.device]
    old = table.get(entry.name)
    if old is not None:  # a base name in two lists would make the policy of a call ambiguous
        raise ValueError(f"{entry.device} autocast: {entry.name!r} is already declared {old.policy!r}; "
                         f"declare each op once per device (now {entry.policy!r})")
    table[entry.name] = entry


def declare_autocast(device: str, policy: str, *entries: str) -> None:
    """Declare the ops ``entries`` (``"pow.Tensor_Scalar"``; a bare name is the default overload) as autocast with
    ``policy`` on ``device``; the overloads of one name are given together."""
    grouped: dict[str, set[str]] = {}
    for entry in entries:
        name, _, overload = entry.partition(".")
        grouped.setdefault(name, set()).add(overload)
    for name, ovs in grouped.items():
        _add(AutocastClass(name, device, policy, frozenset(ovs)))


def declare_composite(policy: str, *names: str, approximate: bool = False) -> None:
    """Declare CUDA composites ``names`` that take ``policy`` from their first inner op (any overload)."""
    for name in names:
        _add(AutocastClass(name, "cuda", policy, frozenset(), composite=True, approximate=approximate))


def autocast_class(name: str, device: str = "cuda") -> AutocastClass | None:
    """The declared class of aten base name ``name`` on ``device`` (``None``: not autocast there)."""
    if device not in _TABLES:
        raise ValueError(f"invalid device kind {device!r}: expected one of {', '.join(map(repr, AUTOCAST_DEVICES))}")
    return _TABLES[device].get(name)


# --- CUDA (AutocastCUDA, dispatch key "Autocast") -------------------------------------------------------------------

# AT_FORALL_LOWER_PRECISION_FP + cudnn_convolution(_transpose) (autocast_mode.cpp) + _cudnn_rnn (cudnn/AutocastRNN.cpp)
declare_autocast(
    "cuda", "lower",
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
    "_cudnn_rnn",
)
# AT_FORALL_FP32
declare_autocast(
    "cuda", "fp32",
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# AT_FORALL_FP32_SET_OPT_DTYPE
declare_autocast(
    "cuda", "fp32_set_opt_dtype",
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (policy fp32_append_dtype)
declare_autocast("cuda", "fp32_append_dtype", "norm.Scalar", "norm.ScalarOpt_dim")
# AT_FORALL_PROMOTE
declare_autocast(
    "cuda", "promote",
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)
declare_autocast("cuda", "banned", "binary_cross_entropy")

#: Registered only in builds with cuDNN (``aten/src/ATen/cudnn/AutocastRNN.cpp``), so absent from a CPU dispatcher.
CUDA_CUDNN_ONLY: frozenset[str] = frozenset({"_cudnn_rnn"})

# C++ composites (CompositeImplicitAutograd) whose decomposition starts with an autocast op: on CUDA that inner op is
# cast, so the emulation gives them its policy. Names are those torch-level callables carry.
# aliases
declare_composite("fp32", "arccos", "arcsin", "special_expm1", "special_log1p", "special_erfinv", "special_logsumexp")
declare_composite("promote", "arctan2")
declare_composite("fp32_set_opt_dtype", "special_softmax", "special_log_softmax")
declare_composite("lower", "matrix_power")
# decompositions: square -> pow; linalg_norm -> linalg_vector_norm / linalg_matrix_norm;
# nll_loss_nd -> nll_loss / nll_loss2d (cross_entropy_loss is emulated step by step: precision/emulation.py)
declare_composite("fp32", "square", "nll_loss_nd", "sum_to_size", "norm_except_dim")
declare_composite("fp32_set_opt_dtype", "linalg_norm")
# approximate: the inner fp32 op comes after elementwise ops (``pairwise_distance`` = ``norm(x1 - x2 + eps)``,
# ``trapezoid`` = ``sum(dx * (y[1:] + y[:-1]) / 2)``): on CUDA those first ops run in the input dtype, in the
# emulation in float32. Output dtypes agree; the emulation is slightly more accurate than CUDA for these ops.
declare_composite("fp32", "pairwise_distance", "trapezoid", "trapz", "cumulative_trapezoid", approximate=True)
# RNN layers on CUDA run cuDNN's _cudnn_rnn, which cudnn/AutocastRNN.cpp casts to lower precision
declare_composite("lower", "lstm", "gru", "rnn_tanh", "rnn_relu")


# --- CPU (AutocastCPU), spelled out in autocast_mode.cpp ------------------------------------------------------------

declare_autocast(
    "cpu", "lower",
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm", "linalg_vecdot",
    "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc",
    "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
    "scaled_dot_product_attention", "_native_multi_head_attention",
)
declare_autocast(
    "cpu", "fp32",
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int",
    "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center", "cdist",
    "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex", "cholesky",
    "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "ctc_loss.IntList",
    "ctc_loss.Tensor", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft",
    "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
    "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.atol_rtol_float",
    "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf",
    "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
    "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd",
    "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)
declare_autocast("cpu", "promote", "stack", "cat", "index_copy")
