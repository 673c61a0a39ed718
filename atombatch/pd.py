"""Prefill/decode disaggregation: the KV payload, its checks, a producer and two transports.

Theory of operation
-------------------
A producer prefills a prompt on its own artifact and hands the decoder a `KVPayload`: a small
msgspec `KVHeader` (who, which model, how many tokens, which dtype and shapes) and one `LayerKV`
per model layer, each K and V `[kv_heads, tokens, head_dim]`. Only tokens x heads x dim cross the
wire, never blocks, so producer and decoder may have different block sizes, batch sizes, contexts
and chunk sizes; `model_identity` covers the model's math only, not the artifact.

A global layer carries positions 0..covered_len-1; a sliding layer carries the last
min(covered_len, window) tokens, oldest first: exactly what the decoder's shift buffer holds for a
sequence of that length. The decoder side (`Batcher.submit(..., kv=source)`) checks the header
with `validate_header`, each layer with `validate_layer`, and writes layers as a `KVSource` hands
them out: all at once ("whole") or as they arrive ("layer-stream").

Every transport fault becomes a `KVTransferError` (a `RequestError`) for that request alone: a
producer exception, a garbled frame, a disconnect, or a stream that ended with layers missing or
extra. Sources never read a clock: the engine owns the timeout that catches a silent producer.

The wire protocol of the ZeroMQ transport is written up in docs/pd.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.config import SLIDING, ArtifactConfig, ModelSpec
from atombatch.errors import KVTransferError, RequestError
from atombatch.sampling import sample
from atombatch.structs import SamplingParams

logger = logging.getLogger("atombatch.pd")

Mode = Literal["whole", "layer-stream"]
MODES = ("whole", "layer-stream")

# Header dtype -> the little-endian NumPy dtype of its buffers (bfloat16: raw uint16 bit patterns).
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}


def model_identity(spec: ModelSpec) -> str:
    """Stable hex digest of the model's shape and math fields (name, BOS and EOS ids excluded).

    Two runtimes with the same identity compute the same K/V for the same tokens whatever their
    artifacts (block layout, batch size, context, chunk size), so KV may move between them.
    """
    fields = msgspec.to_builtins(spec)
    for name in ("name", "bos_token_id", "eos_token_ids"):
        fields.pop(name, None)
    blob = msgspec.json.encode(fields, order="sorted")
    return hashlib.sha256(b"atombatch-pd-model/1\0" + blob).hexdigest()[:16]


class KVHeader(msgspec.Struct, frozen=True):
    """What a producer says about a payload before any K/V (a msgpack map on the wire)."""

    request_id: str                  # the producer-side request id (for logs; not matched)
    model_identity: str              # `model_identity(spec)` of the producer's model
    num_layers: int                  # model layers; one LayerKV per layer follows
    layer_kinds: tuple[str, ...]     # per layer: "full_attention" or "sliding_attention"
    prompt_len: int                  # tokens in the whole prompt
    covered_len: int                 # tokens 0..covered_len-1 whose KV is carried
    first_token: int | None          # producer's sample after the whole prompt; None if partial
    dtype: str                       # K/V element type: "float32" | "float16" | "bfloat16"
    kv_heads: int                    # K/V heads (axis 0 of every K and V)
    head_dim: int                    # K/V head dimension (axis 2)
    sliding_window: int              # sliding layers' window, 0 for a model without them
    layer_tokens: tuple[int, ...]    # per layer: covered_len (global) or min(covered_len, window)


class LayerKV(msgspec.Struct, frozen=True, eq=False):
    """One layer's K and V, each `[kv_heads, tokens, head_dim]` in the header's dtype.

    bfloat16 is carried as uint16 bit patterns (NumPy has no bfloat16); `float32()` widens exactly.
    """

    layer: int                       # model layer index, 0..num_layers-1
    k: np.ndarray                    # keys [kv_heads, tokens, head_dim]
    v: np.ndarray                    # values, same shape and dtype as k

    def float32(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """K and V as float32 (what `NumpyRuntime.write_layer_kv` stores)."""
        return _to_float32(self.k), _to_float32(self.v)

    @classmethod
    def from_float32(cls, layer: int, k: npt.ArrayLike, v: npt.ArrayLike, dtype: str) -> LayerKV:
        """Build from float32 K/V in the wire `dtype` (bfloat16: round to nearest even)."""
        return cls(layer, _from_float32(k, dtype), _from_float32(v, dtype))

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class KVPayload(msgspec.Struct, eq=False):
    """A whole transfer: the header and one `LayerKV` per layer, in layer order."""

    header: KVHeader                 # what the producer says about the layers
    layers: list[LayerKV]            # one per model layer

    def items(self) -> Iterator[KVHeader | LayerKV]:
        """The header, then the layers: what a transport sends, in order."""
        yield self.header
        yield from self.layers

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def _to_float32(x: np.ndarray) -> npt.NDArray[np.float32]:
    if x.dtype == np.uint16:  # bfloat16 bit patterns: the high half of a float32
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def _from_float32(x: npt.ArrayLike, dtype: str) -> np.ndarray:
    if dtype not in WIRE_DTYPES:
        raise RequestError(f"dtype={dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype != "bfloat16":
        return x.astype(WIRE_DTYPES[dtype])
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(np.isnan(x), quiet_nan, rounded).astype("<u2")


# -- checks (decoder side) -------------------------------------------------------------------------
def expected_layer_tokens(kinds: Sequence[str], covered_len: int, window: int) -> tuple[int, ...]:
    """Tokens each layer carries for a prefix of `covered_len` tokens."""
    return tuple(min(covered_len, window) if kind == SLIDING else covered_len for kind in kinds)


def validate_header(header: KVHeader, artifact: ArtifactConfig,
                    prompt: Sequence[int] | npt.NDArray[np.integer[Any]], *,
                    require_full: bool) -> None:
    """Check a producer's header against the decoder's artifact and the request's prompt.

    Args:
        header: what the producer sent.
        artifact: the decoder's artifact.
        prompt: the request's prompt tokens.
        require_full: the decoder's mode needs the whole prompt's KV (single-block and hybrid).
    Raises:
        RequestError: the first broken rule, naming the field, its value and the rule.
    """
    spec = artifact.model
    window = spec.sliding_window if spec.is_hybrid else 0

    def fail(field: str, value: object, rule: str) -> RequestError:
        return RequestError(f"KV header {field}={value!r}: {rule}")

    identity = model_identity(spec)
    if header.model_identity != identity:
        raise fail("model_identity", header.model_identity,
                   f"the decoder's model {spec.name} has identity {identity!r}")
    for field, mine in (("num_layers", spec.num_layers), ("layer_kinds", spec.layer_kinds),
                        ("kv_heads", spec.num_kv_heads), ("head_dim", spec.head_dim),
                        ("sliding_window", window)):
        value = getattr(header, field)
        if value != mine:
            raise fail(field, value, f"the decoder's model has {field}={mine!r}")
    if header.dtype not in WIRE_DTYPES:
        raise fail("dtype", header.dtype, f"must be one of {sorted(WIRE_DTYPES)}")
    if header.prompt_len != len(prompt):
        raise fail("prompt_len", header.prompt_len,
                   f"the request's prompt has {len(prompt)} tokens")
    if not 0 < header.covered_len <= header.prompt_len:
        raise fail("covered_len", header.covered_len,
                   f"must be in 1..prompt_len={header.prompt_len}")
    if require_full and header.covered_len < header.prompt_len:
        raise fail("covered_len", header.covered_len,
                   f"this decoder needs the full prefix of prompt_len={header.prompt_len} tokens "
                   "(single-block and hybrid PD import full prefixes only)")
    if header.covered_len == header.prompt_len:
        if header.first_token is None:
            raise fail("first_token", None, "a full-prefix payload must carry the first token")
        if not 0 <= header.first_token < spec.vocab_size:
            raise fail("first_token", header.first_token,
                       f"must be in the vocabulary 0..{spec.vocab_size - 1}")
    elif header.first_token is not None:
        raise fail("first_token", header.first_token,
                   f"must be None for a partial prefix (covered_len={header.covered_len} < "
                   f"prompt_len={header.prompt_len})")
    want = expected_layer_tokens(spec.layer_kinds, header.covered_len, window)
    if tuple(header.layer_tokens) != want:
        raise fail("layer_tokens", header.layer_tokens,
                   f"covered_len={header.covered_len} means {want} (covered_len per global "
                   f"layer, min(covered_len, window={window}) per sliding layer)")
    if header.covered_len + 1 > artifact.max_seq_len:
        raise fail("covered_len", header.covered_len,
                   f"covered_len + 1 must fit the decoder's max_seq_len={artifact.max_seq_len}")


def validate_layer(header: KVHeader, layer: LayerKV, seen: set[int]) -> None:
    """Check one layer against a validated header; on success `layer.layer` is added to `seen`.

    Raises:
        RequestError: an unknown or duplicate layer index, or K/V of the wrong shape or dtype.
    """
    index = layer.layer
    if not 0 <= index < header.num_layers:
        raise RequestError(f"KV layer={index} is outside 0..{header.num_layers - 1}")
    if index in seen:
        raise RequestError(f"KV layer={index} arrived twice")
    shape = (header.kv_heads, header.layer_tokens[index], header.head_dim)
    wire = WIRE_DTYPES[header.dtype]
    for name, x in (("k", layer.k), ("v", layer.v)):
        if not isinstance(x, np.ndarray):
            raise RequestError(f"KV layer={index} {name} is a {type(x).__name__}, not an array")
        if x.shape != shape:
            raise RequestError(f"KV layer={index} {name} has shape {x.shape}, the header says "
                               f"{shape} (kv_heads, layer_tokens[{index}], head_dim)")
        if x.dtype != wire:
            raise RequestError(f"KV layer={index} {name} has dtype {x.dtype}, header dtype="
                               f"{header.dtype!r} is carried as {wire}")
    seen.add(index)


# -- sources ---------------------------------------------------------------------------------------
class KVSource(Protocol):
    """Where the decoder gets one request's KV from; the engine polls it once per step."""

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        """Non-blocking: the header once known (the same object every call after that) and the
        layers that arrived since the previous poll (possibly none).

        Raises:
            KVTransferError: producer failure, disconnect, garbled data, or a stream that ended
                with layers missing or extra. Errors are sticky: every later poll raises again.
        """
        ...

    def done(self) -> bool:
        """The producer has said all layers are sent and poll has handed every one of them out."""
        ...

    def close(self) -> None:
        """Release resources; idempotent (the engine calls it when the request ends, any reason)."""
        ...


