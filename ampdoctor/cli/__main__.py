"""``python -m ampdoctor.cli``: the ``ampdoctor`` command line."""

from ampdoctor.cli import main

main()
