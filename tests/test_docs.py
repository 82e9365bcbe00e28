"""Generated documentation is current: docs/codes.md comes from the rule registry."""

from __future__ import annotations

from pathlib import Path

from ampdoctor import CODES
from ampdoctor.findings import CODE_INFO, RULES, codes_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_every_code_has_a_registered_rule_with_documentation() -> None:
    assert set(RULES) == set(CODES)
    for code in CODES:
        info = CODE_INFO[code]
        assert info.severity in ("error", "warning", "info") and len(info.doc) > 80, code


def test_codes_md_is_generated_from_the_registry() -> None:
    text = (ROOT / "docs" / "codes.md").read_text(encoding="utf-8")
    assert text == codes_markdown(), "docs/codes.md is stale: regenerate it with " \
        "python -c \"from ampdoctor.findings import codes_markdown; open('docs/codes.md','w').write(codes_markdown())\""
