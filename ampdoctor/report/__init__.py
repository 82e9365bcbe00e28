"""Renderers for :class:`ampdoctor.Report`: terminal (rich), JSON (stdlib) and a self-contained HTML page.

>>> from ampdoctor.report import render_terminal, write_json, write_html, load_report
>>> render_terminal(report)                      # doctest: +SKIP
>>> write_json(report, "report.json")            # doctest: +SKIP
>>> write_html(report, "report.html")            # doctest: +SKIP

The terminal renderer needs ``ampdoctor[cli]`` (rich), the HTML one ``ampdoctor[html]`` (jinja2); both
import them only when called. JSON needs nothing beyond the standard library.
"""

from ampdoctor.report._format import fmt_num
from ampdoctor.report.html import render_html, write_html
from ampdoctor.report.jsonio import SCHEMA_PATH, ReportFormatError, load_report, render_json, write_json
from ampdoctor.report.terminal import render_terminal, terminal_text

__all__ = [
    "SCHEMA_PATH",
    "fmt_num",
    "ReportFormatError",
    "load_report",
    "render_html",
    "render_json",
    "render_terminal",
    "terminal_text",
    "write_html",
    "write_json",
]
