"""PD with LoRA adapters (issue 41): the producer prefills under the request's adapter, its
header carries the adapter's identity, and the decoder refuses a header that names another.

The producer loads the adapters in the other order than the decoder, so their ids differ: what
matches is the adapters' identity (a digest of config and weights), never an id. Mixed adapters
and the base through in-process producers and through a ZeroMQ producer (asked by adapter name)
equal transformers + peft; a producer that ran another adapter, or the base for an adapter
request, fails that request alone with an error naming both, its blocks back in the pool, while
the others finish exact; a producer without the adapter answers an error. Through the engine
core too: its producer pool opens each source with the request's adapter.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import numpy as np
import pytest
from support.driving import run_to_end
from support.lora_engine import ADAPTERS, LoraFamily, core_batcher, greedy, make_family

from atombatch.artifact.lora import load_peft
from atombatch.core import CoreClient
from atombatch.core.pd import PDOptions
from atombatch.pd import InProcessSource, Producer, ZmqProducerServer, ZmqSource
from atombatch.runtime.numpy_runtime import NumpyRuntime

A, B = ADAPTERS
NEW = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> LoraFamily:
    return make_family("llama", tmp_path_factory.mktemp("lora-pd-llama"))


@pytest.fixture(scope="module")
def producer(llama: LoraFamily) -> Producer:
    """A producer whose adapters are loaded in reverse order: other ids than the decoder's."""
    runtime = NumpyRuntime(llama.artifact(1), llama.weights)
    for lora_id, name in enumerate(reversed(ADAPTERS), start=1):
        runtime.add_lora(*load_peft(llama.adapter_dirs[name], name=name, lora_int_id=lora_id,
                                    spec=llama.spec))
    return Producer(runtime)


def work(count: int, seed: int) -> list[tuple[list[int], str | None]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 512, size=int(n)).tolist(), (A, B, None)[i % 3])
            for i, n in enumerate(rng.integers(10, 40, size=count))]


def source(producer: Producer, rid: str, prompt: list[int], lora: str | None) -> Any:
    return InProcessSource(producer.stream(rid, prompt, greedy(NEW),
                                           lora_int_id=producer.lora_int_id_of(lora)))


def test_pd_with_adapters_equals_peft(llama: LoraFamily, producer: Producer) -> None:
    batcher = llama.engine(llama.runtime(4))
    assert {a.lora_int_id for a in batcher.lora_adapters.values()} == {1, 2}
    requests = work(6, seed=1)
    ids = [batcher.submit(p, greedy(NEW), request_id=f"r{i}", lora=lora,
                          kv=source(producer, f"r{i}", p, lora))
           for i, (p, lora) in enumerate(requests)]
    finals = run_to_end(batcher)
    for rid, (prompt, lora) in zip(ids, requests, strict=True):
        completion = finals[rid].completion
        assert completion is not None and completion.finish_reason == "length", finals[rid]
        assert llama.reference(lora, prompt, NEW) == list(completion.token_ids), (rid, lora)


@pytest.mark.parametrize(("runs", "ran"), [(A, B), (A, None), (None, A)])
def test_a_mismatched_header_fails_that_request_alone(llama: LoraFamily, producer: Producer,
                                                      runs: str | None, ran: str | None) -> None:
    batcher = llama.engine(llama.runtime(2))
    good, bad = work(2, seed=2)
    good_id = batcher.submit(good[0], greedy(NEW), lora=good[1],
                             kv=source(producer, "good", good[0], good[1]))
    bad_id = batcher.submit(bad[0], greedy(NEW), lora=runs, kv=source(producer, "bad", bad[0], ran))
    finals = run_to_end(batcher)
    out = finals[bad_id]
    assert out.finish_reason == "error" and out.error is not None
    assert "lora_identity" in out.error
    if runs is not None:
        identity = batcher.lora_adapters[runs].identity
        assert f"LoRA adapter {runs!r} (identity {identity!r})" in out.error
    else:
        assert "runs under the base model" in out.error
    assert ("another LoRA adapter" if ran is not None else "the base model") in out.error
    completion = finals[good_id].completion
    assert completion is not None
    assert llama.reference(good[1], good[0], NEW) == list(completion.token_ids)
    batcher.check_invariants()  # (no leak: every lane idle, its blocks back)
    assert batcher.scheduler.lanes.num_busy == 0


def test_zmq_producer_is_asked_by_adapter_name(llama: LoraFamily, producer: Producer,
                                               tmp_path: Any) -> None:
    endpoint = f"ipc://{tmp_path}/pd.sock"
    server = ZmqProducerServer(producer, endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        batcher = llama.engine(llama.runtime(4))
        requests = work(4, seed=3)
        ids = []
        for i, (prompt, lora) in enumerate(requests):
            kv = ZmqSource(endpoint, f"z{i}", prompt, greedy(NEW), lora=lora,
                           artifact=batcher.artifact)
            ids.append(batcher.submit(prompt, greedy(NEW), lora=lora, kv=kv))
        unknown = ZmqSource(endpoint, "zx", requests[0][0], greedy(NEW), lora="nope",
                            artifact=batcher.artifact)
        batcher.load_lora("nope", str(llama.adapter_dirs[A]))  # the decoder has it, not the producer
        missing = batcher.submit(requests[0][0], greedy(NEW), lora="nope", kv=unknown)
        finals = run_to_end(batcher)
        for rid, (prompt, lora) in zip(ids, requests, strict=True):
            completion = finals[rid].completion
            assert completion is not None and completion.finish_reason == "length", finals[rid]
            assert llama.reference(lora, prompt, NEW) == list(completion.token_ids)
        assert finals[missing].finish_reason == "error"
        assert "lora='nope' is not a LoRA adapter of this producer" in str(finals[missing].error)
    finally:
        server.close()
        thread.join(10)


def test_pd_through_the_engine_core_with_adapters(llama: LoraFamily, producer: Producer,
                                                  tmp_path: Any) -> None:
    """The core opens each request's source with its adapter's name; the producer prefills
    under it and the tokens equal transformers + peft's."""
    endpoint = f"ipc://{tmp_path}/pd-core.sock"
    server = ZmqProducerServer(producer, endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    factory = functools.partial(core_batcher, str(llama.checkpoint),
                                tuple((name, str(llama.adapter_dirs[name])) for name in ADAPTERS))
    requests = work(4, seed=6)

    async def main() -> list[list[int]]:
        async with CoreClient(factory, pd=PDOptions(producers={"p0": endpoint})) as client:
            outs = await asyncio.gather(*(client.generate(p, greedy(NEW), lora=lora)
                                          for p, lora in requests))
            return [list(o.token_ids) for o in outs]

    try:
        served = server.served
        tokens = asyncio.run(main())
        assert server.served - served == len(requests)  # every request came from the producer
    finally:
        server.close()
        thread.join(10)
    for (prompt, lora), got in zip(requests, tokens, strict=True):
        assert llama.reference(lora, prompt, NEW) == got
