"""One step runner: every path that runs a user's step (diagnose, verification curves, headroom, the plain
loop; watch replay calls diagnose) runs the same step and gets bitwise identical losses; the copies are freed as
soon as a run returns."""

from __future__ import annotations

import gc
import math
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.fixes._curve import run_curve
from ampdoctor.precision import GradSnapshot, Observer, ParamSnapshot, make_spec, run, run_steps, saved_rng
from ampdoctor.precision.headroom import headroom_spec


def _spec(precision: str, *, scaler: bool = False, steps: int = 4) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    F.cross_entropy(model(x), y).backward()  # the optimizer carries state: the runner must cast it too
    opt.step()
    opt.zero_grad()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    return make_spec(model, (x,), precision=precision, optimizer=opt, scaler=sc, steps=steps,
                     loss_fn=lambda out, batch: F.cross_entropy(out, y))


@pytest.mark.parametrize("precision,scaler", [("bf16", False), ("fp16-amp", True), ("bf16-amp", False)])
def test_every_path_runs_the_same_step(precision: str, scaler: bool) -> None:
    spec = _spec(precision, scaler=scaler)
    with saved_rng():
        plain_t = run_steps(spec, reference=False).losses
    with saved_rng():
        plain_r = run_steps(spec, reference=True).losses
    report = ampdoctor.diagnose(spec.model, spec.batch, precision=precision, optimizer=spec.optimizer,
                                scaler=spec.scaler, loss_fn=spec.loss_fn, steps=spec.steps)
    curve_t = run_curve(spec, reference=False, steps=spec.steps).losses
    curve_r = run_curve(spec, reference=True, steps=spec.steps).losses
    with saved_rng():
        traced_t = run(spec, reference=False).losses
    room = headroom_spec(spec)
    assert len(plain_t) == spec.steps and all(v is not None for v in plain_t)
    assert plain_t != plain_r  # the precision did something: the comparison below can fail
    assert report.summary["loss_target"] == plain_t == curve_t == traced_t
    assert report.summary["loss_reference"] == plain_r == curve_r
    assert room.loss == plain_r[0]  # headroom's one fp32 step (no optimizer) starts where the reference does


def test_optimizer_state_follows_the_cast() -> None:
    """The verification curve casts the optimizer state as the diagnosis does (the two once diverged)."""
    spec = _spec("bf16", steps=1)
    seen: list[set[torch.dtype]] = []

    class StateDtypes(Observer):
        def grads_ready(self, loop: Any, step: int) -> None:
            seen.append({v.dtype for st in loop.prep.optimizer.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0})

    run_steps(spec, reference=False, observers=[StateDtypes()])
    assert seen == [{torch.bfloat16}]


def test_snapshots_and_no_side_effects() -> None:
    spec = _spec("fp16-amp", scaler=True, steps=2)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    rng = torch.get_rng_state()
    grads, params = GradSnapshot(0), ParamSnapshot()
    with saved_rng():
        res = run_steps(spec, reference=False, observers=[grads, params])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in spec.model.state_dict().items())
    assert grads.grads is not None and set(grads.grads) == {n for n, _ in spec.model.named_parameters()}
    scale = spec.scaler.get_scale()
    # unscaled: the gradient is of the loss's order, not 2**10 times it
    assert all(g is not None and float(g.abs().max()) < scale / 8 for g in grads.grads.values())
    assert not any(torch.equal(params.params[n], p.float()) for n, p in spec.model.named_parameters())
    assert res.finite_steps == 2 and len(res.scales) == 2


def test_each_run_frees_its_copy_before_returning() -> None:
    """Peak memory: a run's copy must be gone when it returns (not at the next GC), so the next copy replaces it."""
    spec = _spec("bf16", steps=2)
    copies: list[weakref.ref[nn.Module]] = []

    def remember(model: nn.Module, optimizer: Any = None, scaler: Any = None) -> None:
        copies.append(weakref.ref(model))

    spec = replace(spec, transforms=(remember,))
    gc.disable()
    try:
        run(spec, reference=True)
        run(spec, reference=False)
        run_steps(spec, reference=False)
        run_curve(spec, reference=False, steps=2)
        assert len(copies) == 4 and all(r() is None for r in copies)
    finally:
        gc.enable()


