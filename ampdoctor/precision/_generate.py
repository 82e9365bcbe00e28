"""Greedy generation in a target precision next to an fp32 reference, aligned per decode step.

Both runs use the model's own cache (what ``model(ids, cache=None, use_cache=True)`` builds, e.g. a
``DynamicCache``); a model whose forward takes no cache is re-run on the whole sequence each step. The
reference picks every token (greedy argmax) and *both* runs are fed the reference's tokens (teacher forcing),
so decode step ``k`` of the target sees exactly the prefix the reference saw and a difference at step ``k``
arose at step ``k``. Memory is bounded: per step a handful of statistics stay on the device (read back once,
at the end), no activation is kept. One step can be re-run under the full op trace (:func:`generate`'s
``trace_step``), which is how the op-level root cause within the failing step is found.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampdoctor.errors import DiagnosisError
from ampdoctor.precision._contexts import (
    LOW_DTYPES,
    _fp8_context,
    _gemm_context,
    _NoAutocast,
    _precision_context,
    device_of,
)
from ampdoctor.precision._runner import RunResult
from ampdoctor.precision._spec import FP8_FORMATS, ScenarioError, _check_fp8_recipe
from ampdoctor.precision.fp8 import Fp8Stats
from ampdoctor.trace import Trace, TraceResult, iter_tensors

log = logging.getLogger(__name__)

#: a token flip is rounding noise when the reference's top-2 margin is within this many RMS logit errors ...
NOISE_MARGIN_RMS = 4.0
#: ... and the step's logits stay within this relative RMS error of the reference (beyond it: precision loss)
NOISE_REL_ERR = 0.1
#: precisions a generation can be diagnosed in; in an fp8 one the target decodes inside one emulated fp8 block
#: (:mod:`ampdoctor.precision.fp8`) re-entered every step, so delayed scaling's amax histories carry over from one
#: decode step to the next, as in a serving loop
GENERATION_PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp16-amp", "bf16-amp", "fp8", "fp8-e4m3", "fp8-e5m2")
_FIELDS = ("ref_token", "target_token", "ref_margin", "target_gap", "logit_err", "logit_rms", "finite",
           "cache_finite")


@dataclass(frozen=True)
class DecodeStat:
    """One decode step of the target against the reference (step 0 is the prefill of the prompt)."""

    step: int
    position: int  # position of the last token fed at this step (the one whose logits pick the next token)
    ref_token: int
    target_token: int  # the target's own argmax; -1 when its logits are not finite
    ref_margin: float  # reference logit of its token minus its runner-up
    target_gap: float  # target logit of its own token minus its logit of the reference's token (>= 0)
    logit_err: float  # RMS over the vocabulary of target - reference logits
    logit_rms: float  # RMS of the reference logits
    finite: bool  # the target's logits are finite
    cache_finite: bool  # the target's cache is finite after this step's write

    @property
    def agrees(self) -> bool:
        return self.finite and self.target_token == self.ref_token

    @property
    def within_noise(self) -> bool:
        """A flipped token whose reference margin the target's rounding error explains."""
        if not self.finite or self.agrees:
            return False
        rel = self.logit_err / self.logit_rms if self.logit_rms > 0 else math.inf
        return self.ref_margin <= NOISE_MARGIN_RMS * self.logit_err and rel <= NOISE_REL_ERR

    @property
    def failed(self) -> bool:
        return not self.finite or not self.cache_finite or not (self.agrees or self.within_noise)

    def to_dict(self) -> dict[str, Any]:
        return {"decode_step": self.step, "position": self.position, "ref_token": self.ref_token,
                "target_token": self.target_token, "ref_margin": self.ref_margin, "target_gap": self.target_gap,
                "logit_rel_err": self.logit_err / self.logit_rms if self.logit_rms > 0 else None,
                "finite": self.finite, "cache_finite": self.cache_finite, "within_noise": self.within_noise}


