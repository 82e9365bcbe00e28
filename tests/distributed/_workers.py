"""What each spawned rank runs, and :func:`launch`, which starts the ranks and collects their results.

Every worker is ``fn(rank, world_size, tmp) -> dict`` and runs inside an initialized gloo process group (a
``FileStore`` in ``tmp``, 60 s collective timeout). It returns plain data (strings, numbers, lists, dicts); the
parent reads one pickle per rank. Models are tiny and built from the same seed on every rank; batches differ
per rank (each rank's own data, as in data-parallel training).
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampdoctor

FP16_MAX = 65504.0


# ------------------------------------------------------------------------------------------------- launcher
def launch(fn: Any, world_size: int = 2, timeout: float = 150.0) -> list[dict[str, Any]]:
    """Run ``fn`` on ``world_size`` spawned ranks; return each rank's result, rank order. Never hangs: after
    ``timeout`` seconds the ranks are killed and :class:`TimeoutError` is raised; a rank's exception is re-raised
    here (``torch.multiprocessing.ProcessRaisedException``) with its traceback."""
    tmp = tempfile.mkdtemp(prefix="ampdoctor_dist_")
    ctx = mp.start_processes(_entry, args=(fn, world_size, tmp), nprocs=world_size, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout:.0f} s on {world_size} ranks")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    out = []
    for rank in range(world_size):
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out


def _entry(rank: int, fn: Any, world_size: int, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, tmp)
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # no rank tears down gloo while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    # Leave without running interpreter teardown: gloo's background threads can abort the process there
    # ("terminate called without an active exception", SIGABRT) after all the work is done and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -------------------------------------------------------------------------------------------------- helpers
def _mlp(up_scale: float = 1.0) -> nn.Module:
    """Linear -> ReLU -> Linear, PyTorch's default init (|w| <= 1/sqrt(8)) with ``up``'s weight times ``up_scale``."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(up=nn.Linear(8, 16), act=nn.ReLU(), down=nn.Linear(16, 1)))
    with torch.no_grad():
        net.up.weight.mul_(up_scale)
    return net


def _square_mean(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _token_loss(out: Any, batch: Any) -> torch.Tensor:
    return out.last_hidden_state.pow(2).mean()


def _findings(report: Any) -> list[dict[str, Any]]:
    return [{"code": f.code, "severity": f.severity, "module": f.module, "op": f.op, "phase": f.phase,
             "step": f.step, "title": f.title, "explanation": f.explanation, "evidence": dict(f.evidence),
             "fix_snippets": [x.snippet for x in f.fixes]}
            for f in report.findings]


def _summary(report: Any) -> dict[str, Any]:
    keys = ("rank", "world_size", "nonfinite_ranks", "nonfinite_origin", "nonfinite_received_through",
            "exception", "loss_target", "first_nonfinite")
    return {k: report.summary[k] for k in keys if k in report.summary}


# -------------------------------------------------------------------------------------------------- DDP
def ddp_unused_pooler(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """BertModel (tiny, with pooler) under DDP, loss on ``last_hidden_state``, 2 steps. Also the plain loop, to
    show the failure ampdoctor explains: DDP raises on the second step on every rank."""
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16)
    model = DDP(BertModel(cfg))
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1 + rank))
    report = ampdoctor.diagnose(model, {"input_ids": ids}, loss_fn=_token_loss, steps=2)

    plain_error = ""
    for _ in range(2):
        try:
            _token_loss(model(input_ids=ids), None).backward()
        except RuntimeError as e:
            plain_error = str(e).splitlines()[0]
            break
    return {"findings": _findings(report), "summary": _summary(report), "plain_error": plain_error,
            "param_names": [n for n, _ in model.named_parameters()],
            "pooler_grad_none": model.module.pooler.dense.weight.grad is None}


def ddp_overflow_on_rank1(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """The same MLP on both ranks (``up``'s weights at 30x PyTorch's init); rank 1's batch is 3,000 times larger,
    so ``up``'s output exceeds fp16's range there only (the batch itself stays in range). DDP's gradient
    all-reduce then gives rank 0 the NaN gradients too."""

    net = _mlp(up_scale=30.0)
    model = DDP(net)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank))
    if rank == 1:
        x = x * 3e3
    with torch.no_grad():
        up_absmax_fp32 = float(net.up(x).abs().max())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=_square_mean, optimizer=opt)
    out: dict[str, Any] = {"findings": _findings(report), "summary": _summary(report),
                           "up_absmax_fp32": up_absmax_fp32, "batch_absmax": float(x.abs().max()),
                           "grads_untouched": all(p.grad is None for p in model.parameters())}
    out.update(_watched_ddp_loop(rank, tmp, net, x))
    out["grads_synced_after_cast"] = _grads_synced_after_cast(rank)
    return out


