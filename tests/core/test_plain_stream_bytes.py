"""The pre-encoded plain chunks on the wire (atombatch/serve/sse.py): every streamed event of a
plain greedy request through a real engine-core server is the bytes msgspec gives for the
protocol Struct it decodes to, and the tokens are the inline server's. The null device (20 ms a
step) makes one event per token. With the engine core, a stream that keeps up has its plain
events written directly from the step's delivery (`DirectWriter`, counted by
`atombatch_stream_direct_events_total`); a reader that does not keep up pushes the stream back
onto its task, which merges what waits, and nothing is lost or reordered either way."""

from __future__ import annotations

import re
import socket
import time

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
        # the core server wrote the plain events after each stream's first two directly (the
        # first token is not plain, the first plain one sets the lane up); inline has no lane
        assert direct_events(core_url) >= 2 * (12 - 3)
        assert direct_events(inline_url) == 0


def direct_events(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^atombatch_stream_direct_events_total (\S+)$", text, re.M)
    assert found, text[:2000]
    return int(float(found.group(1)))


def slow_read(url: str, body: bytes) -> bytes:
    """POST `body` through a 4 KiB receive buffer and read nothing until the server stops
    writing directly (its direct-event count stands still), then read everything."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    last, still, deadline = -1, 0, time.monotonic() + 60
    while still < 3 and time.monotonic() < deadline:
        time.sleep(0.25)
        count = direct_events(url)
        still = still + 1 if count == last and count > 0 else 0
        last = count
    parts = []
    while chunk := sock.recv(1 << 16):
        parts.append(chunk)
    sock.close()
    return b"".join(parts)


def null_greedy(prompt: list[int], max_tokens: int, context: int) -> list[int]:
    """What the null device's greedy decode gives, from an in-process engine (no server)."""
    from atombatch import ArtifactConfig, Batcher, SamplingParams
    from atombatch.runtime.null import NullRuntime
    from atombatch.serve.cli import DEFAULT_SPEC

    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=2, max_seq_len=context,
                         block_size=context, num_blocks=3, prefill_chunk_size=128)
    batcher = Batcher(NullRuntime(art, step_ms=0.0))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(batcher.generate([prompt], params)[0].token_ids)


def kernel_send_buffer_max() -> int:
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20


def test_a_reader_that_falls_behind_gets_every_token_in_order() -> None:
    # Enough ~200-byte events to outgrow the kernel's largest socket send buffer by 2 MiB: the
    # server's transport must pause writing while the reader sleeps, and the stream must then
    # leave the direct path for its task (which waits for the transport to drain).
    prompt = [5, 6, 7]
    max_tokens = (kernel_send_buffer_max() + (2 << 20)) // 200
    context = -(-(max_tokens + 64) // 128) * 128   # a whole number of prefill chunks
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with served("--runtime", "null", "--null-step-ms", "0.1", "--batch-size", "2",
                "--max-seq-len", str(context)) as (url, _):
        before = direct_events(url)
        raw = slow_read(url, msgspec.json.encode(body))
        after = direct_events(url)
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    stream, at = bytearray(), 0    # undo the chunked framing, then read the events
    while True:
        end = chunked.index(b"\r\n", at)
        size = int(chunked[at:end], 16)
        if size == 0:
            break
        stream += chunked[end + 2:end + 2 + size]
        at = end + 2 + size + 2
    assert stream.endswith(b"data: [DONE]\n\n")
    chunks = [b"data: " + part for part in bytes(stream).split(b"data: ")[1:-1]]
    got = check(CompletionResponse, chunks)
    assert got == null_greedy(prompt, max_tokens, context)
    # while the stream kept up it was written directly; once the transport pushed back, the
    # task merged what waited (at least the 2 MiB past the buffers: ~10 000 tokens) into few
    # events instead of buffering one event per token in the server
    assert after > before
    assert len(chunks) <= max_tokens - 2000, (len(chunks), max_tokens)
