"""Prompt-lookup (n-gram) drafts, vLLM's rule: the longest suffix n-gram of the sequence
(`prompt_lookup_max` down to `prompt_lookup_min` tokens) that occurs earlier in it; the draft is
the (up to) k tokens that followed its most recent earlier occurrence. Only the last `window`
tokens are searched, so a step's work is bounded by O(window * prompt_lookup_max)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

EMPTY = np.zeros(0, dtype=np.int64)


def propose(tokens: npt.NDArray[np.int64], k: int, min_n: int, max_n: int,
            window: int) -> npt.NDArray[np.int64]:
    """Up to `k` draft tokens after `tokens` (empty when no n-gram matches)."""
    total = len(tokens)
    if k <= 0 or total < min_n + 1:
        return EMPTY
    seq = tokens[max(total - window, 0):]
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = seq[size - n:]
        # candidate starts 0..size-n-1: an occurrence that ends before the suffix starts to end
        views = sliding_window_view(seq[:size - 1], n)
        hits = np.flatnonzero((views == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent earlier occurrence's continuation
            return np.array(seq[start:start + k], dtype=np.int64)
    return EMPTY
