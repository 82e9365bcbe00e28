"""Property: whatever arguments and file contents the CLI gets, it exits 0, 1 or 2 with a message, never with a
raw traceback.

Hypothesis draws a command, a FILE argument (a missing path, a folder, or a file whose content is drawn from
scenario fragments, broken Python, JSON, binary junk and markup-like text) and a handful of options with valid or
invalid values. Each run goes through click's ``CliRunner`` in process; commands that would train for long are
kept tiny (``--steps 1``), and ``run`` is left out (it executes an arbitrary program by design). Examples are
bounded so the whole property takes well under a minute.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from click.testing import CliRunner

from ampdoctor.cli import main

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HEAD = "import torch\nfrom torch import nn\n"
GOOD_MAKE = ("def make():\n    m = nn.Linear(4, 2)\n    return {'model': m, 'batch': torch.ones(2, 4), "
             "'loss_fn': lambda o, b: o.float().mean(), 'precision': 'fp16'}\n")

#: pieces of scenario files: valid, subtly wrong and plainly broken
FRAGMENTS = [
    HEAD + GOOD_MAKE,
    HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'batch': torch.ones(2, 5)}\n",
    HEAD + "def make():\n    return None\n",
    HEAD + "def make():\n    raise RuntimeError('[/] boom')\n",
    HEAD + "import sys\nsys.exit(0)\n",
    "import sys\n" + HEAD + "def make():\n    sys.exit(3)\n",
    HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'steps': 10**9}\n",
    HEAD + "def make():\n    m = nn.Sequential()\n    m.add_module('[bold]x', nn.Linear(4, 2))\n"
           "    return {'model': m, 'batch': torch.ones(2, 4), 'loss_fn': lambda o, b: o.mean()}\n",
    HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'batch': (i for i in range(3))}\n",
    HEAD + "def make():\n    return {'model': nn.Linear(4, 2), 'batch': torch.ones(2, 4), 'optimizer': 'adam'}\n",
    "def make(:\n",
    "make = 5\n",
    "x = 1\n",
    '{"schema": "ampdoctor.report", "ok": true}',
    "[1, 2, 3]",
    "",
    "\x00\x01\x02",
    "[/]",
]

COMMANDS = ["diagnose", "check", "headroom", "fix", "report", "replay", "explain"]

#: option -> values, valid and invalid; options a command does not take are a usage error (exit 2), also fine
OPTIONS = {
    "--precision": ["fp16", "bf16", "fp16-amp", "as-given", "FP16", "fp12", ""],
    "--steps": ["1", "0", "-3", "x", "100000"],
    "--policy": ["cuda", "native", "CUDA"],
    "--format": ["fp16", "e4m3", "fp12"],
    "--apply": ["best", "keep_fp32", "nope"],
    "--json": ["-", "<tmp>/out.json", "<tmp>/no_dir/out.json", "<tmp>"],
    "--html": ["<tmp>/no_dir/out.html", "<tmp>"],
    "--hf": ["<tmp>"],
}


@st.composite
def invocations(draw: st.DrawFn) -> tuple[list[str], str | None]:
    cmd = draw(st.sampled_from(COMMANDS))
    target = draw(st.sampled_from(["missing", "folder", "file", "none", "builtin-typo"]))
    content = draw(st.sampled_from(FRAGMENTS)) if target == "file" else None
    args = [cmd]
    if target == "missing":
        args.append("<tmp>/nowhere.py")
    elif target == "folder":
        args.append("<tmp>")
    elif target == "file":
        args.append("<tmp>/s.py")
    elif target == "builtin-typo":
        args.append(draw(st.sampled_from(["mlp_fp16_overflw", "overflw", "Overflow", "nan"])))
    for opt in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=3, unique=True)):
        args += [opt, draw(st.sampled_from(OPTIONS[opt]))]
    if cmd == "fix" and "--steps" not in args:
        args += ["--steps", "1"]  # keep a fix verification short
    return args, content


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(invocations())
def test_the_cli_never_ends_in_a_raw_traceback(inv: tuple[list[str], str | None]) -> None:
    args, content = inv
    with tempfile.TemporaryDirectory() as tmp:
        if content is not None:
            with open(os.path.join(tmp, "s.py"), "w", encoding="utf-8", errors="surrogateescape") as f:
                f.write(content)
        argv = [a.replace("<tmp>", tmp) for a in args]
        res = CliRunner().invoke(main, argv, env={"NO_COLOR": "1", "COLUMNS": "120"})
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        f"{argv}: raw {type(res.exception).__name__}: {res.exception}\n{res.output}")
    assert res.exit_code in (0, 1, 2), (argv, res.exit_code, res.output)
    assert "Traceback (most recent call last)" not in res.output, (argv, res.output)
    if res.exit_code == 2:
        assert res.output.strip(), f"{argv}: exit 2 without a message"
