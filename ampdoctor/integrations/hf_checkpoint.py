"""Load a Hugging Face model directory offline and build a synthetic batch from its config.

Used by ``ampdoctor headroom --hf DIR`` and ``ampdoctor check --hf DIR``: "is this checkpoint safe in fp16?"
Needs ``transformers`` (``pip install 'ampdoctor[hf]'``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ampdoctor.errors import AmpDoctorError


def load_checkpoint(path: str, *, batch_size: int = 2, seq_len: int = 16, seed: int = 0) -> dict[str, Any]:
    """A scenario dict (``model``, ``batch``, ``loss_fn``) for the model stored in ``path`` (no downloads).

    The batch is random token ids within the vocabulary (a fixed seed), with an attention mask whose second
    row is padded, so masks are exercised. The loss is the mean square of the last hidden state, which reaches
    every encoder layer in forward and backward.
    """
    try:
        from transformers import AutoConfig, AutoModel
    except ImportError as e:  # pragma: no cover
        raise ImportError("loading a Hugging Face directory needs transformers: pip install 'ampdoctor[hf]'") from e
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise AmpDoctorError(f"{path!r} is not a Hugging Face model directory (no config.json); pass the folder "
                             "that holds config.json and the weights")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
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
