"""The typed run facts (``Report.run``): read once from ``Report.summary``, from a real diagnosis and from JSON."""

from __future__ import annotations

import json
import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.findings import Link, Report, RunSummary, Site
from ampdoctor.report import terminal_text


def _overflowing_mlp() -> tuple[nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():  # products of |w| ~ 3000 and |x| ~ 10 over 8 terms exceed fp16's 65504
        model[0].weight.copy_(torch.randn(8, 8, generator=gen) * 3000)
        model[0].bias.zero_()
    return model, torch.randn(4, 8, generator=gen) * 10


def test_run_facts_of_a_real_diagnosis() -> None:
    model, x = _overflowing_mlp()
    report = ampdoctor.diagnose(model, x, precision="fp16", loss_fn=lambda out, batch: out.float().pow(2).mean())
    run = report.run
    assert (run.precision, run.steps, run.forward_only) == ("fp16", 1, False)
    assert run.loss_target is not None and math.isinf(run.loss_target[-1])  # the fp16 loss is inf
    assert run.loss_reference is not None and math.isfinite(run.loss_reference[-1])
    assert run.first_nonfinite == Site("aten.addmm.default", "0", "forward", 0, 4)
    assert run.first_nan is not None and run.first_nan.phase == "backward"
    assert run.ops_traced == report.summary["ops_traced"] and run.elapsed_s is not None
    # the JSON document is the summary mapping as before: the typed view adds no key and loses none
    loaded = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert set(loaded.to_dict()["summary"]) == set(report.to_dict()["summary"])
    assert loaded.run == run
    # the lineage chain, typed: the origin first, each link as in summary["chain"]
    assert run.chain and run.chain[0] == Link.of(report.summary["chain"][0])
    assert run.chain[0].op == "aten.addmm.default" and run.chain[0].module == "0"
    assert len(run.chain) == len(report.summary["chain"])
    assert loaded.run.loss_target is not None and math.isinf(loaded.run.loss_target[-1])  # "inf" in JSON


def test_partial_and_malformed_summaries_read_as_absent() -> None:
    run = RunSummary.of({"steps": "3", "elapsed_s": "inf", "first_nan": "aten.mm", "forward_only": "yes",
                         "loss_reference": 2.5, "device": ""})
    assert run == RunSummary(steps=None, elapsed_s=None, first_nan=None, forward_only=False,
                             loss_reference=(2.5,), device=None)
    assert RunSummary.of(None) == RunSummary() and RunSummary.of({}, precision="bf16").precision == "bf16"
    assert RunSummary.of({"precision": "fp16"}, precision="bf16").precision == "bf16"  # the report's own wins


def test_scale_facts_and_chain_links_read_typed() -> None:
    run = RunSummary.of({"scales": [65536.0, "inf", None, "x"], "skipped": [2, True, 0, 2], "initial_scale": "inf",
                         "chain": [1, {"op": None, "what": "inf * 0"}, {"op": "aten.mm.default", "phase": "forward"}]})
    assert run.scales is not None and run.scales[0] == 65536.0 and math.isinf(run.scales[1] or 0.0)
    assert run.scales[2:] == (None, None)
    assert run.skipped == (0, 2)  # a bool is no step index; sorted, once each
    assert run.initial_scale == math.inf
    assert run.chain == (Link(what="inf * 0"), Link("aten.mm.default", phase="forward"))  # the 1 is no link
    assert RunSummary.of({"scales": "65536", "skipped": 3}).scales is None
    assert RunSummary.of({"scales": "65536", "skipped": 3}).skipped is None


def test_site_text() -> None:
    assert str(Site("aten.mm.default", "", "backward", 2)) == "aten.mm.default in <root> (backward, step 2)"
    assert str(Site()) == "? in <root>"
    assert Site.of({"op": "aten.mul.Tensor", "module": "a.b", "step": True}) == Site("aten.mul.Tensor", "a.b")


def test_the_terminal_shows_the_typed_facts() -> None:
    report = Report(summary={"precision": "fp16", "steps": 2, "loss_target": [1.0, "nan"],
                             "first_nan": {"op": "aten.div.Tensor", "module": "head", "phase": "forward",
                                           "step": 1, "index": 7}})
    text = terminal_text(report, width=120)
    assert "precision fp16, 2 steps" in text and "target nan" in text
    assert "aten.div.Tensor in head (forward, step 1, op #7)" in text
