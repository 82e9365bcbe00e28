"""Rank workers for ``ampdoctor run`` on a DDP script (spawned by :func:`tests.distributed._workers.launch`)."""

from __future__ import annotations

import os
import textwrap
from typing import Any

DDP_SCRIPT = """
    import torch, torch.nn as nn, torch.distributed as dist
    rank = dist.get_rank()                       # the launcher initialised gloo, as torchrun's env would
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if rank == 1 and step >= 2:
            x = x * 1e5                          # only rank 1's data overflows fp16
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""


def run_ddp_script(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from ampdoctor.integrations.run import run_script

    path = os.path.join(tmp, "train_ddp.py")
    if rank == 0:
        with open(path, "w") as f:
            f.write(textwrap.dedent(DDP_SCRIPT))
    import torch.distributed as dist

    dist.barrier()
    r = run_script(["python", path])
    s = r.summary
    return {"rank": s.get("rank"), "world_size": s.get("world_size"), "model_class": s.get("model_class"),
            "findings": [(f.code, f.severity, f.module, f.op, str(f.phase)) for f in r.findings],
            "script": s.get("script"), "origin_rank": s.get("origin_rank"), "origin": s.get("nonfinite_origin"),
            "events": s.get("rank_events"), "rank_exchanges": s.get("rank_exchanges"),
            "root_cause": None if r.root_cause is None else (r.root_cause.code, r.root_cause.module, r.root_cause.op,
                                                              r.root_cause.evidence.get("origin_rank"),
                                                              r.root_cause.title, r.root_cause.step)}