def test_a_failing_step_is_recorded_or_raised() -> None:
    spec = _spec("bf16", steps=3)

    class Boom(Observer):
        def before_backward(self, loop: Any, step: int, loss: torch.Tensor) -> None:
            if step == 1:
                raise RuntimeError("boom")

    res = run_steps(spec, reference=False, observers=[Boom()])
    assert res.exc_step == 1 and isinstance(res.exc, RuntimeError) and len(res.losses) == 1
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(spec, reference=False, observers=[Boom()], raise_errors=True)


def _optimizer_writes(res: Any) -> dict[tuple[int, str, str, int], Any]:
    return {w.key: w for w in res.trace.writes if w.phase == "optimizer"}


@pytest.mark.parametrize("precision", ["bf16", "fp16-amp"])
def test_optimizer_writes_are_measured_where_the_analysis_reads_them(precision: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside optimizer.step both runs measure exactly the writes into state the target holds in 16 bits (a lost
    update and its fp32 twin); the others are logged unmeasured (NaN, no float64 copies) with the same keys, so
    later writes stay aligned. Measured statistics are those of a trace that measures every write."""
    spec = _spec(precision, steps=2)
    with saved_rng():
        ref, tgt = run(spec, reference=True), run(spec, reference=False)
    ref_w, tgt_w = _optimizer_writes(ref), _optimizer_writes(tgt)
    assert ref_w and ref_w.keys() == tgt_w.keys()
    low = precision == "bf16"
    for key, w in ref_w.items():
        # measured: the counts are known (a CPU fp32 write judged without its whole re-run has ``intended`` NaN)
        measured = [all(x.stats[f] == x.stats[f] for f in ("moving", "lost", "changed", "applied"))
                    for x in (w, tgt_w[key])]
        assert measured == [low, low], (key, w.stats, tgt_w[key].stats)
        assert len(w.stats) == len(tgt_w[key].stats) == 6
    if low:  # the same numbers as measuring everything
        monkeypatch.setattr("ampdoctor.precision._runner._measured_writes", lambda *a: None)
        with saved_rng():
            full = run(spec, reference=True)
        assert {k: w.stats for k, w in _optimizer_writes(full).items()} == {k: w.stats for k, w in ref_w.items()}


class _StateWriter(nn.Module):
    """Writes into module state outside ``optimizer.step``: BatchNorm's running statistics (float32) and an fp16
    buffer in the forward; a root-owned parameter (its update inside ``optimizer.step`` has module ``""``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)
        self.gain = nn.Parameter(torch.ones(4))
        self.register_buffer("ema", torch.zeros(8, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(F.gelu(self.shared(x)))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0).half(), alpha=0.1)
        return self.head(self.bn(h)) * self.gain


def test_writes_outside_the_optimizer_are_measured_where_the_analysis_reads_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside optimizer.step too, each run measures only what ``findings._updates`` reads: the target its 16-bit
    writes, the reference their twins, both the module-less ones (``loss-scaling-misuse``); fp32 running
    statistics are logged unmeasured, with the keys of a trace that measures every write, and the measured ones
    keep its numbers."""
    torch.manual_seed(0)
    model = _StateWriter()
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    spec = make_spec(model, (x,), precision="fp16-amp", optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                     scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 4), steps=1,
                     loss_fn=lambda out, batch: F.cross_entropy(out, y))
    runs = {}
    for ref in (True, False):
        with saved_rng():
            runs[ref] = run(spec, reference=ref)
    monkeypatch.setattr("ampdoctor.precision._runner._measured_writes", lambda *a: None)
    for ref in (True, False):
        with saved_rng():
            full = {w.key: w for w in run(spec, reference=ref).trace.writes}
        writes = {w.key: w for w in runs[ref].trace.writes}
        assert writes.keys() == full.keys()
        for key, w in writes.items():
            measured = w.stats["changed"] == w.stats["changed"]
            read = w.name == "ema" or (w.name == "gain" and w.phase == "optimizer")
            assert measured == read, (ref, key, w.module, w.stats)
            if read:
                assert w.stats == full[key].stats or all(
                    a == b or a != a and b != b for a, b in zip(w.stats.values(), full[key].stats.values()))
        assert {(w.target, w.name) for w in writes.values()} >= {("buffer", "ema"), ("buffer", "bn.running_mean"),
                                                                 ("parameter", "gain")}


@pytest.mark.parametrize("case", ["normal", "embedding", "tiny", "subnormal", "huge", "mixed", "half", "bfloat"])
def test_gradient_norm_sum_of_squares_matches_float64(case: str) -> None:
    """The runner's per-step gradient norm (host path: float32 chunk norms summed in float64) agrees with a float64
    reduction to 1e-5 at every magnitude float32 holds, and is inf/NaN exactly where that one is."""
    from ampdoctor.precision._runner import sum_of_squares

    gen = torch.Generator().manual_seed(0)
    r = lambda n: torch.randn(n, generator=gen)  # noqa: E731
    emb = torch.zeros(3000, 128)
    emb[torch.randint(0, 3000, (40,), generator=gen)] = r(40 * 128).view(40, 128)
    g = {"normal": r(1 << 18) * 3, "embedding": emb, "tiny": r(70000) * 1e-25, "subnormal": torch.full((70001,), 1e-44),
         "huge": r(70000) * 1e25, "half": (r(200000) * 100).half(), "bfloat": r(200000).bfloat16(),
         "mixed": torch.cat([r(100000), r(100000) * 1e-30, torch.zeros(65536 * 3), r(65536) * 1e-30])}[case]
    exact = g.double().pow(2).sum().item()
    got = sum_of_squares(g)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert exact > 0 and abs(got.item() - exact) <= 1e-5 * exact
    for bad, want in ((float("inf"), math.inf), (float("nan"), None)):
        h = g.float().clone().view(-1)
        h[7] = bad
        v = sum_of_squares(h).item()
        assert (v == want) if want is not None else v != v
    assert sum_of_squares(torch.zeros(100)).item() == 0.0


def test_host_runs_keep_no_small_tensors_and_norms_only_with_a_scaler() -> None:
    """On the host the per-parameter zero fractions and the per-step gradient norms are floats from the start (no
    0-d tensor per parameter lives until the read-back: they pin holes in the C heap at scale), and the gradient
    norm -- read only against a loss scale -- is computed only with an enabled GradScaler."""
    for scaler in (True, False):
        spec = _spec("fp16-amp", scaler=scaler, steps=2)
        for reference in (True, False):
            res = run(spec, reference=reference)
            assert all(isinstance(ps.grad_zero, float) for cov in res.coverage for ps in cov if not ps.grad_none)
            assert len(res.coverage) == 2
            if scaler:
                assert len(res.grad_norms) == 2 and all(isinstance(n, float) and n > 0 for n in res.grad_norms)
            else:
                assert res.grad_norms == []


def test_a_host_run_hands_the_heap_back_once_per_step_before_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced host run returns the C heap's free pages (the backward's freed activations) before each step's
    optimizer allocates, and once more when its copy is gone; the numbers are those of a run without it."""
    from ampdoctor.precision import _heap, _runner

    assert _heap.release_free_heap() in (True, False)  # never raises (True under glibc)
    calls: list[int] = []
    spec = _spec("bf16-amp", steps=3)
    with saved_rng():
        plain = run(spec, reference=False)
    monkeypatch.setattr(_runner, "release_free_heap", lambda: calls.append(1) or True)
    with saved_rng():
        res = run(spec, reference=False)
    assert len(calls) == 3 + 1
    assert res.losses == plain.losses and res.grad_norms == plain.grad_norms


def test_the_runners_own_coverage_reads_are_not_recorded() -> None:
    """The gradient coverage (a count of zeros per gradient) is the runner's work, not the step's: a traced step
    records exactly the ops of the forward, backward and optimizer.step, in every phase."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    bare = run(make_spec(model, (x,), loss_fn=lambda out, batch: out.sum()), reference=True)
    assert not [r.op for r in bare.trace.records if r.phase == "optimizer"]
    assert bare.coverage and all(ps.grad_zero is not None for ps in bare.coverage[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    stepped = run(make_spec(model, (x,), optimizer=opt, loss_fn=lambda out, batch: out.sum()), reference=True)
    ops = {r.op for r in stepped.trace.records if r.phase == "optimizer"}
    assert "aten.div.Tensor" not in ops and not any(r.dtype == "float64" for r in stepped.trace.records)
    assert "aten.add_.Tensor" in ops  # SGD's own update is still recorded


@pytest.mark.parametrize("precision,scaler", [("fp16-amp", True), ("fp16", False), ("fp32", False)])
def test_the_loops_loss_and_scale_reads_are_not_recorded(precision: str, scaler: bool) -> None:
    """The loop reads each step's loss (``loss.detach().float().item()``: a ``detach``, in 16 bits a ``_to_copy``)
    and the GradScaler's scale back after the step: its own work, not the step's. A traced run records exactly the
    step's ops: a forward-only step (no optimizer, no backward) has forward records only, none of them a read of the
    loss after it was computed, and every step's last record is its own last op."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    fwd = run(make_spec(model, (x,), precision=None if precision == "fp32" else precision,
                        loss_fn=lambda out, batch: out.float().sum().detach(), steps=2), reference=precision == "fp32")
    assert fwd.forward_only and len(fwd.losses) == 2 and all(v is not None for v in fwd.losses)
    assert {r.phase for r in fwd.trace.records} == {"forward"}
    for step in (0, 1):  # the loss_fn's own detach is the step's last op; no second one (the loop's) after it
        ops = [r.op for r in fwd.trace.records if r.step == step and r.kind == "op"]
        last_sum = len(ops) - 1 - ops[::-1].index("aten.sum.default")
        assert ops[last_sum + 1:] == ["aten.detach.default"], ops
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    spec = make_spec(model, (x,), precision=None if precision == "fp32" else precision, optimizer=opt, scaler=sc,
                     loss_fn=lambda out, batch: out.float().sum(), steps=2)
    with saved_rng():
        traced = run(spec, reference=precision == "fp32")
    with saved_rng():
        plain = run_steps(spec, reference=precision == "fp32")
    assert traced.losses == plain.losses and traced.scales == plain.scales
    for step in (0, 1):
        last = [r for r in traced.trace.records if r.step == step][-1]
        assert last.phase == "optimizer" and last.op != "aten.detach.default", last
        assert not [r for r in traced.trace.records if r.step == step and r.op == "aten.detach.default"
                    and r.phase == "optimizer"]


