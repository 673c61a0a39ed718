"""Progress of a benchmark matrix on stderr, with or without a terminal (tqdm).

On a terminal: one tqdm bar (cells done / total, elapsed, estimated time left, the last cell).
Elsewhere (a log file, CI, `| tee`): one line per finished cell, which a bar's carriage returns
would turn into one unreadable line:

    [ 3/48] koni-8b native 8192/128 B4/k5 prefill-first: ok in 1.2 s | elapsed 00:05, left ~01:20
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


class CellProgress:
    """Report each finished cell of a `total`-cell run (a no-op when not `enabled`).

    Args:
        total: cells in the run.
        enabled: False prints nothing (`--no-progress`).
        stream: where to write (default stderr); a bar only when it is a terminal.
        unit: what is counted ("cell", "request").
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 unit: str = "cell") -> None:
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.started = time.perf_counter()
        self.cell_started = self.started
        self._bar: Any = None
        if enabled and _is_terminal(self.stream):
            self._bar = tqdm(total=total, file=self.stream, unit=unit, dynamic_ncols=True,
                             leave=True)

    def start(self, what: str) -> None:
        """A cell begins (shown on the bar)."""
        self.cell_started = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(what, refresh=True)

    def finish(self, what: str, outcome: str, seconds: float | None = None) -> None:
        """A cell ended with `outcome` ("ok", "rejected", ...) after `seconds` (default: since
        its `start`; cells that overlap, such as concurrent requests, pass their own)."""
        self.done += 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(f"last: {outcome}", refresh=False)
            self._bar.update(1)
            return
        elapsed = now - self.started
        left = elapsed / self.done * (self.total - self.done)
        width = len(str(self.total))
        took = now - self.cell_started if seconds is None else seconds
        print(f"[{self.done:>{width}}/{self.total}] {what}: {outcome} in "
              f"{took:.1f} s | elapsed {tqdm.format_interval(elapsed)}, "
              f"left ~{tqdm.format_interval(left)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done:
            took = tqdm.format_interval(time.perf_counter() - self.started)
            print(f"{self.done} {self.unit}s in {took}", file=self.stream, flush=True)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
