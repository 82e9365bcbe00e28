"""``diagnose_generate``: where greedy generation in a low precision first goes wrong, down to the op.

>>> report = ampdoctor.diagnose_generate(model, input_ids, precision="fp16", max_new_tokens=16)  # doctest: +SKIP
>>> f = report.findings[0]; f.code, f.module, f.evidence["decode_step"], f.evidence["position"]  # doctest: +SKIP
('overflow', 'transformer.h.1.mlp.c_fc', 5, 8)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from ampdoctor.findings import Evidence, Finding, LayerStat, Report, analyse, build_context, enrich_all
from ampdoctor.findings import layers as layer_table
from ampdoctor.findings import summary as run_summary
from ampdoctor.precision import (
    NOISE_MARGIN_RMS,
    NOISE_REL_ERR,
    DecodeStat,
    Generation,
    ScenarioError,
    StepSpec,
    compare_compiled_generation,
    decoder_start,
    first_position,
    generate,
    keep_fp32_transform,
    position_profile,
    saved_rng,
    validate_generation,
)

log = logging.getLogger(__name__)


def unwrap_compiled(model: Any) -> tuple[Any, list[str]]:
    """A ``torch.compile``d module's original (eager) module, and a note saying so; other models unchanged."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(model, nn.Module) and isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, [f"the model is torch.compile()d: diagnosed through its original module "
                       f"({type(inner).__name__}, eager), where every op is visible; compiled kernels can differ "
                       "from eager (fusions, upcasts): `ampdoctor diagnose --hf DIR --compiled` compares them"]
    return model, []


