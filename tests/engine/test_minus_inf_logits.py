"""A device that returns -inf for tokens that cannot be drawn (half the vocabulary here, never the
best one): the decode step takes such rows (`StepKernel.pick` fails only a NaN or +inf), and so
must the prefill that draws the first token, or no request would get past its first token.
NaN and +inf still fail the request at either step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.ledger import LedgerRuntime
from support.scheduling import artifact, drive, expected

from atombatch import Batcher, SamplingParams


class MinusInf(LedgerRuntime):
    """Every logit of the other parity than the row's best is -inf, at prefill and at decode;
    with `prefill_bad`, the prefill row also holds that value (NaN or +inf) away from its best."""

    def __init__(self, art, prefill_bad: float | None = None):  # type: ignore[no-untyped-def]
        super().__init__(art)
        self.prefill_bad = prefill_bad

    @staticmethod
    def _speckle(row: np.ndarray) -> None:
        best = int(np.argmax(row))
        row[np.arange(row.shape[0]) % 2 != best % 2] = -math.inf

    def prefill(self, inputs):  # type: ignore[no-untyped-def]
        row = super().prefill(inputs).copy()
        self._speckle(row)
        if self.prefill_bad is not None:
            row[(int(np.argmax(row)) + 2) % row.shape[0]] = self.prefill_bad
        return row

    def decode(self, inputs):  # type: ignore[no-untyped-def]
        logits = super().decode(inputs).copy()
        for row in logits:
            self._speckle(row)
        return logits


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    # not plain greedy: the sampler's path, raw logprobs included
    "logprobs": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
    "penalty": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                              repetition_penalty=1.0 + 1e-6),
}


def test_minus_inf_logits_at_prefill_and_decode_leave_the_greedy_tokens_alone(core) -> None:
    art = artifact(batch_size=4, num_blocks=5)
    arrivals = {0: [([3 + i, 4, 5], params, name) for i, (name, params) in
                    enumerate(PARAMS.items())]}
    finals, _ = drive(Batcher(MinusInf(art)), arrivals)
    for prompt, params, rid in arrivals[0]:
        out = finals[rid]
        assert out.finish_reason == "length", (rid, out.error)
        assert out.completion.token_ids == tuple(expected(prompt, params, art))
    for entry in finals["logprobs"].completion.logprobs:
        assert math.isfinite(entry.logprob) and entry.top[0].logprob == entry.logprob


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nan_or_inf_prefill_logit_still_fails_the_request(core, bad: float) -> None:
    art = artifact(batch_size=4, num_blocks=5)
    params = PARAMS["greedy"]
    finals, _ = drive(Batcher(MinusInf(art, prefill_bad=bad)), {0: [([3, 4, 5], params, "r")]})
    assert finals["r"].finish_reason == "error" and "non-finite" in finals["r"].error
