"""On-device statistics of one tensor, computed without a host sync.

Each function returns a 1-D float64 tensor on the tensor's device; rows are stacked and read back once per
step. The field order is fixed by :data:`FULL_FIELDS` / :data:`CHEAP_FIELDS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampdoctor.trace._dtypes import FP8_DTYPES, HEADROOM_FORMATS, dtype_limits
from ampdoctor.trace._ops import OPS

#: Full statistics, one float64 each. ``absmax``/``min_nonzero`` are over finite values only; ``n_at_max``
#: counts values whose magnitude equals the dtype's largest finite value (clipped by a clamp or a saturating
#: cast); ``n_subnormal`` counts nonzero finite values below the dtype's smallest normal; ``norm`` is the
#: L2 norm of the finite values (computed in fp32).
FULL_FIELDS: tuple[str, ...] = (
    "absmax",
    "min_nonzero",
    "n_nan",
    "n_posinf",
    "n_neginf",
    "n_zero",
    "n_subnormal",
    "n_at_max",
    "numel",
    "norm",
    "n_at_limit",
)

#: The cheap tier: ``torch.aminmax`` of the tensor. inf and NaN propagate through min/max, so these two
#: numbers tell both the range and whether anything is non-finite.
CHEAP_FIELDS: tuple[str, ...] = ("min", "max")

_FP8 = FP8_DTYPES


@dataclass(frozen=True)
class Request:
    """Which of a full row's statistics a traced run computes; a field not asked for reads NaN ("not measured").

    The run's caller declares it from what its analysis reads (the read audit, ``bench/trace_reads.py`` and
    ``bench/results/trace_overhead.md``): the diagnosis's runner asks :data:`FULL` of the target run and
    :data:`REFERENCE` of the fp32 reference; a run read only by ``headroom`` / ``check``'s quick pass asks
    :data:`HEADROOM_ONLY`. The range, the zero and non-finite counts and ``numel`` are always computed (every reader
    reads them); lite rows (optimizer outputs, parameter leaves) are one ``aminmax`` in every request."""

    #: ``norm``: the relative-error comparisons (``findings._analysis``), the report's layer table
    norm: bool = True
    #: ``n_subnormal``: evidence of the target's underflow and precision-loss findings (their inputs' subnormals)
    subnormal: bool = True
    #: ``n_at_max``: fp8 saturation in the target; the fp32 run's max sentinels in ``headroom`` and ``triage``
    at_max: bool = True
    #: ``n_at_limit``: a bounded op's outputs at its bound, target and reference (``saturated_records``)
    at_limit: bool = True
    #: element samples (step 0, forward/backward) only of outputs whose finite |max| exceeds this, where the row
    #: is computed on the host (its |max| is known when the sample is taken; a device row is always sampled)
    samples_above: float = 0.0


#: every statistic (``trace(full=True)``'s default; the diagnosis's target run)
FULL = Request()
#: the diagnosis's fp32 reference: no finding reads its subnormal or at-max counts (``flush_of`` passes the
#: reference's row on, its readers take ``absmax``/``min_nonzero``/``n_zero``); shared with ``headroom`` it keeps
#: ``n_at_max`` (:data:`REFERENCE_HEADROOM`)
REFERENCE = Request(subnormal=False, at_max=False)
REFERENCE_HEADROOM = Request(subnormal=False)
#: a run read only by ``headroom_from_run`` and ``check``'s quick pass (``triage``): range, zeros, flush counts,
#: non-finite counts, ``n_at_max`` -- no norm, no subnormal or at-limit count; samples only beyond |max| 256, the
#: only ones triage reads (integers a 16-bit format rounds: bf16 holds them exactly up to 256, fp16 up to 2048)
HEADROOM_ONLY = Request(norm=False, subnormal=False, at_limit=False, samples_above=256.0)

#: Ops whose output is bounded (the op registry's bounds); ``n_at_limit`` counts outputs that reached it exactly.
BOUNDED_OPS: dict[str, str] = {name: info.bound.stat for name, info in OPS.items() if info.bound is not None}


class Scratch:
    """Reusable work buffers, one float buffer per (device, dtype) and one bool buffer per device.

    Writing comparisons and ``abs`` into preallocated buffers (``out=``) and counting with
    ``count_nonzero`` avoids allocating (and page-faulting) a fresh tensor per statistic: on CPU that is
    4-10x faster for large tensors than ``(x == 0).sum()``.

    Statistics rows are handed out as rows of blocks of :attr:`ROWS_PER_BLOCK` (:meth:`row`): thousands of
    separately allocated 88-byte tensors that outlive the step's transient tensors pin the holes those leave in
    the C heap (measured on a 220M-parameter T5 step: 0.9 GiB more peak RSS). Rows are never handed out twice.
    """

    ROWS_PER_BLOCK = 2048

    def __init__(self) -> None:
        self._float: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self._bool: dict[torch.device, torch.Tensor] = {}
        self._rows: dict[tuple[torch.device, int], list[Any]] = {}
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self._bool_views: dict[tuple[Any, ...], torch.Tensor] = {}

    def row(self, width: int, device: torch.device) -> torch.Tensor:
        """A fresh float64 vector of ``width`` elements (uninitialised), a row of a shared block."""
        key = (device, width)
        block = self._rows.get(key)
        if block is None or block[1] == self.ROWS_PER_BLOCK:
            block = [torch.empty((self.ROWS_PER_BLOCK, width), dtype=torch.float64, device=device), 0]
            self._rows[key] = block
        row = block[0][block[1]]
        block[1] += 1
        return row

    def floats(self, x: torch.Tensor, slot: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer shaped like ``x`` (uninitialised), of ``x``'s dtype or ``dtype``; ``slot`` picks one of several
        live at once.

        The view for a shape is made once and handed out again (slicing and viewing per call cost more than the
        ``abs`` of a small tensor); growing a buffer drops the views of the old one."""
        dev = x.device
        dtype = x.dtype if dtype is None else dtype
        view_key = (dev, dtype, slot, x.shape)
        view = self._views.get(view_key)
        if view is not None:
            return view
        key = (dev, dtype, slot)
        buf = self._float.get(key)
        if buf is None or buf.numel() < x.numel():
            buf = torch.empty(max(x.numel(), 1024), dtype=dtype, device=dev)
            self._float[key] = buf
            self._views = {k: v for k, v in self._views.items() if k[:3] != key}
        view = buf[: x.numel()].view(x.shape)
        self._views[view_key] = view
        return view

    def bools(self, x: torch.Tensor) -> torch.Tensor:
        """A bool buffer shaped like ``x`` (uninitialised), its view cached per shape as in :meth:`floats`."""
        dev = x.device
        view_key = (dev, x.shape)
        view = self._bool_views.get(view_key)
        if view is not None:
            return view
        buf = self._bool.get(dev)
        if buf is None or buf.numel() < x.numel():
            buf = torch.empty(max(x.numel(), 1024), dtype=torch.bool, device=dev)
            self._bool[dev] = buf
            self._bool_views = {k: v for k, v in self._bool_views.items() if k[0] != dev}
        view = buf[: x.numel()].view(x.shape)
        self._bool_views[view_key] = view
        return view

    def clear(self) -> None:
        self._float.clear()
        self._bool.clear()
        self._rows.clear()
        self._views.clear()
        self._bool_views.clear()


