"""The autocast op policies of PyTorch, kept as data: which aten ops CUDA (and CPU) autocast run in which dtype.

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
    the one CUDA entry a CPU build cannot show).  The CPU data is also checked by running ops under
    ``torch.autocast("cpu", dtype=torch.float16)`` and reading output dtypes.

Policies (the ``CastPolicy`` enum of ``autocast_mode.h``)
    ``"lower"``               cast floating inputs (not float64) to the autocast dtype (fp16 / bf16).
    ``"fp32"``                cast floating inputs (not float64) to float32.
    ``"fp32_set_opt_dtype"``  if the first tensor is eligible and no ``dtype=`` was given, pass ``dtype=float32``.
    ``"fp32_append_dtype"``   ``norm`` overloads without a dtype are redispatched with ``dtype=float32``.
    ``"promote"``             run in the widest floating dtype among the inputs (float64 ignored).
    ``"banned"``              raise (``binary_cross_entropy``: unsafe to autocast; use ``..._with_logits``).
    ``None``                  not registered: the op runs in whatever dtype its inputs have.

Only the overloads listed in ``CUDA_OVERLOADS`` / ``CPU_OVERLOADS`` are registered ("" is the default overload);
ops called through another overload (``sum.dim_DimnameList``, ``softmax.Dimname``, ``exp.out``, in-place
``exp_``) are not autocast.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

Policy = Literal["lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned"]

#: Every policy name, in the order of the documentation table.
POLICIES: tuple[str, ...] = ("lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")

#: The device kinds :func:`policy_for` knows.
DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")

TORCH_VERSION = "2.13.0"
TORCH_GIT_VERSION = "cf30153c4c131c8164ee7798e5022d810682e2cb"


def _ops(*entries: str) -> dict[str, frozenset[str]]:
    """``"pow.Tensor_Scalar"`` -> ``{"pow": {"Tensor_Scalar"}}``; a bare name is the default overload ``""``."""
    out: dict[str, set[str]] = {}
    for entry in entries:
        name, _, overload = entry.partition(".")
        out.setdefault(name, set()).add(overload)
    return {name: frozenset(ovs) for name, ovs in out.items()}


# --- CUDA (AutocastCUDA, dispatch key "Autocast") -------------------------------------------------------------------

# AT_FORALL_LOWER_PRECISION_FP + cudnn_convolution(_transpose) (autocast_mode.cpp) + _cudnn_rnn (cudnn/AutocastRNN.cpp)
_CUDA_LOWER = _ops(
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
    "_cudnn_rnn",
)
# AT_FORALL_FP32
_CUDA_FP32 = _ops(
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
_CUDA_FP32_SET_OPT_DTYPE = _ops(
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (policy fp32_append_dtype)
_CUDA_FP32_APPEND_DTYPE = _ops("norm.Scalar", "norm.ScalarOpt_dim")
# AT_FORALL_PROMOTE
_CUDA_PROMOTE = _ops(
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)
_CUDA_BANNED = _ops("binary_cross_entropy")

#: Registered only in builds with cuDNN (``aten/src/ATen/cudnn/AutocastRNN.cpp``), so absent from a CPU dispatcher.
CUDA_CUDNN_ONLY: frozenset[str] = frozenset({"_cudnn_rnn"})


# --- CPU (AutocastCPU), spelled out in autocast_mode.cpp ------------------------------------------------------------

_CPU_LOWER = _ops(
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm", "linalg_vecdot",
    "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc",
    "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
    "scaled_dot_product_attention", "_native_multi_head_attention",
)
_CPU_FP32 = _ops(
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
_CPU_PROMOTE = _ops("stack", "cat", "index_copy")



def _by_policy(*groups: tuple[str, dict[str, frozenset[str]]]) -> tuple[Mapping[str, str], Mapping[str, frozenset]]:
    policy: dict[str, str] = {}
    overloads: dict[str, frozenset[str]] = {}
    for name, ops in groups:
        for op, ovs in ops.items():
            if op in policy:  # a base name in two lists would make policy_for ambiguous
                raise AssertionError(f"{op} is listed as {policy[op]!r} and {name!r}")
            policy[op] = name
            overloads[op] = ovs
    return MappingProxyType(policy), MappingProxyType(overloads)


CUDA_POLICY, CUDA_OVERLOADS = _by_policy(
    ("lower", _CUDA_LOWER), ("fp32", _CUDA_FP32), ("fp32_set_opt_dtype", _CUDA_FP32_SET_OPT_DTYPE),
    ("fp32_append_dtype", _CUDA_FP32_APPEND_DTYPE), ("promote", _CUDA_PROMOTE), ("banned", _CUDA_BANNED),
)
CPU_POLICY, CPU_OVERLOADS = _by_policy(("lower", _CPU_LOWER), ("fp32", _CPU_FP32), ("promote", _CPU_PROMOTE))

#: The message CUDA autocast raises for ``binary_cross_entropy`` (``binary_cross_entropy_banned``), verbatim.
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def split_op_name(op_name: str) -> tuple[str, str | None]:
    """``"aten.pow.Tensor_Scalar"`` / ``"aten::pow.Tensor_Scalar"`` -> ``("pow", "Tensor_Scalar")``.

    ``"pow"`` -> ``("pow", None)`` (no overload given); ``"aten.mm.default"`` -> ``("mm", "")``.
    """
    if not isinstance(op_name, str) or not op_name:
        raise TypeError(f"op_name must be a non-empty str like 'softmax' or 'aten.pow.Tensor_Scalar', got {op_name!r}")
    name = op_name
    for prefix in ("aten::", "aten."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    base, dot, overload = name.partition(".")
    if not dot:
        return base, None
    return base, "" if overload == "default" else overload


def policy_for(op_name: str, device_kind: str = "cuda") -> str | None:
    """The autocast policy of an aten op on ``device_kind`` ("cuda" or "cpu"), or ``None`` if it is not autocast.

    >>> policy_for("softmax"), policy_for("softmax", "cpu"), policy_for("aten.pow.Tensor_Scalar")
    ('fp32_set_opt_dtype', None, 'fp32')

    ``op_name`` is a base name (``"linear"``) or an overload (``"aten.sum.dim_IntList"``, ``"aten::mm"``); an
    overload that autocast does not register (``"sum.dim_DimnameList"``, ``"exp.out"``) gives ``None``.
    Returns one of ``"lower"``, ``"fp32"``, ``"fp32_set_opt_dtype"``, ``"fp32_append_dtype"``, ``"promote"``,
    ``"banned"`` (CPU uses only ``"lower"``, ``"fp32"``, ``"promote"``) or ``None``. Pure lookup, no side effects.
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"invalid device_kind {device_kind!r}: expected one of {', '.join(map(repr, DEVICE_KINDS))}")
    base, overload = split_op_name(op_name)
    policy, overloads = (CUDA_POLICY, CUDA_OVERLOADS) if device_kind == "cuda" else (CPU_POLICY, CPU_OVERLOADS)
    found = policy.get(base)
    if found is None or (overload is not None and overload not in overloads[base]):
        return None
    return found


