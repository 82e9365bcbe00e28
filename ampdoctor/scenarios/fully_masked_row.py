"""A recommender's history attention with an additive ``-1e9`` padding mask, run in fp16: the mask turns into
``-inf``, and the cold-start user whose history is empty gets a fully masked row -> softmax NaN -> NaN loss.

Real-world failure
    Click-through / next-item models (DIN, BST, SASRec-style) pool a user's past items with a target attention:
    the candidate item is the query, the padded history the keys.  The padding mask is written for fp32 as
    ``scores + (1 - mask) * -1e9``.  In fp32 a user with no history at all (cold start, or history filtered out)
    gets -1e9 on every key, the softmax is uniform over the padding slots and the output finite -- harmless
    garbage nobody notices.  After ``model.half()`` the same line produces ``-inf``: -1e9 does not fit fp16
    (max 65504) and the multiplication by a Python scalar stores inf without an error.  A partially masked row
    survives -inf (softmax absorbs it); a fully masked row computes ``exp(-inf - (-inf)) = exp(NaN)``, so the
    cold-start user's prediction, the mean loss and every gradient become NaN.
Mechanism
    ``(1.0 - history_mask.to(fp16)) * -1e9`` is ``-0.0`` on real items and ``-inf`` on padding; for the user with
    length 0 the whole row of scores is ``-inf``; softmax subtracts the row max (-inf) -> NaN; ``NaN @ value`` ->
    NaN interest vector -> NaN logit -> NaN BCE loss.  The failure needs both the fp16 overflow of the mask
    constant and the fully masked row: the healthy twin ``healthy_partial_neg_inf_mask`` uses -inf on purpose and
    is fine because every row keeps a real key.
Public evidence
    pytorch/pytorch #41508 and PR #42323 (fully masked rows in MultiheadAttention give NaN gradients),
    #26098 (key_padding_mask -> NaN), #103749 (SDPA NaN with a padding mask, later ``_safe_softmax``);
    huggingface/transformers PR #17306 (in fp16, ``finfo.min`` plus a negative score rounds to -inf and fully
    masked rows give NaN); tatp22/linformer-pytorch PR #19 and bentrevett/pytorch-seq2seq #191 (-1e10 / -1e9
    mask constants break under fp16 / mixed precision).
Reproduction
    ``ClickModel``: item embedding (dim 16, padding_idx 0), ``history_attention`` (query/key/value Linear,
    additive -1e9 mask), an MLP head on [candidate, interest]; 4 users with history lengths 6, 3, 0, 2 (user 2 is
    a cold start); BCE-with-logits loss on click labels (fp32); precision ``"fp16"`` (model and floating inputs
    cast to fp16).  fp32 gives a finite loss (0.685).
Known fixes
    a dtype-aware finite mask value (``torch.finfo(scores.dtype).min``) or a boolean mask with ``masked_fill``;
    handle users without history explicitly (skip the attention, or zero their interest vector *before* it
    meets NaN); ``F.scaled_dot_product_attention`` with a boolean mask, which returns 0 for fully masked rows.
EXPECT
    codes ["constant-out-of-range", "masked-row-nan"], module "history_attention" (its forward multiplies the
    mask by the literal -1e9, which is -inf in fp16, and takes the softmax of the fully masked row), phase
    "forward". Both codes are right: the literal is what turns a harmless large negative mask into -inf, and
    the fully masked row is where -inf - (-inf) makes the NaN; ampdoctor ranks the literal first.

Run ``python -m ampdoctor.scenarios.fully_masked_row`` to see the failure.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"codes": ["constant-out-of-range", "masked-row-nan"], "module": "history_attention", "phase": "forward"}

NUM_ITEMS = 50
DIM = 16
HISTORY_LENGTHS = (6, 3, 0, 2)


class HistoryAttention(nn.Module):
    """Target attention of each candidate item over the user's padded item history."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, candidate: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor) -> torch.Tensor:
        q = self.query(candidate).unsqueeze(1)                                  # (B, 1, D)
        k, v = self.key(history), self.value(history)                           # (B, L, D)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])                 # (B, 1, L)
        scores = scores + (1.0 - history_mask.unsqueeze(1).to(scores.dtype)) * -1e9
        return (scores.softmax(dim=-1) @ v).squeeze(1)


class ClickModel(nn.Module):
    def __init__(self, num_items: int = NUM_ITEMS, dim: int = DIM) -> None:
        super().__init__()
        self.items = nn.Embedding(num_items, dim, padding_idx=0)
        self.history_attention = HistoryAttention(dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, 1))

    def forward(self, candidate: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor) -> torch.Tensor:
        cand = self.items(candidate)
        interest = self.history_attention(cand, self.items(history), history_mask)
        return self.head(torch.cat([cand, interest], dim=-1)).squeeze(-1)


def click_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], clicks: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.float(), clicks)


def make() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ClickModel()
    g = torch.Generator().manual_seed(1)
    n, length = len(HISTORY_LENGTHS), max(HISTORY_LENGTHS)
    history_mask = (torch.arange(length)[None, :] < torch.tensor(HISTORY_LENGTHS)[:, None]).long()
    history = torch.randint(1, NUM_ITEMS, (n, length), generator=g) * history_mask     # 0 = padding item
    batch = {"candidate": torch.randint(1, NUM_ITEMS, (n,), generator=g), "history": history,
             "history_mask": history_mask}
    clicks = torch.tensor([1.0, 0.0, 1.0, 0.0])
    return {"model": model, "batch": batch, "loss_fn": functools.partial(click_loss, clicks=clicks),
            "precision": "fp16"}


if __name__ == "__main__":
    spec = make()
    for name, model in (("fp32", spec["model"]), ("fp16", copy.deepcopy(spec["model"]).half())):
        seen: dict[str, Any] = {}
        model.history_attention.register_forward_hook(lambda mod, args, out, seen=seen: seen.update(
            nan_users=torch.isnan(out).any(-1).nonzero().flatten().tolist()))
        loss = spec["loss_fn"](model(**spec["batch"]), spec["batch"])
        loss.backward()
        nan_grads = sum(int(not torch.isfinite(p.grad).all()) for p in model.parameters())
        print(f"{name}: users with NaN interest {seen['nan_users']}; loss {loss.item():.4f}; "
              f"params with non-finite grads {nan_grads}")
        if name == "fp32":
            ok = math.isfinite(loss.item()) and not seen["nan_users"]
        else:
            ok = ok and math.isnan(loss.item()) and seen["nan_users"] == [2]
    print("REPRODUCED: -1e9 mask -> -inf in fp16 -> fully masked row of the cold-start user -> NaN" if ok
          else "NOT REPRODUCED")
