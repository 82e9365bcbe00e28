"""Honest outputs: ``fix(..., inplace=True)`` can be removed; ``fix --save`` writes a state_dict only when the
weights changed, otherwise the code to apply, and says which; the CLI prints the snippet."""

from __future__ import annotations

from pathlib import Path

import torch

from ampdoctor.cli._fix import save_fix
from ampdoctor.fixes import diagnose_and_fix, fix
from ampdoctor.scenarios import load_scenario


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_inplace_fix_is_removed_exactly() -> None:
    spec = load_scenario("fully_masked_row").make()
    model, batch = spec["model"], spec["batch"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out_before = model(**batch)
    report = diagnose_and_fix("fully_masked_row", steps=2, until_verified=True)
    result = fix(model, report, inplace=True)
    assert result.model is model and _hooks(model) > 0
    assert torch.isfinite(model(**{k: v.half() if v.is_floating_point() else v for k, v in batch.items()})).all()
    result.remove()
    assert _hooks(model) == 0
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(model(**batch), out_before)
    result.remove()  # idempotent


def test_save_writes_code_when_no_weight_changed(tmp_path: Path) -> None:
    spec = load_scenario("bert_unused_pooler").make()
    report = diagnose_and_fix("bert_unused_pooler", steps=2, until_verified=True)
    result = fix(spec["model"], report)
    out = tmp_path / "fix.out"
    msg = save_fix(spec["model"], result, str(out))
    assert "changes no weights" in msg and "no state_dict" in msg
    text = out.read_text()
    assert text.startswith("# ampdoctor fix: exclude_unused") and (result.snippet or "") in text


def test_save_writes_a_state_dict_when_weights_changed(tmp_path: Path) -> None:
    spec = load_scenario("fully_masked_row").make()
    report = diagnose_and_fix("fully_masked_row", steps=2, until_verified=True)
    result = fix(spec["model"], report)  # precision fp16: the fixed copy is cast
    out = tmp_path / "fix.pt"
    msg = save_fix(spec["model"], result, str(out))
    assert "state_dict is written" in msg
    sd = torch.load(out, weights_only=True)
    assert all(v.dtype == torch.float16 for v in sd.values() if v.is_floating_point())