def diagnose_generate(model: nn.Module, input_ids: torch.Tensor, *, precision: str = "fp16",
                      max_new_tokens: int = 16, keep_fp32: Iterable[str] = (), policy: str = "cuda",
                      source: str = "", compiled: bool = False, fp8_recipe: Any = None) -> Report:
    """Diagnose a greedy generation of ``max_new_tokens`` tokens from ``input_ids`` (shape ``(1, L)``).

    >>> r = diagnose_generate(model, tok("Hello", return_tensors="pt")["input_ids"], precision="fp16")  # doctest: +SKIP

    The fp32 reference and the target decode with the same cache implementation (the model's own), both fed
    the reference's tokens, so decode step ``k`` compares like with like. The first step whose target logits or
    cache are not finite, or whose token differs from the reference beyond rounding noise, is re-run under the
    full op trace: ``findings[0]`` is the op-level root cause within that step (phase ``forward``; evidence
    ``decode_step``, ``position``, ``cache``). Flipped tokens within rounding noise are ``info`` findings.
    ``keep_fp32`` names parameters kept in float32 in the target (as ``from_pretrained(dtype=float16)`` keeps
    ``_keep_in_fp32_modules``). A ``torch.compile``d model is diagnosed through its original module; with
    ``compiled=True`` the compiled target's logits are also compared with the eager target's. In an fp8 precision
    the target decodes in ampdoctor's emulated fp8 with ``fp8_recipe`` (an :class:`~ampdoctor.precision.Fp8Recipe`
    of the precision's format; default ``Fp8Recipe()``), one block for the whole generation so delayed scaling's
    amax histories carry over between decode steps; the failing step's ``fp8-scale`` findings name the layer, the
    role and its numbers in that step.
    Runs on copies; the caller's model and RNG state are untouched. Host syncs: one per generation, plus the
    traced step's read-back. Raises :class:`ampdoctor.precision.ScenarioError` for unusable input.
    """
    t0 = time.perf_counter()
    model, notes = unwrap_compiled(model)
    validate_generation(model, input_ids, precision, max_new_tokens, fp8_recipe)
    if compiled and precision.startswith("fp8"):
        raise ScenarioError("compiled=True compares torch.compile's fp16/bf16 kernels with eager; it has no meaning "
                            "for the emulated fp8 precision: drop compiled or pass precision='fp16'/'bf16'")
    keep = list(keep_fp32)
    transforms = (keep_fp32_transform(model, keep),) if keep else ()
    with saved_rng():
        gen = generate(model, input_ids, precision=precision, max_new_tokens=max_new_tokens, policy=policy,
                       transforms=transforms, fp8_recipe=fp8_recipe)
    first = next((s for s in gen.stats if s.failed), None)
    findings: list[Finding] = []
    layers: list[LayerStat] = []
    step_summary: dict[str, Any] = {}
    if first is not None:
        findings, layers, step_summary = _failing_step(model, input_ids, precision, max_new_tokens, policy,
                                                       transforms, source, first, fp8_recipe)
    noise = [s for s in gen.stats if s.within_noise and (first is None or s.step <= first.step)]
    if noise:
        findings.append(_noise_finding(noise))
    summary: dict[str, Any] = {
        "precision": precision, "steps": 1, "forward_only": True, "torch_version": torch.__version__,
        "device": str(next((p.device for p in model.parameters()), "cpu")),
        "generation": _generation_summary(gen, max_new_tokens, first, noise), "notes": notes,
    }
    summary.update(step_summary)
    if gen.fp8_recipe is not None:
        summary["fp8_recipe"] = asdict(gen.fp8_recipe)
        if "fp8_unquantised" not in summary:  # no failing step was traced: the prefill is, for the GEMM coverage
            summary["fp8_unquantised"] = _fp8_unquantised(model, input_ids, precision, policy, transforms, source,
                                                          fp8_recipe)
    if compiled:
        summary["compiled"] = compare_compiled_generation(model, input_ids, precision, policy, gen.ref_tokens,
                                                          transforms)
        findings.extend(compiled_findings(summary["compiled"], precision))
    summary["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return Report(tuple(findings), precision, summary, tuple(layers), source)


def _failing_step(model: nn.Module, input_ids: torch.Tensor, precision: str, max_new_tokens: int, policy: str,
                  transforms: tuple[Any, ...], source: str, first: DecodeStat,
                  fp8_recipe: Any = None) -> tuple[list[Finding], list[LayerStat], dict[str, Any]]:
    """The first failing decode step re-run under the full op trace (a failing prefill also profiled per position):
    its findings, per-layer table and summary entries."""
    with saved_rng():
        again = generate(model, input_ids, precision=precision, max_new_tokens=max_new_tokens, policy=policy,
                         transforms=transforms, trace_step=first.step, fp8_recipe=fp8_recipe)
    curves: dict[str, list[float]] = {}
    # the prefill spans the whole prompt: find the position within it per module (an emulated-fp8 layer names its
    # own step instead, and the profile has no fp8 target)
    if first.step == 0 and not precision.startswith("fp8"):
        batch: dict[str, Any] = {"input_ids": input_ids}
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):  # positions of the encoder
            batch["decoder_input_ids"] = torch.full((1, 1), decoder_start(model), dtype=input_ids.dtype)
        curves = position_profile(model, batch, precision=precision, policy=policy, transforms=transforms)
    return _step_findings(model, precision, source, first, again, curves)


def _generation_summary(gen: Generation, max_new_tokens: int, first: DecodeStat | None,
                        noise: list[DecodeStat]) -> dict[str, Any]:
    """``summary["generation"]``: the tokens of both runs, every decode step, the first failure, the noise flips."""
    return {
        "prompt_len": gen.prompt_len, "max_new_tokens": max_new_tokens, "cache": gen.cache or "none",
        "teacher_forced": True, "reference_tokens": gen.ref_tokens,
        "target_tokens": [s.target_token for s in gen.stats],
        "first_failure": first.to_dict() if first is not None else None,
        "noise_flips": [s.step for s in noise],
        "steps": [s.to_dict() for s in gen.stats],
        "noise_rule": f"a flipped token is rounding noise when the reference margin <= {NOISE_MARGIN_RMS} x the "
                      f"step's RMS logit error and that error is <= {NOISE_REL_ERR:.0%} of the logits' RMS",
    }


