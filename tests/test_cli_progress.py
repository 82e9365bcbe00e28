"""`check` and `headroom` show their phases on a terminal (stderr), and nothing when stderr is not a terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rich")

HEALTHY = """
import torch
from torch import nn

def make():
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), "batch": torch.randn(4, 8),
            "loss_fn": lambda o, b: o.pow(2).mean(), "precision": "fp16"}
"""
ROOT = Path(__file__).resolve().parents[1]


def _cli(args: list[str], tty: bool) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100", "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    env.pop("NO_COLOR", None)
    cmd = [sys.executable, "-m", "ampdoctor.cli", *args]
    if not tty:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    err = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            err += chunk
        elif p.poll() is not None:
            break
    out = p.stdout.read().decode() if p.stdout else ""
    p.wait(timeout=120)
    os.close(master)
    return p.returncode, out, err.decode(errors="replace")


def test_progress_on_a_terminal_only(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ampdoctor.cli import main

    f = tmp_path / "healthy.py"
    f.write_text(HEALTHY)
    code, out, err = _cli(["check", str(f)], tty=True)  # one subprocess: stderr on a pseudo-terminal
    assert code == 0, err
    assert "fp32 headroom run" in err and "SAFE" in out
    for command in ("check", "headroom"):  # not a terminal: no progress, the result on stdout
        res = CliRunner().invoke(main, [command, str(f)], env={"NO_COLOR": "1", "COLUMNS": "100"})
        assert res.exit_code == 0, res.output
        assert "fp32 headroom run" not in res.output and "reference run" not in res.output


def test_quick_check_shows_its_phases(tmp_path: Path) -> None:
    """fp16-amp on the healthy model: the fp32 headroom run, then the quick target step (no full diagnosis)."""
    f = tmp_path / "healthy_amp.py"
    f.write_text(HEALTHY.replace('"precision": "fp16"', '"precision": "fp16-amp"'))
    code, out, err = _cli(["check", str(f)], tty=True)
    assert code == 0, err
    assert "fp32 headroom run" in err and "quick target-precision step" in err, err
    assert "full diagnosis" not in err and "quick check" in out, out