def test_a_diagnosis_trims_the_heap_between_its_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run's freed heap goes back to the OS before the second allocates (the target runs first, then the
    reference): without that trim the second run starts from the first's resident free pages and adds its own
    beside them (measured at 750M, fp16-amp, when the reference ran first: the target started at 17.2 GiB RSS and
    peaked at 19.7 GiB, 1.55x a plain step, against 6.1 / 14.0 GiB with the trim)."""
    import sys

    from ampdoctor.precision import _runner

    spec = _spec("fp16-amp", scaler=True, steps=2)
    calls: list[str] = []
    real_run = _runner.run

    def run_traced(*a: Any, **k: Any) -> Any:
        calls.append("reference" if k.get("reference") else "target")
        return real_run(*a, **k)

    monkeypatch.setattr(_runner, "release_free_heap", lambda: calls.append("trim") or True)
    monkeypatch.setattr(sys.modules["ampdoctor.diagnose"], "run", run_traced)
    ampdoctor.diagnose(spec.model, spec.batch, precision="fp16-amp", optimizer=spec.optimizer, scaler=spec.scaler,
                       loss_fn=spec.loss_fn, steps=2)
    # per run: one trim per optimizer step entered, one after the run; the reference leaves out its last update
    # (nothing reads it: ``unread_updates``), so it trims once in its step and once after
    assert calls == ["target", "trim", "trim", "trim", "reference", "trim", "trim"], calls