def _row(scratch: Scratch | None, parts: list[torch.Tensor] | None, values: list[float] | None,
         device: torch.device) -> torch.Tensor:
    """A statistics row from 0-d tensors ``parts`` or host ``values``, in ``scratch``'s row blocks if given."""
    if parts is not None:
        parts = [p.to(torch.float64) for p in parts]
        return torch.stack(parts) if scratch is None else torch.stack(parts, out=scratch.row(len(parts), device))
    row = torch.tensor(values, dtype=torch.float64, device=device)
    return row if scratch is None else scratch.row(len(row), device).copy_(row)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's own shard (FSDP2 ``DTensor``): statistics are per rank."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


_FINFO: dict[torch.dtype, torch.finfo] = {}


def _finfo(dtype: torch.dtype) -> torch.finfo:
    """``torch.finfo(dtype)``, made once per dtype (a fresh one per output cost as much as a small reduction)."""
    fi = _FINFO.get(dtype)
    if fi is None:
        fi = _FINFO[dtype] = torch.finfo(dtype)
    return fi


def _prepare(t: torch.Tensor) -> tuple[torch.Tensor, torch.finfo]:
    x = t if type(t) is torch.Tensor else _local(t)
    if x.requires_grad:  # below autograd (inside the dispatch mode) nothing requires grad: no detach op per output
        x = x.detach()
    dtype = x.dtype
    finfo = _finfo(dtype)
    if dtype in _FP8:
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    return x, finfo


