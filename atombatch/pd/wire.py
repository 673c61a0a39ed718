"""The PD wire format: header, layers and payload, the frame codec, and the bounds a frame must meet.

Everything a peer controls is bounded here before anything is allocated from it:

- `check_header` bounds every header field by itself (layer count, head counts, token counts,
  string lengths) as soon as a header is decoded, so no later code builds a range, a set or a
  message from an absurd `num_layers`; `atombatch.pd.checks.validate_header` then matches it
  against the decoder's artifact.
- `decode_layer` accepts a K or V buffer only when its byte length is exactly what the header says,
  and views it in place (`np.frombuffer`): a layer costs the frame ZeroMQ already received.
- `max_layer_frame_bytes(artifact)` is the largest K or V buffer an artifact can legally receive
  (a full context of float32); the ZeroMQ transport sets it as `ZMQ_MAXMSGSIZE`, so a larger frame
  drops the connection before it is buffered.

The message layout is written up in docs/pd.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.structs import SamplingParams
from atombatch.artifact import kv_dtype as kv_types
from atombatch.artifact.config import SLIDING, ArtifactConfig, ModelSpec
from atombatch.errors import KVTransferError, RequestError

Mode = Literal["whole", "layer-stream"]
MODES = ("whole", "layer-stream")

# Header dtype -> the little-endian NumPy dtype of its buffers (bfloat16 and float8_e4m3fn: raw
# uint16 and uint8 bit patterns): the KV dtypes' host representations.
WIRE_DTYPES: dict[str, np.dtype[Any]] = dict(kv_types.HOST_DTYPES)


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
    dtype: str                       # K/V element type: "float32" | "float16" | "bfloat16" |
                                     # "float8_e4m3fn"
    kv_heads: int                    # K/V heads (axis 0 of every K and V)
    head_dim: int                    # K/V head dimension (axis 2)
    sliding_window: int              # sliding layers' window, 0 for a model without them
    layer_tokens: tuple[int, ...]    # per layer: covered_len (global) or min(covered_len, window)
    # the LoRA adapter the prefill ran under (`LoraAdapter.identity`, a digest of its config and
    # weights); "" for the base model. The decoder refuses a header whose adapter is not the
    # request's (docs/pd.md)
    lora_identity: str = ""


class LayerKV(msgspec.Struct, frozen=True, eq=False):
    """One layer's K and V, each `[kv_heads, tokens, head_dim]` in the header's dtype.

    bfloat16 and float8_e4m3fn are carried as uint16 and uint8 bit patterns (NumPy has neither);
    `float32()` widens exactly.
    """

    layer: int                       # model layer index, 0..num_layers-1
    k: np.ndarray                    # keys [kv_heads, tokens, head_dim]
    v: np.ndarray                    # values, same shape and dtype as k

    def float32(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """K and V as float32 (what `NumpyRuntime.write_layer_kv` stores)."""
        return _to_float32(self.k), _to_float32(self.v)

    @classmethod
    def from_float32(cls, layer: int, k: npt.ArrayLike, v: npt.ArrayLike, dtype: str) -> LayerKV:
        """Build from float32 K/V in the wire `dtype` (bfloat16, float8_e4m3fn: round to nearest
        even; float8 saturates at +-448)."""
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
        return kv_types.decode(x, "bfloat16")
    if x.dtype == np.uint8:   # float8_e4m3fn bit patterns
        return kv_types.decode(x, kv_types.FLOAT8)
    return np.asarray(x, dtype=np.float32)


def _from_float32(x: npt.ArrayLike, dtype: str) -> np.ndarray:
    if dtype not in WIRE_DTYPES:
        raise RequestError(f"dtype={dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    return kv_types.encode(x, dtype)


def expected_layer_tokens(kinds: Sequence[str], covered_len: int, window: int) -> tuple[int, ...]:
    """Tokens each layer carries for a prefix of `covered_len` tokens."""
    return tuple(min(covered_len, window) if kind == SLIDING else covered_len for kind in kinds)


# -- bounds on what a peer may announce ------------------------------------------------------------
MAX_LAYERS = 1024              # model layers (the largest open models have ~128)
MAX_HEAD_COUNT = 4096          # kv_heads
MAX_HEAD_DIM = 4096            # head_dim
MAX_TOKENS = 1 << 24           # prompt_len, covered_len, layer_tokens, sliding_window
MAX_ID_CHARS = 256             # request_id, model_identity, dtype, layer kind strings
MAX_ERROR_CHARS = 4096         # producer error text kept in a request's error
# Frame cap when no artifact is known (the ZeroMQ source without `artifact=`): one K or V buffer.
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
# Small frames (header, request, end, error) are never capped below this.
MIN_FRAME_BYTES = 64 * 1024


def max_layer_frame_bytes(artifact: ArtifactConfig) -> int:
    """The largest legal K or V buffer for `artifact`: a full context in the widest wire dtype."""
    spec = artifact.model
    widest = max(dtype.itemsize for dtype in WIRE_DTYPES.values())
    return max(MIN_FRAME_BYTES, spec.num_kv_heads * artifact.max_seq_len * spec.head_dim * widest)


def max_request_frame_bytes(artifact: ArtifactConfig) -> int:
    """The largest legal `KVRequest` frame for a producer's artifact (msgpack ints <= 9 bytes)."""
    return MIN_FRAME_BYTES + 9 * artifact.max_seq_len


