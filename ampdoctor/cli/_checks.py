"""Checks the command line makes before it runs anything: output paths, optional extras, scenario names, and the
guard that turns whatever a user's scenario does (raise, ``sys.exit``) into one message and exit code 2.

Every function here either returns or ends the process through :func:`fail` (exit 2, message on stderr).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import logging
import os
from collections.abc import Iterable, Iterator
from typing import NoReturn

import click

from ampdoctor.errors import AmpDoctorError

log = logging.getLogger("ampdoctor.cli")

#: the extra and the import names each optional CLI feature needs
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "--html": ("html", ("jinja2", "plotly")),
    "the terminal report": ("cli", ("rich",)),
}


class CliExit(SystemExit):
    """The CLI's own exit (after its message), told apart from a ``sys.exit`` in the user's code."""


def fail(msg: str) -> NoReturn:
    """Print ``ampdoctor: error: msg`` on stderr and exit 2 (usage or input error)."""
    click.echo(f"ampdoctor: error: {msg}", err=True)
    raise CliExit(2)


def need(feature: str) -> None:
    """Fail before the run when an optional dependency of ``feature`` (a key of :data:`EXTRAS`) is missing."""
    extra, modules = EXTRAS[feature]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        fail(f"{feature} needs {' and '.join(missing)}, which is not installed: pip install 'ampdoctor[{extra}]'")


def output_path(path: str | None, option: str, *, dash: bool = False) -> None:
    """Fail before the run when ``path`` (the value of ``option``) cannot be written: a folder, a missing or
    unwritable parent folder. ``dash``: ``-`` means stdout."""
    if path is None or (dash and path == "-"):
        return
    if os.path.isdir(path):
        fail(f"{option} {path!r} is a folder; pass a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        fail(f"the folder {parent!r} of {option} {path!r} does not exist; create it first or pass another path")
    if not os.access(parent, os.W_OK):
        fail(f"cannot write {option} {path!r}: the folder {parent!r} is not writable")


def _is_saved_tensors(file: str) -> bool:
    """A ``torch.save`` file (a zip archive, or a ``.pt``/``.pth`` name), never a scenario's Python source."""
    if file.endswith((".pt", ".pth")):
        return True
    try:
        with open(file, "rb") as fh:
            return fh.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def scenario_path(file: str) -> str:
    """``file`` itself, or the file of a built-in scenario of that name (as ``ampdoctor fix`` accepts)."""
    if os.path.exists(file):
        if _is_saved_tensors(file):
            fail(f"{file!r} is a torch.save file, not a scenario (a .py file that defines make()); a watch "
                 f"reproducer is run with: ampdoctor replay {file}")
        return file
    if os.sep in file or file.endswith(".py"):
        fail(f"scenario file not found: {file!r}; pass the path of a .py file that defines make()")
    from ampdoctor.scenarios import BUILTIN, load_scenario

    if file in BUILTIN:
        try:
            return str(load_scenario(file).__file__)
        except (ImportError, ValueError) as e:
            fail(f"built-in scenario {file!r} cannot be loaded: {e}")
    close = difflib.get_close_matches(file, list(BUILTIN), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    fail(f"scenario file not found: {file!r}{hint}; pass the path of a .py file that defines make(), or a built-in "
         f"scenario name ({', '.join(BUILTIN)})")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` (case-insensitive), or ``""``."""
    options = list(choices)
    lowered = {c.lower(): c for c in options}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.5)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


@contextlib.contextmanager
def user_code(what: str = "the scenario") -> Iterator[None]:
    """Run code that executes the user's scenario: any way it ends other than returning is exit 2 with a message.

    ``AmpDoctorError`` carries its own message; ``sys.exit`` from the user's code is a failure, never the CLI's
    exit status (a CI gate must not pass because a scenario exited 0); other exceptions are unexpected and are
    reported with their type (``-v`` logs the traceback). ``KeyboardInterrupt`` propagates.
    """
    try:
        yield
    except AmpDoctorError as e:
        fail(str(e))
    except CliExit:
        raise
    except SystemExit as e:
        fail(f"{what} called sys.exit({e.code!r}) during the run, so it produced no result; guard script code with "
             "`if __name__ == '__main__':`")
    except Exception as e:  # noqa: BLE001 - the CLI's contract: a message and exit 2, never a raw traceback
        log.info("unexpected error", exc_info=True)
        fail(f"{what} failed with {type(e).__name__}: {e}. If this looks like a bug in ampdoctor, rerun with "
             "`ampdoctor -v ...` and report the traceback")
