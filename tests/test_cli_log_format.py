"""The CLI's log lines: ampdoctor's messages name their source once (the watch's from its logger name), other
libraries' records get their logger name; under a plain ``logging.basicConfig()`` a watch warning names it once too."""

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
logging.getLogger("ampdoctor.watch").warning("step %d: the loss is nan", 3)
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


BASIC = """
import logging
import torch
from torch import nn
from ampdoctor.watch import watch
logging.basicConfig()
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with watch(model, opt, locate=False) as w:
    loss = model(torch.full((2, 4), float("nan"))).mean()
    loss.backward()
    opt.step()
    w.step(loss)
"""


def test_a_watch_warning_under_basic_config_names_its_source_once() -> None:
    p = subprocess.run([sys.executable, "-c", BASIC], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr
    warned = [line for line in p.stderr.splitlines() if line.startswith("WARNING:ampdoctor.watch:")]
    assert any("the loss is nan at step 0" in line for line in warned), p.stderr
    assert "ampdoctor.watch:ampdoctor.watch" not in p.stderr
