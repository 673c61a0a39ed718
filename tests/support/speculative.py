"""Speculative decoding test helpers: prompts that repeat, and an oracle drafter.

`OracleDrafts.propose` stands in for the n-gram proposer (same signature): it proposes the tokens
a run without speculation produced next, each replaced with probability `miss_rate` by another
id, so a test controls how much of each draft the model accepts. It proposes nothing for a
sequence that is not a prefix of a reference run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def repeating_prompts(rng: np.random.Generator) -> list[list[int]]:
    """Prompts whose n-grams recur (so the n-gram proposer finds drafts) and one that does not."""
    pattern = rng.integers(3, 512, size=7).tolist()
    other = rng.integers(3, 512, size=5).tolist()
    return [pattern * 4, (other + pattern) * 3 + other, rng.integers(3, 512, size=23).tolist()]


class OracleDrafts:
    def __init__(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                 miss_rate: float, seed: int) -> None:
        self.runs = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
        self.miss_rate = miss_rate
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: np.ndarray, k: int, min_n: int, max_n: int,
                window: int) -> np.ndarray:
        seq = tokens.tolist()
        for run in self.runs:
            if run[:len(seq)] == seq and len(run) > len(seq):
                draft = np.array(run[len(seq):len(seq) + k], dtype=np.int64)
                miss = self.rng.random(len(draft)) < self.miss_rate
                draft[miss] = (draft[miss] + 1 + self.rng.integers(0, 50, int(miss.sum()))) % 512
                return draft
        return np.zeros(0, dtype=np.int64)
