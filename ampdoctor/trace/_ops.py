"""What each aten op family means numerically, declared once: the registry every layer reads.

An op is named by its aten base name (``aten.mm.default`` -> ``"mm"``). :func:`declare` registers one
:class:`OpInfo` per name and rejects a second declaration. Queries: :func:`op_info` for one op,
:func:`ops_with` for the set of ops of one :class:`Kind`.

>>> from ampdoctor.trace import Kind, op_base, op_info, ops_with
>>> op_base("aten.addmm.default"), op_info("addmm").reduces
('addmm', <Reduces.INNER_1: 'inner_1'>)
>>> op_info("tanh").bound.text, "clone" in ops_with(Kind.SAME_ELEMENTS), "clone" in ops_with(Kind.VIEW)
('±1', True, False)

Which arguments are literals (:class:`Literal`): a fill value, a clamp bound, a norm's ``eps``, a Scalar addend
or factor.
:func:`literal_values` reads them from one call's arguments (the trace stores them as ``OpRecord.literals``):

>>> [(lit.name, lit.role.value) for lit in op_info("masked_fill").literals]
[('value', 'fill')]
>>> literal_values("native_layer_norm", (None, [8], None, None, 1e-5), {})
((Literal(name='eps', position=4, role=<Role.EPS: 'eps'>), 1e-05),)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cache

__all__ = ["ALIAS_OPS", "Bound", "DUNDERS", "Family", "Kind", "Literal", "OpInfo", "Reduces", "Role", "Upcast",
           "adds_an_offset", "declare", "family_ops", "literal_values", "op_base", "op_info", "ops_with",
           "ops_with_literal", "torch_names", "OPS"]


class Kind(enum.Enum):
    """What an op does to the values it reads (an op can have several kinds)."""

    VIEW = "view"                    # its output is (a view of) its first input's memory
    SAME_ELEMENTS = "same_elements"  # its single output holds exactly its first input's elements (stats reusable)
    REPEATS = "repeats"              # its output repeats its first input's elements (expand): same values, more of them
    COPY = "copy"                    # a copy of its first input into new memory (clone, contiguous)
    JOIN = "join"                    # its output is made of its inputs' elements (cat, stack)
    CAST = "cast"                    # converts dtype (a cast that flushes changes nothing else)
    BOUNDED = "bounded"              # its output is bounded (:attr:`OpInfo.bound`)
    SOFTMAX = "softmax"              # a (log-)softmax over rows: NaN for a row that is entirely -inf
    CANCELLING = "cancelling"        # sums terms of either sign: catastrophic cancellation happens here
    NORM_STATISTIC = "norm_stat"     # computes the statistic of a norm (mean of squares, variance, ...)
    NORM_SCALE = "norm_scale"        # turns a norm statistic into the scale (rsqrt, sqrt, reciprocal)
    PERIODIC = "periodic"            # sin / cos: an angle's absolute error becomes the result's error
    UNINITIALISED = "uninitialised"  # allocates memory without writing it (its statistics describe garbage)
    ZEROS = "zeros"                  # its output is all zeros (zeros_like, zero_): its statistics are known unread
    POLE = "pole"                    # infinite where an input is 0: log(0) = -inf, 1/0, rsqrt(0), x / 0
    LOG = "log"                      # a logarithm (log, log2, log10): of a softmax it is a log-softmax
    GEMM = "gemm"                    # a GEMM kernel below autograd (mm, addmm, convolution): accumulates K products
    EXPONENTIAL = "exponential"      # exp: an input's absolute error becomes the result's relative error
    DECISION = "decision"            # returns indices chosen by comparing values (argmax, topk, sort)
    PICKS_SMALLEST = "picks_smallest"  # a decision for the smallest values (argmin, min, kthvalue)
    PICKS_K = "picks_k"              # a decision for the k largest (topk): each row's choice is a set
    ORDERS = "orders"                # a decision that orders a whole row (sort, argsort)
    THRESHOLDS = "thresholds"        # a decision per element against a threshold (gt, lt, ge, le): a boolean mask
    MASKS = "masks"                  # selects by a boolean mask argument (masked_fill, where): a mask steers it
    CLIPS = "clips"                  # replaces out-of-range or non-finite values (clamp, nan_to_num, where): a guard
    STATS_WRITE = "stats_write"      # writes running_mean / running_var in training; the schema does not say so
    GATHERS = "gathers"              # picks elements of its first input by integer indices: a subset of its values


class Reduces(enum.Enum):
    """How many terms K each output element sums (rounding error grows like sqrt(K) * u)."""

    INNER_0 = "inner_0"      # K = inputs[0].shape[-1]            (mm, bmm, matmul, linear)
    INNER_1 = "inner_1"      # K = inputs[1].shape[-1]            (addmm, baddbmm: inputs[0] is the bias)
    KERNEL = "kernel"        # K = prod(inputs[1].shape[1:])      (convolution: C_in * kernel size)
    KERNEL_GRAD = "kernel_grad"  # K = numel(inputs[2]) / inputs[1].shape[1]  (convolution_backward's grad_input:
    #                          C_out / groups * kernel size; transposed: the same count in its weight layout)
    ROW = "row"              # K = output.shape[-1]               (softmax, layer norm, cumsum along rows)
    RATIO = "ratio"          # K = numel(input) / numel(output)   (sum, mean, var, norms)


@dataclass(frozen=True)
class Bound:
    """The bound of a bounded op: ``stat`` names the trace's ``n_at_limit`` test (``"abs1"``: |y| == 1,
    ``"01"``: y in {0, 1}, ``"1"``: y == 1), ``backward`` its backward op, ``text`` the bound for people."""

    stat: str
    backward: str
    text: str


class Role(enum.Enum):
    """What a literal argument does to the op's result."""

    FILL = "fill"          # written into the output as is (masked_fill value, fill_, full, where's scalar)
    BOUND = "bound"        # a clamp bound: outputs beyond it become it
    EPS = "eps"            # added to a statistic to keep it off 0 (layer/rms/batch/group norm eps)
    ADDEND = "addend"      # a Scalar added or subtracted (``x + 1e-10``, ``1 - x``): an eps that must not flush
    FACTOR = "factor"      # a Scalar multiplier or divisor (``x * 0.5``, ``x / 8.0``)


