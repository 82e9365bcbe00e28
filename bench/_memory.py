"""Process memory for the bench scripts: ``/proc/self/status`` fields and the RSS high-water mark's reset (Linux)."""

from __future__ import annotations


def status_gib(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in GiB; NaN where the field is missing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def reset_peak() -> bool:
    """Reset the process's RSS high-water mark to its current RSS (Linux >= 4.0); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
