"""The HTTP/SSE server against a plain Batcher on an identical runtime.

Every test runs uvicorn in a background thread on a loopback port (127.0.0.1, port picked by the OS)
and talks to it with real clients: the official `openai` client and `httpx`. Expected token ids come
from a separate `Batcher` on `NumpyRuntime.random` with the same artifact and weight seed (greedy
decoding is per lane, so batch composition cannot change it).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from support.paced import PacedDecode
from support.served import ServerThread
from support.serving import (
    ART,
    NAME,
    SPEC,
    WEIGHT_SEED,
    assert_blocks_released,
    expected,
    ids_of,
    make_server,
    metrics,
    wait_idle,
)

from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app
from atombatch.serve.tokens import HFCodec


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with make_server(max_waiting=64) as s:
        yield s


async def read_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      stop_after: int | None = None) -> tuple[list[int], str | None, bool]:
    """Stream a completion: (ids, finish_reason, saw [DONE]); hang up after `stop_after` ids."""
    ids: list[int] = []
    finish = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        if stop_after == 0:
            return ids, finish, False
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[6:]
            if data == "[DONE]":
                return ids, finish, True
            choice = json.loads(data)["choices"][0]
            assert ids_of(choice["text"]) == choice["token_ids"]
            ids.extend(choice["token_ids"])
            finish = choice["finish_reason"]
            if stop_after is not None and len(ids) >= stop_after:
                return ids, finish, False  # leaving the `async with` closes the connection
    return ids, finish, False


# -- the openai client -----------------------------------------------------------------------------
def test_openai_client_streams_the_batchers_greedy_tokens(server: ServerThread) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, SPEC.vocab_size, n).tolist() for n in (1, 5, 33, 70)]
    want = expected(prompts, 20)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for prompt, tokens in zip(prompts, want, strict=True):
        got: list[int] = []
        text = ""
        finish = None
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=20,
                                           temperature=0.0, stream=True)
        for chunk in stream:
            choice = chunk.choices[0]
            got.extend(choice.model_extra["token_ids"])
            text += choice.text
            finish = choice.finish_reason
        assert got == tokens
        assert ids_of(text) == tokens
        assert finish == ("stop" if tokens[-1] in SPEC.eos_token_ids else "length")

    # Non-streaming, text prompt ("<id>" pieces without a tokenizer), and chat.
    whole = client.completions.create(model=NAME, prompt="".join(f"<{t}>" for t in prompts[2]),
                                      max_tokens=20, temperature=0.0)
    assert whole.choices[0].model_extra["token_ids"] == want[2]
    assert ids_of(whole.choices[0].text) == want[2]
    assert whole.usage.prompt_tokens == len(prompts[2])
    assert whole.usage.completion_tokens == len(want[2])
    chat = client.chat.completions.create(
        model=NAME, max_tokens=20, temperature=0.0,
        messages=[{"role": "user", "content": "".join(f"<{t}>" for t in prompts[1])}])
    assert ids_of(chat.choices[0].message.content) == want[1]
    chunks = list(client.chat.completions.create(
        model=NAME, max_tokens=20, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "".join(f"<{t}>" for t in prompts[1])}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert ids_of("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) == want[1]
    assert chunks[-1].usage.completion_tokens == len(want[1])

    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].model_extra["atombatch"]["vocab_size"] == SPEC.vocab_size
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=[3], max_tokens=2)


def test_health_and_models(server: ServerThread) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == ART.max_seq_len
    assert card["atombatch"]["identity"] == ART.identity
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


# -- concurrency and disconnects -------------------------------------------------------------------
async def test_sixteen_streams_with_random_disconnects(server: ServerThread) -> None:
    rnd = random.Random(5)
    max_tokens = 48
    prompts = [[rnd.randrange(3, SPEC.vocab_size) for _ in range(rnd.randrange(1, 60))]
               for _ in range(16)]
    hang_up = [rnd.choice([None, None, 0, 1, 3, 8]) for _ in prompts]
    want = expected(prompts, max_tokens)
    before = metrics(server.url)
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        results = await asyncio.gather(*(
            read_stream(client, server.url, {"prompt": p, "max_tokens": max_tokens,
                                             "temperature": 0, "stream": True}, stop_after=h)
            for p, h in zip(prompts, hang_up, strict=True)))
    for (ids, finish, done), tokens, h in zip(results, want, hang_up, strict=True):
        if h is None:
            assert done and ids == tokens
            assert finish == ("stop" if tokens[-1] in SPEC.eos_token_ids else "length")
        else:
            assert ids == tokens[:len(ids)]  # what arrived before the hang-up was right
    after = wait_idle(server.url)
    assert_blocks_released(after)
    hung = sum(h is not None for h in hang_up)
    assert hung >= 4
    aborted = after.get('atombatch_engine_requests_finished_total{reason="abort"}', 0) - \
        before.get('atombatch_engine_requests_finished_total{reason="abort"}', 0)
    disconnected = after.get('atombatch_requests_finished_total{reason="disconnect"}', 0) - \
        before.get('atombatch_requests_finished_total{reason="disconnect"}', 0)
    print(f"hung up {hung}, disconnects seen {disconnected}, engine aborts {aborted}")
    assert 1 <= aborted <= hung and 1 <= disconnected <= hung


# -- bad requests ----------------------------------------------------------------------------------
BAD = [
    # (body bytes or JSON, status, param, code)
    (b'{"prompt": [1, 2', 400, None, "invalid_json"),
    (b"not json at all", 400, None, "invalid_json"),
    ({"prompt": [5, 6], "max_tokens": "four"}, 400, "max_tokens", "invalid_type"),
    ({"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    ([1, 2, 3], 400, None, "invalid_type"),
    ({"prompt": [5, [6]], "max_tokens": 4}, 400, "prompt", "invalid_type"),
    ({"prompt": [[5], []], "max_tokens": 4}, 400, "prompt[1]", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "suffix": "x"}, 400, "suffix", "unsupported_value"),
    ({"prompt": list(range(3, 120)), "max_tokens": 20}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 4, "temperature": -0.5}, 400, "temperature", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_p": 0.0}, 400, "top_p", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_k": -3}, 400, "top_k", "invalid_value"),
    ({"prompt": [5, SPEC.vocab_size], "max_tokens": 4}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, -1], "max_tokens": 4}, 400, "prompt", "invalid_value"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt", "invalid_value"),
    ({"prompt": "hello", "max_tokens": 4}, 400, "prompt", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "stop_token_ids": [999]}, 400, "stop_token_ids",
     "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "seed": -1}, 400, "seed", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "n": 0}, 400, "n", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "min_p": 2}, 400, "min_p", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "logit_bias": {"7": 101}}, 400, "logit_bias", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "stop": ["x"]}, 400, "stop", "invalid_value"),
    ({"prompt": [5], "max_tokens": 4, "echo": True, "best_of": 2}, 400, "best_of",
     "unsupported_value"),
    ({"prompt": [5], "max_tokens": 4, "model": "gpt-9"}, 404, "model", "model_not_found"),
]


async def test_bad_requests_answer_errors_while_a_stream_completes(server: ServerThread) -> None:
    prompt = [9, 8, 7, 6, 5]
    want = expected([prompt], 100)[0]
    async with httpx.AsyncClient(timeout=60) as client:
        stream = asyncio.create_task(read_stream(
            client, server.url, {"prompt": prompt, "max_tokens": 100, "temperature": 0,
                                 "stream": True}))
        for body, status, param, code in BAD:
            for path in ("/v1/completions",):
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await client.post(f"{server.url}{path}", content=content,
                                      headers={"content-type": "application/json"})
                assert r.status_code == status, (body, r.text)
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["param"] == param and error["code"] == code, (body, error)
                assert error["type"] == "invalid_request_error" and error["message"]
        chat_bad = [
            ({"messages": [{"role": "wizard", "content": "<5>"}]}, 400, "messages[0].role"),
            ({"messages": [{"content": "<5>"}]}, 400, "messages[0].role"),
            ({"messages": [{"role": "user", "content": "<5><999>"}]}, 400, "messages"),
            ({"messages": [{"role": "user", "content": "words"}]}, 400, "messages"),
            ({"messages": "hi"}, 400, "messages"),
            # 0 is a value, not "unset": the engine rejects it (regression)
            ({"messages": [{"role": "user", "content": "<5>"}], "max_tokens": 0}, 400,
             "max_tokens"),
            ({"messages": [{"role": "user", "content": "<5>"}], "max_completion_tokens": 0,
              "max_tokens": 3}, 400, "max_tokens"),
        ]
        for body, status, param in chat_bad:
            r = await client.post(f"{server.url}/v1/chat/completions", json=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["param"] == param
        ids, _, done = await stream
    assert done and ids == want
    assert_blocks_released(wait_idle(server.url))


# -- queue bound -----------------------------------------------------------------------------------
class GatedRuntime:
    """A NumpyRuntime whose decode steps wait for `gate` (so a test can hold lanes busy)."""

    def __init__(self, inner: NumpyRuntime) -> None:
        self.inner = inner
        self.artifact = inner.artifact
        self.gate = threading.Event()

    def prefill(self, inputs: Any) -> Any:
        return self.inner.prefill(inputs)

    def decode(self, inputs: Any) -> Any:
        assert self.gate.wait(30)
        return self.inner.decode(inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_full_queue_answers_429_with_retry_after() -> None:
    art = ArtifactConfig(model=SPEC, batch_size=1, max_seq_len=64, block_size=64, num_blocks=2,
                         prefill_chunk_size=32, kv_dtype="float32")
    runtime = GatedRuntime(NumpyRuntime.random(art, seed=WEIGHT_SEED))
    prompts = [[11, 12, 13], [21, 22], [31]]
    want = expected(prompts[:2], 6, art)
    body = {"max_tokens": 6, "temperature": 0, "stream": True}
    with make_server(art, runtime, max_waiting=1) as s:
        async with httpx.AsyncClient(timeout=60) as client:
            # A takes the only lane: its first token (from prefill) arrives, its decode waits.
            first = asyncio.create_task(read_stream(client, s.url, {**body, "prompt": prompts[0]}))
            while metrics(s.url)["atombatch_generation_tokens_total"] < 1:
                await asyncio.sleep(0.02)
            # B waits for the lane: the queue (max_waiting=1) is now full.
            second = asyncio.create_task(read_stream(client, s.url, {**body, "prompt": prompts[1]}))
            while metrics(s.url)["atombatch_prompt_tokens_total"] < 5:
                await asyncio.sleep(0.02)
            r = await client.post(f"{s.url}/v1/completions", json={**body, "prompt": prompts[2]})
            assert r.status_code == 429
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            runtime.gate.set()
            assert (await first)[0] == want[0]
            assert (await second)[0] == want[1]
        m = metrics(s.url)
        assert m['atombatch_requests_rejected_total{status="429"}'] == 1


async def test_non_streaming_client_that_hangs_up_aborts_its_request() -> None:
    runtime = GatedRuntime(NumpyRuntime.random(ART, seed=WEIGHT_SEED))
    with make_server(ART, runtime) as s:
        async with httpx.AsyncClient(timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):  # decode is held: no answer in time
                await client.post(f"{s.url}/v1/completions",
                                  json={"prompt": [7, 8], "max_tokens": 20, "temperature": 0})
        deadline = time.monotonic() + 10
        while metrics(s.url).get('atombatch_requests_finished_total{reason="disconnect"}') != 1:
            assert time.monotonic() < deadline, "the server did not notice the hang-up"
            await asyncio.sleep(0.02)
        runtime.gate.set()  # the abort applies as soon as the held step returns
        m = wait_idle(s.url)
        assert m['atombatch_engine_requests_finished_total{reason="abort"}'] == 1
        assert m["atombatch_engine_generated_tokens_total"] < 20
        assert_blocks_released(m)


# -- shutdown --------------------------------------------------------------------------------------
async def test_shutdown_drains_in_flight_streams() -> None:
    prompt = [40, 41, 42]
    want = expected([prompt], 30)[0]
    runtime = GatedRuntime(NumpyRuntime.random(ART, seed=WEIGHT_SEED))
    s = make_server(ART, runtime)
    with s:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(read_stream(
                client, s.url, {"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                "stream": True}))
            while metrics(s.url)["atombatch_generation_tokens_total"] < 1:
                await asyncio.sleep(0.01)
            s.server.should_exit = True  # what SIGINT/SIGTERM does
            deadline = time.monotonic() + 10
            while True:  # the listener closes while the stream is held mid-way
                try:
                    httpx.get(f"{s.url}/health", timeout=1)
                except httpx.TransportError:
                    break
                assert time.monotonic() < deadline, "server kept accepting after should_exit"
                await asyncio.sleep(0.05)
            assert not task.done()
            runtime.gate.set()
            ids, _, done = await task
    assert done and ids == want


# -- a tokenizer -----------------------------------------------------------------------------------
def test_tokenizer_text_and_chat_template(tmp_path: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(SPEC.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                "{% if add_generation_prompt %}w5{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    codec = HFCodec.from_dir(tmp_path)
    assert codec is not None
    assert codec.render_chat([{"role": "user", "content": "w10 w11"}]) == [3, 10, 11, 4, 5]

    rt = NumpyRuntime.random(ART, seed=WEIGHT_SEED)
    want = expected([[10, 11, 12], [3, 10, 11, 4, 5]], 8)
    with ServerThread(create_app(Batcher(rt), NAME, codec)) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=NAME, prompt="w10 w11 w12", max_tokens=8,
                                        temperature=0)
        assert out.choices[0].model_extra["token_ids"] == want[0]
        assert out.choices[0].text.split() == [f"w{t}" for t in want[0]]
        chat = client.chat.completions.create(
            model=NAME, max_tokens=8, temperature=0, stream=True,
            messages=[{"role": "user", "content": "w10 w11"}])
        ids: list[int] = []
        for chunk in chat:
            ids.extend(chunk.choices[0].model_extra["token_ids"])
        assert ids == want[1]


# -- command line ----------------------------------------------------------------------------------
def test_cli_builds_the_artifact_and_refuses_bad_configs(capsys: Any) -> None:
    from atombatch.serve.cli import build_engine, main, parser

    batcher, name, codec = build_engine(parser().parse_args(
        ["--batch-size", "2", "--max-seq-len", "256", "--block-size", "64",
         "--prefill-chunk-size", "32", "--policy", "interleave:2", "--max-waiting", "3"]))
    art = batcher.artifact
    assert (art.batch_size, art.max_seq_len, art.block_size, art.num_blocks) == (2, 256, 64, 9)
    assert name == "atombatch-tiny" and codec is None and batcher.max_waiting == 3
    assert batcher.policy.label == "interleave:2"
    assert main(["--batch-size", "4", "--num-blocks", "3"]) == 2
    assert "lanes+1 rule" in capsys.readouterr().err
    assert main(["--runtime", "rebel", "--model", "/nonexistent"]) == 2
    assert "needs --model DIR, a directory compiled by optimum-rbln" in capsys.readouterr().err


def test_metrics_say_where_the_device_time_went(server: ServerThread) -> None:
    before = metrics(server.url)
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200
    after = wait_idle(server.url)
    device = after["atombatch_device_seconds_total"] - before["atombatch_device_seconds_total"]
    gaps = after["atombatch_host_gaps_total"] - before["atombatch_host_gaps_total"]
    gap = after["atombatch_host_gap_seconds_total"] - before["atombatch_host_gap_seconds_total"]
    steps = after["atombatch_engine_steps_total"] - before["atombatch_engine_steps_total"]
    # one prefill and five decode steps back to back: five gaps between them, none across the
    # idle time before this request
    assert steps == 6 and gaps == 5
    assert device > 0 and 0 < gap < device + gap
    # --overlap (the default): the first decode starts the pipeline, the device thread launches
    # the other four straight after the one before (none after the last: the limit was known)
    overlapped = after["atombatch_overlapped_steps_total"] - \
        before["atombatch_overlapped_steps_total"]
    assert overlapped == 4


@pytest.fixture(scope="module")
def paced() -> Iterator[ServerThread]:
    runtime = PacedDecode.random(ART, seed=WEIGHT_SEED)
    runtime.step_s = 0.005  # the stream below still decodes when the second request arrives
    with make_server(runtime=runtime) as s:
        yield s


def test_a_request_arriving_mid_stream_is_admitted_inside_the_pipeline(
        paced: ServerThread) -> None:
    """While one stream decodes, a second request arrives with a lane free for it: its prefill
    chunk is launched by the device thread right after the decode on the device (counted in
    atombatch_overlapped_prefills_total), and both get the tokens of a synchronous engine."""
    server = paced
    before = metrics(server.url)
    first: list[int] = []
    seen = threading.Event()

    def stream() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 90, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first.extend(json.loads(line[6:])["choices"][0]["token_ids"])
                    if len(first) >= 10:
                        seen.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert seen.wait(30)
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": [9, 8, 7, 6], "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
    reader.join(60)
    assert reply.status_code == 200
    alone = Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED))
    want = alone.generate([[5, 6, 7], [9, 8, 7, 6]], [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (90, 8)])
    assert first == list(want[0].token_ids)
    assert ids_of(reply.json()["choices"][0]["text"]) == list(want[1].token_ids)
    after = wait_idle(server.url)
    assert after["atombatch_overlapped_prefills_total"] - \
        before["atombatch_overlapped_prefills_total"] == 1
    assert_blocks_released(after)


class _RecordBodies:
    """ASGI wrapper recording each completion's body messages (what the app hands uvicorn)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[list[tuple[bytes, bool]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        mine: list[tuple[bytes, bool]] = []
        self.bodies.append(mine)

        async def recording(message: Any) -> None:
            if message["type"] == "http.response.body":
                mine.append((message.get("body", b""), message.get("more_body", False)))
            await send(message)

        return await self.app(scope, receive, recording)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_streams_last_event_done_and_end_leave_in_one_write(path: str, n: int) -> None:
    recorder = _RecordBodies(create_app(Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED)), NAME))
    body: dict[str, Any] = {"max_tokens": 3, "temperature": 0, "stream": True, "n": n,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    # a server without a tokenizer reads text as <id> pieces
    body |= {"messages": [{"role": "user", "content": "<4><5><6>"}]} if "chat" in path else \
        {"prompt": [4, 5, 6]}
    with ServerThread(recorder) as s:
        reply = httpx.post(f"{s.url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    (messages,) = recorder.bodies
    # every message but the last carries more; the last holds the last choice's final event,
    # the usage and [DONE] (no empty message to end the body)
    assert [more for _, more in messages] == [True] * (len(messages) - 1) + [False]
    last = messages[-1][0]
    events = [e for e in last.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and b'"usage":{' in events[-2]
    assert b'"finish_reason":"length"' in events[-3]
    # the bytes are those of the whole stream, in order
    assert b"".join(b for b, _ in messages) == reply.content
    finished = [e for b, _ in messages for e in b.split(b"\n\n") if b'"finish_reason":"length"' in e]
    assert len(finished) == n
