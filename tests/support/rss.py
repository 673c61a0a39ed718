"""Resident-memory probes for the adversarial tests (Linux /proc; the suite runs on Linux)."""

from __future__ import annotations

import gc
from pathlib import Path

MiB = 1024 * 1024


def _status_kib(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_bytes(pid: int | str = "self") -> int:
    """Current resident set size of a process."""
    gc.collect()
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident set size (high-water mark) of a process since it started."""
    return _status_kib(pid, "VmHWM") * 1024
