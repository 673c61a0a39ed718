"""Where a benchmark result came from: commit, machine, SDK, memory. Recorded with every JSON."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str | None:
    """HEAD of the checkout the package runs from, `-dirty` if tracked files changed; None
    outside a git checkout (an installed wheel)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=_ROOT, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def machine() -> str:
    return (f"{platform.platform()} {platform.machine()} cpus={os.cpu_count()} "
            f"python={platform.python_version()}")


def sdk_version() -> str | None:
    """rebel-sdk's version when it is importable."""
    try:
        import rebel  # type: ignore[import-not-found]
    except Exception:
        return None
    return str(getattr(rebel, "__version__", "unknown"))


def max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
