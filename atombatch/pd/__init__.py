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

The package is split the way the bounds are (each bound sits next to the code it guards):

- `wire`: header, layers, payload, the frame codec and the field bounds of a header;
- `checks`: a header against the decoder's artifact and prompt, a layer against its header;
- `producer`: prefill and export;
- `source`: the `KVSource` protocol, stream accounting and the in-process source;
- `zmq_transport`: the ZeroMQ producer server and source, with frame, queue and send bounds;
- `pool`: a decoder's producers, picked by load, a failed one suspect (`ProducerPool`).

The engine's side (polling sources, writing layers) is atombatch/engine/pd_intake.py; the engine
core's wiring (the pool in the core, probes, registry messages) atombatch/core/pd.py.

The wire protocol is written up in docs/pd.md, the threat model in docs/security.md.
"""

from atombatch.errors import KVTransferError
from atombatch.pd.checks import validate_header, validate_layer
from atombatch.pd.pool import ProducerPool
from atombatch.pd.producer import Producer
from atombatch.pd.source import InProcessSource, KVSource, LayerStream
from atombatch.pd.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    END,
    ERROR,
    HEADER,
    LAYER,
    MAX_LAYERS,
    MODES,
    REQUEST,
    WIRE_DTYPES,
    KVHeader,
    KVPayload,
    KVRequest,
    LayerKV,
    Mode,
    check_header,
    decode_header,
    decode_layer,
    encode_header,
    expected_layer_tokens,
    layer_frames,
    max_layer_frame_bytes,
    max_request_frame_bytes,
    model_identity,
)
from atombatch.pd.zmq_transport import (
    DEFAULT_MAX_QUEUED_BYTES,
    ZmqProducerServer,
    ZmqSource,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_MAX_QUEUED_BYTES", "END", "ERROR", "HEADER", "LAYER",
    "MAX_LAYERS", "MODES", "REQUEST", "WIRE_DTYPES", "InProcessSource", "KVHeader", "KVPayload",
    "KVRequest", "KVSource", "KVTransferError", "LayerKV", "LayerStream", "Mode", "Producer",
    "ProducerPool",
    "ZmqProducerServer", "ZmqSource", "check_header", "decode_header", "decode_layer",
    "encode_header", "expected_layer_tokens", "layer_frames", "max_layer_frame_bytes",
    "max_request_frame_bytes", "model_identity", "validate_header",
    "validate_layer",
]
