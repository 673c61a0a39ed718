"""Hypothesis fuzzing of the HTTP endpoints: every hostile body gets a typed JSON error (never a
500 or a hang), and afterwards the server is healthy with every lane and block released.

Temperatures include the denormals of issue 12's F2 (1e-320, 1e-310), which must sample greedily
rather than produce NaN probabilities.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atombatch import ArtifactConfig, Batcher, ModelSpec
from atombatch.runtime import NumpyRuntime
from atombatch.serve import create_app
from atombatch.serve.limits import ServerLimits, uvicorn_config

SPEC = ModelSpec(name="fuzz", family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, bos_token_id=1,
                 eos_token_ids=(2,))
ART = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=32, block_size=8, num_blocks=9,
                     prefill_chunk_size=8)
ALLOWED = {200, 400, 404, 408, 413, 422, 429}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = create_app(Batcher(NumpyRuntime.random(ART, seed=0), max_waiting=8, overlap=True), "fuzz",
                     max_body_bytes=MAX_BODY, body_timeout=5.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(app, ServerLimits(max_body_bytes=MAX_BODY, header_timeout=5.0),
                            log_level="critical", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    sock.close()


HOSTILE_INTS = st.sampled_from([-(2**63), -(2**31), -1, 0, 1, 2, 3, 31, 32, 64, 2**31, 2**63 - 1,
                                2**64, 10**30])
SMALL = st.integers(min_value=1, max_value=3)
TEXT = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(min_value=0, max_value=80), max_size=12).map(
        lambda ids: "".join(f"<{i}>" for i in ids)),
    st.integers(min_value=1, max_value=6000).map(lambda n: "<" + "9" * n + ">"),
    st.just("<1>" * 40),
)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
                    st.text(max_size=10), lambda kids: st.lists(kids, max_size=4) |
                    st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
COMMON = {
    "model": st.one_of(st.just("fuzz"), st.text(max_size=8), st.integers()),
    "temperature": st.one_of(st.just(0.0), st.floats(min_value=0.05, max_value=2.0),
                             st.sampled_from([-1.0, 1e308, 1e-320, 1e-310, 5e-324, "hot"])),
    "top_p": st.one_of(st.floats(min_value=0.05, max_value=1.0), st.sampled_from([0.0, 2.0, -1])),
    "top_k": st.one_of(SMALL, HOSTILE_INTS, st.just(2.5)),
    "seed": st.one_of(st.none(), HOSTILE_INTS),
    "stream": st.booleans(),
    "stop_token_ids": st.lists(HOSTILE_INTS, max_size=3),
    "ignore_eos": st.booleans(),
    "n": st.sampled_from([1, 2, 0]),
    "stop": st.sampled_from([None, [], "x"]),
    "unknown_field": JSON,
}
MAX_TOKENS = st.one_of(SMALL, HOSTILE_INTS, st.just(5.5), st.none())
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", ""])},
    optional={"content": st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": TEXT}), max_size=2), JSON)})
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT, st.lists(HOSTILE_INTS | SMALL, max_size=40), JSON)},
    optional={"max_tokens": MAX_TOKENS, **COMMON})
CHAT = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON), "max_tokens": MAX_TOKENS},
    optional=COMMON)


def check(response: httpx.Response, streamed: bool) -> None:
    assert response.status_code in ALLOWED, (response.status_code, response.text[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and len(error["message"]) < 2000
    elif streamed:
        assert response.text.rstrip().endswith("data: [DONE]") or '"error"' in response.text


def post(url: str, path: str, body: Any) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    streamed = isinstance(body, dict) and body.get("stream") is True
    response = httpx.post(f"{url}{path}", content=content, timeout=60,
                          headers={"Content-Type": "application/json"})
    check(response, streamed)


FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(body=COMPLETION)
def test_fuzzed_completions(url: str, body: dict[str, Any]) -> None:
    post(url, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_fuzzed_chat(url: str, body: dict[str, Any]) -> None:
    if body.get("max_tokens") is None:
        body["max_tokens"] = 2  # None would generate to the context's end: slow, not hostile
    post(url, "/v1/chat/completions", body)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()),
                     st.just(b"{" * 5000), st.just(b"[" * 100_000)),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]))
def test_fuzzed_raw_bodies(url: str, raw: bytes, path: str) -> None:
    post(url, path, raw)


def test_after_fuzzing_the_server_is_healthy_and_idle(url: str) -> None:
    post(url, "/v1/completions", {"prompt": "<5><6>", "max_tokens": 2})
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{url}/metrics").text
        values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                      if line and not line.startswith("#"))
        idle = (float(values["atombatch_occupied_lanes"]) == 0
                and float(values["atombatch_requests_in_flight"]) == 0)
        if idle:
            break
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)
    assert float(values['atombatch_blocks{state="lane"}']) == 0
    assert float(values['atombatch_blocks{state="staged"}']) == 0
    assert httpx.get(f"{url}/health").status_code == 200