class _Stream:
    """Accounting shared by the sources: header first, then each layer once, then the end."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.header: KVHeader | None = None
        self.received: set[int] = set()
        self.count = 0
        self.ended = False

    def on_header(self, header: KVHeader) -> None:
        if self.header is not None:
            raise KVTransferError(f"{self.where}: a second header arrived")
        self.header = header

    def on_layer(self, layer: LayerKV) -> None:
        if self.header is None:
            raise KVTransferError(f"{self.where}: layer {layer.layer} arrived before the header")
        self.count += 1
        if self.count > self.header.num_layers:
            raise KVTransferError(f"{self.where}: layer {layer.layer} is extra, the header "
                                  f"announced num_layers={self.header.num_layers}")
        self.received.add(layer.layer)

    def on_end(self, sent: int | None = None) -> None:
        if self.header is None:
            raise KVTransferError(f"{self.where}: the stream ended before the header")
        total = self.header.num_layers
        if sent is not None and sent != self.count:
            raise KVTransferError(f"{self.where}: the producer says it sent {sent} layers, "
                                  f"{self.count} arrived")
        missing = sorted(set(range(total)) - self.received)
        if missing or self.count != total:
            raise KVTransferError(f"{self.where}: the stream ended after {self.count} of "
                                  f"num_layers={total} layers (missing {missing})")
        self.ended = True


class InProcessSource:
    """A `KVSource` over items in memory: a producer in the same process, or a test's fault list.

    Items are `KVHeader`, `LayerKV` or an `Exception` (raised from `poll` as `KVTransferError`:
    fault injection). "whole" hands out the header and every layer in one poll; "layer-stream"
    hands out the header and at most one layer per poll, so decode steps interleave with the import.
    `items` is consumed lazily (a generator producer runs on the first poll).
    """

    def __init__(self, items: Iterable[KVHeader | LayerKV | BaseException],
                 mode: Mode = "layer-stream") -> None:
        if mode not in MODES:
            raise RequestError(f"mode={mode!r} is not one of {MODES}")
        self.mode = mode
        self._items = iter(items)
        self._stream = _Stream("in-process KV source")
        self._peeked: KVHeader | LayerKV | BaseException | None = None
        self._exhausted = False
        self._error: KVTransferError | None = None
        self._closed = False
        self.polls = 0

    @classmethod
    def from_producer(cls, producer: Producer, request_id: str, prompt: Sequence[int],
                      params: SamplingParams | None = None, mode: Mode = "layer-stream",
                      covered_len: int | None = None) -> InProcessSource:
        """A source whose producer runs (prefills) on the first poll."""
        return cls(producer.stream(request_id, prompt, params, mode=mode, covered_len=covered_len),
                   mode)

    def _next(self) -> KVHeader | LayerKV | BaseException | None:
        """The next item, None when exhausted; a raising iterator counts as a producer error."""
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        if self._exhausted:
            return None
        try:
            return next(self._items)
        except StopIteration:
            self._exhausted = True
            return None
        except Exception as exc:  # the producer itself raised
            self._exhausted = True
            return exc

    def _fail(self, exc: BaseException) -> KVTransferError:
        if isinstance(exc, KVTransferError):
            error = exc
        else:
            error = KVTransferError(f"KV producer failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._error = error
        return error

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise self._fail(KVTransferError("in-process KV source was closed"))
        self.polls += 1
        stream = self._stream
        if stream.ended:
            return stream.header, []
        layers: list[LayerKV] = []
        want = None if self.mode == "whole" else 1
        try:
            while want is None or len(layers) < want:
                item = self._next()
                if item is None:
                    stream.on_end()
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, KVHeader):
                    stream.on_header(item)
                elif isinstance(item, LayerKV):
                    stream.on_layer(item)
                    layers.append(item)
                else:
                    raise KVTransferError(f"in-process KV source got a {type(item).__name__}, "
                                          "not a KVHeader or LayerKV")
            if not stream.ended and want is not None:
                # Peek so done() turns True with the last layer; a fault found here is raised
                # on the next poll, after this poll's layer was handed out.
                self._peeked = self._next()
                if self._peeked is None:
                    try:
                        stream.on_end()
                    except KVTransferError as exc:
                        self._peeked = exc
        except Exception as exc:
            error = self._fail(exc)
            raise error from error.__cause__
        if self.mode == "whole" and not stream.ended:
            return None, []
        return stream.header, layers

    def done(self) -> bool:
        return self._stream.ended and self._error is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


# -- producer --------------------------------------------------------------------------------------
class Producer:
    """Prefills prompts on its own runtime (lane/slot 0, its own blocks) and exports the KV.

    `runtime` is a `NumpyRuntime` or anything with `artifact`, `prefill(PrefillInputs)` and
    `read_layer_kv`. Calls are serialized (one prefill at a time on the runtime).
    """

    def __init__(self, runtime: Any, *, dtype: str = "float32") -> None:
        from atombatch.blocks import PrefillInputs

        if dtype not in WIRE_DTYPES:
            raise RequestError(f"dtype={dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        self.runtime = runtime
        self.artifact: ArtifactConfig = runtime.artifact
        self.spec = self.artifact.model
        self.dtype = dtype
        self.identity = model_identity(self.spec)
        self._inputs = PrefillInputs(self.artifact.prefill_chunk_size,
                                     self.artifact.blocks_per_seq)
        self._row = np.arange(self.artifact.blocks_per_seq, dtype=np.int32)
        self._lock = threading.Lock()
        self.requests = 0

    def produce(self, request_id: str, prompt: Sequence[int],
                params: SamplingParams | None = None,
                covered_len: int | None = None) -> KVPayload:
        """Prefill `prompt[:covered_len]` (default: all of it) and return the whole payload.

        Raises:
            RequestError: an empty prompt, covered_len outside 1..len(prompt), a prefix longer
                than this producer's max_seq_len, or a token outside the vocabulary.
        """
        params = params or SamplingParams(temperature=0.0)  # no params: greedy
        spec, art = self.spec, self.artifact
        tokens = np.asarray(list(prompt), dtype=np.int64)
        covered = len(tokens) if covered_len is None else int(covered_len)
        if not 0 < covered <= len(tokens):
            raise RequestError(f"covered_len={covered} is outside 1..{len(tokens)} (prompt length)")
        if covered > art.max_seq_len:
            raise RequestError(f"covered_len={covered} exceeds the producer's max_seq_len="
                               f"{art.max_seq_len}")
        if tokens.min() < 0 or tokens.max() >= spec.vocab_size:
            raise RequestError(f"prompt tokens {tokens.min()}..{tokens.max()} are outside the "
                               f"vocabulary 0..{spec.vocab_size - 1}")
        prefix = tokens[:covered]
        window = spec.sliding_window if spec.is_hybrid else 0
        with self._lock:
            self.requests += 1
            logits = None
            for start in range(0, covered, art.prefill_chunk_size):
                self._inputs.build(prefix, start, self._row, len(self._row), 0)
                logits = self.runtime.prefill(self._inputs)
            layers = []
            for i in range(spec.num_layers):
                k, v = self.runtime.read_layer_kv(i, self._row, covered)
                layers.append(LayerKV.from_float32(i, k, v, self.dtype))
        first = None
        if covered == len(tokens):
            assert logits is not None
            first = sample(logits, params, np.random.default_rng(params.seed), spec.eos_token_ids,
                           tokens)
        header = KVHeader(
            request_id=request_id, model_identity=self.identity, num_layers=spec.num_layers,
            layer_kinds=spec.layer_kinds, prompt_len=len(tokens), covered_len=covered,
            first_token=first, dtype=self.dtype, kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, sliding_window=window,
            layer_tokens=expected_layer_tokens(spec.layer_kinds, covered, window))
        return KVPayload(header, layers)

    def stream(self, request_id: str, prompt: Sequence[int],
               params: SamplingParams | None = None, mode: Mode = "layer-stream",
               covered_len: int | None = None) -> Iterator[KVHeader | LayerKV]:
        """The header, then every `LayerKV` in layer order (what a transport sends).

        The prefill runs when the first item is taken. Both modes read every layer right after the
        prefill (the runtime's KV is then free for the next request); `mode` is the pacing the
        consumer asked for, which the transports apply.
        """
        if mode not in MODES:
            raise RequestError(f"mode={mode!r} is not one of {MODES}")
        return self._stream(request_id, list(prompt), params, covered_len)

    def _stream(self, request_id: str, prompt: list[int], params: SamplingParams | None,
                covered_len: int | None) -> Iterator[KVHeader | LayerKV]:
        yield from self.produce(request_id, prompt, params, covered_len).items()


# -- ZeroMQ transport ------------------------------------------------------------------------------
# Message kinds (first frame after the ROUTER's routing id); see docs/pd.md.
REQUEST, HEADER, LAYER, END, ERROR = b"R", b"H", b"L", b"E", b"X"


class KVRequest(msgspec.Struct, frozen=True):
    """What a decoder asks a producer for (a msgpack map on the wire)."""

    request_id: str                  # the decoder's id for logs; echoed in the header
    prompt: list[int]                # the whole prompt
    params: SamplingParams = SamplingParams()  # how to sample the first token
    mode: str = "layer-stream"       # "whole" | "layer-stream" (pacing; the frames are the same)
    covered_len: int | None = None   # prefix to prefill; None = the whole prompt


_header_decoder = msgspec.msgpack.Decoder(KVHeader)
_request_decoder = msgspec.msgpack.Decoder(KVRequest)
_int_decoder = msgspec.msgpack.Decoder(int)
_encoder = msgspec.msgpack.Encoder()


def encode_header(header: KVHeader) -> bytes:
    """The header as a msgpack map (field name -> value)."""
    return _encoder.encode(header)


def decode_header(data: bytes | memoryview) -> KVHeader:
    """Parse a msgpack header. Raises KVTransferError when it is not a valid header."""
    try:
        return _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise KVTransferError(f"KV header frame is not a valid header: {exc}") from None


def layer_frames(layer: LayerKV) -> list[Any]:
    """The frames of one layer message after the kind: msgpack index, K buffer, V buffer."""
    return [_encoder.encode(layer.layer), np.ascontiguousarray(layer.k),
            np.ascontiguousarray(layer.v)]


def decode_layer(header: KVHeader, frames: Sequence[Any]) -> LayerKV:
    """Rebuild a layer from its frames (zero-copy views of the K/V buffers).

    Raises:
        KVTransferError: a wrong frame count, index or buffer size.
    """
    if len(frames) != 3:
        raise KVTransferError(f"KV layer message has {len(frames)} frames, needs 3 "
                              "(index, K, V)")
    try:
        index = _int_decoder.decode(_buffer(frames[0]))
    except msgspec.DecodeError as exc:
        raise KVTransferError(f"KV layer index frame is not a msgpack int: {exc}") from None
    if not 0 <= index < header.num_layers:
        raise KVTransferError(f"KV layer={index} is outside 0..{header.num_layers - 1}")
    wire = WIRE_DTYPES.get(header.dtype)
    if wire is None:
        raise KVTransferError(f"KV header dtype={header.dtype!r} is not one of "
                              f"{sorted(WIRE_DTYPES)}")
    shape = (header.kv_heads, header.layer_tokens[index], header.head_dim)
    expected = int(np.prod(shape)) * wire.itemsize
    arrays = []
    for name, frame in zip("kv", frames[1:], strict=True):
        buf = _buffer(frame)
        if buf.nbytes != expected:
            raise KVTransferError(f"KV layer={index} {name} buffer has {buf.nbytes} bytes, "
                                  f"shape {shape} of {header.dtype} needs {expected}")
        arrays.append(np.frombuffer(buf, dtype=wire).reshape(shape))
    return LayerKV(index, arrays[0], arrays[1])


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


class ZmqProducerServer:
    """Serves `Producer` requests on a ZeroMQ ROUTER socket, one request at a time.

    Each request is a `[b"R", msgpack KVRequest]` message from a DEALER; the reply is a header
    message, one message per layer, and an end marker, or an error message (docs/pd.md).

    Args:
        producer: the producer to run.
        endpoint: where to bind, e.g. "tcp://127.0.0.1:5557" or "ipc:///tmp/pd.sock".
        layer_delay: seconds to sleep before each layer (tests: a slow producer).
        fail_at_layer: raise before sending this layer (tests: a producer failing mid-stream).
    """

    def __init__(self, producer: Producer, endpoint: str, *, context: Any = None,
                 layer_delay: float = 0.0, fail_at_layer: int | None = None) -> None:
        import zmq

        self.producer = producer
        self.endpoint = endpoint
        self.layer_delay = layer_delay
        self.fail_at_layer = fail_at_layer
        self._zmq = zmq
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone decoder raises, not drops
        self._socket.bind(endpoint)
        self.last_endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._serving = False
        self.served = 0

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Serve until `close()` (from any thread) or the process ends."""
        self._serving = True
        try:
            while not self._stop.is_set():
                if self._socket.poll(int(poll_interval * 1000)):
                    self.serve_one()
        finally:
            self._socket.close()

    def serve_one(self) -> None:
        """Receive one request (blocking) and send its whole reply."""
        zmq = self._zmq
        frames = self._socket.recv_multipart()
        peer, body = frames[0], frames[1:]
        try:
            if len(body) != 2 or body[0] != REQUEST:
                raise KVTransferError(f"expected a [{REQUEST!r}, request] message, got "
                                      f"{len(body)} frames")
            try:
                request = _request_decoder.decode(body[1])
            except msgspec.DecodeError as exc:
                raise KVTransferError(f"the request is not a valid KVRequest: {exc}") from None
            self.served += 1
            sent = 0
            for item in self.producer.stream(request.request_id, request.prompt, request.params,
                                             mode="layer-stream" if request.mode != "whole"
                                             else "whole", covered_len=request.covered_len):
                if isinstance(item, KVHeader):
                    self._socket.send_multipart([peer, HEADER, encode_header(item)])
                    continue
                if self.layer_delay:
                    time.sleep(self.layer_delay)
                if self.fail_at_layer is not None and item.layer == self.fail_at_layer:
                    raise RuntimeError(f"injected producer failure at layer {item.layer}")
                self._socket.send_multipart([peer, LAYER, *layer_frames(item)], copy=False)
                sent += 1
            self._socket.send_multipart([peer, END, _encoder.encode(sent)])
        except zmq.ZMQError as exc:  # the decoder went away (EHOSTUNREACH): drop its request
            logger.warning("pd.peer_gone", extra={"error": str(exc)})
        except Exception as exc:
            logger.warning("pd.producer_failed", extra={"error": repr(exc)})
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart([peer, ERROR,
                                             f"{type(exc).__name__}: {exc}".encode()])

    def close(self) -> None:
        """Stop `serve_forever` (it closes the socket), or close the socket if not serving."""
        self._stop.set()
        if not self._serving:
            self._socket.close()


def run_producer_process(spec_or_checkpoint: ModelSpec | str, artifact_kwargs: dict[str, Any],
                         seed: int, endpoint: str, *, dtype: str = "float32",
                         layer_delay: float = 0.0, fail_at_layer: int | None = None) -> None:
    """A `multiprocessing` (spawn) target: build a NumpyRuntime producer and serve forever.

    Args:
        spec_or_checkpoint: a `ModelSpec` (random weights from `seed`) or a Hugging Face
            checkpoint directory (`NumpyRuntime.from_pretrained`).
        artifact_kwargs: `ArtifactConfig` fields besides `model` (the producer's own layout).
        seed: the random weights' seed (ignored for a checkpoint).
        endpoint: where to bind the ROUTER socket.
    """
    from atombatch.runtime.numpy_runtime import NumpyRuntime

    if isinstance(spec_or_checkpoint, ModelSpec):
        runtime = NumpyRuntime.random(ArtifactConfig(model=spec_or_checkpoint, **artifact_kwargs),
                                      seed)
    else:
        spec = ModelSpec.from_pretrained(spec_or_checkpoint)
        runtime = NumpyRuntime.from_pretrained(
            spec_or_checkpoint, ArtifactConfig(model=spec, **artifact_kwargs))
    server = ZmqProducerServer(Producer(runtime, dtype=dtype), endpoint,
                               layer_delay=layer_delay, fail_at_layer=fail_at_layer)
    server.serve_forever()


class ZmqSource:
    """A `KVSource` that asks a `ZmqProducerServer` (or any producer speaking docs/pd.md).

    The request is sent on construction from a DEALER socket of its own. `poll` reads with
    `zmq.NOBLOCK`; K/V arrive as zero-copy frames viewed with `np.frombuffer`.

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
                 heartbeat_ivl: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        import zmq

        if mode not in MODES:
            raise RequestError(f"mode={mode!r} is not one of {MODES}")
        self._zmq = zmq
        self.endpoint = endpoint
        self.mode = mode
        self._stream = _Stream(f"KV producer at {endpoint}")
        self._pending: deque[LayerKV] = deque()
        self._error: KVTransferError | None = None
        self._closed = False
        self._connected = False
        self._disconnected = False
        context = context or zmq.Context.instance()
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        request = KVRequest(request_id=request_id, prompt=[int(t) for t in prompt],
                            params=params or SamplingParams(temperature=0.0), mode=mode,
                            covered_len=covered_len)
        try:
            self._socket.connect(endpoint)
            self._socket.send_multipart([REQUEST, _encoder.encode(request)])
        except zmq.ZMQError as exc:
            self.close()
            raise KVTransferError(f"cannot reach a KV producer at {endpoint!r}: {exc}") from exc

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
        kind = bytes(_buffer(frames[0]))
        stream = self._stream
        if kind == HEADER and len(frames) == 2:
            stream.on_header(decode_header(_buffer(frames[1])))
        elif kind == LAYER:
            if stream.header is None:
                raise KVTransferError(f"{stream.where}: a layer arrived before the header")
            layer = decode_layer(stream.header, frames[1:])
            stream.on_layer(layer)
            self._pending.append(layer)
        elif kind == END and len(frames) == 2:
            try:
                sent = _int_decoder.decode(_buffer(frames[1]))
            except msgspec.DecodeError as exc:
                raise KVTransferError(f"{stream.where}: the end marker is not a msgpack int: "
                                      f"{exc}") from None
            stream.on_end(sent)
        elif kind == ERROR:
            text = b"".join(bytes(_buffer(f)) for f in frames[1:]).decode(errors="replace")
            raise KVTransferError(f"{stream.where} failed: {text}")
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
                        raise KVTransferError(f"{self._stream.where} disconnected {got}")
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
