"""Value types that cross the public API: sampling parameters, streamed outputs, completions."""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one request samples and when it stops."""

    max_tokens: int = 16                  # generated tokens at most (the first token included)
    temperature: float = 0.0              # 0 = greedy
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0                    # 1 = off
    seed: int | None = None               # per-request RNG seed; None derives one from the engine
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides the model's EOS ids
    ignore_eos: bool = False              # keep generating through EOS (benchmarks)


class RequestTimings(msgspec.Struct, frozen=True):
    """Per-request times in seconds on the engine's clock (virtual for the simulator)."""

    arrival: float                        # submit time
    admitted: float                       # took a lane or started staging
    first_token: float                    # first generated token sampled
    finished: float                       # final output produced
    queue_wait: float                     # admitted - arrival
    ttft: float                           # first_token - arrival
    e2e: float                            # finished - arrival
    inter_token: tuple[float, ...] = ()   # gaps between consecutive generated tokens


class Completion(msgspec.Struct, frozen=True):
    """A finished request: everything it generated and how long it took."""

    request_id: str                       # the id submit() returned
    prompt_len: int                       # prompt tokens
    token_ids: tuple[int, ...]            # generated tokens, in order
    finish_reason: FinishReason           # stop | length | abort | error
    error: str | None                     # the failure message when finish_reason == "error"
    timings: RequestTimings | None        # None when the request never ran (aborted while queued)
    preemptions: int = 0                  # times it was preempted and recomputed


class RequestOutput(msgspec.Struct, frozen=True):
    """What one step produced for one request (streamed to the caller)."""

    request_id: str                       # the id submit() returned
    new_token_ids: tuple[int, ...]        # tokens generated since the previous output
    finished: bool                        # True exactly once per request, on its last output
    finish_reason: FinishReason | None = None  # set when finished
    error: str | None = None              # set when finish_reason == "error"
    completion: Completion | None = None  # the whole result, on the finishing output only
