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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ampdoctor.__version__, "--version", prog_name="ampdoctor")
@click.option("-v", "--verbose", is_flag=True, help="log progress to stderr")
def main(verbose: bool) -> None:
    """Find, explain and fix why mixed-precision PyTorch runs produce inf/NaN or lose accuracy."""
    need("the terminal report")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