def _step_findings(model: nn.Module, precision: str, source: str, first: DecodeStat, again: Generation,
                   curves: dict[str, list[float]]) -> tuple[list[Finding], list[LayerStat], dict[str, Any]]:
    """The op-level findings of the failing decode step, each carrying where in the generation it happened.

    ``curves`` (per module, |max| per position of the prefill) place a prefill finding within the prompt."""
    if again.traced is None:  # pragma: no cover - generate(trace_step=k) traces step k whenever it is reached
        raise RuntimeError(f"decode step {first.step} was not traced")
    target, reference = again.traced
    spec = StepSpec(model, None, precision, source=source)
    ctx = build_context(spec, target, reference)
    op_findings = enrich_all(analyse(ctx), model, precision)
    where = {"decode_step": first.step, "position": first.position, "ref_token": first.ref_token,
             "target_token": first.target_token, "ref_margin": first.ref_margin}
    out: list[Finding] = []
    for f in op_findings:
        cache = _cache_role(ctx, f, again.cache_records)
        if "roles" in f.evidence:  # an emulated-fp8 layer: judged over every decode step so far, at its own step
            out.append(_fp8_layer_finding(f, first, where, cache))
            continue
        pos = first_position(curves.get(f.module, []))
        pos = first.position if pos is None else pos
        ev = {**f.evidence, **where, "position": pos, "cache": cache}
        title = f"decode step {first.step} (position {pos}): {f.title}"
        # the traced run is one step (its step 0): say which decode step it is, in the text and in ``step``
        expl = f.explanation.replace(f", step {f.step})", f", decode step {first.step})")
        out.append(replace(f, evidence=Evidence.of(ev), title=title, explanation=expl, step=first.step))
    if not any(f.severity == "error" for f in out):
        out.insert(0, _divergence_finding(first, where))
    records = ctx.records
    nf = next((r for r in records if r.kind == "op" and r.stats and (
        r.stats.get("n_nan", 0) + r.stats.get("n_posinf", 0) + r.stats.get("n_neginf", 0)) > 0), None)
    summary: dict[str, Any] = {"ops_traced": len(records)}
    if ctx.target.fp8 is not None:  # as diagnose reports it (and logs it): GEMMs the fp8 emulation did not see
        summary["fp8_unquantised"] = run_summary(ctx, op_findings, 0.0)["fp8_unquantised"]
    if nf is not None:
        summary["first_nonfinite"] = dict(ctx.describe(nf), decode_step=first.step, position=first.position)
    return out, layer_table(ctx), summary


def _fp8_unquantised(model: nn.Module, input_ids: torch.Tensor, precision: str, policy: str,
                     transforms: tuple[Any, ...], source: str, fp8_recipe: Any) -> list[dict[str, Any]]:
    """``summary["fp8_unquantised"]`` of a generation with no failing step: the prefill under the full op trace
    (the same GEMMs every decode step runs), as :func:`ampdoctor.diagnose` reports it for an fp8 step."""
    with saved_rng():
        pre = generate(model, input_ids, precision=precision, max_new_tokens=1, policy=policy,
                       transforms=transforms, trace_step=0, fp8_recipe=fp8_recipe)
    if pre.traced is None:  # pragma: no cover - generate(trace_step=0) always traces the prefill
        return []
    ctx = build_context(StepSpec(model, None, precision, source=source), *pre.traced)
    return list(run_summary(ctx, [], 0.0).get("fp8_unquantised", []))


def _fp8_layer_finding(f: Finding, first: DecodeStat, where: dict[str, Any], cache: str) -> Finding:
    """An emulated-fp8 layer's finding at the decode step it first lost precision (its ``step``), which may be
    before the step whose token flips (a clipped k/v projection writes a wrong cache entry)."""
    step = f.step if f.step is not None else first.step
    pos = first.position - first.step + step
    ev = {**f.evidence, **where, "decode_step": step, "position": pos, "cache": cache}
    return replace(f, evidence=Evidence.of(ev), title=f"decode step {step} (position {pos}): {f.title}")


