"""The scheduler's records: a request and its states, a step's plan, the trace and the counters.

These are data: the scheduler (`atombatch.engine.scheduler`, who runs) and the KV manager
(`atombatch.engine.kv_manager`, which blocks and rows) both read and write them.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Container, Iterable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.reports import EngineCounters
from atombatch.api.structs import FinishReason, SamplingParams
from atombatch.api.structs import stop_ids as stop_ids  # its old home (tests, embedders)
from atombatch.errors import StateError
from atombatch.kernel.prefix import Entry, TokenChain


def output_limit(prompt_len: int, params: SamplingParams, max_seq_len: int) -> int:
    """Tokens a request may generate: prompt + `max_tokens` capped at `max_seq_len`, and
    `max_tokens=None` meaning up to the context end. The one place the limit is resolved
    (`Request.max_tokens` holds it, as vLLM's `Request.max_tokens` does)."""
    room = max_seq_len - prompt_len
    return room if params.max_tokens is None else min(params.max_tokens, room)


def check_stop(request: Request, token: int, eos_token_ids: Iterable[int], *,
               stop_string: bool = False) -> FinishReason | None:
    """The stop rule, once `token` is the last of `request.output` (vLLM's `check_stop`).

    In order: a stop string that the detokenized text matched with this token (`stop_string`)
    or one of the request's stop ids (`Request.stops`: `stop_token_ids`, and EOS unless
    `ignore_eos`; resolved once with `eos_token_ids` if the request has not been yet) gives
    "stop"; otherwise the output reaching the resolved limit (`request.max_tokens`) gives
    "length"; otherwise None. A stop string so wins over the limit on the same token (as in
    vLLM). The decode-step kernel (`StepKernel.complete`) applies the same rule in C to
    `request.stop_ids`, with `request.max_tokens` as its limit (`tests/blocks/test_stop_rule.py`
    compares the two).
    """
    stops = request.stops
    if stops is None:  # a request outside a scheduler (the scheduler resolves on `add`)
        stops = request.resolve_stops(eos_token_ids)
    if stop_string or token in stops:
        return "stop"
    if len(request.output) >= request.max_tokens:
        return "length"
    return None


class RequestState(enum.Enum):
    WAITING = "waiting"        # queued: no lane, no blocks
    STAGING = "staging"        # no lane; prefilling into the spare (STAGED blocks)
    STAGED = "staged"          # no lane; prefill done, first token out, waiting for a lane
    PREFILLING = "prefilling"  # has a lane; prefill chunks in progress
    DECODING = "decoding"      # has a lane; one token per decode step
    FINISHED = "finished"      # terminal


S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.PREFILLING, S.STAGING, S.FINISHED}),
    S.STAGING: frozenset({S.STAGED, S.PREFILLING, S.WAITING, S.FINISHED}),
    S.STAGED: frozenset({S.DECODING, S.FINISHED}),
    S.PREFILLING: frozenset({S.DECODING, S.WAITING, S.FINISHED}),
    S.DECODING: frozenset({S.WAITING, S.FINISHED}),
    S.FINISHED: frozenset(),
}


class PDImport:
    """Progress of a request's KV import; the engine fills in what the producer sent."""

    __slots__ = ("covered_len", "done_layers", "first_token", "header_ok", "num_layers", "pending")

    def __init__(self) -> None:
        self.header_ok = False          # the header arrived and matched the artifact
        self.covered_len = 0            # prompt tokens whose KV the producer sends
        self.first_token: int | None = None  # the producer's sample after the whole prompt
        self.num_layers = 0             # layers to import
        self.done_layers = 0            # layers written into the request's blocks
        self.pending = 0                # layers arrived, not yet written

    @property
    def complete(self) -> bool:
        return self.header_ok and self.done_layers == self.num_layers


