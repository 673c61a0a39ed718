"""Speculative decoding test helpers: prompts that repeat, and an oracle drafter.

`OracleDrafts.propose` stands in for the n-gram proposer (same signature): it proposes the tokens
a run without speculation produced next, each replaced with probability `miss_rate` by another
id, so a test controls how much of each draft the model accepts. It proposes nothing for a
sequence that is not a prefix of a reference run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def chi_square_limit(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at upper tail 1e-4 (z: the normal's), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def two_sample_chi_square(a: dict[Any, int], b: dict[Any, int]) -> tuple[float, int]:
    """The two-sample chi-square statistic of equal-size samples' counts, and its df."""
    cells = set(a) | set(b)
    stat = sum((a.get(c, 0) - b.get(c, 0)) ** 2 / (a.get(c, 0) + b.get(c, 0)) for c in cells)
    return stat, len(cells) - 1


def sampled_experiment(make_runtime: Any, prompt: list[int], n: int,
                       monkeypatch: Any) -> tuple[float, int, Any]:
    """N seeded requests (temperature 1, top_k 3, four tokens) without speculation and N with
    it (two draft tokens: the greedy continuation, from a reference engine): the two-sample
    chi-square statistic of their first three tokens' joint counts, its df, and the speculative
    engine's stats. `make_runtime()` builds a fresh runtime of the model."""
    from atombatch import Batcher, SamplingParams
    from atombatch.api.speculative import SpeculativeConfig
    from atombatch.sampling import ngram

    reference_engine = Batcher(make_runtime())
    greedy: dict[tuple[int, ...], list[int]] = {}

    def greedy_drafts(tokens: np.ndarray, k: int, min_n: int, max_n: int,
                      window: int) -> np.ndarray:
        key = tuple(tokens.tolist())
        if key not in greedy:
            done = reference_engine.generate([list(key)], SamplingParams(
                max_tokens=k, temperature=0.0, ignore_eos=True))
            greedy[key] = list(done[0].token_ids)
        return np.array(greedy[key][:k], dtype=np.int64)

    def params(seed: int) -> Any:
        return SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True, seed=seed)

    plain = Batcher(make_runtime()).generate([prompt] * n, [params(s) for s in range(n)])
    monkeypatch.setattr(ngram, "propose", greedy_drafts)
    batcher = Batcher(make_runtime(), speculative=SpeculativeConfig(num_speculative_tokens=2,
                                                                    auto_off=False))
    speculated = batcher.generate([prompt] * n, [params(n + s) for s in range(n)])
    counts: list[dict[tuple[int, ...], int]] = []
    for run in (plain, speculated):
        joint: dict[tuple[int, ...], int] = {}
        for completion in run:
            assert len(completion.token_ids) == 4
            key = tuple(completion.token_ids[:3])
            joint[key] = joint.get(key, 0) + 1
        counts.append(joint)
    stat, df = two_sample_chi_square(*counts)
    return stat, df, batcher.stats()


def ledger_every_position() -> Any:
    """`LedgerRuntime` (support/ledger.py) with `prefill(every_position=True)`: each real
    position's one-hot logits, read through the tables after the chunk's writes (position i
    reads positions 0..i only, as causal attention does). Non-hybrid artifacts."""
    from support.ledger import LedgerRuntime

    class EveryPositionLedger(LedgerRuntime):
        every_position_logits = True

        def prefill(self, inputs: Any, every_position: bool = False) -> np.ndarray:
            if not every_position:
                return super().prefill(inputs)  # type: ignore[no-any-return]
            super().prefill(inputs)  # the writes (and the last position's logits)
            q = int(inputs.query_position)
            slot = int(inputs.local_block_tables[0])
            rows = np.zeros((inputs.input_ids.shape[1], self.vocab), dtype=np.float32)
            for i in range(q + 1):
                rows[i] = self._logits(inputs.block_tables, slot, int(inputs.cache_position[0, i]))
            return rows

    return EveryPositionLedger


class LedgerDrafts:
    """Drafts from the ledger's own rule (`support.ledger.reference`), each token replaced with
    probability `miss_rate`: the exact continuation, in part."""

    def __init__(self, vocab: int, miss_rate: float, seed: int) -> None:
        self.vocab = vocab
        self.miss_rate = miss_rate
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: np.ndarray, k: int, min_n: int, max_n: int,
                window: int) -> np.ndarray:
        from support.ledger import reference

        draft = np.array(reference(tokens.tolist(), k, self.vocab), dtype=np.int64)
        miss = self.rng.random(len(draft)) < self.miss_rate
        draft[miss] = draft[miss] % (self.vocab - 1) + 1 if self.vocab > 2 else draft[miss]
        return draft