class Family(enum.Enum):
    """The op families the ``upcast_op`` fix runs in float32 by name (``fixes.upcast_op(ops=["norm"])``)."""

    SOFTMAX = "softmax"
    NORM = "norm"          # a norm's statistic (pow, var, ...) and the norm ops themselves
    LOSS = "loss"
    EXP = "exp"
    TANH = "tanh"
    SIGMOID = "sigmoid"


class Upcast(enum.Enum):
    """What an op run in float32 by ``upcast_op`` hands back outside autocast."""

    INPUT = "input"        # the inputs' low dtype: the result is bounded and fits
    FP32 = "fp32"          # float32: the result may not fit the low dtype


@dataclass(frozen=True)
class Literal:
    """A literal argument of an op: its schema name, its position in the aten call, its :class:`Role`."""

    name: str
    position: int
    role: Role


@dataclass(frozen=True)
class OpInfo:
    """The numerics of one aten op family."""

    name: str
    kinds: frozenset[Kind] = field(default_factory=frozenset)
    reduces: Reduces | None = None
    bound: Bound | None = None
    literals: tuple[Literal, ...] = ()
    family: Family | None = None
    upcast: Upcast | None = None


#: every declared op by aten base name
OPS: dict[str, OpInfo] = {}


def declare(name: str, *kinds: Kind, reduces: Reduces | None = None, bound: Bound | None = None,
            literals: tuple[Literal, ...] = (), family: Family | None = None, upcast: Upcast | None = None) -> OpInfo:
    """Declare op ``name``; a second declaration of the same name raises ``ValueError``."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already declared ({OPS[name]}); declare each op once, with all its kinds")
    if (Kind.BOUNDED in kinds) != (bound is not None):
        raise ValueError(f"op {name!r}: a bounded op needs bound=..., and only a bounded op has one")
    if len({lit.position for lit in literals}) != len(literals):
        raise ValueError(f"op {name!r}: two literals at one position in {literals}")
    if (family is None) != (upcast is None):
        raise ValueError(f"op {name!r}: an op of an upcast family needs upcast=..., and only such an op has one")
    info = OpInfo(name, frozenset(kinds), reduces, bound, tuple(literals), family, upcast)
    OPS[name] = info
    ops_with.cache_clear()
    family_ops.cache_clear()
    ops_with_literal.cache_clear()
    return info


def op_base(op: str) -> str:
    """``"aten.mm.default"`` -> ``"mm"`` (a name without dots passes through)."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


_NONE = OpInfo("")


