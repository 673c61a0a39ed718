"""What the front and the engine core say to each other (msgpack, one message per frame).

Front to core: `Submit` (a validated request), `Abort` (ids), `Shutdown`. Core to front: `Ready`
(or `Failed`) once at startup, then one `Step` per engine step that produced anything, and
`Stopped` last. A `Step` carries the step's plain decode tokens (requests that are simply decoding
on) as two parallel values, `ids` and the int64 bytes of `tokens`, and every other output (first
tokens, finishes, errors, logprobs, n > 1 choices, text of stop-string requests) as a
`RequestOutput`.
"""

from __future__ import annotations

import msgspec

from atombatch.engine import EngineStats
from atombatch.structs import RequestOutput, SamplingParams
from atombatch.validation import RequestRules


class Submit(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt: bytes                  # int64 token ids, native byte order (validated by the front)
    params: SamplingParams


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    drain: bool                    # let in-flight requests finish first, else abort them


class Ready(msgspec.Struct, frozen=True, tag=True):
    rules: RequestRules            # what the front validates requests against
    policy: str                    # the scheduling policy's label
    max_waiting: int | None
    stats: EngineStats
    pid: int


class Failed(msgspec.Struct, frozen=True, tag=True):
    error: str                     # why the engine could not be built
    config: bool                   # a ConfigError (the operator's to fix), not a crash


class Step(msgspec.Struct, frozen=True, tag=True):
    ids: list[str]                 # request id of each plain token
    tokens: bytes                  # int64, one per id
    outputs: list[RequestOutput]
    stats: EngineStats | None = None   # sent at most every STATS_INTERVAL seconds


class Stopped(msgspec.Struct, frozen=True, tag=True):
    pass


FrontMessage = Submit | Abort | Shutdown
CoreMessage = Ready | Failed | Step | Stopped

front_encoder = msgspec.msgpack.Encoder()
front_decoder = msgspec.msgpack.Decoder(FrontMessage)
core_encoder = msgspec.msgpack.Encoder()
core_decoder = msgspec.msgpack.Decoder(CoreMessage)