@dataclass
class Generation:
    """What :func:`generate` saw: per-step statistics, and the traced step's runs when one was traced."""

    stats: list[DecodeStat]
    prompt_len: int
    cache: str  # the cache class both runs used ("" without a cache)
    ref_tokens: list[int]
    traced: tuple[RunResult, RunResult] | None = None  # (target, reference) of ``trace_step``
    cache_records: set[int] = field(default_factory=set)  # target records that produced cache tensors
    #: an fp8 target's recipe (``None`` otherwise)
    fp8_recipe: Any = None


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The floating tensors a model cache holds (HF ``Cache`` layers, legacy tuples, or any nesting)."""
    if cache is None:
        return []
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)):
        out: list[torch.Tensor] = []
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    out.append(t)
        return out
    for a, b in (("self_attention_cache", "cross_attention_cache"),):
        if hasattr(cache, a):
            return cache_tensors(getattr(cache, a)) + cache_tensors(getattr(cache, b, None))
    return [t for t in iter_tensors(cache) if t.is_floating_point()]


class _Side:
    """One run: a model copy in a precision, its cache, and the calls that advance it by one step."""

    def __init__(self, model: nn.Module, precision: str | None, policy: str, reference: bool,
                 transforms: tuple[Any, ...], fp8_recipe: Any = None) -> None:
        self.model = copy.deepcopy(model)
        self.reference = reference
        self.precision = None if reference else precision
        if reference:
            self.model.to(torch.float32)
        elif precision in LOW_DTYPES:
            self.model.to(LOW_DTYPES[precision])
        if not reference:
            for transform in transforms:
                transform(self.model, None, None)
        self.model.eval()
        self.device = device_of(self.model)
        self.policy = policy
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = next((k for k in ("cache", "past_key_values") if k in params), None)
        self.use_cache_kw = "use_cache" in params
        self.cache: Any = None
        #: encoder-decoder models: the prompt is the encoder's input, generation runs in the decoder
        self.seq2seq = bool(getattr(getattr(self.model, "config", None), "is_encoder_decoder", False))
        self.encoder_ids: torch.Tensor | None = None
        self.amp = contextlib.nullcontext() if reference else _precision_context(precision, self.device, policy)
        #: an fp8 target's emulated block, re-entered every step (its amax histories continue)
        self.fp8 = None if reference or precision not in FP8_FORMATS else _fp8_context(precision, self.model,
                                                                                        fp8_recipe)

    def fp8_context(self) -> Any:
        return contextlib.nullcontext() if self.fp8 is None else self.fp8

    def fp8_since(self, start: int) -> Fp8Stats | None:
        """The fp8 statistics recorded from the ``start``-th quantisation on (one host sync); ``None`` without fp8."""
        if self.fp8 is None:
            return None
        stats = self.fp8.stats()
        return Fp8Stats(stats.recipe, stats.tensors[start:])

    def fp8_count(self) -> int:
        return 0 if self.fp8 is None else self.fp8.recorded()

    def gemm(self) -> Any:
        """CUDA's GEMM numerics off-GPU for the target (entered below a trace, as the step runner does)."""
        return contextlib.nullcontext() if self.reference else _gemm_context(self.precision, self.device, self.policy)

    def step(self, new_ids: torch.Tensor, all_ids: torch.Tensor, gemm: bool = True) -> torch.Tensor:
        """Feed ``new_ids`` (the cache holds the rest of ``all_ids``); the last position's logits."""
        kw: dict[str, Any] = {}
        if self.cache_kw is not None:
            kw[self.cache_kw] = self.cache
            ids = new_ids
        else:
            ids = all_ids
        if self.use_cache_kw:
            kw["use_cache"] = self.cache_kw is not None
        no_autocast = _NoAutocast(self.device.type) if self.reference else contextlib.nullcontext()
        if self.seq2seq:
            kw["decoder_input_ids"], ids = ids, self.encoder_ids  # type: ignore[assignment]
        with self.gemm() if gemm else contextlib.nullcontext(), torch.no_grad(), no_autocast, self.amp, \
                self.fp8_context():
            out = self.model(input_ids=ids, **kw)
        if self.cache_kw is not None:
            self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        logits = getattr(out, "logits", None)
        if logits is None:
            logits = out if isinstance(out, torch.Tensor) else out[0]
        if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
            raise ScenarioError("generation needs a model whose forward returns logits of shape (batch, seq, vocab) "
                                "(a tensor or an output with .logits), e.g. a *ForCausalLM model")
        return logits[:, -1, :] if logits.dim() == 3 else logits

    def close(self) -> None:
        self.cache = None


