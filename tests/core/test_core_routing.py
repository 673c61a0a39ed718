"""The prefix-cache summary of an engine core (atombatch/core/routing.py): computed in the core on
request, it equals the summary of an in-process engine that served the same requests, and says
which prompts the cache holds."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

from support.engines import numpy_batcher

from atombatch import SamplingParams
from atombatch.cluster import CacheSummarizer, route_digests
from atombatch.core import CoreClient

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SHARED = [(5 * i) % 200 + 3 for i in range(96)]


async def summary_of(client: CoreClient, route_block: int, bits: int) -> object:
    seen = client.summaries
    assert client.request_summary(route_block, 8, bits)
    for _ in range(500):
        if client.summaries > seen:
            return client.summary
        await asyncio.sleep(0.01)
    raise AssertionError("the core did not answer the summary request")


async def test_the_core_summarizes_its_prefix_cache_as_an_in_process_engine_would() -> None:
    prompts = [SHARED + [7, 8, 9], SHARED[:64] + [1] * 40]
    local = numpy_batcher(prefix_cache=True)
    local.generate(prompts, PARAMS)
    want = CacheSummarizer(32, 8, bits=4096).summary(local.scheduler.prefix, local.scheduler.host)
    assert want.count > 0
    async with CoreClient(functools.partial(numpy_batcher, prefix_cache=True)) as client:
        for prompt in prompts:
            await client.generate(prompt, PARAMS)
        got = await summary_of(client, 32, 4096)
        assert got == want
        # it names what is cached: both prompts' leading route blocks, not a stranger's
        for prompt in prompts:
            digests = route_digests(prompt, 32)
            assert got.run(digests) >= 2
        assert got.run(route_digests([250] * 96, 32)) == 0
        # a request the summarizer refuses is answered with no summary, and the core goes on
        assert await summary_of(client, 32, 100) is None
        assert await summary_of(client, 32, 4096) == want
        # a waiter (a thread-safe future) gets its own request's answer, in order
        first, second = concurrent.futures.Future(), concurrent.futures.Future()
        client.request_summary(32, 8, 100, first)
        client.request_summary(32, 8, 4096)
        client.request_summary(32, 8, 4096, second)
        assert await asyncio.wait_for(asyncio.wrap_future(second), 5) == want
        assert first.result(0) is None


async def test_a_core_without_a_prefix_cache_sends_no_summary() -> None:
    async with CoreClient(functools.partial(numpy_batcher)) as client:
        await client.generate([4, 5, 6], PARAMS)
        assert await summary_of(client, 32, 4096) is None
