"""The pre-encoded plain chunks on the wire (atombatch/serve/sse.py): every streamed event of a
plain greedy request through a real engine-core server is the bytes msgspec gives for the
protocol Struct it decodes to, and the tokens are the inline server's. The null device (20 ms a
step) makes one event per token."""

from __future__ import annotations

import httpx
import msgspec
from support.served import served

from atombatch.serve.protocol import ChatChunk, CompletionResponse


def events(url: str, path: str, body: dict) -> list[bytes]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    return [b"data: " + part for part in raw.split(b"data: ")[1:-1]]


def check(kind: type, chunks: list[bytes]) -> list[int]:
    encoder, ids = msgspec.json.Encoder(), []
    for chunk in chunks:
        assert chunk.endswith(b"\n\n")
        obj = msgspec.json.decode(chunk[6:-2], type=kind)
        assert b"data: " + encoder.encode(obj) + b"\n\n" == chunk
        for choice in obj.choices:
            ids.extend(choice.token_ids)
    return ids


def test_plain_stream_events_are_the_structs_bytes() -> None:
    completion = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "stream": True,
                  "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "<5><6>"}], "max_tokens": 12,
            "temperature": 0, "stream": True, "ignore_eos": True}
    null = ("--runtime", "null", "--null-step-ms", "20", "--batch-size", "2")
    with served(*null) as (core_url, _), \
            served(*null, "--engine-core", "inline") as (inline_url, _):
        got = {}
        for name, url in (("core", core_url), ("inline", inline_url)):
            a = events(url, "/v1/completions", completion)
            b = events(url, "/v1/chat/completions", chat)
            assert len(a) >= 12 and len(b) >= 12   # one event per token (a plain stream)
            got[name] = (check(CompletionResponse, a), check(ChatChunk, b))
        assert got["core"] == got["inline"]
        assert len(got["core"][0]) == 12 and len(got["core"][1]) == 12
