"""Token sampling: greedy, or seeded temperature / top-k / top-p."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from atombatch.structs import SamplingParams


def sample(logits: npt.NDArray[np.floating], params: SamplingParams,
           rng: np.random.Generator) -> int:
    """One token from a row of logits. Greedy when temperature is 0 (ties: lowest id)."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(scaled, vocab - params.top_k)[vocab - params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, params.top_p)) + 1  # smallest set reaching top_p
        mask = np.zeros_like(probs)
        mask[order[:keep]] = 1.0
        probs = probs * mask
        probs /= probs.sum()
    return int(rng.choice(vocab, p=probs))
