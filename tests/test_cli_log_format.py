"""The CLI's log lines: ampdoctor's messages name their source once, other libraries' records get their logger name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging
from ampdoctor.cli import main
try:
    main(["explain", "nonfinite-loss"])
except SystemExit:
    pass
logging.getLogger("ampdoctor.watch").warning("ampdoctor.watch: step %d: the loss is nan", 3)
logging.getLogger("ampdoctor.integrations.run").warning("ampdoctor run: watching Net with SGD")
logging.getLogger("transformers.trainer").warning("a foreign warning")
"""


def test_watch_messages_carry_one_prefix_and_foreign_ones_their_logger_name() -> None:
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert "ampdoctor.watch: step 3: the loss is nan" in lines
    assert "ampdoctor run: watching Net with SGD" in lines
    assert "transformers.trainer: a foreign warning" in lines
    assert "ampdoctor.watch: ampdoctor.watch" not in p.stderr
    assert "ampdoctor.integrations.run: ampdoctor run" not in p.stderr
