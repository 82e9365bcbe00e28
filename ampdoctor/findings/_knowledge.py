"""Known mechanisms of Hugging Face architectures, attached to findings the rules already made.

The rules find causes from ranges, dtypes and lineage only. This registry adds what is known about a specific
architecture -- why its authors declared a module fp32, a clamp that never runs under autocast, a config switch
that fixes the issue -- to a finding whose module belongs to that architecture. It never changes a finding's
code, module, op or phase: it appends text, fixes and an ``evidence["known_mechanisms"]`` list.

>>> from ampdoctor.findings._knowledge import enrich_all
>>> findings = enrich_all(report.findings, model, precision=report.precision)   # doctest: +SKIP

An architecture is recognised by the Python module of the classes that own the finding's module (its own class
or an ancestor's, following the MRO, so subclasses count): ``transformers.models.<family>.modeling_<family>``,
or by ``config.model_type``. transformers is never imported.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.findings._types import CODES, Finding, FixProposal

_FAMILY_RE = re.compile(r"^transformers\.models\.([A-Za-z0-9_]+)\.")


@dataclass(frozen=True)
class Mechanism:
    """What is known about one architecture family and one kind of finding.

    ``families``: transformers model families (``transformers.models.<family>``) or ``config.model_type``
    values. ``codes``: finding codes it explains. ``module_pattern``: regular expression searched in the
    finding's module path (``""`` matches any). ``precisions``: run precisions it applies to (empty: any).
    """

    key: str
    title: str
    families: frozenset[str]
    codes: frozenset[str]
    module_pattern: str
    explanation: str
    fixes: tuple[FixProposal, ...] = ()
    references: tuple[str, ...] = ()
    precisions: frozenset[str] = field(default_factory=frozenset)


#: The registry: ``key -> Mechanism``. Fill it with :func:`register`.
KNOWLEDGE: dict[str, Mechanism] = {}


def register(mechanism: Mechanism) -> Mechanism:
    """Add ``mechanism`` to :data:`KNOWLEDGE`; a duplicate key, an unknown code or a bad pattern raises."""
    if mechanism.key in KNOWLEDGE:
        raise ValueError(f"a mechanism with key {mechanism.key!r} is already registered")
    bad = sorted(set(mechanism.codes) - set(CODES))
    if bad:
        raise ValueError(f"mechanism {mechanism.key!r} names unknown code(s) {bad}; expected codes from {CODES}")
    try:
        re.compile(mechanism.module_pattern)
    except re.error as e:
        raise ValueError(
            f"mechanism {mechanism.key!r}: invalid module_pattern {mechanism.module_pattern!r}: {e}") from e
    KNOWLEDGE[mechanism.key] = mechanism
    return mechanism


# ------------------------------------------------------------------------------------------------------------
# recognising the architecture
# ------------------------------------------------------------------------------------------------------------
def _class_families(obj: Any) -> list[str]:
    out = []
    for cls in type(obj).__mro__:
        m = _FAMILY_RE.match(getattr(cls, "__module__", "") or "")
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def _unwrap(model: Any) -> Any:
    for _ in range(4):
        inner = getattr(model, "module", None)  # DistributedDataParallel / DataParallel / FSDP wrappers
        if inner is None or not hasattr(inner, "named_modules"):
            break
        model = inner
    return model


def families_of(model: Any, module: str = "") -> list[str]:
    """Families of the module ``module`` of ``model`` (innermost owner first), then of the whole model.

    ``module`` is a name from ``model.named_modules()`` (``""``: the root); a wrapper prefix (DDP's ``module.``)
    is accepted."""
    out: list[str] = []
    roots = [model]
    inner = _unwrap(model)
    if inner is not model:
        roots.append(inner)
    parts = module.split(".") if module else []
    for root in roots:
        get = getattr(root, "get_submodule", None)
        if get is None:
            continue
        for k in range(len(parts), -1, -1):
            name = ".".join(parts[:k])
            try:
                sub = get(name) if name else root
            except (AttributeError, ValueError, TypeError, IndexError, KeyError):
                continue
            for fam in _class_families(sub):
                if fam not in out:
                    out.append(fam)
        cfg = getattr(root, "config", None)
        mt = getattr(cfg, "model_type", None)
        if isinstance(mt, str) and mt not in out:
            out.append(mt)
    return out


def mechanisms_for(finding: Finding, model: Any, precision: str | None = None) -> list[Mechanism]:
    """The registered mechanisms that explain ``finding`` for ``model`` (in registration order)."""
    fams = set(families_of(model, finding.module))
    out = []
    for m in KNOWLEDGE.values():
        if finding.code not in m.codes or not (fams & m.families):
            continue
        if m.precisions and precision not in m.precisions:
            continue
        if m.module_pattern and not re.search(m.module_pattern, finding.module):
            continue
        out.append(m)
    return out


def enrich(finding: Finding, model: Any, precision: str | None = None) -> Finding:
    """``finding`` with the model-specific explanation and fixes of every matching mechanism appended.

    >>> f2 = enrich(report.findings[0], model, "fp16-amp")           # doctest: +SKIP
    >>> (f2.code, f2.module, f2.op, f2.phase) == (f.code, f.module, f.op, f.phase)   # doctest: +SKIP
    True

    Code, severity, module, op, phase and step are never changed. No side effects, no host sync."""
    mechs = mechanisms_for(finding, model, precision)
    if not mechs:
        return finding
    text = finding.explanation
    titles = {f.title for f in finding.fixes}
    fixes = list(finding.fixes)
    for m in mechs:
        refs = f" References: {'; '.join(m.references)}." if m.references else ""
        text += f"\n\nKnown mechanism -- {m.title}: {m.explanation}{refs}"
        for f in m.fixes:
            if f.title not in titles:
                titles.add(f.title)
                fixes.append(f)
    evidence = finding.evidence.replace(known_mechanisms=[m.key for m in mechs])
    return dataclasses.replace(finding, explanation=text, fixes=tuple(fixes), evidence=evidence)


def enrich_all(findings: Any, model: Any, precision: str | None = None) -> list[Finding]:
    """:func:`enrich` every finding (same order). ``diagnose`` calls it with the user's model."""
    return [enrich(f, model, precision) for f in findings]


# ------------------------------------------------------------------------------------------------------------
# the knowledge
# ------------------------------------------------------------------------------------------------------------
_T5 = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"})
_BART = frozenset({"bart", "mbart", "pegasus", "pegasus_x", "marian", "blenderbot", "blenderbot_small",
                   "blenderbot-small", "plbart", "m2m_100", "bigbird_pegasus", "led", "nllb_moe"})
_GPT2 = frozenset({"gpt2"})
_ROPE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                   "gemma3", "gemma3_text", "phi", "phi3", "starcoder2", "olmo", "olmo2", "cohere", "granite",
                   "gpt_neox", "stablelm", "deepseek_v3", "persimmon", "glm", "helium", "smollm3"})