def registered_overloads(device_kind: str = "cuda") -> frozenset[str]:
    """Every registered overload as the dispatcher spells it (``"aten::pow.Tensor_Scalar"``, ``"aten::mm"``)."""
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"invalid device_kind {device_kind!r}: expected one of {', '.join(map(repr, DEVICE_KINDS))}")
    overloads = CUDA_OVERLOADS if device_kind == "cuda" else CPU_OVERLOADS
    return frozenset(f"aten::{op}.{ov}" if ov else f"aten::{op}" for op, ovs in overloads.items() for ov in ovs)


_POLICY_ORDER = {name: i for i, name in enumerate(POLICIES)}


def policy_table_markdown() -> str:
    """The CUDA and CPU autocast policies of every listed op as a Markdown table (generated into docs/precision.md).

    Rows are sorted by CUDA policy (ops only CPU autocasts last), then by name; overloads are shown when only some
    overloads are registered. Pure function of the data in this module.
    """

    def cell(policy: Mapping[str, str], overloads: Mapping[str, frozenset], op: str) -> str:
        if op not in policy:
            return "-"
        ovs = overloads[op]
        if ovs == frozenset({""}):
            return f"`{policy[op]}`"
        shown = ", ".join(ov or "default" for ov in sorted(ovs))
        return f"`{policy[op]}` ({shown})"

    ops = sorted(set(CUDA_POLICY) | set(CPU_POLICY),
                 key=lambda op: (_POLICY_ORDER.get(CUDA_POLICY.get(op, ""), len(POLICIES)), op))
    lines = [
        f"| aten op | CUDA autocast (torch {TORCH_VERSION}) | CPU autocast (torch {TORCH_VERSION}) |",
        "|---|---|---|",
    ]
    for op in ops:
        note = " (cuDNN builds)" if op in CUDA_CUDNN_ONLY else ""
        cuda, cpu = cell(CUDA_POLICY, CUDA_OVERLOADS, op), cell(CPU_POLICY, CPU_OVERLOADS, op)
        lines.append(f"| `{op}`{note} | {cuda} | {cpu} |")
    return "\n".join(lines) + "\n"