def _cache_role(ctx: Any, f: Finding, cache_records: set[int]) -> str:
    """``"write"`` when the finding's op produced (or feeds into) a tensor stored in the cache this step,
    ``"read"`` when it consumes a cached tensor, else ``"none"``."""
    recs = [r for r in ctx.records if r.module == f.module and r.op == f.op and r.kind == "op"]
    for r in recs:
        if r.index in cache_records or any(i in cache_records for i in ctx.lineage.descendants.get(r.index, [])[:1]):
            return "write"
        if any(i in cache_records for i in r.inputs):
            return "read"
    for r in recs:
        if set(ctx.lineage.descendants.get(r.index, [])) & cache_records:
            return "write"
    return "none"


def compiled_findings(cmp: dict[str, Any], precision: str) -> list[Finding]:
    """A warning when ``torch.compile``'s target outputs differ from the eager target's (from ``compare_compiled``)."""
    if cmp.get("verdict") != "differs":
        return []
    name = cmp["first_differing_output"]
    row = next(r for r in cmp["outputs"] if r["output"] == name)
    detail = (f"eager has {row.get('eager_nonfinite', '?')} inf/NaN, compiled {row.get('compiled_nonfinite', '?')}; "
              f"max |compiled - eager| {row.get('max_abs_diff', float('nan')):.3g} "
              f"({row.get('rel_diff', float('nan')):.2%} of eager's |max|)") if "rel_diff" in row else row["status"]
    return [Finding(
        "precision-loss", "warning", "", "", "forward", f"torch.compile changes {precision} numerics: {name!r} differs",
        f"In {precision}, the compiled model's output {name!r} differs from the eager model's on the same inputs "
        f"({detail}). Compiled kernels fuse ops and may keep intermediates in float32 (hiding an overflow eager "
        "shows) or round differently; the op-level diagnosis above is of the eager model. Check the model both "
        "ways before trusting either in production.", {"compiled": cmp})]


def _divergence_finding(s: DecodeStat, where: dict[str, Any]) -> Finding:
    if not s.finite or not s.cache_finite:
        what = "its logits are not finite" if not s.finite else "its KV cache holds inf/NaN after this step's write"
        return Finding("overflow", "error", "", "", "forward", f"generation goes non-finite at decode step {s.step}",
                       f"At decode step {s.step} (position {s.position}) {what}; the op trace of the step found no "
                       "op-level cause (the non-finite value may come from outside the traced model call).",
                       {**where, "cache": "write" if not s.cache_finite else "none"})
    return Finding(
        "precision-loss", "error", "", "", "forward", f"generated token differs at decode step {s.step}",
        f"At decode step {s.step} (position {s.position}) the target picks token {s.target_token} where the fp32 "
        f"reference picks {s.ref_token} by a margin of {s.ref_margin:.3g}, beyond rounding noise (the step's RMS "
        f"logit error is {s.logit_err:.3g}, {s.logit_err / max(s.logit_rms, 1e-30):.1%} of the logits).",
        {**where, "logit_rms_err": s.logit_err, "logit_rms": s.logit_rms, "cache": "none"})


def _noise_finding(noise: list[DecodeStat]) -> Finding:
    steps = ", ".join(f"{s.step} (margin {s.ref_margin:.2g} vs error {s.logit_err:.2g})" for s in noise[:8])
    return Finding(
        "precision-loss", "info", "", "", "forward", f"{len(noise)} token(s) flipped within rounding noise",
        f"At decode step(s) {steps} the target's token differs from the reference's, but the reference itself "
        "chose it by a margin the low precision's rounding error covers: a near-tie, not a failure.",
        {"decode_step": noise[0].step, "position": noise[0].position, "steps": [s.to_dict() for s in noise]})
