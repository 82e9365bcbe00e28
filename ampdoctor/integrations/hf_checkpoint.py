"""Load a Hugging Face model directory offline: a training-style scenario, or a model ready for inference.

``load_checkpoint`` is used by ``ampdoctor headroom --hf DIR`` and ``ampdoctor check --hf DIR``;
``load_for_inference`` by ``ampdoctor diagnose --hf DIR`` (a forward or a generation, tokenized with the
checkpoint's own tokenizer). Nothing is downloaded (``local_files_only``). Needs ``transformers``
(``pip install 'ampdoctor[hf]'``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ampdoctor.errors import AmpDoctorError

#: ``--task`` values: which Auto class loads the checkpoint and what the diagnosed forward returns
TASKS: tuple[str, ...] = ("auto", "causal-lm", "seq2seq", "embeddings", "classification")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model", "vocab.json",
                    "tokenizer.model", "sentencepiece.bpe.model")


class CheckpointError(AmpDoctorError, ValueError):
    """The directory, task, text or token ids given with ``--hf`` cannot be used; the message says what to pass."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ImportError("loading a Hugging Face directory needs transformers: pip install 'ampdoctor[hf]'") from e
    return transformers


def _check_dir(path: str) -> None:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path!r} is not a Hugging Face model directory (no config.json); pass the folder "
                              "that holds config.json and the weights (what save_pretrained() writes)")


