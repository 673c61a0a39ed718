"""The ZeroMQ transport of PD: a producer server on a ROUTER socket and a DEALER `KVSource`.

Bounds (docs/security.md lists them with their defaults):

- Decoder side (`ZmqSource`): `ZMQ_MAXMSGSIZE` is the largest K/V frame the decoder's artifact can
  legally receive (`wire.max_layer_frame_bytes`; `DEFAULT_MAX_FRAME_BYTES` without `artifact=`), so
  ZeroMQ drops a connection that sends a larger frame before buffering it. The receive high-water
  mark is set in messages from a byte budget (`max_queued_bytes` / the largest layer message).
  With `artifact=`, the header is checked against the artifact and the prompt the moment it
  arrives, before any layer frame is decoded.
- Producer side (`ZmqProducerServer`): requests are capped in size (`ZMQ_MAXMSGSIZE` from the
  producer's context) and in number per peer. Replies are sent without blocking: each peer has an
  outbox holding at most one reply, flushed as its pipe (a byte-budgeted send high-water mark)
  makes room. A peer whose outbox makes no progress for `send_timeout` seconds is dropped with
  everything it queued; when more than `max_backlogged_peers` peers hold replies, the one that
  progressed least recently is dropped. One slow or hostile decoder therefore costs the others at
  most one prefill, never a blocked send.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import msgspec

from atombatch.api.structs import SamplingParams
from atombatch.artifact.config import ArtifactConfig
from atombatch.errors import KVTransferError, RequestError
from atombatch.logs import logger
from atombatch.pd.checks import validate_header
from atombatch.pd.producer import Producer
from atombatch.pd.source import LayerStream
from atombatch.pd.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    END,
    ERROR,
    HEADER,
    LAYER,
    MAX_ERROR_CHARS,
    MODES,
    REQUEST,
    KVHeader,
    KVRequest,
    LayerKV,
    Mode,
    buffer,
    clip,
    decode_header,
    decode_layer,
    encode_header,
    encoder,
    int_decoder,
    layer_frames,
    max_layer_frame_bytes,
    max_request_frame_bytes,
    request_decoder,
)

log = logger("atombatch.pd")

# Bytes of layer messages a socket may queue for one peer (turned into a high-water mark). An
# 8B model at a 9 216-token context has 75 MB layer messages: three of them fit.
DEFAULT_MAX_QUEUED_BYTES = 256 * 1024 * 1024
MIN_QUEUED_MESSAGES = 4


def _hwm(max_queued_bytes: int, message_bytes: int) -> int:
    """A high-water mark in messages that keeps queued layer messages near a byte budget
    (never below `MIN_QUEUED_MESSAGES`, so a huge layer still streams)."""
    return max(MIN_QUEUED_MESSAGES, max_queued_bytes // max(1, message_bytes))


class _Peer:
    """One decoder connection as the producer sees it: its queued requests and its outbox."""

    __slots__ = ("last_progress", "outbox", "requests", "routing_id")

    def __init__(self, routing_id: bytes, now: float) -> None:
        self.routing_id = routing_id
        self.requests: deque[KVRequest] = deque()     # received, not yet produced
        self.outbox: deque[list[Any]] = deque()       # reply messages not yet sent
        self.last_progress = now                      # last message the peer's pipe took


class ZmqProducerServer:
    """Serves `Producer` requests on a ZeroMQ ROUTER socket: one prefill at a time, peers in turn.

    Each request is a `[b"R", msgpack KVRequest]` message from a DEALER; the reply is a header
    message, one message per layer, and an end marker, or an error message (docs/pd.md). Peers
    are served round-robin; replies never block (see the module docstring for the bounds).

    Args:
        producer: the producer to run.
        endpoint: where to bind, e.g. "tcp://127.0.0.1:5557" or "ipc:///tmp/pd.sock".
        send_timeout: seconds a peer's reply may make no progress before the peer is dropped.
        max_requests_per_peer: requests one peer may have queued; more answer an error.
        max_queued_requests: requests all peers together may have queued (each holds its
            prompt until produced); more answer an error, so many peers cannot multiply the
            per-peer cap.
        max_backlogged_peers: peers that may hold unsent replies at once.
        max_queued_bytes: bytes of layer messages ZeroMQ may queue towards one peer.
        layer_delay: seconds to sleep before each layer (tests: a slow producer).
        fail_at_layer: raise before sending this layer (tests: a producer failing mid-stream).
    """

    def __init__(self, producer: Producer, endpoint: str, *, context: Any = None,
                 send_timeout: float = 10.0, max_requests_per_peer: int = 16,
                 max_queued_requests: int = 64, max_backlogged_peers: int = 8,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
                 layer_delay: float = 0.0, fail_at_layer: int | None = None) -> None:
        import zmq

        self.producer = producer
        self.endpoint = endpoint
        self.send_timeout = send_timeout
        self.max_requests_per_peer = max_requests_per_peer
        self.max_queued_requests = max_queued_requests
        self.queued_requests = 0  # over every peer
        self.max_backlogged_peers = max_backlogged_peers
        self.layer_delay = layer_delay
        self.fail_at_layer = fail_at_layer
        self._zmq = zmq
        self._context = context or zmq.Context.instance()
        art = producer.artifact
        self.max_frame_bytes = max_layer_frame_bytes(art)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone decoder raises, not drops
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_request_frame_bytes(art))
        self._socket.setsockopt(zmq.RCVHWM, 256)
        self._socket.setsockopt(zmq.SNDHWM, _hwm(max_queued_bytes, 2 * self.max_frame_bytes))
        self._socket.bind(endpoint)
        self.last_endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._serving = False
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()  # round-robin order
        self._stalled: dict[bytes, float] = {}  # dropped peers -> until when their requests drop
        self.served = 0
        self.dropped_peers = 0
        self.refused = 0  # requests dropped without a reply (malformed or over the per-peer cap)

    # -- the loop ----------------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Serve until `close()` (from any thread) or the process ends."""
        self._serving = True
        try:
            while not self._stop.is_set():
                self.serve_one(poll_interval)
        finally:
            self._socket.close()

    def serve_one(self, poll_interval: float = 0.1) -> None:
        """One turn: take the requests that arrived, flush outboxes, produce one reply."""
        ready = any(p.requests and not p.outbox for p in self._peers.values())
        waiting = any(p.outbox for p in self._peers.values())
        timeout = 0 if ready else 5 if waiting else int(poll_interval * 1000)
        if self._socket.poll(timeout):
            self._receive()
        self._flush_all()
        peer = self._next_ready()
        if peer is not None:
            self.queued_requests -= 1
            self._produce(peer, peer.requests.popleft())
        self._forget_idle()

    def _receive(self, limit: int = 1024) -> None:
        zmq = self._zmq
        now = time.monotonic()
        for _ in range(limit):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            routing_id, body = frames[0], frames[1:]
            if routing_id in self._stalled:
                if now < self._stalled[routing_id]:
                    continue  # dropped for not reading: its requests cost nothing for a while
                del self._stalled[routing_id]
            peer = self._peers.get(routing_id)
            if peer is None:
                peer = self._peers[routing_id] = _Peer(routing_id, now)
            try:
                if len(body) != 2 or body[0] != REQUEST:
                    raise KVTransferError(f"expected a [{REQUEST!r}, request] message, got "
                                          f"{len(body)} frames")
                try:
                    request = request_decoder.decode(body[1])
                except msgspec.DecodeError as exc:
                    raise KVTransferError(f"the request is not a valid KVRequest: "
                                          f"{clip(str(exc))}") from None
                if len(peer.requests) >= self.max_requests_per_peer:
                    raise KVTransferError(f"this peer already has {len(peer.requests)} requests "
                                          f"queued (max_requests_per_peer="
                                          f"{self.max_requests_per_peer})")
                if self.queued_requests >= self.max_queued_requests:
                    raise KVTransferError(f"the producer already has {self.queued_requests} "
                                          f"requests queued (max_queued_requests="
                                          f"{self.max_queued_requests}): retry later")
            except KVTransferError as exc:
                if peer.outbox:  # not reading its replies: an error reply would only pile up
                    self.refused += 1
                else:
                    self._queue(peer, [ERROR, str(exc).encode()])
                continue
            peer.requests.append(request)
            self.queued_requests += 1

    def _next_ready(self) -> _Peer | None:
        for routing_id, peer in self._peers.items():
            if peer.requests and not peer.outbox:
                self._peers.move_to_end(routing_id)  # round-robin: served last next time
                return peer
        return None

    def _produce(self, peer: _Peer, request: KVRequest) -> None:
        """Run one request; its messages go to the peer's outbox, flushed as they are made."""
        self._make_room(peer)
        self.served += 1
        sent = 0
        try:
            mode: Mode = "whole" if request.mode == "whole" else "layer-stream"
            lora_int_id = self.producer.lora_int_id_of(request.lora)
            for item in self.producer.stream(request.request_id, request.prompt, request.params,
                                             mode=mode, covered_len=request.covered_len,
                                             lora_int_id=lora_int_id):
                if peer.routing_id not in self._peers:
                    return  # dropped while its reply was being made
                if isinstance(item, KVHeader):
                    self._queue(peer, [HEADER, encode_header(item)])
                    continue
                if self.layer_delay:
                    time.sleep(self.layer_delay)
                if self.fail_at_layer is not None and item.layer == self.fail_at_layer:
                    raise RuntimeError(f"injected producer failure at layer {item.layer}")
                self._queue(peer, [LAYER, *layer_frames(item)])
                sent += 1
            self._queue(peer, [END, encoder.encode(sent)])
        except Exception as exc:
            log.warning("pd.producer_failed", error=repr(exc))
            text = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            self._queue(peer, [ERROR, text.encode()])

    # -- sending without blocking --------------------------------------------------------------------
    def _queue(self, peer: _Peer, message: list[Any]) -> None:
        if peer.routing_id not in self._peers:  # dropped meanwhile: nothing more is sent
            return
        if not peer.outbox:
            peer.last_progress = time.monotonic()
        peer.outbox.append(message)
        self._flush(peer, time.monotonic())

    def _flush_all(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.outbox:
                self._flush(peer, now)

    def _flush(self, peer: _Peer, now: float) -> None:
        zmq = self._zmq
        while peer.outbox:
            try:
                self._socket.send_multipart([peer.routing_id, *peer.outbox[0]],
                                            flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its pipe is full: try again later, others go on meanwhile
                if now - peer.last_progress > self.send_timeout:
                    self._drop(peer, f"no progress for {now - peer.last_progress:.1f} s "
                                     f"(send_timeout={self.send_timeout} s)")
                return
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the decoder went away
                self._drop(peer, str(exc))
                return
            peer.outbox.popleft()
            peer.last_progress = now

    def _make_room(self, serving: _Peer) -> None:
        backlogged = [p for p in self._peers.values() if p.outbox and p is not serving]
        while len(backlogged) >= self.max_backlogged_peers:
            slowest = min(backlogged, key=lambda p: p.last_progress)
            self._drop(slowest, f"more than max_backlogged_peers={self.max_backlogged_peers} "
                                "peers hold unsent replies; this one progressed least recently")
            backlogged.remove(slowest)

    def _drop(self, peer: _Peer, why: str) -> None:
        log.warning("pd.peer_dropped", why=why, requests=len(peer.requests),
                    messages=len(peer.outbox))
        self.dropped_peers += 1
        self._peers.pop(peer.routing_id, None)
        now = time.monotonic()
        self._stalled = {r: t for r, t in self._stalled.items() if t > now}
        self._stalled[peer.routing_id] = now + self.send_timeout
        self.queued_requests -= len(peer.requests)
        peer.requests.clear()
        peer.outbox.clear()

    def _forget_idle(self) -> None:
        for routing_id in [r for r, p in self._peers.items() if not p.requests and not p.outbox]:
            del self._peers[routing_id]

    def close(self) -> None:
        """Stop `serve_forever` (it closes the socket), or close the socket if not serving."""
        self._stop.set()
        if not self._serving:
            self._socket.close()


class ZmqSource:
    """A `KVSource` that asks a `ZmqProducerServer` (or any producer speaking docs/pd.md).

    The request is sent on construction from a DEALER socket of its own. `poll` reads with
    `zmq.NOBLOCK`; K/V arrive as zero-copy frames viewed with `np.frombuffer`.

    Pass the decoder's `artifact`: frames are then capped (`ZMQ_MAXMSGSIZE`) at the largest legal
    layer buffer of that artifact. Without it frames are capped at `max_frame_bytes`. A frame over
    the cap makes ZeroMQ drop the connection; the source reports a disconnect. Either way the
    header is checked against the decoder's artifact and prompt on arrival, before any layer frame
    is decoded, once the artifact is known (`artifact=` or `Batcher.submit`, which calls
    `expect`), so only layers of the artifact's legal sizes are ever kept.

    A killed producer is detected through the socket monitor: the operating system closes a dead
    process's connections, ZeroMQ reports `EVENT_DISCONNECTED`, and `poll` raises once the frames
    that did arrive are read. A producer host that vanishes without closing anything (power loss,
    partition) is caught by ZMTP heartbeats (`heartbeat_ivl`, `heartbeat_timeout`), which ZeroMQ's
    I/O thread answers even while the producer computes; a live but stuck producer is left to the
    engine's timeout.
    """

    def __init__(self, endpoint: str, request_id: str, prompt: Sequence[int],
                 params: SamplingParams | None = None, mode: Mode = "layer-stream",
                 covered_len: int | None = None, *, context: Any = None,
                 heartbeat_ivl: float = 1.0, heartbeat_timeout: float = 5.0,
                 artifact: ArtifactConfig | None = None, require_full: bool | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
                 lora: str | None = None) -> None:
        import zmq

        if mode not in MODES:
            raise RequestError(f"mode={mode!r} is not one of {MODES}")
        self._zmq = zmq
        self.endpoint = endpoint
        self.mode = mode
        self.artifact = artifact
        self._prompt = list(prompt)
        if artifact is not None:
            max_frame_bytes = max_layer_frame_bytes(artifact)
            if require_full is None:
                require_full = artifact.single_block or artifact.model.is_hybrid
        self._require_full = bool(require_full)
        self.max_frame_bytes = max_frame_bytes
        self._stream = LayerStream(f"KV producer at {endpoint}")
        self._pending: deque[LayerKV] = deque()
        self._error: KVTransferError | None = None
        self._closed = False
        self._connected = False
        self._disconnected = False
        context = context or zmq.Context.instance()
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._socket.setsockopt(zmq.RCVHWM, _hwm(max_queued_bytes, 2 * max_frame_bytes))
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        request = KVRequest(request_id=request_id, prompt=[int(t) for t in self._prompt],
                            params=params or SamplingParams(temperature=0.0), mode=mode,
                            covered_len=covered_len, lora=lora)
        try:
            self._socket.connect(endpoint)
            self._socket.send_multipart([REQUEST, encoder.encode(request)])
        except zmq.ZMQError as exc:
            self.close()
            raise KVTransferError(f"cannot reach a KV producer at {endpoint!r}: {exc}") from exc

    def expect(self, artifact: ArtifactConfig, prompt: Sequence[int], require_full: bool) -> None:
        """Check the header against `artifact` and `prompt` the moment it arrives, before any
        layer frame is decoded (`Batcher.submit` calls this). Layers are then only accepted at
        the artifact's legal sizes, whatever frame cap the socket was opened with."""
        if self.artifact is None:
            self.artifact = artifact
            self._require_full = require_full
        self._prompt = [int(t) for t in prompt]

    def _fail(self, error: KVTransferError) -> KVTransferError:
        self._error = error
        return error

    def _drain(self) -> None:
        zmq = self._zmq
        while not self._stream.ended:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[Any]) -> None:
        kind = bytes(buffer(frames[0])[:16])
        stream = self._stream
        if kind == HEADER and len(frames) == 2:
            header = decode_header(buffer(frames[1]))
            if self.artifact is not None:
                try:
                    validate_header(header, self.artifact, self._prompt,
                                    require_full=self._require_full)
                except KVTransferError:
                    raise
                except RequestError as exc:
                    raise KVTransferError(str(exc)) from None
            stream.on_header(header)
        elif kind == LAYER:
            if stream.header is None:
                raise KVTransferError(f"{stream.where}: a layer arrived before the header")
            layer = decode_layer(stream.header, frames[1:])
            stream.on_layer(layer)
            self._pending.append(layer)
        elif kind == END and len(frames) == 2:
            try:
                sent = int_decoder.decode(buffer(frames[1]))
            except msgspec.DecodeError as exc:
                raise KVTransferError(f"{stream.where}: the end marker is not a msgpack int: "
                                      f"{clip(str(exc))}") from None
            stream.on_end(sent)
        elif kind == ERROR:
            text = b"".join(bytes(buffer(f)[:MAX_ERROR_CHARS]) for f in frames[1:])
            raise KVTransferError(f"{stream.where} failed: "
                                  f"{text[:MAX_ERROR_CHARS].decode(errors='replace')}")
        else:
            raise KVTransferError(f"{stream.where}: unknown message kind {kind[:16]!r} with "
                                  f"{len(frames)} frames")

    def _watch(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self._connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and self._connected:
                self._disconnected = True

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise self._fail(KVTransferError(f"KV source for {self.endpoint} was closed"))
        try:
            self._drain()
            if not self._stream.ended:
                self._watch()
                if self._disconnected:
                    self._drain()  # frames that arrived before the connection dropped
                    if not self._stream.ended:
                        header = self._stream.header
                        got = (f"after {self._stream.count} of {header.num_layers} layers"
                               if header else "before the header")
                        raise KVTransferError(
                            f"{self._stream.where} disconnected {got} (ZeroMQ also drops a "
                            f"peer that sends a frame over max_frame_bytes="
                            f"{self.max_frame_bytes})")
        except KVTransferError as exc:
            raise self._fail(exc) from None
        except Exception as exc:
            error = KVTransferError(f"{self._stream.where}: {type(exc).__name__}: {exc}")
            raise self._fail(error) from exc
        if self.mode == "whole" and not self._stream.ended:
            return None, []
        layers = list(self._pending)
        self._pending.clear()
        return self._stream.header, layers

    def done(self) -> bool:
        return self._stream.ended and not self._pending and self._error is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(self._zmq.ZMQError):
            self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