class Request:
    """The scheduler's mutable record of one request."""

    __slots__ = ("admit_order", "admitted_at", "arrival", "blocks", "cached_tokens", "chain",
                 "compiling", "error", "error_param",
                 "finish_reason", "first_token_at", "lane", "lane_flags", "max_tokens", "output",
                 "params", "pd", "preemptions", "prefill_pos", "prompt", "request_id", "rng",
                 "shared", "state", "stop_ids", "stops", "token_times")

    def __init__(self, request_id: str, prompt: npt.NDArray[np.int64], params: SamplingParams,
                 arrival: float, rng: np.random.Generator | None, max_seq_len: int | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        # its stop ids (`stop_ids`: stop_token_ids, and EOS unless ignore_eos), resolved once for
        # the model (`resolve_stops`, by the scheduler on `add`): the kernel's bind, the sampler
        # and `check_stop` read them; `stops` is the set form the stop rule tests every token
        # against (a client sends up to MAX_LIST_ITEMS)
        self.stop_ids: tuple[int, ...] = ()
        self.stops: Container[int] | None = None
        # tokens it may generate, resolved once (`output_limit`) for the artifact's context:
        # every limit check reads this. Without `max_seq_len` the scheduler resolves it when the
        # request is added (`resolve_limit`); -1 until then
        self.max_tokens = -1
        if max_seq_len is not None:
            self.resolve_limit(max_seq_len)
        self.arrival = arrival
        self.rng = rng
        self.state = S.WAITING
        self.lane = -1
        self.blocks: list[int] = []      # STAGED blocks while staging (lane blocks live in LaneTable)
        # int64 and float64 arrays: the decode kernel appends to them in C, without a Python
        # object per token
        self.output: array[int] = array("q")
        self.prefill_pos = 0             # positions of `prefill_tokens` already written
        self.admit_order = -1
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.token_times: array[float] = array("d")
        self.preemptions = 0
        self.cached_tokens = -1          # prompt tokens its first prefix-cache lookup saved (-1:
                                         #   not looked up; vLLM's `num_cached_tokens`)
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # the request field whose value failed it (its
                                             #   structured-output constraint), else None
        self.pd: PDImport | None = None  # set for a request whose KV a producer sends
        self.shared = 0                  # leading row entries that are pinned CACHED blocks
        self.chain: TokenChain | None = None  # prefix cache: its tokens' block digests
        self.lane_flags = 0              # StepKernel flags: LANE_SAMPLE, LANE_OWN_OUTPUT
        self.compiling = False           # its structured-output grammar is still compiling

    def resolve_stops(self, eos_token_ids: Iterable[int]) -> Container[int]:
        """Fix the request's stop ids for a model with these EOS ids (once); returns `stops`."""
        if self.stops is None:
            self.stop_ids = stop_ids(self.params, eos_token_ids)
            self.stops = frozenset(self.stop_ids) if len(self.stop_ids) > 8 else self.stop_ids
        return self.stops

    def resolve_limit(self, max_seq_len: int) -> None:
        """Fix `max_tokens` for a context of `max_seq_len` positions (once)."""
        if self.max_tokens < 0:
            self.max_tokens = output_limit(len(self.prompt), self.params, max_seq_len)

    @property
    def ready(self) -> bool:
        """Admissible: its grammar (if any) compiled, and native or a PD request whose header
        has been validated."""
        return not self.compiling and (self.pd is None or self.pd.header_ok)

    @property
    def importing(self) -> bool:
        return self.pd is not None and not self.pd.complete

    def set_state(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise StateError(f"request {self.request_id}: illegal transition "
                             f"{self.state.value} -> {new.value}")
        self.state = new

    @property
    def prefill_tokens(self) -> npt.NDArray[np.int64]:
        """What a (re)prefill must write: the prompt, plus all but the last generated token."""
        if len(self.output) <= 1:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output[:-1], dtype=np.int64)])

    @property
    def recomputing(self) -> bool:
        """A preempted request whose next token is already known (no sampling after prefill)."""
        return len(self.output) > 0


class StepPlan(msgspec.Struct):
    """One device call, decided by the scheduler, executed by the engine."""

    kind: str                                # "prefill" | "decode" | "import"
    inputs: Any                              # PrefillInputs or DecodeInputs, filled in place
    request_id: str = ""                     # prefill: the request whose chunk this is
    chunk_start: int = 0                     # prefill: first position of the chunk
    chunk_len: int = 0                       # prefill: real tokens in the chunk
    last_chunk: bool = False                 # prefill: the chunk ends the prompt (sample after it)
    staged: bool = False                     # prefill: into the spare (no lane yet)
    rows: int = 0                            # decode: rows 0..rows-1 of the bucket decode (their
                                             #   lanes are `inputs.row_lanes`); the rest is padding
    blocks: tuple[int, ...] = ()             # import: the request's block row (positions 0..)
    slot: int = 0                            # import: its sliding slot (hybrid)
    saves: tuple[Entry, ...] = ()            # first: copy these evicted blocks to the host cache
    restores: tuple[tuple[int, Any, str], ...] = ()  # then: write host data into a block
                                                     #   (block, data, for request id)
    copies: tuple[tuple[int, int, str], ...] = ()    # then: copy_block(src, dst, for request id)
    # hybrid prefix cache (`atombatch.engine.checkpoints`): read lanes' sliding slots into checkpoints
    # (lane, checkpoint), before the restores (lane, checkpoint, for request id)
    slot_saves: tuple[tuple[int, Any], ...] = ()
    slot_restores: tuple[tuple[int, Any, str], ...] = ()


class StepRecord(msgspec.Struct, frozen=True):
    """A compact trace entry: what each step ran (compared across runtimes)."""

    kind: str                                # "prefill" | "decode" | "import"
    lanes: int                               # decode: decoding lanes; prefill: 1
    request_id: str = ""                     # prefill: whose chunk
    rows: int = 0                            # decode: rows of the compiled batch that ran


# Upper bounds of the tokens-per-device-call histogram (`Counters.iteration_tokens`): vLLM's
# `vllm:iteration_tokens_total` buckets (vllm/v1/metrics/buckets.py)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Counters(EngineCounters):
    """The engine's counters as the scheduler counts them (`EngineCounters`, named there once;
    the lists mutable here)."""

    lane_histogram: list[int] = msgspec.field(default_factory=list)  # decode steps by busy lanes
    iteration_tokens: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        """Every counter by its name, frozen (lists as tuples, dicts copied): `Batcher.stats()`
        puts them into `EngineStats` under the same names, so a counter is listed here once."""
        return {name: tuple(value) if isinstance(value, list) else
                dict(value) if isinstance(value, dict) else value
                for name in self.__struct_fields__ for value in (getattr(self, name),)}
