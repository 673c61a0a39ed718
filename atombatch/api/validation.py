"""What a request must satisfy against one artifact, checked before it is queued.

One rule set for every place that admits requests: `Batcher.validate` (in-process) and the
front of an engine-core process (`atombatch.core.client.CoreClient`), which checks requests
against the artifact the core reported, so that a bad request costs front CPU and never a step
of the core.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import overload

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.structs import MAX_LOGPROBS, SamplingParams, stop_ids
from atombatch.artifact.config import ArtifactConfig
from atombatch.errors import RequestError


class RequestRules(msgspec.Struct, frozen=True):
    """What the checks need to know of an engine: its artifact and two runtime capabilities."""

    artifact: ArtifactConfig
    has_tokenizer: bool = False          # stop strings and bad words need one
    every_position_logits: bool = False  # prompt_logprobs needs the logits of every position
    every_position_hint: str | None = None  # why not, when the runtime cannot


@overload
def queue_limit(lanes: int, max_waiting: int, fronts: int = 1) -> int: ...
@overload
def queue_limit(lanes: int, max_waiting: int | None, fronts: int = 1) -> int | None: ...


def queue_limit(lanes: int, max_waiting: int | None, fronts: int = 1) -> int | None:
    """The queue bound, written once: how many choices (each of a request's n counts) one of
    `fronts` fronts may hold, `lanes` of them running and `max_waiting` waiting for a lane, the
    total split evenly (rounded up) among the fronts; None: unbounded.

    The engine (`Batcher.submit`, `AsyncBatcher.submit`) counts only the choices without a lane,
    so it asks with `lanes=0`; a front of the engine core counts its choices in flight, lanes
    included (atombatch/core/client.py), and the server sizes its batches and its Ray replicas'
    `max_ongoing_requests` from the same figure.
    """
    if max_waiting is None:
        return None
    return -(-(lanes + max_waiting) // fronts)


def validate_request(rules: RequestRules, prompt: Sequence[int] | npt.NDArray[np.integer],
                     params: SamplingParams, runtime_name: str = "the runtime"
                     ) -> npt.NDArray[np.int64]:
    """Check a request against `rules`; returns the prompt as a fresh int64 array.

    Raises:
        RequestError: naming the offending value and the rule.
    """
    if isinstance(params, SamplingParams) and isinstance(prompt, Sized) and \
            len(prompt) >= rules.artifact.max_seq_len:  # before a copy of a huge list
        _check_length(len(prompt), params, rules.artifact.max_seq_len)
    try:
        tokens = np.asarray(prompt)
    except (ValueError, TypeError) as exc:  # ragged nesting, mixed types
        raise RequestError(f"prompt must be a flat sequence of token ids: {exc}",
                           param="prompt") from None
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise RequestError(f"prompt must be a flat sequence of token ids, got shape "
                           f"{tokens.shape} of {tokens.dtype}", param="prompt")
    if tokens.size == 0:
        raise RequestError("prompt is empty: a request needs at least one token", param="prompt")
    vocab = rules.artifact.model.vocab_size
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        i = int(bad[0])
        raise RequestError(f"token id {int(tokens[i])} at prompt index {i} is outside the "
                           f"vocabulary 0..{vocab - 1}", param="prompt", limit=vocab)
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    _check_length(tokens.size, params, rules.artifact.max_seq_len)
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("logit_bias", params.logit_bias or ())):
        if ids and max(ids) >= vocab:
            token = next(t for t in ids if t >= vocab)
            raise RequestError(f"{name} names token id {token}, outside the vocabulary "
                               f"0..{vocab - 1}", param=name, limit=vocab)
    _check_something_samplable(rules, params)
    if not rules.has_tokenizer:
        for name in ("stop", "bad_words"):
            if getattr(params, name):
                raise RequestError(f"{name}={list(getattr(params, name))!r} needs a tokenizer: "
                                   "build the Batcher with tokenizer=... (docs/sampling.md)",
                                   param=name)
    if params.structured is not None and not rules.has_tokenizer:
        raise RequestError(f"{params.structured.param}: structured output needs a tokenizer: "
                           "build the Batcher with tokenizer=... (docs/sampling.md)",
                           param=params.structured.param)
    if params.prompt_logprobs is not None:
        check_prompt_logprobs(rules, params.prompt_logprobs, runtime_name)
    return tokens.astype(np.int64, copy=True)


def _check_length(size: int, params: SamplingParams, max_len: int) -> None:
    if params.max_tokens is None:
        if size >= max_len:
            raise RequestError(f"prompt of {size} tokens leaves no room to generate: "
                               f"max_seq_len={max_len}", param="prompt", limit=max_len)
    elif size + params.max_tokens > max_len:
        raise RequestError(f"prompt of {size} tokens + max_tokens={params.max_tokens} = "
                           f"{size + params.max_tokens} exceeds max_seq_len={max_len}",
                           param="prompt", limit=max_len)


def _check_something_samplable(rules: RequestRules, params: SamplingParams) -> None:
    """Refuse at submit what would mask every token at a step (the sampler would fail the request
    mid-stream): `allowed_token_ids` that are all stop ids while `min_tokens` masks those."""
    allowed = params.allowed_token_ids
    if allowed is None or params.min_tokens == 0:
        return
    stops = set(stop_ids(params, rules.artifact.model.eos_token_ids))
    if stops.issuperset(allowed):
        shown = sorted(set(allowed))[:8]
        raise RequestError(f"allowed_token_ids {shown}{'...' if len(set(allowed)) > 8 else ''} "
                           f"are all stop ids (EOS or stop_token_ids), which min_tokens="
                           f"{params.min_tokens} masks: no token could be sampled",
                           param="allowed_token_ids")


def check_prompt_logprobs(rules: RequestRules, k: int, runtime_name: str = "the runtime") -> None:
    vocab = rules.artifact.model.vocab_size
    if k == -1 and vocab > MAX_LOGPROBS:
        raise RequestError(f"prompt_logprobs=-1 asks for the whole vocabulary ({vocab} ids); "
                           f"at most {MAX_LOGPROBS} are returned per position",
                           param="prompt_logprobs", limit=MAX_LOGPROBS)
    if not rules.every_position_logits:
        hint = rules.every_position_hint or (
            f"{runtime_name} returns only the last prefill position's logits")
        raise RequestError(f"prompt_logprobs={k} needs the logits of every prompt position: "
                           f"{hint}", param="prompt_logprobs")
