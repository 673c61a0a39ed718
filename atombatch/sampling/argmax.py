"""A decode step's greedy argmax, split over a few threads when the logits are large.

The host reads every logit of every decode step before the next step can start: the greedy
token of each row is its argmax. With a real vocabulary that read is most of the host's
critical path (B64 x 151 936 float32 logits are 39 MB: ~2.3 ms on one core here, against a
few milliseconds of device step), and memory bandwidth, not arithmetic, bounds it. numpy's
argmax releases the interpreter lock while it scans, so `RowArgmax` hands blocks of rows to
worker threads and scans one block itself; below `min_elements` logits (where starting the
workers would cost more than it saves) it is one compiled pass per row
(`atombatch.kernel.blocks.argmax_rows`), which also keeps the logit each row picked when asked.

Why compiled below the threshold: the first numpy call after a device wait pays its dispatch
code's cold start as well as the cold logits. `python -m atombatch.bench argmax` alternates the
two after a 5 ms sleep: on the two-vCPU AMD EPYC VM the benchmarks run on (AVX2) the compiled
pass is 1.3-1.8x faster at 64-256 x 1 024, 1.1-1.4x at one to eight rows of 151 936, and even
with numpy's (or 3-5 % slower) at 64 x 151 936, above the threshold, where numpy's stays
(docs/overlap.md, "The argmax in one compiled call").

The result is numpy's argmax of each row either way (a NaN or +inf anywhere in a row is where
it lands, which the step kernel relies on: `StepKernel.pick`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.errors import ConfigError
from atombatch.kernel import blocks as core

MIN_ELEMENTS = 1 << 22   # 4M logits (16 MB of float32): below it one thread is as fast (measured)
MAX_AUTO_THREADS = 4     # memory bandwidth stops paying for more


def auto_threads(cpus: int | None = None) -> int:
    """Threads for the argmax when the caller does not say: half the cores this process may run
    on (the front, the sender and the device driver need the rest), at most `MAX_AUTO_THREADS`;
    1 on four cores or fewer."""
    if cpus is None:  # the cores this process may run on (a pinned core or a cpuset: fewer)
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return 1 if cpus <= 4 else min(MAX_AUTO_THREADS, cpus // 2)


class RowArgmax:
    """`argmax(logits, out)`: `out[i] = argmax(logits[i])`, over `threads` threads when the
    step is large enough (see the module docstring)."""

    def __init__(self, threads: int | None = None, min_elements: int = MIN_ELEMENTS) -> None:
        if threads is None:
            threads = auto_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"argmax_threads={threads!r} must be an int >= 1 (or None: "
                              f"{auto_threads()} on this machine)")
        self.threads = threads
        self.min_elements = min_elements
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, logits: npt.NDArray[Any], out: npt.NDArray[np.int64]) -> None:
        rows = logits.shape[0]
        parts = min(self.threads, rows)
        if logits.size < self.min_elements and _compiled(logits):
            core.argmax_rows(logits, out)
            return
        if parts < 2 or logits.size < self.min_elements:
            np.argmax(logits, axis=1, out=out)
            return
        pool = self._pool or self._start()
        bounds = [rows * i // parts for i in range(parts + 1)]
        futures: list[Future[Any]] = [
            pool.submit(np.argmax, logits[bounds[i]:bounds[i + 1]], 1, out[bounds[i]:bounds[i + 1]])
            for i in range(1, parts)]
        try:
            np.argmax(logits[:bounds[1]], axis=1, out=out[:bounds[1]])
        finally:
            # every block is done before this returns, even when one failed: a worker still
            # writing `out` would race the caller's next use of it (the engine's next step)
            errors = [future.exception() for future in futures]
        for error in errors:
            if error is not None:
                raise error

    def pick(self, logits: npt.NDArray[np.float32], source: npt.NDArray[Any],
             out: npt.NDArray[np.int64], best: npt.NDArray[np.float32], keep: int) -> None:
        """`out[row]` = the argmax of `source[row]` for every row, and `best[row]` =
        `logits[row, out[row]]` for rows `0..keep-1`: `source` is the runtime's array, `logits`
        its C-contiguous float32 form (the same array, or a copy of a wider one). A small float32
        step is one compiled call."""
        rows = logits.shape[0]
        if source is logits and logits.size < self.min_elements:
            core.argmax_rows(logits, out, best)
            return
        self(source, out[:rows])
        core.picked_logits(logits, out, best, keep)

    def _start(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1,
                                                thread_name_prefix="atombatch-argmax")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def _compiled(logits: npt.NDArray[Any]) -> bool:
    """Whether `argmax_rows` takes `logits` as they are (float32, C-contiguous, a plain ndarray:
    a subclass may define its own `argmax`)."""
    return type(logits) is np.ndarray and logits.dtype == np.float32 and \
        logits.flags.c_contiguous and logits.ndim == 2 and logits.shape[1] > 0