def op_info(name: str) -> OpInfo:
    """The declaration of aten base name ``name`` (an empty one for an undeclared op)."""
    return OPS.get(name, _NONE)


@cache
def ops_with(kind: Kind) -> frozenset[str]:
    """The base names of every op of ``kind``."""
    return frozenset(n for n, i in OPS.items() if kind in i.kinds)


def adds_an_offset(op: str) -> bool:
    """An op whose output holds or adds a value as it is -- a cast, an add/sub, a GEMM with a bias input -- so that
    an offset it rounds is common to the values a softmax compares. A product (``logit_scale * cos``, a GEMM without
    a bias) scales the differences with the values instead."""
    base = op_base(op)
    if base in ops_with(Kind.CAST) | ops_with(Kind.CANCELLING):
        return True
    return op_info(base).reduces is Reduces.INNER_1


def literal_values(name: str, args: tuple, kwargs: dict,
                   arg_names: tuple[str, ...] | None = None) -> tuple[tuple[Literal, float], ...]:
    """``(literal, value)`` for each declared literal of op ``name`` that this call passes as a Python number
    (by position or by keyword); a tensor or ``None`` in that place is not a literal. ``arg_names``: the called
    overload's schema argument names, when known (an overload can place a literal elsewhere:
    ``_native_batch_norm_legit.no_stats`` has ``eps`` at 5, not 7). No host sync."""
    out: list[tuple[Literal, float]] = []
    for lit in op_info(name).literals:
        pos = lit.position
        if arg_names is not None:
            if lit.name not in arg_names:
                continue
            pos = arg_names.index(lit.name)
        v = args[pos] if pos < len(args) else kwargs.get(lit.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((lit, float(v)))
    return tuple(out)


#: torch-level dunders and the aten base name they dispatch to (in-place dunders to the in-place op)
DUNDERS: dict[str, str] = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "rsub", "__isub__": "sub_",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div", "__rtruediv__": "div",
    "__itruediv__": "div_", "__pow__": "pow", "__rpow__": "pow", "__matmul__": "matmul", "__rmatmul__": "matmul",
}


def torch_names(names: frozenset[str] | set[str]) -> frozenset[str]:
    """``names`` plus the dunders that dispatch to one of them: the ``__name__`` s a torch-level callable of those
    ops may carry (``{"add"}`` -> ``{"add", "__add__", "__radd__"}``)."""
    return frozenset(names) | frozenset(d for d, base in DUNDERS.items() if base in names)


@cache
def family_ops(family: Family) -> dict[str, str]:
    """Base name -> :class:`Upcast` value of every op declared in ``family``, in declaration order."""
    return {n: i.upcast.value for n, i in OPS.items() if i.family is family and i.upcast is not None}


@cache
def ops_with_literal(role: Role) -> frozenset[str]:
    """The base names of every op with a literal argument of ``role``."""
    return frozenset(n for n, i in OPS.items() if any(lit.role is role for lit in i.literals))


def _lits(*spec: tuple[str, int, Role]) -> tuple[Literal, ...]:
    return tuple(Literal(n, p, r) for n, p, r in spec)


K = Kind
R = Role
F = Family
IN, FP32 = Upcast.INPUT, Upcast.FP32
# ------------------------------------------------------------------------------------ memory views and copies
for _n in ("view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "detach", "alias",
           "unsqueeze", "squeeze", "flatten", "unflatten", "view_as", "lift_fresh"):
    declare(_n, K.VIEW, K.SAME_ELEMENTS)
declare("expand", K.VIEW, K.REPEATS)
for _n in ("as_strided", "narrow", "select", "slice", "split", "split_with_sizes", "chunk", "unbind", "unfold"):
    declare(_n, K.VIEW)  # a subset of the input's elements
declare("clone", K.COPY, K.SAME_ELEMENTS)
declare("contiguous", K.COPY, K.SAME_ELEMENTS)
for _n in ("index", "index_select", "gather", "take", "embedding"):
    declare(_n, K.GATHERS)  # (embedding's first input is the weight)
declare("cat", K.JOIN)
declare("stack", K.JOIN)
for _n in ("_to_copy", "to", "_to_copy_", "copy_"):
    declare(_n, K.CAST)
for _n in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"):
    declare(_n, K.UNINITIALISED)
for _n in ("zeros", "zeros_like", "new_zeros", "zero", "zero_"):
    declare(_n, K.ZEROS)

