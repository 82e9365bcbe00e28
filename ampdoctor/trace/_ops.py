"""What each aten op family means numerically, declared once: the registry every layer reads.

An op is named by its aten base name (``aten.mm.default`` -> ``"mm"``). :func:`declare` registers one
:class:`OpInfo` per name and rejects a second declaration. Queries: :func:`op_info` for one op,
:func:`ops_with` for the set of ops of one :class:`Kind`.

>>> from ampdoctor.trace import Kind, op_base, op_info, ops_with
>>> op_base("aten.addmm.default"), op_info("addmm").reduces
('addmm', <Reduces.INNER_1: 'inner_1'>)
>>> op_info("tanh").bound.text, "clone" in ops_with(Kind.SAME_ELEMENTS), "clone" in ops_with(Kind.VIEW)
('±1', True, False)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cache

__all__ = ["Bound", "Kind", "OpInfo", "Reduces", "declare", "op_base", "op_info", "ops_with", "OPS"]


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
    POLE = "pole"                    # infinite where an input is 0: log(0) = -inf, 1/0, rsqrt(0), x / 0


class Reduces(enum.Enum):
    """How many terms K each output element sums (rounding error grows like sqrt(K) * u)."""

    INNER_0 = "inner_0"      # K = inputs[0].shape[-1]            (mm, bmm, matmul, linear)
    INNER_1 = "inner_1"      # K = inputs[1].shape[-1]            (addmm, baddbmm: inputs[0] is the bias)
    KERNEL = "kernel"        # K = prod(inputs[1].shape[1:])      (convolution: C_in * kernel size)
    ROW = "row"              # K = output.shape[-1]               (softmax, layer norm, cumsum along rows)
    RATIO = "ratio"          # K = numel(input) / numel(output)   (sum, mean, var, norms)


@dataclass(frozen=True)
class Bound:
    """The bound of a bounded op: ``stat`` names the trace's ``n_at_limit`` test (``"abs1"``: |y| == 1,
    ``"01"``: y in {0, 1}, ``"1"``: y == 1), ``backward`` its backward op, ``text`` the bound for people."""

    stat: str
    backward: str
    text: str


@dataclass(frozen=True)
class OpInfo:
    """The numerics of one aten op family."""

    name: str
    kinds: frozenset[Kind] = field(default_factory=frozenset)
    reduces: Reduces | None = None
    bound: Bound | None = None


#: every declared op by aten base name
OPS: dict[str, OpInfo] = {}


def declare(name: str, *kinds: Kind, reduces: Reduces | None = None, bound: Bound | None = None) -> OpInfo:
    """Declare op ``name``; a second declaration of the same name raises ``ValueError``."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already declared ({OPS[name]}); declare each op once, with all its kinds")
    if (Kind.BOUNDED in kinds) != (bound is not None):
        raise ValueError(f"op {name!r}: a bounded op needs bound=..., and only a bounded op has one")
    info = OpInfo(name, frozenset(kinds), reduces, bound)
    OPS[name] = info
    ops_with.cache_clear()
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


K = Kind
# ------------------------------------------------------------------------------------ memory views and copies
for _n in ("view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "detach", "alias",
           "unsqueeze", "squeeze", "flatten", "unflatten", "view_as", "lift_fresh"):
    declare(_n, K.VIEW, K.SAME_ELEMENTS)
declare("expand", K.VIEW, K.REPEATS)
for _n in ("as_strided", "narrow", "select", "slice", "split", "split_with_sizes", "chunk", "unbind", "unfold"):
    declare(_n, K.VIEW)  # a subset of the input's elements
declare("clone", K.COPY, K.SAME_ELEMENTS)
declare("contiguous", K.COPY, K.SAME_ELEMENTS)
declare("cat", K.JOIN)
declare("stack", K.JOIN)
for _n in ("_to_copy", "to", "_to_copy_", "copy_"):
    declare(_n, K.CAST)
for _n in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"):
    declare(_n, K.UNINITIALISED)

# ------------------------------------------------------------------------------------ bounded functions, rows
declare("tanh", K.BOUNDED, bound=Bound("abs1", "tanh_backward", "±1"))
declare("sigmoid", K.BOUNDED, bound=Bound("01", "sigmoid_backward", "0 or 1"))
_SOFTMAX_BOUND = Bound("1", "_softmax_backward_data", "1")
declare("_softmax", K.BOUNDED, K.SOFTMAX, reduces=Reduces.ROW, bound=_SOFTMAX_BOUND)
declare("softmax", K.BOUNDED, K.SOFTMAX, reduces=Reduces.ROW, bound=_SOFTMAX_BOUND)
for _n in ("_log_softmax", "log_softmax", "_safe_softmax"):
    declare(_n, K.SOFTMAX, reduces=Reduces.ROW)
for _n in ("native_layer_norm", "native_group_norm", "cumsum", "logsumexp"):
    declare(_n, reduces=Reduces.ROW)

# ------------------------------------------------------------------------------------ matmuls and convolutions
for _n in ("mm", "bmm", "matmul", "linear", "_scaled_mm"):
    declare(_n, reduces=Reduces.INNER_0)
for _n in ("addmm", "baddbmm", "addbmm", "addmv"):
    declare(_n, reduces=Reduces.INNER_1)
for _n in ("convolution", "_convolution", "conv2d", "conv1d"):
    declare(_n, reduces=Reduces.KERNEL)

# ------------------------------------------------------------------------------------ reductions and arithmetic
declare("sum", K.CANCELLING, K.NORM_STATISTIC, reduces=Reduces.RATIO)
declare("mean", K.CANCELLING, K.NORM_STATISTIC, reduces=Reduces.RATIO)
declare("var", K.CANCELLING, K.NORM_STATISTIC, reduces=Reduces.RATIO)
declare("var_mean", K.NORM_STATISTIC, reduces=Reduces.RATIO)
declare("linalg_vector_norm", K.NORM_STATISTIC, reduces=Reduces.RATIO)
declare("norm", K.NORM_STATISTIC, reduces=Reduces.RATIO)
for _n in ("std", "prod", "amax"):
    declare(_n, reduces=Reduces.RATIO)
for _n in ("sub", "add", "rsub", "addcmul", "addcdiv", "lerp"):
    declare(_n, K.CANCELLING)
for _n in ("pow", "mul", "square"):
    declare(_n, K.NORM_STATISTIC)
declare("sqrt", K.NORM_SCALE)
for _n in ("rsqrt", "reciprocal"):
    declare(_n, K.NORM_SCALE, K.POLE)
for _n in ("log", "log2", "log10", "div", "true_divide"):
    declare(_n, K.POLE)
for _n in ("sin", "cos"):
    declare(_n, K.PERIODIC)
del _n, K
