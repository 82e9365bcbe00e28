"""The ``ampdoctor`` click group and the option values and help texts its commands share."""

from __future__ import annotations

import logging

import click

import ampdoctor
from ampdoctor.cli._checks import need

PRECISION_CHOICES = ["fp16", "bf16", "fp16-amp", "bf16-amp", "fp8", "fp8-e4m3", "fp8-e5m2", "as-given"]
JSON_HELP = "write the JSON report to this file ('-': stdout, the terminal report then goes to stderr)"
HTML_HELP = "write the offline HTML report to this file (needs the html extra: jinja2, plotly)"
POLICY_HELP = "autocast op policy for *-amp: CUDA's (emulated off-GPU) or the device's own"


class LogFormat(logging.Formatter):
    """``name: message`` for other libraries' records (a script run under ``ampdoctor run`` logs too) and for the
    watch's (logger ``ampdoctor.watch``: its messages name no source, so a plain ``logging.basicConfig()`` shows
    it once, from the logger name); ampdoctor's other messages already start with what says where they come from
    (``ampdoctor run:``) or are the CLI's own, so they get no second prefix."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")
        self.own = logging.Formatter("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name != "ampdoctor.watch" and (record.name == "ampdoctor" or record.name.startswith("ampdoctor.")):
            return self.own.format(record)
        return super().format(record)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ampdoctor.__version__, "--version", prog_name="ampdoctor")
@click.option("-v", "--verbose", is_flag=True, help="log progress to stderr")
def main(verbose: bool) -> None:
    """Find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy."""
    need("the terminal report")
    handler = logging.StreamHandler()
    handler.setFormatter(LogFormat())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
