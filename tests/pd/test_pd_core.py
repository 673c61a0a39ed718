"""PD through the engine core process (atombatch/core/pd.py): the core holds the producer pool
and opens every request's KV source itself. Real processes throughout: NumPy producers behind
`ZmqProducerServer`s, a spawned engine core, ZeroMQ in between. References are each request run
alone on an in-process `Batcher` with the same weights (native prefill)."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from support.pd_models import PRODUCER_LAYOUT, SEED, SPECS, artifact, pd_decoder, prompts
from support.producers import run_producer_process

from atombatch import Batcher, RequestError, SamplingParams
from atombatch.core import CoreClient
from atombatch.core.messages import Submit, front_encoder
from atombatch.core.pd import CorePD, PDOptions, handshake, pd_eligible, static_producers
from atombatch.core.process import CoreLoop, _Sender
from atombatch.errors import ConfigError
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)


def alone(prompt: list[int], params: SamplingParams, family: str = "llama") -> list[int]:
    """The request run by itself in-process, prefilled natively (the decoder's layout)."""
    decoder = artifact(SPECS[family], 4, 5)
    [done] = Batcher(NumpyRuntime.random(decoder, SEED)).generate([prompt], params)
    return list(done.token_ids)


class ProducerProcesses:
    """Llama producers in their own processes, by name (spawned together: start-ups overlap)."""

    def __init__(self, tmp: Path, family: str = "llama", **kwargs_by_name: dict[str, Any]
                 ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.family = family
        self.endpoints: dict[str, str] = {}
        self.processes: dict[str, Any] = {}
        for name, kwargs in kwargs_by_name.items():
            endpoint = f"ipc://{tmp}/{name}.sock"
            process = ctx.Process(target=run_producer_process,
                                  args=(SPECS[family], PRODUCER_LAYOUT, SEED, endpoint),
                                  kwargs=kwargs, daemon=True)
            process.start()
            self.endpoints[name] = endpoint
            self.processes[name] = process
        deadline = time.monotonic() + 60
        for endpoint in self.endpoints.values():
            while not handshake(endpoint, timeout=0.5):
                assert time.monotonic() < deadline, f"producer {endpoint} did not come up"

    def kill(self, name: str) -> None:
        os.kill(self.processes[name].pid, signal.SIGKILL)
        self.processes[name].join(10)

    def close(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
            process.join(5)


@pytest.fixture
def producers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ProducerProcesses]:
    started = ProducerProcesses(tmp_path, **request.param)
    yield started
    started.close()


async def tokens_of(client: CoreClient, prompt: list[int], params: SamplingParams
                    ) -> tuple[list[int], str | None, str | None]:
    ids: list[int] = []
    last = None
    async for out in client.stream(prompt, params):
        ids.extend(out.new_token_ids)
        last = out
    assert last is not None
    return ids, last.finish_reason, last.error


async def wait_until(what: str, check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout} s")


def pool(client: CoreClient, registry: dict[str, str] | None = None) -> dict[str, Any]:
    """The core's pool as last reported; with `registry`, also ask for a fresh report (the core
    answers a registry message with its stats, also while its requests wait on producers)."""
    if registry is not None:
        client.sync_producers(registry)
    return {p.name: p for p in client.producers}


@pytest.mark.parametrize("producers", [{"p0": {}, "p1": {}},
                                       {"family": "gemma3", "p0": {}, "p1": {}}],
                         indirect=True, ids=["llama", "gemma3-hybrid"])
async def test_pd_through_the_core_gives_each_requests_native_tokens(
        producers: ProducerProcesses) -> None:
    family = producers.family
    work = prompts(5, seed=3)
    params = [GREEDY, SEEDED, GREEDY, GREEDY, GREEDY]
    want = [alone(p, s, family) for p, s in zip(work, params, strict=True)]
    options = PDOptions(producers=producers.endpoints)
    async with CoreClient(functools.partial(pd_decoder, family), pd=options) as client:
        got = await asyncio.gather(*(tokens_of(client, p, s)
                                     for p, s in zip(work, params, strict=True)))
        assert [g[0] for g in got] == want                    # seeded included (docs/pd.md)
        assert all(g[1] == "length" for g in got)
        await wait_until("the stats after the last step", lambda: client.stats().finished.get(
            "length", 0) == 5)
        stats = client.stats()
        assert stats.imports > 0 and stats.prefill_chunks == 0   # every prompt from a producer
        opened = {name: p.opened for name, p in pool(client).items()}
        assert sorted(opened) == ["p0", "p1"] and sum(opened.values()) == 5
        assert min(opened.values()) >= 2                       # by load: both took requests
        assert all(p.in_flight == 0 for p in pool(client).values())   # every source closed
        assert client.pd_stats is not None and client.pd_stats.native_fallbacks == 0

        # what a producer cannot serve is prefilled in the core: n > 1, logprobs, prompt logprobs
        for special in (SamplingParams(temperature=0.0, max_tokens=4, logprobs=1),
                        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)):
            assert not pd_eligible(special)
            done = await client.generate(work[0], special)
            assert list(done.token_ids) == alone(work[0], special, family)
        pair = SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True)
        assert not pd_eligible(pair)
        choices = await client.generate_choices(work[0], pair)
        assert [list(c.token_ids) for c in choices] == [want[0][:4]] * 2
        await wait_until("the native prefills counted", lambda: client.stats().prefill_chunks > 0)
        assert sum(p.opened for p in pool(client).values()) == 5   # no producer asked
        # a bad request is refused before any producer work (and a source cannot be passed)
        with pytest.raises(RequestError, match="vocabulary"):
            client.submit([1, 9999], GREEDY)
        with pytest.raises(RequestError, match="cannot cross"):
            client.submit([1, 2], GREEDY, kv=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("producers", [{"slow": {"layer_delay": 1.5}, "fast": {}}],
                         indirect=True)
async def test_a_killed_producer_fails_only_its_requests(producers: ProducerProcesses) -> None:
    """The slow producer is killed while a request waits for its layers: that request fails
    alone; the fast producer's request and every later one get their native tokens, and with
    no producer left the core prefills natively."""
    work = prompts(6, seed=11)
    want = [alone(p, GREEDY) for p in work]
    registry = {"slow": producers.endpoints["slow"], "fast": producers.endpoints["fast"]}
    options = PDOptions(producers=registry, probe_s=0.2)
    factory = functools.partial(pd_decoder, "llama", pd_timeout=30.0)
    async with CoreClient(factory, pd=options) as client:
        doomed = asyncio.ensure_future(tokens_of(client, work[0], GREEDY))
        await wait_until("the first request on the slow producer",
                         lambda: pool(client, registry).get("slow") and pool(client)["slow"].in_flight)
        survivor = asyncio.ensure_future(tokens_of(client, work[1], GREEDY))   # least loaded
        await asyncio.sleep(0.5)    # connected; the producer waits before its first layer
        producers.kill("slow")
        ids, reason, error = await doomed
        assert reason == "error" and "KV producer" in (error or "") and ids == []
        assert (await survivor)[:2] == (want[1], "length")
        await wait_until("the dead producer suspect", lambda: pool(client, registry)["slow"].suspect)
        later = await asyncio.gather(*(tokens_of(client, p, GREEDY) for p in work[2:4]))
        assert [g[0] for g in later] == want[2:4]
        assert pool(client)["slow"].opened == 1 and pool(client)["fast"].opened == 3

        producers.kill("fast")      # idle: the core's probe finds it gone
        await wait_until("the idle dead producer suspect", lambda: pool(client, registry)["fast"].suspect)
        alone_now = await asyncio.gather(*(tokens_of(client, p, GREEDY) for p in work[4:]))
        assert [g[0] for g in alone_now] == want[4:]
        await wait_until("the fallbacks counted", lambda: client.pd_stats is not None and
                         client.pd_stats.native_fallbacks == 2)
        stats = client.stats()
        assert stats.finished == {"error": 1, "length": 5}
        assert stats.lane_blocks == 0 and stats.staged_blocks == 0   # the failure's blocks back


@pytest.mark.parametrize("producers", [{"p0": {"layer_delay": 30.0}}], indirect=True)
async def test_aborting_a_request_that_waits_on_its_producer(
        producers: ProducerProcesses) -> None:
    registry = dict(producers.endpoints)
    async with CoreClient(functools.partial(pd_decoder, "llama"),
                          pd=PDOptions(producers=registry)) as client:
        request_id = client.submit(prompts(1, seed=2)[0], GREEDY)
        await wait_until("the request on the producer", lambda: getattr(
            pool(client, registry).get("p0"), "in_flight", 0) == 1)
        client.abort(request_id)
        outs = [out async for out in client.outputs(request_id)]
        assert outs[-1].finish_reason == "abort" and not any(o.new_token_ids for o in outs)
        await wait_until("its source closed", lambda: pool(client, registry)["p0"].in_flight == 0)
        stats = client.stats()
        assert stats.finished == {"abort": 1} and stats.staged_blocks == 0 and \
            stats.lane_blocks == 0
        assert client.running and not pool(client)["p0"].suspect   # an abort is no failure


@pytest.mark.parametrize("producers", [{"p0": {"layer_delay": 30.0}}], indirect=True)
def test_a_front_that_dies_has_its_sources_closed_in_the_core(
        producers: ProducerProcesses, tmp_path: Path) -> None:
    """The core loop of `run_core`, driven over real sockets: once its front is gone it aborts
    what it held, which closes every producer source (the pool has nothing in flight)."""
    ctx = zmq.Context()
    inbox_address, outbox_address = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind(inbox_address)
    from_core.bind(outbox_address)
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    batcher = pd_decoder("llama")
    core_pd = CorePD(PDOptions(producers=producers.endpoints), batcher.artifact)
    sender = _Sender(outbox)
    loop = CoreLoop(batcher, inbox, sender, os.getppid(), pd=core_pd)
    try:
        for i, prompt in enumerate(prompts(2, seed=5)):
            tokens = np.asarray(prompt, dtype=np.int64)
            to_core.send(front_encoder.encode(Submit(f"r{i}", tokens.tobytes(), GREEDY, True)))
        runner = threading.Thread(target=loop.run, daemon=True)
        runner.start()
        deadline = time.monotonic() + 20
        while core_pd.pool.snapshot()[0].in_flight < 2:
            assert time.monotonic() < deadline, "the requests did not reach the producer"
            time.sleep(0.02)
        assert len(batcher._pd.links) == 2
        loop.parent_pid = -1                     # the front is gone
        runner.join(10)
        assert not runner.is_alive()
        assert core_pd.pool.snapshot()[0].in_flight == 0 and not batcher._pd.links
        assert not batcher.has_unfinished() or all(
            r.finish_reason == "abort" for r in batcher.step())
    finally:
        core_pd.close()
        sender.close()
        for sock in (to_core, from_core, inbox, outbox):
            sock.close(linger=0)
        ctx.term()


def test_static_producer_endpoints_are_checked() -> None:
    assert static_producers(["tcp://a:1", "ipc:///x"]) == {"producer-0": "tcp://a:1",
                                                           "producer-1": "ipc:///x"}
    with pytest.raises(ConfigError, match="twice"):
        static_producers(["tcp://a:1", "tcp://a:1"])
    with pytest.raises(ConfigError, match="not a ZeroMQ endpoint"):
        static_producers(["http://a:1"])
    with pytest.raises(ConfigError, match="probe_s"):
        PDOptions(probe_s=-1)


@pytest.mark.parametrize("producers", [{"p0": {"layer_delay": 2.5}}], indirect=True)
async def test_a_core_waiting_on_a_slow_producer_is_not_taken_for_hung(
        producers: ProducerProcesses) -> None:
    """Every unfinished request waits for its producer's layers, seconds longer than the
    front's `hang_timeout`: the core has no device work and no output, but its heartbeats say
    it is alive, so nothing is killed and the request gets its native tokens."""
    work = prompts(1, seed=4)[0]
    want = alone(work, GREEDY)
    registry = dict(producers.endpoints)
    async with CoreClient(functools.partial(pd_decoder, "llama"), hang_timeout=1.0,
                          pd=PDOptions(producers=registry)) as client:
        started = time.monotonic()
        ids, reason, error = await tokens_of(client, work, GREEDY)
        assert (ids, reason, error) == (want, "length", None)
        assert time.monotonic() - started > 2.5    # the wait outlasted hang_timeout
        assert client.running and pool(client)["p0"].opened == 1
