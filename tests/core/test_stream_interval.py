"""`stream_interval`: a stream's consumer wakes at most once per N tokens after its first one (its
end at once), through the in-process `AsyncBatcher` and the engine-core client alike, and the
tokens are exactly those of a stream that wakes for every token."""

from __future__ import annotations

import asyncio
import functools

import pytest
from support.engines import numpy_batcher

from atombatch import AsyncBatcher, SamplingParams
from atombatch.core import CoreClient
from atombatch.errors import ConfigError

PARAMS = SamplingParams(max_tokens=23, ignore_eos=True, temperature=0.0, n=2)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


async def _wakeups(streams: AsyncBatcher | CoreClient) -> list[list[list[tuple[int, ...]]]]:
    """Per request: the tokens of each choice-0 and choice-1 output, one list per wakeup."""
    async with streams:
        ids = [streams.submit(p, PARAMS) for p in PROMPTS]

        async def read(rid: str) -> list[list[tuple[int, ...]]]:
            return [[(o.index, *o.new_token_ids) for o in batch]
                    async for batch in streams.output_batches(rid)]

        return list(await asyncio.gather(*(read(rid) for rid in ids)))


def _engine(interval: int, core: bool) -> AsyncBatcher | CoreClient:
    if core:
        return CoreClient(functools.partial(numpy_batcher, max_waiting=None),
                          stream_interval=interval)
    return AsyncBatcher(numpy_batcher(max_waiting=None), offload=False,
                        stream_interval=interval)


@pytest.mark.parametrize("core", [False, True], ids=["inline", "core"])
def test_tokens_arrive_in_wakeups_of_the_interval(core: bool) -> None:
    every = asyncio.run(_wakeups(_engine(1, core)))
    grouped = asyncio.run(_wakeups(_engine(5, core)))

    def tokens(wakeups: list[list[tuple[int, ...]]], index: int) -> list[int]:
        return [t for batch in wakeups for out in batch if out[0] == index for t in out[1:]]

    for plain, batched in zip(every, grouped, strict=True):
        for index in (0, 1):
            assert tokens(batched, index) == tokens(plain, index)
            assert len(tokens(plain, index)) == PARAMS.max_tokens
        counts = [sum(len(out) - 1 for out in batch) for batch in batched]
        assert counts[0] >= 1  # the first token goes at once
        # every wakeup but the first and those carrying a choice's end holds >= 5 tokens
        assert all(c >= 5 for c in counts[1:-2]), counts
        assert len(batched) < len(plain)


def test_the_interval_is_checked() -> None:
    with pytest.raises(ConfigError, match="stream_interval=0 must be an int >= 1"):
        AsyncBatcher(numpy_batcher(), stream_interval=0)
