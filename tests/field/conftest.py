"""tests/field reads the case registry from bench/_field_cases.py (shared with bench/field.py)."""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
