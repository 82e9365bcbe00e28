#!/usr/bin/env bash
# The whole test suite from a fresh clone: pinned CPU torch, the package with its test extra, a headless
# browser for the HTML report test, then ruff, mypy and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0                 # pinned CPU build first: never a multi-GB CUDA wheel
python -m pip install -q -e ".[test]"
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "chromium could not be installed: the HTML browser test will skip" >&2
fi
python -m ruff check ampdoctor tests bench
python -m mypy ampdoctor
python -m pytest -q -rs "$@"