#: Devices whose tensors take the host path (:func:`_host_row`, :func:`lite_stats`): reading a CPU value back is
#: no device sync, and a host list costs a few float passes where the reduction path costs a dozen small ops. Every
#: other device takes the reduction path, which never reads a value back during the step.
HOST_DEVICES: frozenset[str] = frozenset({"cpu"})
#: Elements per chunk of the host path (1 MiB of float32: the scratch stays in cache).
CPU_CHUNK = 1 << 18
#: :class:`Scratch` slot of the float32 copy of a float16 tensor on the host path (0 and 1 are ``abs``/``sign``)
_F16_SLOT = 2
#: per format whose values the host path holds in float32 (float16's copy): a float32 number between its largest
#: subnormal and its smallest normal. ``|x| < tiny`` counts as ``(n - sum(sign(|x| - mid))) / 2`` -- a subtraction, a
#: sign and a float sum, ~3x faster on CPU than a comparison into a bool mask and its count (bench/results/
#: diagnose_split.md): ``|x| - mid`` is never zero (no value is ``mid``) and keeps its sign when rounded
_BELOW_TINY: dict[str, float] = {"float16": torch.finfo(torch.float16).tiny - 2.0 ** -25}


def full_stats(t: torch.Tensor, bounded: str | None = None, scratch: Scratch | None = None,
               flush: bool = False, req: Request = FULL) -> torch.Tensor | list[float]:
    """Full statistics of ``t`` in :data:`FULL_FIELDS` order (+ :func:`flush_counts` if ``flush``); the fields
    ``req`` does not ask for read NaN.

    No host sync on an accelerator: a float64 tensor row, read back once per step. A CPU tensor (where reading a
    value back is no sync) takes :func:`_host_row` when it is all finite: the same numbers as a host list, from
    two to five float passes instead of a dozen reductions and comparisons."""
    x, finfo = _prepare(t)
    n = x.numel()
    dev = x.device
    if n == 0:
        row = torch.tensor([0.0, math.inf, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64, device=dev)
        return torch.cat([row, flush_counts(t, scratch)]) if flush else row
    sc = scratch if scratch is not None else Scratch()
    if not req.at_limit:
        bounded = None
    if dev.type in HOST_DEVICES and not (flush and x.dtype == torch.float64):
        # float16 through a float32 copy (``finfo`` stays float16's): the float32-accumulated norm of a float16
        # tensor and the counts' compares cost more than the copy plus float32's (10-26 % of a float16 row; bench/
        # results/diagnose_split.md), and every value is exact in float32, so each field is the same number
        xh = torch.Tensor.copy_(sc.floats(x, _F16_SLOT, torch.float32), x) if x.dtype == torch.float16 else x
        values = _host_row(xh, finfo, bounded, sc, flush, req)
        if values is not None:
            return values
    row = _row(scratch, _device_row(x, finfo, bounded, sc, req), None, dev)
    return torch.cat([row, flush_counts(t, sc)]) if flush else row


def _device_row(x: torch.Tensor, finfo: torch.finfo, bounded: str | None, sc: Scratch,
                req: Request = FULL) -> list[torch.Tensor]:
    """:data:`FULL_FIELDS` of a contiguous non-empty tensor as 0-d tensors: no host read (any device, any value).
    Fields ``req`` leaves out are NaN (no pass)."""
    n = x.numel()
    dev = x.device
    b = sc.bools(x)
    a = torch.abs(x, out=sc.floats(x))
    cnt = torch.count_nonzero
    n_nonzero = cnt(x)  # NaN and inf count as nonzero
    n_nan = cnt(torch.ne(x, x, out=b))
    n_posinf = cnt(torch.eq(x, math.inf, out=b))
    n_neginf = cnt(torch.eq(x, -math.inf, out=b))
    if bounded == "abs1":
        n_lim = cnt(torch.eq(a, 1, out=b))
    elif bounded == "01":
        n_lim = cnt(torch.eq(x, 1, out=b)) + (n - n_nonzero)
    elif bounded == "1":
        n_lim = cnt(torch.eq(x, 1, out=b))
    elif req.at_limit:
        n_lim = torch.zeros((), dtype=torch.int64, device=dev)
    else:
        n_lim = torch.full((), math.nan, dtype=torch.float64, device=dev)
    n_at_max = cnt(torch.eq(a, finfo.max, out=b)) if req.at_max else torch.full((), math.nan, device=dev)
    torch.nan_to_num_(a, nan=0.0, posinf=0.0, neginf=0.0)  # finite magnitudes only from here on
    absmax = a.amax()
    n_nonfinite = n_nan + n_posinf + n_neginf
    n_zero = n - n_nonzero
    n_sub = (cnt(torch.lt(a, finfo.tiny, out=b)) - n_zero - n_nonfinite if req.subnormal
             else torch.full((), math.nan, device=dev))
    norm = (torch.linalg.vector_norm(a, dtype=torch.float64 if a.dtype == torch.float64 else torch.float32)
            if req.norm else torch.full((), math.nan, device=dev))
    a.masked_fill_(torch.eq(a, 0, out=b), math.inf)
    min_nz = a.amin()
    return [absmax, min_nz, n_nan, n_posinf, n_neginf, n_zero, n_sub, n_at_max,
            torch.full((), float(n), device=dev), norm, n_lim]


def _host_row(x: torch.Tensor, finfo: torch.finfo, bounded: str | None, sc: Scratch,  # long: one pass plan
              flush: bool, req: Request = FULL) -> list[float] | None:
    """:func:`full_stats` values of a contiguous CPU tensor that holds no inf or NaN; ``None`` if it holds any.

    Walks ``x`` in chunks of :data:`CPU_CHUNK` elements: ``abs`` into a chunk-sized scratch buffer and one
    ``aminmax`` of it decide everything else, since a non-finite value shows in its max (NaN propagates), a zero in
    its min, a subnormal or a flush-to-zero candidate in the smallest nonzero magnitude. Counts known to be zero
    are skipped; zeros are counted and masked with float ops (``sign``, a sum, one ``add``), several times faster
    on CPU than comparisons into a bool mask. The norm is one pass over ``x`` (``|x|**2 == x**2``, same order):
    every number is bit-identical to :func:`_device_row` (and :func:`flush_counts`). A count ``req`` leaves out is
    neither counted nor decided on (NaN)."""
    n = x.numel()
    lo_ok = finfo.tiny if req.subnormal else 0.0  # (a smallest magnitude from here up needs no count)
    hi_ok = finfo.max if req.at_max else math.inf
    if n <= CPU_CHUNK:  # one chunk (most outputs): no loop, and a range inside every bound needs no count at all
        a = torch.abs(x, out=sc.floats(x))
        mn, mx = torch.aminmax(a)
        hi = mx.item()
        if not math.isfinite(hi):
            return None
        lo = mn.item()
        absmax = hi
        counts = [0, 0, 0, 0]  # zeros, subnormals, at max, at the op's bound
        flushed = [0] * len(HEADROOM_FORMATS)
        if bounded is None and not flush and lo >= lo_ok and lo > 0.0 and hi < hi_ok:
            min_nz = lo
        else:
            min_nz = _chunk_counts(x, a, lo, hi, finfo, bounded, sc, counts, flushed if flush else None, req)
        flat = x
    else:
        flat = x.reshape(-1)
        absmax, min_nz = 0.0, math.inf
        counts = [0, 0, 0, 0]
        flushed = [0] * len(HEADROOM_FORMATS)
        for start in range(0, n, CPU_CHUNK):
            xc = flat[start:start + CPU_CHUNK]
            a = torch.abs(xc, out=sc.floats(xc))
            mn, mx = torch.aminmax(a)
            lo, hi = mn.item(), mx.item()
            if not math.isfinite(hi):
                return None
            absmax = max(absmax, hi)
            min_nz = min(min_nz, _chunk_counts(xc, a, lo, hi, finfo, bounded, sc, counts,
                                               flushed if flush else None, req))
    if bounded == "01":
        counts[3] += counts[0]
    # (a float32 or float64 tensor -- 4 bytes or more -- is reduced in its own dtype: no dtype argument, the same
    # bits, less dispatch)
    if not req.norm:
        norm = math.nan
    elif flat.dtype.itemsize >= 4:
        norm = torch.linalg.vector_norm(flat).item()
    else:
        norm = torch.linalg.vector_norm(flat, dtype=torch.float32).item()
    nan = math.nan
    row = [absmax, min_nz, 0.0, 0.0, 0.0, float(counts[0]), float(counts[1]) if req.subnormal else nan,
           float(counts[2]) if req.at_max else nan, float(n), norm, float(counts[3]) if req.at_limit else nan]
    return row + [float(f) for f in flushed] if flush else row


def _chunk_counts(xc: torch.Tensor, a: torch.Tensor, lo: float, hi: float, finfo: torch.finfo, bounded: str | None,
                  sc: Scratch, counts: list[int], flushed: list[int] | None, req: Request = FULL) -> float:
    """Add one finite chunk's counts (``a = |xc|``, ``lo``/``hi`` its range) into ``counts`` and ``flushed``;
    return the chunk's smallest nonzero magnitude (inf if none)."""
    cnt = torch.count_nonzero
    if bounded == "abs1":
        counts[3] += int(cnt(torch.eq(a, 1, out=sc.bools(a))))
    elif bounded in ("01", "1"):
        counts[3] += int(cnt(torch.eq(xc, 1, out=sc.bools(a))))
    if hi >= finfo.max and req.at_max:
        counts[2] += int(cnt(torch.eq(a, finfo.max, out=sc.bools(a))))
    zeros = 0
    if lo == 0.0:
        s = torch.sign(a, out=sc.floats(a, 1))  # 1 where nonzero, 0 where zero
        zeros = a.numel() - int(s.sum(dtype=torch.float32).item())  # exact: a chunk has < 2**24 elements
        counts[0] += zeros
        if zeros == a.numel():
            return math.inf
        lo = torch.add(a, s.sub_(1), alpha=-finfo.max, out=s).amin().item()  # zeros read as the max
    if lo < finfo.tiny and req.subnormal:
        mid = _BELOW_TINY.get(finfo.dtype) if a.dtype == torch.float32 else None
        if mid is None:
            below = int(cnt(torch.lt(a, finfo.tiny, out=sc.bools(a))))
        else:  # float16 values in float32: no value lies at ``mid``, so each is below it or above it
            s = torch.sign(torch.add(a, -mid, out=sc.floats(a, 1)), out=sc.floats(a, 1))
            below = (a.numel() - int(s.sum(dtype=torch.float32).item())) // 2  # exact: < 2**24 elements
        counts[1] += below - zeros
    if flushed is not None:
        a32 = a if a.dtype == torch.float32 else a.float()
        for i, (_, _, th) in enumerate(HEADROOM_FORMATS):
            if lo < th:  # only a nonzero magnitude below the threshold can flush
                flushed[i] += int(cnt(torch.lt(a32, th, out=sc.bools(a32)))) - zeros
    return lo


def lite_stats(t: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor | list[float]:
    """:data:`FULL_FIELDS` from one ``aminmax`` pass: the range and which kinds of non-finite values occur
    (counted as 0/1). Counts it cannot know (zeros, subnormals, values at the max, the norm) read 0 and
    ``min_nonzero`` reads inf, so no count-based rule fires on them. Used for optimizer-phase outputs and
    parameter leaves, where full counts would cost more than the optimizer step itself. A CPU tensor reads the pair
    back and returns the row as a host list instead of a dozen small tensor ops (same numbers)."""
    x, _ = _prepare(t)
    dev = x.device
    if x.numel() == 0:
        return torch.tensor([0.0, math.inf, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64, device=dev)
    mn, mx = torch.aminmax(x)
    if dev.type in HOST_DEVICES:
        lo, hi = mn.item(), mx.item()
        has_nan = lo != lo or hi != hi
        return [0.0 if has_nan else max(abs(lo), abs(hi)), math.inf, float(has_nan), float(hi == math.inf),
                float(lo == -math.inf), 0.0, 0.0, 0.0, float(x.numel()), 0.0, 0.0]
    mn, mx = mn.to(torch.float64), mx.to(torch.float64)
    nan = (mn != mn) | (mx != mx)
    absmax = torch.where(nan, torch.zeros((), dtype=torch.float64, device=dev), torch.maximum(mn.abs(), mx.abs()))
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    parts = [absmax, torch.full((), math.inf, dtype=torch.float64, device=dev), nan.to(torch.float64),
             (mx == math.inf).to(torch.float64), (mn == -math.inf).to(torch.float64), zero, zero, zero,
             torch.full((), float(x.numel()), dtype=torch.float64, device=dev), zero, zero]
    return _row(scratch, parts, None, dev)


def zeros_lite_row(t: torch.Tensor) -> list[float] | None:
    """What :func:`lite_stats` returns for ``t`` if every element is zero, without reading it (``None``: ``t`` is not a
    plain non-empty CPU tensor, compute it). For the outputs of ops the registry declares all-zero
    (:attr:`Kind.ZEROS <ampdoctor.trace._ops.Kind>`: a fresh optimizer's ``zeros_like`` state, a ``zero_`` of the
    gradients), one parameter-sized pass each in an optimizer step."""
    if type(t) is not torch.Tensor or t.device.type not in HOST_DEVICES or t.numel() == 0:
        return None
    return [0.0, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, float(t.numel()), 0.0, 0.0]


#: Flush thresholds per format (half the smallest subnormal: anything below rounds to zero), in this order:
#: :data:`ampdoctor.trace._dtypes.HEADROOM_FORMATS`.


def flush_counts(t: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """Per format of :data:`HEADROOM_FORMATS`: count of nonzero finite values that would round to zero."""
    x, _ = _prepare(t)
    x = x.float()
    sc = scratch if scratch is not None else Scratch()
    b = sc.bools(x)
    a = torch.abs(x, out=sc.floats(x))
    torch.nan_to_num_(a, nan=0.0, posinf=0.0, neginf=0.0)
    zeros = x.numel() - torch.count_nonzero(a)
    return torch.stack([torch.count_nonzero(torch.lt(a, th, out=b)) - zeros
                        for _, _, th in HEADROOM_FORMATS]).to(torch.float64)


def cheap_stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``t`` as two 0-d tensors in ``t``'s dtype (no host sync; stacked and cast once per
    step when read back). Empty tensors give zeros. Runs below autograd: no ``detach`` needed."""
    t = _local(t)
    if t.numel() == 0:
        z = torch.zeros((), dtype=torch.float32, device=t.device)
        return z, z
    if t.dtype in _FP8:
        t = t.float()
    return torch.aminmax(t)


__all__ = ["BOUNDED_OPS", "CHEAP_FIELDS", "FULL", "FULL_FIELDS", "HEADROOM_FORMATS", "HEADROOM_ONLY", "REFERENCE",
           "REFERENCE_HEADROOM", "Request", "Scratch", "cheap_stats", "dtype_limits",
           "flush_counts", "full_stats", "lite_stats", "zeros_lite_row"]
