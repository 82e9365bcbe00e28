"""Every real failure in ../shared/cases (and the built-in demo scenarios): the best proposed fix is verified.

Each case's docstring names its known remedies ("Known fixes"); the best fix that ``diagnose_and_fix`` verifies
must be one of them, and its numbers must show the repair: finite steps, losses and gradients within the
tolerance of the dtype, while the broken run fails at least one of those checks. A case whose expected finding
the diagnosis does not produce fails (no xfail). With ``CI=true`` a missing cases folder fails.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from ampdoctor.fixes import NoFixError, best_fix, diagnose_and_fix
from ampdoctor.precision import load_scenario_module
from tests.conftest import REPO_ROOT, SHARED_CASES, in_ci

K = 20
CASES_DIR = SHARED_CASES
SCENARIOS_DIR = REPO_ROOT / "ampdoctor" / "scenarios"

#: The fix ids that implement each case's documented remedy, and a phrase of its "Known fixes" paragraph that
#: names that remedy (checked against the docstring, so the table cannot drift from the case).
REMEDIES: dict[str, dict[str, str]] = {
    "adam_fp16_params_eps_underflow": {"fp32_master": "fp32 master weights"},
    "bert_pooler_tanh_saturation_fp16_amp": {"keep_fp32": "in fp32", "upcast_op": "in fp32"},
    "bf16_weight_update_lost": {"fp32_master": "fp32 master weights"},
    "ddp_unused_bert_pooler": {"exclude_unused": "exclude pooler params from the optimizer"},
    "fp16_gradient_underflow_no_loss_scaling": {"grad_scaler": "GradScaler", "loss_scaling": "loss scaling"},
    "fp8_lora_zero_amax_scale_nan": {"fp8_amax_floor": "floor amax"},
    "gelu_new_pow_backward_nan_fp16": {"keep_fp32": "compute activation in fp32", "upcast_op": "in fp32",
                                       "switch_precision": "bf16"},
    "gpt2_attention_qk_overflow_fp16_amp": {"keep_fp32": "fp32 accumulation", "switch_precision": "bf16"},
    "gradscaler_scale_collapse_gelu_new": {"keep_fp32": "fix the op producing non-finite grads",
                                           "switch_precision": "bf16"},
    "neg_inf_mask_fully_masked_row_nan": {"safe_mask": "finite mask value"},
    "rmsnorm_fp16_square_overflow": {"keep_fp32": "statistics in fp32", "upcast_op": "statistics in fp32"},
    "t5_amp_wo_overflow": {"switch_precision": "bf16", "keep_fp32": "disable autocast for `T5LayerFF`"},
    "t5_gated_ff_product_overflow_fp16": {"switch_precision": "run in bf16", "keep_fp32": "in fp32"},
    # built-in demo scenarios
    "t5_fp16_amp_ff_overflow": {"switch_precision": "train in bf16", "keep_fp32": "autocast disabled in fp32"},
    "bert_unused_pooler": {"exclude_unused": "leave the pooler parameters out of the optimizer"},
}
BUILTIN = ("t5_fp16_amp_ff_overflow", "bert_unused_pooler")


def _case_paths() -> list[object]:
    paths = [pytest.param(SCENARIOS_DIR / f"{n}.py", id=n) for n in BUILTIN]
    if CASES_DIR.is_dir():
        paths = [pytest.param(p, id=p.stem) for p in sorted(CASES_DIR.glob("*.py"))] + paths
    else:
        paths.insert(0, pytest.param(None, id="shared-cases-folder"))
    return paths


def _known_fixes(doc: str) -> str:
    m = re.search(r"Known fixes\n(.*?)\n(?:EXPECT|\S)", doc or "", re.S)
    return " ".join((m.group(1) if m else "").split())


def _broken_fails(v: dict, finding: str) -> list[str]:
    """The checks the original (broken) run fails, from the same numbers, and whether its finding is gone."""
    tol, steps = v["tolerance"], v["steps"]
    out = []
    if finding in v["findings_before"] and finding not in v["findings_after"]:
        out.append(f"{finding} resolved")
    if v["steps_finite_broken"] is not None and v["steps_finite_broken"] < steps:
        out.append("non-finite steps")
    lb = v["loss_broken"]
    if isinstance(lb, str) or (lb is not None and not math.isfinite(lb)):
        out.append("non-finite loss")
    if v["grad_lost_fraction_broken"] is not None and float(v["grad_lost_fraction_broken"]) > float(tol["lost"]):
        out.append("gradients lost")
    g = v["grad_rel_err_broken"]
    if g is not None and float(g) > float(tol["grad"]):
        out.append("gradient error")
    c = v.get("max_rel_err_curve_broken")
    if c is not None and (isinstance(c, str) or c > tol["curve"]):
        out.append("curve drift")
    o = v["output_rel_err_broken"]
    if v["loss_fp32"] is None and (o is None or isinstance(o, str) or o > tol["output"]):
        out.append("output error")
    if "broken_exception" in v.get("extra", {}):
        out.append("crash")
    return out


@pytest.mark.parametrize("path", _case_paths())
def test_best_proposed_fix_is_verified(path: Path | None) -> None:
    if path is None:
        msg = f"the shared cases folder {CASES_DIR} is missing"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    name = path.stem
    module = load_scenario_module(str(path))
    known = _known_fixes(module.__doc__)
    assert known, f"{name}: its docstring has no 'Known fixes' paragraph"
    report = diagnose_and_fix(str(path), steps=K, until_verified=True)
    expected = module.EXPECT["codes"][0]
    assert expected in report.codes(), f"{name}: the diagnosis does not produce {expected!r} ({report.codes()})"
    try:
        proposal, finding = best_fix(report)
    except NoFixError as e:
        pytest.fail(f"{name}: {e}")
    v = proposal.verification
    assert proposal.id in REMEDIES[name], f"{name}: best fix {proposal.id} ({v['reason']}) is not a known remedy"
    phrase = REMEDIES[name][proposal.id]
    assert phrase.lower() in known.lower(), f"{name}: {phrase!r} not in its known fixes: {known!r}"
    if proposal.id == "switch_precision":
        assert proposal.params["precision"] in ("bf16", "bf16-amp")

    assert proposal.verified is True and v["verified"] is True and v["report_ok"] is True, v["reason"]
    tol = v["tolerance"]
    if v["trained"]:
        assert v["steps"] == K and v["steps_finite"] == K
        assert isinstance(v["loss_fixed"], float) and math.isfinite(v["loss_fixed"])
        assert v["max_rel_err_first_step"] <= tol["loss"]
        assert v["max_rel_err_curve"] <= tol["curve"]
        assert len(v["curve_fixed"]) == K and all(isinstance(x, float) for x in v["curve_fixed"])
        if v["grad_rel_err"] is not None and tol["grad"] == "inf":
            # the healthy run's GradScaler skipped step 0 too (its gradients are not finite): gradient checks off
            assert tol["healthy"]["grad"] == "inf"
        elif v["grad_rel_err"] is not None:
            assert float(v["grad_rel_err"]) <= tol["grad"] and float(v["grad_lost_fraction"]) <= float(tol["lost"])
    else:
        assert v["steps"] == 1 and v["steps_finite"] == 1
        assert v["output_rel_err"] <= tol["output"]
    assert tol["loss"] >= 8 * tol["u"] and float(tol["grad"]) >= 16 * tol["u"]
    label = f"{finding.code}@{finding.module or '<root>'}"
    assert label in v["findings_before"] and label not in v["remaining"], (label, v["remaining"])
    assert _broken_fails(v, label), f"{name}: the original run passes every check; nothing was fixed: {v}"