# ------------------------------------------------------------------------------------ bounded functions, rows
declare("tanh", K.BOUNDED, bound=Bound("abs1", "tanh_backward", "±1"), family=F.TANH, upcast=IN)
declare("sigmoid", K.BOUNDED, bound=Bound("01", "sigmoid_backward", "0 or 1"), family=F.SIGMOID, upcast=IN)
_SOFTMAX_BOUND = Bound("1", "_softmax_backward_data", "1")
declare("softmax", K.BOUNDED, K.SOFTMAX, reduces=Reduces.ROW, bound=_SOFTMAX_BOUND, family=F.SOFTMAX, upcast=IN)
for _n in ("log_softmax", "_log_softmax"):
    declare(_n, K.SOFTMAX, reduces=Reduces.ROW, family=F.SOFTMAX, upcast=IN)
declare("_softmax", K.BOUNDED, K.SOFTMAX, reduces=Reduces.ROW, bound=_SOFTMAX_BOUND, family=F.SOFTMAX, upcast=IN)
declare("_safe_softmax", K.SOFTMAX, reduces=Reduces.ROW)
for _n in ("cumsum", "logsumexp"):
    declare(_n, reduces=Reduces.ROW)

# ------------------------------------------------------------------------------------ matmuls and convolutions
for _n in ("matmul", "linear", "_scaled_mm"):
    declare(_n, reduces=Reduces.INNER_0)
for _n in ("mm", "bmm"):
    declare(_n, K.GEMM, reduces=Reduces.INNER_0)
for _n in ("addmm", "baddbmm", "addbmm", "addmv"):
    declare(_n, K.GEMM, reduces=Reduces.INNER_1)
for _n in ("mv", "dot", "vdot", "addr", "_addmm_activation"):
    declare(_n, K.GEMM)
declare("convolution_backward", K.GEMM, reduces=Reduces.KERNEL_GRAD)
declare("convolution", K.GEMM, reduces=Reduces.KERNEL)
for _n in ("_convolution", "conv2d", "conv1d"):
    declare(_n, reduces=Reduces.KERNEL)

# ------------------------------------------------------------------------------------ reductions and arithmetic
# (family/upcast: what ``upcast_op`` runs in float32 by name; a norm statistic or a loss may not fit the low dtype)
for _n in ("pow", "square"):
    declare(_n, K.NORM_STATISTIC, family=F.NORM, upcast=FP32)
declare("var", K.CANCELLING, K.NORM_STATISTIC, reduces=Reduces.RATIO, family=F.NORM, upcast=FP32)
declare("var_mean", K.NORM_STATISTIC, reduces=Reduces.RATIO, family=F.NORM, upcast=FP32)
for _n in ("std", "std_mean"):
    declare(_n, reduces=Reduces.RATIO, family=F.NORM, upcast=FP32)
declare("norm", K.NORM_STATISTIC, reduces=Reduces.RATIO, family=F.NORM, upcast=FP32)
declare("linalg_vector_norm", K.NORM_STATISTIC, reduces=Reduces.RATIO, family=F.NORM, upcast=FP32)
declare("layer_norm", literals=_lits(("eps", 4, R.EPS)), family=F.NORM, upcast=IN)
declare("group_norm", literals=_lits(("eps", 4, R.EPS)), family=F.NORM, upcast=IN)
declare("rms_norm", literals=_lits(("eps", 3, R.EPS)), family=F.NORM, upcast=IN)
# losses: torch-level names (``F.cross_entropy.__name__``), which is what upcast_op matches
for _n in ("cross_entropy", "mse_loss", "nll_loss", "binary_cross_entropy_with_logits", "l1_loss", "smooth_l1_loss",
           "huber_loss", "kl_div"):
    declare(_n, family=F.LOSS, upcast=FP32)
declare("sum", K.CANCELLING, K.NORM_STATISTIC, reduces=Reduces.RATIO, family=F.LOSS, upcast=FP32)
declare("mean", K.CANCELLING, K.NORM_STATISTIC, reduces=Reduces.RATIO, family=F.LOSS, upcast=FP32)
for _n in ("exp", "expm1", "exp2"):
    declare(_n, K.EXPONENTIAL, family=F.EXP, upcast=FP32)
for _n in ("prod", "amax"):
    declare(_n, reduces=Reduces.RATIO)