_BERT = frozenset({"bert", "roberta", "xlm-roberta", "xlm_roberta", "camembert", "ernie", "albert", "mpnet",
                   "data2vec-text", "data2vec_text", "roberta-prelayernorm", "roberta_prelayernorm", "nezha"})


def _bf16_amp(title: str) -> FixProposal:
    """The automatic switch to bf16 autocast, with the snippet for a transformers model."""
    return FixProposal(title, "with torch.autocast(device_type, dtype=torch.bfloat16):\n    loss = model(**batch).loss",
                       id="switch_precision", params={"precision": "bf16-amp"})


register(Mechanism(
    key="t5-ff-fp32",
    title="T5 / mT5 / Flan-T5 feed-forward needs float32 in fp16",
    families=_T5,
    codes=frozenset({"overflow", "must-stay-fp32", "nan-from-inf"}),
    module_pattern=r"DenseReluDense|layer_norm|\.layer\.\d+$",
    explanation=(
        "T5 v1.1, mT5, Flan-T5 and t5-large checkpoints were pretrained in bfloat16; their feed-forward outputs "
        "(the `wo` projection and the gated product before it) reach ~1e5, beyond fp16's 65504. transformers "
        "declares `_keep_in_fp32_modules = [\"wo\"]`, which only `from_pretrained(..., dtype=torch.float16)` "
        "honours; `.half()`, `.to()` and autocast run `wo` in fp16. T5Block clamps inf only "
        "`if hidden_states.dtype == torch.float16`: under autocast with fp32 weights the residual add comes out "
        "float32, so the clamp never runs and the inf reaches the next T5LayerNorm (inf * rsqrt(inf) = NaN). "
        "PR #10956 ran T5LayerFF with autocast disabled for this reason."),
    fixes=(
        _bf16_amp("train T5 in bfloat16 (the precision it was pretrained in)"),
        FixProposal("run every T5LayerFF with autocast disabled (as PR #10956 did)",
                    "for block in model.encoder.block + model.decoder.block:\n"
                    "    ff = block.layer[-1]\n"
                    "    ff.forward = torch.autocast(device_type, enabled=False)(ff.forward)"),
        FixProposal("for fp16 inference, load with the dtype argument so `wo` stays float32",
                    "model = T5ForConditionalGeneration.from_pretrained(name, dtype=torch.float16)"),
    ),
    references=("huggingface/transformers#23918", "huggingface/transformers#14189",
                "huggingface/transformers#9295", "huggingface/transformers PR #10956",
                "google-research/text-to-text-transfer-transformer#539"),
))

