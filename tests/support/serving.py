"""The served tiny model of the server tests: its spec, artifact and weights' seed, the greedy
reference a server must reproduce, and probes of a running server's metrics."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app
from support.served import ServerThread

__all__ = ["ART", "NAME", "SPEC", "WEIGHT_SEED", "ServerThread", "assert_blocks_released",
           "expected", "ids_of", "make_server", "metrics", "wait_idle"]

SPEC = ModelSpec(name="serve-test", family="llama", vocab_size=256, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 bos_token_id=1, eos_token_ids=(2,), dtype="float32")
# Partitioned blocks (4 per sequence), 4 lanes, lanes x blocks + 1 spare; chunked prefill.
ART = ArtifactConfig(model=SPEC, batch_size=4, max_seq_len=128, block_size=32, num_blocks=17,
                     prefill_chunk_size=32, kv_dtype="float32")
WEIGHT_SEED = 7
NAME = "serve-test"


def expected(prompts: list[list[int]], max_tokens: int, artifact: ArtifactConfig = ART
             ) -> list[list[int]]:
    batcher = Batcher(NumpyRuntime.random(artifact, seed=WEIGHT_SEED))
    done = batcher.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(c.token_ids) for c in done]


def ids_of(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def make_server(artifact: ArtifactConfig = ART, runtime: Any = None, **batcher_kw: Any
                ) -> ServerThread:
    runtime = runtime or NumpyRuntime.random(artifact, seed=WEIGHT_SEED)
    batcher_kw.setdefault("overlap", True)  # what `python -m atombatch.serve` runs by default
    return ServerThread(create_app(Batcher(runtime, **batcher_kw), NAME))


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["atombatch_occupied_lanes"] == 0 and m["atombatch_queue_length"] == 0
                and m["atombatch_requests_in_flight"] == 0):
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.05)


def assert_blocks_released(m: dict[str, float]) -> None:
    blocks = {s: m[f'atombatch_blocks{{state="{s}"}}'] for s in
              ("free", "spare", "staged", "lane", "cached")}
    assert blocks["staged"] == 0 and blocks["lane"] == 0, blocks
    assert blocks["free"] + blocks["spare"] + blocks["cached"] == ART.num_blocks, blocks