_ADDEND = _lits(("other", 1, R.ADDEND))
_FACTOR = _lits(("other", 1, R.FACTOR))
for _n in ("sub", "add", "rsub"):
    declare(_n, K.CANCELLING, literals=_ADDEND)
for _n in ("addcmul", "addcdiv", "lerp"):
    declare(_n, K.CANCELLING)
declare("mul", K.NORM_STATISTIC, literals=_FACTOR)
declare("sqrt", K.NORM_SCALE)
for _n in ("rsqrt", "reciprocal"):
    declare(_n, K.NORM_SCALE, K.POLE)
for _n in ("log", "log2", "log10"):
    declare(_n, K.POLE, K.LOG)
for _n in ("div", "true_divide"):
    declare(_n, K.POLE, literals=_FACTOR)
for _n in ("sin", "cos"):
    declare(_n, K.PERIODIC)

# ------------------------------------------------------------------------------------ literal arguments
# (aten schemas: ``masked_fill.Scalar(self, mask, value)``, ``clamp(self, min, max)``,
# ``native_layer_norm(input, normalized_shape, weight, bias, eps)``, ``native_batch_norm(..., momentum, eps)``)
for _n in ("add_", "sub_"):  # in-place arithmetic: the same Scalar operand, no other kind
    declare(_n, literals=_ADDEND)
for _n in ("mul_", "div_"):
    declare(_n, literals=_FACTOR)
for _n in ("masked_fill", "masked_fill_"):
    declare(_n, K.MASKS, literals=_lits(("value", 2, R.FILL)))
for _n in ("fill", "fill_"):
    declare(_n, literals=_lits(("value", 1, R.FILL)))
declare("full_like", literals=_lits(("fill_value", 1, R.FILL)))
declare("full", literals=_lits(("fill_value", 1, R.FILL)))
declare("new_full", literals=_lits(("fill_value", 2, R.FILL)))
for _n in ("index_fill", "index_fill_"):
    declare(_n, literals=_lits(("value", 3, R.FILL)))
declare("where", K.CLIPS, K.MASKS, literals=_lits(("self", 1, R.FILL), ("other", 2, R.FILL)))
for _n in ("clamp", "clamp_", "clip", "clip_"):
    declare(_n, K.CLIPS, literals=_lits(("min", 1, R.BOUND), ("max", 2, R.BOUND)))
for _n in ("clamp_min", "clamp_min_"):
    declare(_n, K.CLIPS, literals=_lits(("min", 1, R.BOUND)))
for _n in ("clamp_max", "clamp_max_"):
    declare(_n, K.CLIPS, literals=_lits(("max", 1, R.BOUND)))
for _n in ("nan_to_num", "nan_to_num_", "hardtanh", "hardtanh_"):
    declare(_n, K.CLIPS)
declare("native_layer_norm", reduces=Reduces.ROW, literals=_lits(("eps", 4, R.EPS)))
declare("native_group_norm", reduces=Reduces.ROW, literals=_lits(("eps", 7, R.EPS)))
declare("_fused_rms_norm", literals=_lits(("eps", 3, R.EPS)))
for _n in ("native_batch_norm", "_native_batch_norm_legit", "batch_norm"):
    declare(_n, *((K.STATS_WRITE,) if _n == "native_batch_norm" else ()), literals=_lits(("eps", 7, R.EPS)))
for _n in ("cudnn_batch_norm", "miopen_batch_norm"):
    declare(_n, K.STATS_WRITE, literals=_lits(("epsilon", 7, R.EPS)))
declare("_native_batch_norm_legit_no_training", literals=_lits(("eps", 6, R.EPS)))
for _n in ("argmax", "max"):
    declare(_n, K.DECISION)
for _n in ("argmin", "min", "kthvalue"):
    declare(_n, K.DECISION, K.PICKS_SMALLEST)
declare("topk", K.DECISION, K.PICKS_K)
for _n in ("sort", "argsort"):
    declare(_n, K.DECISION, K.ORDERS)
for _n in ("gt", "lt", "ge", "le"):  # a threshold on a running total (nucleus sampling's cumsum > p) is a choice
    declare(_n, K.DECISION, K.THRESHOLDS)
del _n, K, R, F, IN, FP32

#: ops whose output holds (a subset of) the values of their inputs: a zero, a bound or a dtype passes through unchanged
ALIAS_OPS: frozenset[str] = ops_with(Kind.VIEW) | ops_with(Kind.COPY) | ops_with(Kind.JOIN)