def _grads_synced_after_cast(rank: int) -> dict[str, bool]:
    """A deep copy of a DDP model cast to fp16 (what ``diagnose`` runs in ``"fp16"``): are the ranks' gradients
    all-reduced, without and with :func:`resync_after_cast`? (Each rank has its own batch.)"""
    import copy

    from ampdoctor.precision._distributed import param_dtypes, resync_after_cast

    base = DDP(_mlp())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(20 + rank)).half()
    out = {}
    for resync in (False, True):
        model = copy.deepcopy(base)
        before = param_dtypes(model)
        model.half()
        if resync:
            resync_after_cast(model, before)
        _square_mean(model(x), x).backward()
        g = model.module.up.weight.grad.float()
        both = [torch.zeros_like(g) for _ in range(2)]
        dist.all_gather(both, g)
        out["resynced" if resync else "cast only"] = torch.equal(both[0], both[1])
    return out


def _watched_ddp_loop(rank: int, tmp: str, net: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Two fp16-autocast steps of a DDP model under ``ampdoctor.watch``, each rank writing its reproducers."""
    try:
        from ampdoctor.watch import watch
    except ImportError as e:  # watch is optional here: report why it was not exercised
        return {"watch_error": f"ImportError: {e}"}
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    repro = os.path.join(tmp, f"repro-rank{rank}")
    with watch(model, opt, reproducer_dir=repro, on_anomaly="warn") as w:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _square_mean(model(x), x)
            loss.backward()
            opt.step()
            w.step(loss)
    report = w.report()
    files = sorted(os.listdir(repro)) if os.path.isdir(repro) else []
    return {"watch_codes": report.codes(), "watch_disabled": w.disabled, "reproducers": files,
            "watch_anomalies": [a.get("kind", a) if isinstance(a, dict) else str(a)
                                for a in report.summary.get("anomalies", [])]}


# ------------------------------------------------------------------------------------------------- FSDP
def _trace_facts(model: nn.Module, x: torch.Tensor, opt: Any) -> dict[str, Any]:
    """Train one step under ``ampdoctor.trace``; what the trace saw, and which origins arrived by collective."""
    from ampdoctor.precision._distributed import is_collective, own_origins, received_origins

    out: dict[str, Any] = {}
    try:
        with ampdoctor.trace(model, opt, full=True) as t:
            _square_mean(model(x), x).backward()
            if opt is not None:
                opt.step()
        res = t.result()
    except Exception as e:  # noqa: BLE001 - reported to the test, which decides
        return {"trace_error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    recs = res.records
    lin = res.lineage()
    received = received_origins(recs, lin.origins)
    local = own_origins(recs, lin.origins)
    out["trace_error"] = None
    out["modules"] = sorted({r.module for r in recs})
    out["collectives"] = sorted({r.op for r in recs if is_collective(r.op)})
    out["param_records"] = sorted({(r.name, tuple(r.shape)) for r in recs if r.kind == "param" and r.name})
    out["origins"] = len(lin.origins)
    out["received"] = len(received)
    out["local"] = [{"op": recs[o].op, "module": recs[o].module, "phase": recs[o].phase, "kind": recs[o].kind}
                    for o in local]
    return out


def fsdp_trace(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """FSDP1 (``use_orig_params=True``) and FSDP2 (``fully_shard``) on CPU/gloo: a traced training step each, with
    rank 1's batch so large that ``up``'s fp32 output overflows; and what ``diagnose`` says about the wrappers."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank))
    if rank == 1:
        x = x * 1e37  # |w| up to 10.6: sums of 8 products exceed float32's 3.4e38
    ref = _mlp(up_scale=30.0)
    with torch.no_grad():
        up_fp32 = ref.up(x)
    out: dict[str, Any] = {
        "original_modules": [n for n, _ in ref.named_modules()],
        "original_params": {n: tuple(p.shape) for n, p in ref.named_parameters()},
        "up_nonfinite": int((~torch.isfinite(up_fp32)).sum()),
    }

    # without device_id FSDP refuses CPU: "FSDP needs a non-CPU accelerator device"
    fsdp1 = FSDP(_mlp(up_scale=30.0), use_orig_params=True, device_id=torch.device("cpu"))
    out["fsdp1_params"] = [n for n, _ in fsdp1.named_parameters()]
    out["fsdp1_modules"] = [n for n, _ in fsdp1.named_modules()]
    out["fsdp1"] = _trace_facts(fsdp1, x, torch.optim.SGD(fsdp1.parameters(), lr=0.01))
    out["fsdp1_diagnose"] = _diagnose_error(fsdp1, x)

    net = _mlp(up_scale=30.0)
    fully_shard(net.up)
    fully_shard(net.down)
    fsdp2 = fully_shard(net)
    out["fsdp2_params"] = [n for n, _ in fsdp2.named_parameters()]
    out["fsdp2_modules"] = [n for n, _ in fsdp2.named_modules()]
    out["fsdp2"] = _trace_facts(fsdp2, x, None)
    out["fsdp2_with_optimizer"] = _trace_facts(fsdp2, x, torch.optim.SGD(fsdp2.parameters(), lr=0.01))
    out["fsdp2_diagnose"] = _diagnose_error(fsdp2, x)
    return out


def _diagnose_error(model: nn.Module, x: torch.Tensor) -> dict[str, str]:
    try:
        ampdoctor.diagnose(model, x, loss_fn=_square_mean)
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return {"type": type(e).__name__, "is_scenario_error": str(isinstance(e, ampdoctor.precision.ScenarioError)),
                "message": str(e)}
    return {"type": "", "is_scenario_error": "False", "message": ""}


def ddp_watch_nan_loss_on_rank1(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Three DDP steps under ``ampdoctor.watch`` per policy (the default, then ``"replay"``), the loss NaN on rank 1
    only at step 1 (a NaN term outside the model: the gradients, and so DDP's all-reduce, stay finite). Rank 1
    alone handles the anomaly and replays; were the replay to issue a collective, the ranks' collective sequences
    would no longer match and the next DDP step or the final ``all_reduce`` would fail or hang."""
    from ampdoctor.watch import watch

    out: dict[str, Any] = {}
    for policy in ("warn", "replay"):
        net = _mlp()
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank))
        steps = 0
        with watch(model, opt, on_anomaly=policy) as w:  # type: ignore[arg-type]
            for step in range(3):
                opt.zero_grad(set_to_none=True)
                loss = _square_mean(model(x), x)
                if rank == 1 and step == 1:
                    loss = loss + torch.tensor(float("nan"))
                loss.backward()
                w.step(loss)
                opt.step()
                steps += 1
        report = w.report()
        check = torch.tensor([float(rank + 1)])
        dist.all_reduce(check)                   # still in step with the other rank
        out[policy] = {"steps": steps, "codes": report.codes(), "disabled": w.disabled,
                       "anomalies": [(a["kind"], a["step"]) for a in report.summary.get("anomalies", [])],
                       "replayed": "replay" in report.summary, "replay_error": report.summary.get("replay_error"),
                       "all_reduce": float(check), "finite_weights": all(bool(torch.isfinite(p).all())
                                                                         for p in net.parameters())}
    return out


def ddp_watch_agreed_decisions(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """The NaN loss of rank 1 at step 1 (finite gradients) under ``on_anomaly="skip"`` and ``"raise"``: the
    decision must be taken on both ranks (rank 0 sees nothing wrong itself)."""
    from ampdoctor.watch import AnomalyError, watch

    out: dict[str, Any] = {}
    for policy in ("skip", "raise", "raise-late"):
        late = policy == "raise-late"
        net = _mlp()
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank))
        steps, error = 0, None
        before_bad: list[torch.Tensor] = []
        try:
            with watch(model, opt, on_anomaly="raise" if late else policy, locate=False) as w:  # type: ignore[arg-type]
                for step in range(3):
                    if step == 1:
                        before_bad = [p.detach().clone() for p in net.parameters()]
                    opt.zero_grad(set_to_none=True)
                    loss = _square_mean(model(x), x)
                    if rank == 1 and step == (2 if late else 1):
                        loss = loss + torch.tensor(float("nan"))
                    loss.backward()
                    if not late:
                        w.step(loss)
                    opt.step()
                    if late:             # the loss given after the update, at the last step: seen at exit
                        w.step(loss)
                    steps += 1
        except AnomalyError as e:
            error = (e.kind, e.step)
        weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        both = [torch.zeros_like(weights) for _ in range(world_size)]
        dist.all_gather(both, weights)           # also proves the ranks are still in step
        out[policy] = {"steps": steps, "error": error, "replicas_equal": torch.equal(both[0], both[1]),
                       "skipped_by_guard": w.report().summary["steps_skipped_by_watch"], "disabled": w.disabled,
                       "unchanged_by_bad_step": (policy == "raise" and all(
                           torch.equal(a, b) for a, b in zip(before_bad, net.parameters())))}
    return out


# ------------------------------------------------------------------------------------- watch: origin rank
def _watch_facts(w: Any, steps: int) -> dict[str, Any]:
    report = w.report()
    keys = ("rank", "world_size", "origin_rank", "nonfinite_origin", "rank_events", "rank_own_anomalies",
            "rank_nonfinite_grad_steps", "rank_exchanges")
    return {"steps": steps, "disabled": w.disabled, "findings": _findings(report),
            "summary": {k: report.summary.get(k) for k in keys},
            "anomalies": [(a["kind"], a["step"]) for a in report.summary.get("anomalies", [])],
            "replay_error": report.summary.get("replay_error"), "replay_note": report.summary.get("replay_note")}


def _watched_loop(rank: int, model: nn.Module, opt: Any, batches: list[torch.Tensor], *, give_loss: bool,
                  nan_loss_steps: tuple[int, ...] = (), autocast: bool = False, scaler: bool = False) -> dict[str, Any]:
    from ampdoctor.watch import watch

    steps = 0
    sc = torch.amp.GradScaler("cpu", enabled=scaler)
    with watch(model, opt, sc if scaler else None) as w:
        for step, x in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = _square_mean(model(x), x)
            if step in nan_loss_steps:
                loss = loss + torch.tensor(float("nan"))    # outside the model: the gradients stay finite
            sc.scale(loss).backward()
            if give_loss:
                w.step(loss)
            sc.step(opt)
            sc.update()
            steps += 1
    out = _watch_facts(w, steps)
    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)                       # the ranks are still in step
    out["all_reduce"] = float(check)
    return out


def _batches(rank: int, n: int, big_at: int | None = None, scale: float = 3e3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(4, 8, generator=g) for _ in range(n)]
    if rank == 1 and big_at is not None:
        xs[big_at] = xs[big_at] * scale
    return xs


def ddp_watch_origin_rank(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """The default watch on both ranks of a DDP job, three ways: fp16 autocast with rank 1's batch at step 1 so
    large that ``up`` overflows there only (DDP's all-reduce then gives rank 0 the inf/NaN gradients), with and
    without the loss given to ``w.step``; a NaN loss on rank 1 only (finite gradients); and different anomaly counts
    per rank (NaN losses: rank 1 at steps 1 and 3, rank 0 at step 2)."""
    out: dict[str, Any] = {}
    for name, give_loss in (("inf", True), ("inf-no-loss", False)):
        net = _mlp(up_scale=30.0)
        model = DDP(net)
        out[name] = _watched_loop(rank, model, torch.optim.SGD(model.parameters(), lr=0.01),
                                  _batches(rank, 3, big_at=1), give_loss=give_loss, autocast=True)
    # GradScaler: rank 1's batches overflow ``up`` from step 1 on, every step is skipped on both ranks, and rank 0's
    # own replay of its loss-scale collapse (step 3) stays finite: it only received the inf/NaN
    model = DDP(_mlp(up_scale=30.0))
    xs = _batches(rank, 5)
    out["scaler"] = _watched_loop(rank, model, torch.optim.SGD(model.parameters(), lr=0.01),
                                  [x * 3e3 if rank == 1 and i >= 1 else x for i, x in enumerate(xs)],
                                  give_loss=True, autocast=True, scaler=True)
    model = DDP(_mlp())
    out["nan-loss"] = _watched_loop(rank, model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(rank, 3),
                                    give_loss=True, nan_loss_steps=(1,) if rank == 1 else ())
    model = DDP(_mlp())
    out["counts"] = _watched_loop(rank, model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(rank, 5),
                                  give_loss=True, nan_loss_steps=(1, 3) if rank == 1 else (2,))
    return out


def fsdp_watch_origin_rank(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """The default watch over FSDP FULL_SHARD models (FSDP1 ``use_orig_params=True`` and FSDP2 ``fully_shard``),
    rank 1's batch at step 1 so large that ``up``'s float32 output overflows there only."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, fully_shard

    out: dict[str, Any] = {"original_params": [n for n, _ in _mlp().named_parameters()]}
    fsdp1 = FSDP(_mlp(up_scale=30.0), use_orig_params=True, device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy.FULL_SHARD)
    out["fsdp1"] = _watched_loop(rank, fsdp1, torch.optim.SGD(fsdp1.parameters(), lr=0.01),
                                 _batches(rank, 3, big_at=1, scale=1e37), give_loss=True)
    net = _mlp(up_scale=30.0)
    fully_shard(net.up)
    fully_shard(net.down)
    fsdp2 = fully_shard(net)
    out["fsdp2"] = _watched_loop(rank, fsdp2, torch.optim.SGD(fsdp2.parameters(), lr=0.01),
                                 _batches(rank, 3, big_at=1, scale=1e37), give_loss=True)
    return out