def load_checkpoint(path: str, *, batch_size: int = 2, seq_len: int = 16, seed: int = 0) -> dict[str, Any]:
    """A scenario dict (``model``, ``batch``, ``loss_fn``) for the model stored in ``path`` (no downloads).

    The batch is random token ids within the vocabulary (a fixed seed), with an attention mask whose second
    row is padded, so masks are exercised. The loss is the mean square of the last hidden state, which reaches
    every encoder layer in forward and backward.
    """
    tf = _transformers()
    _check_dir(path)
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    model = tf.AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.train()
    vocab = int(getattr(config, "vocab_size", 1000))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, max(vocab, 6), (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if batch_size > 1:
        mask[1, seq_len // 2:] = 0
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if getattr(config, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = ids[:, : max(seq_len // 2, 1)]

    def loss_fn(out: Any, b: Any) -> torch.Tensor:
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h.float().pow(2).mean()

    return {"model": model, "batch": batch, "loss_fn": loss_fn}


@dataclass(frozen=True)
class InferenceCheckpoint:
    """A checkpoint loaded for inference: the fp32 model, its inputs and what a low-precision load would do."""

    model: Any
    task: str
    input_ids: torch.Tensor
    batch: dict[str, Any]
    #: parameters ``from_pretrained(dtype=float16)`` (or bf16) keeps in float32, per dtype name
    keep_fp32: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tokenizer: str = ""  # "checkpoint" or "synthetic"
    notes: tuple[str, ...] = ()

    def casting(self) -> dict[str, Any]:
        """What each way of lowering the precision does with this checkpoint (for the report's summary)."""
        keep16 = list(self.keep_fp32.get("fp16", ()))
        return {
            "keep_in_fp32_modules": sorted(getattr(self.model, "_keep_in_fp32_modules", None) or []),
            "keep_in_fp32_modules_strict": sorted(getattr(self.model, "_keep_in_fp32_modules_strict", None) or []),
            "from_pretrained_fp16_keeps_fp32": keep16,
            "from_pretrained_bf16_keeps_fp32": list(self.keep_fp32.get("bf16", ())),
            "half": ("model.half() casts every parameter to float16"
                     + (f", including the {len(keep16)} that from_pretrained(dtype=torch.float16) keeps in "
                        "float32" if keep16 else "")),
            "autocast": ("torch.autocast keeps every weight in float32 and runs matmuls/linears in the low "
                         "precision, the keep-in-fp32 list included (autocast does not read it)"),
        }


def _keep_fp32_params(model: Any, dtype: torch.dtype) -> tuple[str, ...]:
    """Parameter/buffer names that ``from_pretrained(dtype=dtype)`` keeps in float32 (transformers' own plan)."""
    plan: dict[str, Any] = {}
    get_plan = getattr(model, "_get_dtype_plan", None)
    if callable(get_plan):
        plan = dict(get_plan(dtype))
    else:  # older transformers: the class attributes, with fp16-only / strict semantics
        plan = dict.fromkeys(getattr(model, "_keep_in_fp32_modules", None) or [] if dtype == torch.float16 else [])
        plan.update(dict.fromkeys(getattr(model, "_keep_in_fp32_modules_strict", None) or []))
    if not plan:
        return ()
    pattern = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in plan))
    names = [n for n, _ in model.named_parameters()] + [n for n, b in model.named_buffers() if b.is_floating_point()]
    return tuple(n for n in names if pattern.search(n))


def _auto_task(config: Any) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal-lm"
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "classification"
    return "embeddings"


def _load_model(tf: Any, path: str, config: Any, task: str) -> Any:
    auto = {"causal-lm": tf.AutoModelForCausalLM, "seq2seq": tf.AutoModelForSeq2SeqLM,
            "embeddings": tf.AutoModel, "classification": tf.AutoModelForSequenceClassification}[task]
    try:
        model = auto.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        kind = getattr(config, "model_type", "?")
        others = [t for t in TASKS if t not in ("auto", task)]
        raise CheckpointError(
            f"transformers cannot load {path!r} (model_type {kind!r}, architectures "
            f"{getattr(config, 'architectures', None)}) as --task {task}: {str(e).splitlines()[0]}. Pass the task "
            f"this checkpoint was trained for (--task {' | '.join(others)}), or write a scenario file with a "
            "make() that builds the model (ampdoctor diagnose FILE)") from e
    except OSError as e:
        raise CheckpointError(f"no usable weights in {path!r}: {str(e).splitlines()[0]}; the folder needs "
                              "model.safetensors (or pytorch_model.bin) next to config.json") from e
    model.eval()
    return model


def _read_ids(path: str) -> torch.Tensor:
    if not os.path.isfile(path):
        raise CheckpointError(f"--input-ids file {path!r} not found; pass a JSON list of token ids, e.g. [101, 7592]")
    try:
        if path.endswith((".pt", ".pth")):
            ids = torch.load(path, weights_only=True)  # data only: nothing in the file is executed
        else:
            with open(path) as f:
                text = f.read()
            ids = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
        ids = torch.as_tensor(ids)
    except Exception as e:
        raise CheckpointError(f"cannot read token ids from {path!r} ({type(e).__name__}: {e}); pass a JSON list of "
                              "ints ([101, 7592]), a list of equal-length lists, whitespace-separated ints, or a "
                              ".pt tensor") from e
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2) or ids.numel() == 0:
        raise CheckpointError(f"--input-ids must hold a non-empty 1-D or 2-D list of integer token ids, got dtype "
                              f"{ids.dtype} shape {tuple(ids.shape)}")
    return ids.long().reshape(1, -1) if ids.dim() == 1 else ids.long()


def _tokenize(tf: Any, path: str, text: str) -> torch.Tensor:
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise CheckpointError(f"--text needs a tokenizer, and {path!r} holds none (no {', '.join(_TOKENIZER_FILES[:3])}"
                              ", ...); save the tokenizer next to the model (tokenizer.save_pretrained(DIR)), or pass "
                              "token ids with --input-ids FILE, or leave both out for synthetic ids")
    try:
        tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"the tokenizer in {path!r} cannot be loaded ({type(e).__name__}: {first}); pass "
                              "token ids with --input-ids FILE") from e
    return tok(text, return_tensors="pt")["input_ids"]


def load_for_inference(path: str, *, task: str = "auto", text: str | None = None, input_ids: str | None = None,
                       seq_len: int | None = None, seed: int = 0) -> InferenceCheckpoint:
    """Load ``path`` in float32 for an inference diagnosis, with input ids from ``text``, a file, or synthetic.

    Raises :class:`CheckpointError` (what to pass instead) for a folder that is not a checkpoint, ``text``
    without a tokenizer, an unreadable ids file or an architecture transformers cannot load for ``task``.
    """
    if task not in TASKS:
        raise CheckpointError(f"invalid task {task!r}, expected one of {', '.join(TASKS)}")
    if text is not None and input_ids is not None:
        raise CheckpointError("give --text or --input-ids, not both")
    if seq_len is not None and seq_len < 1:
        raise CheckpointError(f"--seq-len must be a positive int, got {seq_len}")
    tf = _transformers()
    _check_dir(path)
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path!r}/config.json is not a configuration this transformers knows: "
                              f"{str(e).splitlines()[0]} Pass a folder written by save_pretrained() for an "
                              "architecture transformers supports, or write a scenario file whose make() builds the "
                              "model (ampdoctor diagnose FILE)") from e
    task = _auto_task(config) if task == "auto" else task
    notes: list[str] = []
    if text is not None:
        ids, source = _tokenize(tf, path, text), "checkpoint"
    elif input_ids is not None:
        ids, source = _read_ids(input_ids), "file"
    else:
        vocab = int(getattr(config, "vocab_size", 0) or 1000)
        g = torch.Generator().manual_seed(seed)
        ids, source = torch.randint(min(5, vocab - 1), vocab, (1, seq_len or 16), generator=g), "synthetic"
        notes.append(f"synthetic token ids (seed {seed}, length {ids.shape[1]}): pass --text or --input-ids to "
                     "diagnose real inputs")
    if seq_len is not None and ids.shape[1] != seq_len:
        reps = -(-seq_len // ids.shape[1])
        ids = ids.repeat(1, reps)[:, :seq_len]
        notes.append(f"input ids repeated/truncated to --seq-len {seq_len}")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and ids.shape[1] > limit:
        raise CheckpointError(f"{ids.shape[1]} tokens exceed the model's max_position_embeddings ({limit}); pass a "
                              f"shorter --text / --seq-len (at most {limit})")
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and int(ids.max()) >= vocab_size:
        raise CheckpointError(f"token id {int(ids.max())} is outside the vocabulary (vocab_size {vocab_size}); pass "
                              f"ids below {vocab_size}")
    model = _load_model(tf, path, config, task)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "seq2seq":
        given = getattr(config, "decoder_start_token_id", None)
        start = int(given) if isinstance(given, int) else int(getattr(config, "pad_token_id", 0) or 0)
        batch["decoder_input_ids"] = torch.full((ids.shape[0], 1), start, dtype=torch.long)
    keep = {"fp16": _keep_fp32_params(model, torch.float16), "bf16": _keep_fp32_params(model, torch.bfloat16)}
    return InferenceCheckpoint(model, task, ids, batch, keep, source, tuple(notes))


def diagnose_checkpoint(ckpt: InferenceCheckpoint, *, precision: str = "fp16", policy: str = "cuda",
                        source: str = "", progress: Any = None, positions: bool = False,
                        compiled: bool = False, fp8_recipe: Any = None) -> Any:
    """Diagnose one inference forward of a loaded checkpoint in ``precision`` (a :class:`~ampdoctor.Report`).

    A pure ``fp16``/``bf16`` target holds what ``from_pretrained(dtype=...)`` would load: the checkpoint's
    keep-in-fp32 parameters stay float32 (their original values). ``*-amp`` targets keep every weight in float32
    (autocast's semantics). The report's summary carries ``checkpoint`` (task, tokenizer, what ``.half()`` and
    autocast would do instead); with ``positions``, ``positions`` (the per-position headroom curve); with
    ``compiled``, ``compiled`` (compiled vs eager target outputs). ``fp8_recipe``: an fp8 precision's recipe.
    """
    from dataclasses import replace

    from ampdoctor.diagnose import diagnose_spec
    from ampdoctor.precision import keep_fp32_transform, make_spec

    spec = make_spec(ckpt.model, ckpt.batch, precision=precision, source=source, fp8_recipe=fp8_recipe)
    kept = ckpt.keep_fp32.get(precision, ()) if precision in ("fp16", "bf16") else ()
    transforms = (keep_fp32_transform(ckpt.model, kept),) if kept else ()
    spec = replace(spec, transforms=transforms)
    report = diagnose_spec(spec, policy=policy, progress=progress)
    summary = {**report.summary, "checkpoint": checkpoint_summary(ckpt, kept)}
    if positions:
        from ampdoctor.precision import headroom_curve, position_profile

        ref = position_profile(ckpt.model, ckpt.batch, precision=precision, reference=True)
        tgt = position_profile(ckpt.model, ckpt.batch, precision=precision, policy=policy, transforms=transforms)
        summary["positions"] = headroom_curve(ref, tgt, precision)
    if compiled:
        from ampdoctor.diagnose_generate import compiled_findings
        from ampdoctor.precision import compare_compiled

        summary["compiled"] = compare_compiled(ckpt.model, ckpt.batch, precision, policy, transforms)
        extra = compiled_findings(summary["compiled"], precision)
        return replace(report, summary=summary, findings=report.findings + tuple(extra))
    return replace(report, summary=summary)


def _with_checkpoint(report: Any, ckpt: InferenceCheckpoint, kept: tuple[str, ...]) -> Any:
    from dataclasses import replace

    return replace(report, summary={**report.summary, "checkpoint": checkpoint_summary(ckpt, kept)})


def checkpoint_summary(ckpt: InferenceCheckpoint, kept: tuple[str, ...] | list[str]) -> dict[str, Any]:
    return {"task": ckpt.task, "architecture": type(ckpt.model).__name__, "tokens": ckpt.tokenizer,
            "input_shape": list(ckpt.input_ids.shape), "kept_fp32_in_target": list(kept),
            "casting": ckpt.casting(), "notes": list(ckpt.notes)}


def diagnose_hf(path: str, *, precision: str = "fp16", policy: str = "cuda", task: str = "auto",
                text: str | None = None, input_ids: str | None = None, max_new_tokens: int | None = None,
                seq_len: int | None = None, compiled: bool = False, progress: Any = None,
                fp8_recipe: Any = None) -> Any:
    """``ampdoctor diagnose --hf DIR``: load ``path`` offline and diagnose a forward (or a generation)."""
    ckpt = load_for_inference(path, task=task, text=text, input_ids=input_ids, seq_len=seq_len)
    if max_new_tokens is not None:
        if ckpt.task not in ("causal-lm", "seq2seq"):
            raise CheckpointError(f"--max-new-tokens diagnoses a generation; {path!r} was loaded as --task "
                                  f"{ckpt.task}, which does not generate. Pass --task causal-lm or seq2seq for a "
                                  "generating checkpoint, or drop --max-new-tokens to diagnose one forward")
        from ampdoctor.diagnose_generate import diagnose_generate

        kept = ckpt.keep_fp32.get(precision, ()) if precision in ("fp16", "bf16") else ()
        report = diagnose_generate(ckpt.model, ckpt.input_ids, precision=precision, max_new_tokens=max_new_tokens,
                                   keep_fp32=kept, policy=policy, source=path, compiled=compiled,
                                   fp8_recipe=fp8_recipe)
        return _with_checkpoint(report, ckpt, kept)
    return diagnose_checkpoint(ckpt, precision=precision, policy=policy, source=path, progress=progress,
                               positions=seq_len is not None, compiled=compiled, fp8_recipe=fp8_recipe)