register(Mechanism(
    key="bart-family-fp16-clamp",
    title="BART / Pegasus / Marian encoder clamp runs only on fp16 hidden states",
    families=_BART,
    codes=frozenset({"overflow", "nan-from-inf", "must-stay-fp32"}),
    module_pattern=r"layers?\.\d+|fc1|fc2|self_attn|layer_norm",
    explanation=(
        "The encoder layers of this family clamp hidden states to finfo(float16).max - 1000 only when "
        "`hidden_states.dtype == torch.float16` (BART additionally only when a non-finite value is present). "
        "Under autocast with fp32 weights the residual stream is float32, so the clamp is skipped and an fp16 "
        "overflow in fc1/fc2 or attention flows on; in pure fp16 the clamp hides the overflow by pinning values "
        "near 65504 instead of fixing it."),
    fixes=(
        _bf16_amp("use bfloat16 (no clamp needed: fp32's exponent range)"),
        FixProposal("run the overflowing feed-forward (fc1/fc2) in float32", "", id="keep_fp32"),
    ),
    references=("transformers/models/bart/modeling_bart.py (BartEncoderLayer.forward)",
                "transformers/models/pegasus/modeling_pegasus.py (PegasusEncoderLayer.forward)"),
))

register(Mechanism(
    key="gpt2-upcast-attn",
    title="GPT-2 attention scores in fp16",
    families=_GPT2,
    codes=frozenset({"overflow", "nan-from-inf", "precision-loss", "saturation"}),
    module_pattern=r"\.attn($|\.)",
    explanation=(
        "GPT-2 multiplies q @ k^T in the input dtype and scales by 1/sqrt(head_dim) afterwards, so the raw "
        "scores can exceed fp16's 65504 before the scale applies. GPT2Config has two switches for this: "
        "`reorder_and_upcast_attn=True` computes the scores in float32 with the scale folded into the matmul "
        "(eager attention only, `attn_implementation=\"eager\"`), and `scale_attn_by_inverse_layer_idx=True` "
        "further divides layer i's scores by i + 1 (both added for Stanford CRFM's Mistral GPT-2 training)."),
    fixes=(
        FixProposal("compute GPT-2's attention scores in float32 with the scale applied first",
                    "config = GPT2Config.from_pretrained(name, reorder_and_upcast_attn=True)\n"
                    "model = GPT2LMHeadModel.from_pretrained(name, config=config, attn_implementation='eager')"),
        FixProposal("also scale each layer's scores by 1 / (layer_idx + 1)",
                    "config.scale_attn_by_inverse_layer_idx = True"),
    ),
    references=("transformers/models/gpt2/modeling_gpt2.py (GPT2Attention._upcast_and_reordered_attn)",
                "stanford-crfm/mistral (stable GPT-2 training)"),
))

register(Mechanism(
    key="rope-inv-freq-fp32",
    title="rotary embedding frequencies (inv_freq) cast to half precision",
    families=_ROPE,
    codes=frozenset({"must-stay-fp32", "precision-loss"}),
    module_pattern=r"rotary|self_attn|attention",
    explanation=(
        "The rotary embedding module registers `inv_freq` (and `original_inv_freq`) as non-persistent float32 "
        "buffers at construction and computes `position_ids.float() * inv_freq.float()` in float32, but "
        "`model.to(torch.bfloat16)` / `.half()` cast the buffers first: the upcast in forward cannot restore the "
        "rounded bits, so angles at long positions are off by up to position * 2**-8 (bf16). Autocast leaves "
        "the buffers in float32."),
    fixes=(
        FixProposal("recompute the frequencies in float32 after casting the model",
                    "rope = model.model.rotary_emb\n"
                    "inv_freq, _ = rope.compute_default_rope_parameters(rope.config)\n"
                    "rope.inv_freq = inv_freq.to(rope.inv_freq.device)  # float32\n"
                    "rope.original_inv_freq = rope.inv_freq.clone()"),
    ),
    references=("transformers/models/llama/modeling_llama.py (LlamaRotaryEmbedding)",),
))

register(Mechanism(
    key="bert-pooler",
    title="BERT-style pooler (tanh over the [CLS] state)",
    families=_BERT,
    codes=frozenset({"saturation", "unused-parameters"}),
    module_pattern=r"pooler",
    explanation=(
        "The pooler computes tanh(dense(h_[CLS])). Sequence-classification heads train through it; token-level "
        "heads and masked-LM losses do not use it, so its parameters get no gradient (DDP then needs "
        "find_unused_parameters=True). In fp16 its tanh returns exactly ±1 once |dense output| >= 4.51, which "
        "zeroes every gradient below it. `add_pooling_layer=False` removes it when the loss does not need it."),
    fixes=(
        FixProposal("build the encoder without the pooler when the loss does not use it",
                    "model = AutoModel.from_pretrained(name, add_pooling_layer=False)"),
        FixProposal("classify from the [CLS] hidden state (or a mean pool) instead of the tanh pooler",
                    "logits = head(outputs.last_hidden_state[:, 0])"),
    ),
    references=("transformers/models/bert/modeling_bert.py (BertPooler, BertModel(add_pooling_layer=...))",),
))


__all__ = ["KNOWLEDGE", "Mechanism", "enrich", "enrich_all", "families_of", "mechanisms_for", "register"]