def _compare(ref: torch.Tensor, tgt: torch.Tensor, cache_ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's next token and the step's statistics, as device tensors (no host sync)."""
    r, t = ref[0].float(), tgt[0].float()
    top = torch.topk(r, 2).values if r.numel() > 1 else torch.cat([r, r - math.inf])
    ref_tok = torch.argmax(r)
    finite = torch.isfinite(t).all()
    tgt_tok = torch.where(finite, torch.argmax(torch.nan_to_num(t, nan=-math.inf)), torch.tensor(-1))
    gap = torch.where(finite, t.max() - t[ref_tok], torch.tensor(math.inf))
    diff = torch.where(torch.isfinite(t), t - r, torch.zeros_like(r))
    err = torch.where(finite, diff.pow(2).mean().sqrt(), torch.tensor(math.inf))
    row = torch.stack([ref_tok.double(), tgt_tok.double(), (top[0] - top[1]).double(), gap.double(), err.double(),
                       r.pow(2).mean().sqrt().double(), finite.double(), cache_ok.double()])
    return ref_tok.reshape(1, 1), row


def _cache_ok(side: _Side) -> torch.Tensor:
    ts = cache_tensors(side.cache)
    if not ts:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(t).all() for t in ts]).all()


def validate_generation(model: Any, input_ids: Any, precision: str | None, max_new_tokens: Any,
                        fp8_recipe: Any = None) -> None:
    """Raise :class:`ScenarioError` (what to pass) before anything runs."""
    if not isinstance(model, nn.Module):
        raise ScenarioError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if precision not in GENERATION_PRECISIONS:
        allowed = ", ".join(repr(p) for p in GENERATION_PRECISIONS)
        raise ScenarioError(f"invalid precision {precision!r} for a generation, expected one of {allowed}")
    _check_fp8_recipe(fp8_recipe, precision)
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.dim() != 2:
        raise ScenarioError("input_ids must be an integer tensor of shape (1, prompt_len), e.g. "
                            "tokenizer(text, return_tensors='pt')['input_ids']")
    if input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ScenarioError(f"generation diagnosis takes one prompt (batch 1, at least one token), got shape "
                            f"{tuple(input_ids.shape)}; pass input_ids[:1]")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ScenarioError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def generate(model: nn.Module, input_ids: torch.Tensor, *, precision: str, max_new_tokens: int,
             policy: str = "cuda", transforms: tuple[Any, ...] = (), trace_step: int | None = None,
             fp8_recipe: Any = None) -> Generation:
    """Greedy, teacher-forced generation of ``max_new_tokens`` steps in ``precision`` next to fp32.

    Runs on deep copies (the caller's model is untouched); EOS does not stop it. With ``trace_step``, that step
    runs under the full op trace in both runs and the generation stops after it (an fp8 target's traced run
    carries the fp8 statistics of every decode step up to it: their ``step`` is the decode step, since each
    layer quantises once per forward; a clip at an earlier step corrupts the KV cache before a token flips).
    ``fp8_recipe``: an fp8 target's :class:`Fp8Recipe` (default ``Fp8Recipe()`` in the precision's format).
    Host syncs: one, at the end (and the trace's read-back of the traced step).
    """
    validate_generation(model, input_ids, precision, max_new_tokens, fp8_recipe)
    ref = _Side(model, precision, policy, True, transforms)
    tgt = _Side(model, precision, policy, False, transforms, fp8_recipe)
    device = ref.device
    ids = input_ids.to(device)
    if ref.seq2seq:  # the decoder starts from its start token; positions count decoder tokens
        ref.encoder_ids = tgt.encoder_ids = ids
        ids = torch.full((1, 1), decoder_start(ref.model), dtype=ids.dtype, device=device)
    prompt_len = ids.shape[1]
    rows: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    new = ids
    traced: tuple[RunResult, RunResult] | None = None
    cache_records: set[int] = set()
    last = max_new_tokens - 1 if trace_step is None else min(trace_step, max_new_tokens - 1)
    try:
        for step in range(last + 1):
            if step == trace_step:
                r_logits, r_run, _ = _traced(ref, new, ids)
                t_logits, t_run, cache_records = _traced(tgt, new, ids)
                t_run.fp8 = tgt.fp8_since(0)  # every decode step so far: a scale that clipped earlier is named
                traced = (t_run, r_run)
            else:
                r_logits = _checked(ref, new, ids, step, precision)
                t_logits = _checked(tgt, new, ids, step, precision)
            nxt, row = _compare(r_logits, t_logits, _cache_ok(tgt))
            rows.append(row)
            tokens.append(nxt)
            new = nxt.to(ids.dtype)
            ids = torch.cat([ids, new], dim=1)
        cache_name = type(tgt.cache).__name__ if tgt.cache is not None else ""
    finally:
        ref.close()
        tgt.close()
    values = torch.stack([r.cpu() for r in rows]).tolist() if rows else []  # the one host sync
    stats = []
    for step, v in enumerate(values):
        d = dict(zip(_FIELDS, v))
        stats.append(DecodeStat(step, prompt_len - 1 + step, int(d["ref_token"]), int(d["target_token"]),
                                float(d["ref_margin"]), float(d["target_gap"]), float(d["logit_err"]),
                                float(d["logit_rms"]), bool(d["finite"]), bool(d["cache_finite"])))
    recipe = tgt.fp8.recipe if tgt.fp8 is not None else None
    return Generation(stats, prompt_len, cache_name, [int(s.ref_token) for s in stats], traced, cache_records,
                      recipe)


def decoder_start(model: nn.Module) -> int:
    """The decoder start token of an encoder-decoder model (its config's, else its pad token, else 0)."""
    cfg = getattr(model, "config", None)
    for name in ("decoder_start_token_id", "pad_token_id", "bos_token_id"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return 0


def _checked(side: _Side, new: torch.Tensor, ids: torch.Tensor, step: int, precision: str) -> torch.Tensor:
    """``side.step``, with a crash turned into an error that says which run and which decode step."""
    try:
        return side.step(new, ids)
    except ScenarioError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        if side.reference:
            raise ScenarioError(
                f"the model cannot decode step {step} (sequence length {ids.shape[1]}) even in float32: "
                f"{type(e).__name__}: {first}. Check that it is a causal LM taking input_ids (and a cache), and that "
                "prompt + max_new_tokens fits its context length") from e
        raise DiagnosisError(f"the {precision} run raised {type(e).__name__} at decode step {step} where fp32 did "
                             f"not: {first}. Run that step without ampdoctor to see the full traceback") from e


def _traced(side: _Side, new: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, RunResult, set[int]]:
    """One step under the full op trace, as a :class:`RunResult` the findings rules read."""
    tr = Trace(side.model, None, full=True)
    names = tr.attribution.param_names
    owners = tr.attribution.param_owner
    result = RunResult("reference" if side.reference else "target", side.precision, TraceResult([], True),
                       forward_only=True, device=str(side.device))
    result.owners = {names[i]: owners[i] for i in names}
    result.param_dtypes = {names.get(id(p), ""): str(p.dtype).replace("torch.", "") for p in side.model.parameters()}
    result.keep_fp32 = list(getattr(side.model, "_keep_in_fp32_modules", None) or [])
    with side.gemm(), tr:  # the GEMM emulation below the trace, so the trace records the GEMMs in their dtype
        tr.set_step(0)
        logits = side.step(new, ids, gemm=False)
        tr.mark("output", logits)
        cache = [i for t in cache_tensors(side.cache) if (i := tr.index_of(t)) is not None]
    result.trace = tr.result()
    result.output_records = tr.marks.get("output", [])
    result.losses, result.loss_records = [None], [None]
    return logits, result, set(cache)
