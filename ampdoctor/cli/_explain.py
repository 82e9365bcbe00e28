"""``ampdoctor explain``: the documentation of a cause code, with the remedies registered for it."""

from __future__ import annotations

import click

import ampdoctor
from ampdoctor.cli._app import main
from ampdoctor.cli._checks import did_you_mean, fail
from ampdoctor.cli._output import make_console


@main.command()
@click.argument("code", required=False)
def explain(code: str | None) -> None:
    """Print the documentation of a cause CODE (all codes without an argument)."""
    from rich.markdown import Markdown

    from ampdoctor.findings import CODE_INFO, codes_markdown

    console = make_console()
    if code is None:
        console.print(Markdown(codes_markdown()))
        return
    info = CODE_INFO.get(code) or CODE_INFO.get(code.lower().replace("_", "-"))
    if info is None:
        fail(f"unknown code {code!r}{did_you_mean(code, ampdoctor.CODES)}; expected one of "
              f"{', '.join(ampdoctor.CODES)}")
    console.print(Markdown(f"# `{info.code}` ({info.severity}, precedence {info.precedence})\n\n"
                           f"**{info.summary}**\n\n{info.doc}" + _remedies_markdown(info.code)))


def _remedies_markdown(code: str) -> str:
    """The mechanism-specific fixes registered for ``code``: mechanism, remedy, automatic fix id, snippet."""
    from ampdoctor.findings import remedies_for
    from ampdoctor.fixes import FIXES

    rems = remedies_for(code)
    if not rems:
        return ""
    out = ["\n\n## Fixes registered for this code\n"]
    for r in rems:
        auto = (f"automatic: `ampdoctor fix --apply {r.fix_id}` ({FIXES[r.fix_id].summary})"
                if r.fix_id in FIXES else "a source change (no automatic application)")
        out.append(f"- **{r.id}** — {r.mechanism}: {r.title}; {auto}\n\n```python\n{r.snippet}\n```\n")
    return "\n".join(out)