def check_header(header: KVHeader, where: str = "KV header") -> None:
    """Bound every field of a header by itself, before anything is built from it.

    Raises:
        KVTransferError: naming the field, its value (clipped) and the bound.
    """
    def fail(field: str, value: object, rule: str) -> KVTransferError:
        return KVTransferError(f"{where} {field}={clip(repr(value))}: {rule}")

    for field in ("request_id", "model_identity", "dtype", "lora_identity"):
        value = getattr(header, field)
        if len(value) > MAX_ID_CHARS:
            raise fail(field, value, f"longer than {MAX_ID_CHARS} characters")
    if not 1 <= header.num_layers <= MAX_LAYERS:
        raise fail("num_layers", header.num_layers, f"must be in 1..{MAX_LAYERS}")
    for field in ("layer_kinds", "layer_tokens"):
        value = getattr(header, field)
        if len(value) != header.num_layers:
            raise fail(field, f"<{len(value)} entries>",
                       f"needs one entry per layer (num_layers={header.num_layers})")
    if any(len(kind) > MAX_ID_CHARS for kind in header.layer_kinds):
        raise fail("layer_kinds", "<...>", f"an entry is longer than {MAX_ID_CHARS} characters")
    for field, bound in (("kv_heads", MAX_HEAD_COUNT), ("head_dim", MAX_HEAD_DIM)):
        value = getattr(header, field)
        if not 1 <= value <= bound:
            raise fail(field, value, f"must be in 1..{bound}")
    for field in ("prompt_len", "covered_len", "sliding_window"):
        value = getattr(header, field)
        if not 0 <= value <= MAX_TOKENS:
            raise fail(field, value, f"must be in 0..{MAX_TOKENS}")
    if any(not 0 <= n <= MAX_TOKENS for n in header.layer_tokens):
        raise fail("layer_tokens", "<...>", f"an entry is outside 0..{MAX_TOKENS}")


def clip(text: str, limit: int = 80) -> str:
    """`text`, cut to `limit` characters with a marker (peer-supplied text in messages)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# -- frames ----------------------------------------------------------------------------------------
# Message kinds (first frame after the ROUTER's routing id); see docs/pd.md.
REQUEST, HEADER, LAYER, END, ERROR = b"R", b"H", b"L", b"E", b"X"


class KVRequest(msgspec.Struct, frozen=True):
    """What a decoder asks a producer for (a msgpack map on the wire)."""

    request_id: str                  # the decoder's id for logs; echoed in the header
    prompt: list[int]                # the whole prompt
    params: SamplingParams = SamplingParams()  # how to sample the first token
    mode: str = "layer-stream"       # "whole" | "layer-stream" (pacing; the frames are the same)
    covered_len: int | None = None   # prefix to prefill; None = the whole prompt
    lora: str | None = None          # the LoRA adapter to prefill under, by name (None: the base)


_header_decoder = msgspec.msgpack.Decoder(KVHeader)
request_decoder = msgspec.msgpack.Decoder(KVRequest)
int_decoder = msgspec.msgpack.Decoder(int)
encoder = msgspec.msgpack.Encoder()


def encode_header(header: KVHeader) -> bytes:
    """The header as a msgpack map (field name -> value)."""
    return encoder.encode(header)


def decode_header(data: bytes | memoryview) -> KVHeader:
    """Parse a msgpack header and bound its fields (`check_header`).

    Raises:
        KVTransferError: not a valid header, or a field past its bound.
    """
    try:
        header = _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise KVTransferError(f"KV header frame is not a valid header: {clip(str(exc))}") from None
    check_header(header)
    return header


def layer_frames(layer: LayerKV) -> list[Any]:
    """The frames of one layer message after the kind: msgpack index, K buffer, V buffer."""
    return [encoder.encode(layer.layer), np.ascontiguousarray(layer.k),
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
        index = int_decoder.decode(buffer(frames[0]))
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
        buf = buffer(frame)
        if buf.nbytes != expected:
            raise KVTransferError(f"KV layer={index} {name} buffer has {buf.nbytes} bytes, "
                                  f"shape {shape} of {header.dtype} needs {expected}")
        arrays.append(np.frombuffer(buf, dtype=wire).reshape(shape))
    return LayerKV(index, arrays[0], arrays[1])


def buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
