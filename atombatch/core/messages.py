"""What the front and the engine core say to each other (msgpack, one message per frame).

Front to core: `Submit` (a validated request), `Abort` (ids), `Shutdown` (and, to a shared core,
`Hello` and `Consumed`). Core to front: `Ready`
(or `Failed`) once at startup (a core shared by several fronts answers each front's `Hello`
with it instead: atombatch/core/shared.py), then one `Step` per engine step that produced anything, and
`Stopped` last. A `Step` carries the step's plain decode tokens (requests that are simply decoding
on) as two parallel values, `ids` and the int64 bytes of `tokens`, and every other output (first
tokens, finishes, errors, logprobs, n > 1 choices, text of stop-string requests) as a
`RequestOutput`.

With PD (atombatch/core/pd.py) the front also sends `Producers` (the producer registry) and
`ProducerVerdicts` (liveness), and the core's stats carry `PDStats`; a front that routes (the Ray
replicas) sends `SummaryRequest` and gets one `Summary` back (atombatch/core/routing.py).
"""

from __future__ import annotations

import msgspec

from atombatch.api.reports import CacheSummary, EngineStats, ProducerState
from atombatch.api.structs import RequestOutput, SamplingParams
from atombatch.api.validation import RequestRules


class Submit(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt: bytes                  # int64 token ids, native byte order (validated by the front)
    params: SamplingParams
    pd: bool = False               # take the prompt's KV from a PD producer (the front checked
                                   #   `pd_eligible`); the core prefills itself with none up
    lora: str | None = None        # the LoRA adapter it runs under, by name (None: the base)


class Hello(msgspec.Struct, frozen=True, tag=True):
    """A front of a shared core (`--api-server-count N`) says it is up: the core answers `Ready`
    (sent again until it does), watches `pid` and aborts the front's requests when it exits."""
    front: int                     # its index among the core's fronts, 0..N-1
    pid: int


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class Consumed(msgspec.Struct, frozen=True, tag=True):
    """A front of a shared core has read `count` of the core's messages since its `Ready` (sent
    every `ACK_EVERY` messages read, or on a read `ACK_INTERVAL` after the last one: the core
    compares it with what it sent to find a front that stopped reading, core/process.py)."""
    count: int


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    drain: bool                    # let in-flight requests finish first, else abort them


class Ready(msgspec.Struct, frozen=True, tag=True, array_like=True):
    rules: RequestRules            # what the front validates requests against
    policy: str                    # the scheduling policy's label
    max_waiting: int | None
    stats: EngineStats
    pid: int
    frozen: int = 0                # objects the core moved out of the collector's reach at start
    loras: list[str] = []          # the LoRA adapters requests may name (docs/lora.md)


class Failed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    error: str                     # why the engine could not be built
    config: bool                   # a ConfigError (the operator's to fix), not a crash


class Step(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    # one per engine step: array-like (no field names on the wire; what the core sends is what
    # the front decodes, the same code on both sides) and out of the collector's reach (it holds
    # lists and bytes, never a cycle)
    ids: list[str]                 # request id of each plain token
    tokens: bytes                  # int64, one per id
    outputs: list[RequestOutput]
    stats: EngineStats | None = None   # sent at most every STATS_INTERVAL seconds
    pd: PDStats | None = None          # the core's producer pool, with every `stats` (PD only)


class Stopped(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


# -- PD and routing (atombatch/core/pd.py, atombatch/core/routing.py) --------------------------------
class Producers(msgspec.Struct, frozen=True, tag=True):
    registry: dict[str, str]       # name -> ZeroMQ endpoint: the pool becomes exactly these


class Verdict(msgspec.Struct, frozen=True):
    name: str
    endpoint: str                  # the endpoint the front tested (a rejoined name is not hit)
    alive: bool                    # False: removed from the pool for good (at this endpoint)


class ProducerVerdicts(msgspec.Struct, frozen=True, tag=True):
    verdicts: list[Verdict]        # the front's liveness test of the pool's producers


class PDStats(msgspec.Struct, frozen=True):
    producers: list[ProducerState]  # the pool as the core sees it
    native_fallbacks: int           # PD requests the core prefilled itself: no producer was up


class SummaryRequest(msgspec.Struct, frozen=True, tag=True):
    route_block: int               # as `CacheSummarizer`'s arguments (checked there)
    max_blocks: int
    bits: int


class LoadLora(msgspec.Struct, frozen=True, tag=True):
    """Load a PEFT adapter directory under a name (`Batcher.load_lora`, read off the core's
    loop); answered by one `LoraDone` with the same `seq`."""
    seq: int                       # the front's number for the answer
    name: str
    path: str
    # the front's --max-cpu-loras: refused when that many adapters are loaded (None: no cap);
    # checked by the core, which sees every front's loads
    max_loaded: int | None = None


class UnloadLora(msgspec.Struct, frozen=True, tag=True):
    """Unload an adapter no request uses (`Batcher.unload_lora`); answered by a `LoraDone`."""
    seq: int
    name: str


class LoraDone(msgspec.Struct, frozen=True, tag=True, array_like=True):
    seq: int                       # the `LoadLora` / `UnloadLora` answered
    error: str | None              # why it was refused (None: done)
    config: bool                   # the refusal is the adapter's or runtime's (ConfigError)
    loras: list[str]               # the adapters loaded now


class Summary(msgspec.Struct, frozen=True, tag=True, array_like=True):
    summary: CacheSummary | None   # None: the engine has no prefix cache (or the request was bad)


# The core's messages are array-like (a union of tagged structs must be all array-like or none):
# msgpack arrays led by the tag, their fields by position.
FrontMessage = Submit | Abort | Consumed | Shutdown | Hello | Producers | ProducerVerdicts | \
    SummaryRequest | LoadLora | UnloadLora
CoreMessage = Ready | Failed | Step | Stopped | Summary | LoraDone

front_encoder = msgspec.msgpack.Encoder()
front_decoder = msgspec.msgpack.Decoder(FrontMessage)
core_encoder = msgspec.msgpack.Encoder()
core_decoder = msgspec.msgpack.Decoder(CoreMessage)
