"""The lean streaming path's pieces: pre-encoded plain chunks give msgspec's bytes exactly, the
mailbox hands plain tokens over as ints, and the SSE response aborts on a disconnect."""

from __future__ import annotations

import asyncio

import pytest

from atombatch.api.mailbox import Mailbox, as_outputs
from atombatch.api.structs import RequestOutput
from atombatch.serve.app import _sse
from atombatch.serve.protocol import (
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from atombatch.serve.sse import PlainChunk, SSEResponse

TEXTS = ["", "<17>", 'quote " backslash \\ newline \n tab \t', "\x00\x01\x1f control",
         "\u2028\u2029 separators", "é ü 漢字 😀 \ud7ff", "@@", "}]},{\"index\":9"]
IDS = [[], [0], [1, 2, 3], [2**40, 7]]


def completion(model: str, index: int):
    return lambda text, ids: _sse(CompletionResponse(
        id="cmpl-abc", created=1_700_000_000, model=model,
        choices=[CompletionChoice(index=index, text=text, token_ids=ids)]))


def chat(model: str, index: int):
    return lambda text, ids: _sse(ChatChunk(
        id="chatcmpl-abc", created=1_700_000_000, model=model,
        choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text), token_ids=ids)]))


@pytest.mark.parametrize("build", [completion, chat])
@pytest.mark.parametrize("model", ["tiny", 'we"ird \\ name é', "[7654321987654321]"])
@pytest.mark.parametrize("index", [0, 5])
def test_plain_chunk_is_msgspecs_encoding(build, model: str, index: int) -> None:
    encode = build(model, index)
    template = PlainChunk.cut(encode)
    assert template is not None
    for text in TEXTS:
        for ids in IDS:
            assert template(text, ids) == encode(text, ids)


def test_plain_chunk_refuses_a_model_name_holding_its_marker() -> None:
    assert PlainChunk.cut(completion("@@atombatch-plain-text@@", 0)) is None


def test_mailbox_wakes_once_per_batch_and_converts_ints() -> None:
    async def main() -> None:
        box = Mailbox()
        taken: list[list[object]] = []

        async def consume() -> None:
            while True:
                items = await box.take()
                taken.append(items)
                if isinstance(items[-1], RequestOutput) and items[-1].finished:
                    return

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        box.put_nowait(5)
        box.put_plain(6)        # no sink: queued as the client's plain tokens are
        box.put_plain(7)
        await asyncio.sleep(0)
        final = RequestOutput(request_id="r", new_token_ids=(8,), finished=True,
                              finish_reason="length")
        box.put_nowait(final)
        await task
        assert taken == [[5, 6, 7], [final]]
        outs = as_outputs("r", [5, final])
        assert outs[0] == RequestOutput(request_id="r", new_token_ids=(5,), finished=False)
        assert outs[1] is final

    asyncio.run(main())


class _Gen:
    def __init__(self) -> None:
        self.abandoned = 0

    def abandon(self) -> None:
        self.abandoned += 1


def test_sse_response_disconnect_cancels_the_body_and_abandons() -> None:
    async def main() -> tuple[list[dict], _Gen, bool]:
        sent: list[dict] = []
        closed = False
        disconnect = asyncio.Event()

        async def body():
            nonlocal closed
            try:
                yield b"data: 1\n\n"
                await asyncio.sleep(3600)  # a stream waiting for its next token
                yield b"never"
            finally:
                closed = True

        async def receive() -> dict:
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message.get("body") == b"data: 1\n\n":
                disconnect.set()

        gen = _Gen()
        response = SSEResponse(body(), [gen], {"X-Test": "1"})
        await asyncio.wait_for(response({"type": "http"}, receive, send), 10)
        return sent, gen, closed

    sent, gen, closed = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]  # no end: the client left
    assert gen.abandoned == 1 and closed


def test_sse_response_sends_body_through_the_raw_send() -> None:
    async def main() -> tuple[list[dict], list[dict]]:
        wrapped: list[dict] = []
        raw: list[dict] = []

        async def body():
            yield b"a"
            yield b"b"

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def wrapped_send(message: dict) -> None:
            wrapped.append(message)

        async def raw_send(message: dict) -> None:
            raw.append(message)

        await SSEResponse(body(), [])({"type": "http", "atombatch.raw_send": raw_send},
                                      receive, wrapped_send)
        return wrapped, raw

    wrapped, raw = asyncio.run(main())
    assert [m["type"] for m in wrapped] == ["http.response.start"]
    assert [(m["body"], m["more_body"]) for m in raw] == [(b"a", True), (b"b", True),
                                                          (b"", False)]


def test_token_metrics_expose_as_prometheus_clients_own() -> None:
    import re

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from atombatch.serve.metrics import _LATENCY_BUCKETS, _GapHistogram, _TokenCounter

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("atombatch_gap_seconds", "doc", buckets=_LATENCY_BUCKETS,
                          registry=theirs)
    counter = Counter("atombatch_tokens", "doc", registry=theirs)
    gaps, tokens = _GapHistogram("atombatch_gap_seconds", "doc", _LATENCY_BUCKETS), \
        _TokenCounter("atombatch_tokens", "doc")
    ours.register(gaps)
    ours.register(tokens)
    for value in (0.0, 0.0005, 0.001, 0.0010001, 0.005, 0.02, 3.0, 600.0, 1e4):
        histogram.observe(value)
        gaps.observe(value)
    counter.inc(7)
    tokens.inc(7)

    def text(registry: CollectorRegistry) -> bytes:
        return re.sub(rb"_created \S+", b"_created T", generate_latest(registry))

    assert text(ours) == text(theirs)


def test_sse_response_ends_the_body_with_the_chunk_that_carries_done() -> None:
    async def main() -> list[dict]:
        raw: list[dict] = []

        async def body():
            yield b"data: a\n\n"
            yield b"data: last\n\ndata: [DONE]\n\n"

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            raw.append(message)

        await SSEResponse(body(), [])({"type": "http"}, receive, send)
        return raw

    raw = asyncio.run(main())
    assert [(m.get("body"), m.get("more_body")) for m in raw[1:]] == [
        (b"data: a\n\n", True), (b"data: last\n\ndata: [DONE]\n\n", False)]
