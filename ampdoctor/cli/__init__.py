"""The ``ampdoctor`` command line. Exit codes: 0 ok, 1 findings of severity error, 2 usage or input error.

One module per command group, each registering its commands on the :func:`main` group of :mod:`._app`:

- ``_diagnose.py`` — ``diagnose`` (scenario files and ``--hf`` checkpoints) and ``report`` (render a saved report);
- ``_fix.py`` — ``fix`` and ``demo`` (diagnose, verify fixes against fp32, apply one);
- ``_explain.py`` — ``explain`` (the documentation of a cause code and its registered remedies);
- ``_watch.py`` — ``run`` (a script under the watch) and ``replay`` (a watch reproducer);
- ``_headroom.py`` — ``headroom`` and ``check`` (range headroom from one fp32 step; the CI gate).

``_checks.py`` holds the checks every command makes before it runs anything, ``_output.py`` the console, the report
outputs and the progress bar they share. click and rich are imported only when this package is (``import
ampdoctor`` never imports it).
"""

from __future__ import annotations

try:
    import click  # noqa: F401 - checked first, so a missing extra gives one clear message
except ImportError as e:  # pragma: no cover - the CLI extra is missing
    raise ImportError("the ampdoctor command line needs click and rich: pip install 'ampdoctor[cli]'") from e

from ampdoctor.cli import _diagnose, _explain, _fix, _headroom, _watch  # noqa: F401 - each registers its commands
from ampdoctor.cli._app import main

__all__ = ["main"]
