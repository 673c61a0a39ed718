"""Value types that cross the public API: sampling parameters, streamed outputs, completions."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import msgspec
import msgspec.structs
import numpy as np

from atombatch.api.structured import StructuredOutput
from atombatch.errors import RequestError

FinishReason = Literal["stop", "length", "abort", "error"]


MAX_LOGPROBS = 20                          # top logprobs per position at most (vLLM's default cap)
MAX_N = 64                                 # completions per prompt at most
MAX_STOP_STRINGS = 64                      # stop strings / bad words per request at most
MAX_STOP_CHARS = 1024                      # characters per stop string or bad word at most
MAX_LIST_ITEMS = 1 << 18                   # ids in stop_token_ids / allowed_token_ids / logit_bias
GREEDY_EPS = 1e-5                          # temperatures below this sample greedily (vLLM's eps)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How one request samples and when it stops; vLLM's names, defaults and ranges.

    Every value is checked when the object is built (`RequestError` naming the field and the
    rule); ids are checked against the vocabulary when the request is submitted. Semantics of
    each field: docs/sampling.md.
    """

    n: int = 1                                 # completions of this prompt (forked requests)
    max_tokens: int | None = 16                # generated tokens at most; None = up to the context
    min_tokens: int = 0                        # no EOS / stop id / stop string before this many
    temperature: float = 1.0                   # 0 (below 1e-5) = greedy
    top_p: float = 1.0                         # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0                             # keep the k most likely; 0 or -1 = off
    min_p: float = 0.0                         # drop tokens below min_p x the top probability
    seed: int | None = None                    # per-request RNG seed; None derives one
    presence_penalty: float = 0.0              # in [-2, 2]: minus this once per generated token id
    frequency_penalty: float = 0.0             # in [-2, 2]: minus this x the id's generated count
    repetition_penalty: float = 1.0            # > 0: divides (multiplies if < 0) seen ids' logits
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] added to logits
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these ids
    bad_words: tuple[str, ...] = ()            # words never generated (needs a tokenizer)
    stop: tuple[str, ...] = ()                 # stop strings (needs a tokenizer); a str is one
    include_stop_str_in_output: bool = False   # keep the matched stop string in the text
    stop_token_ids: tuple[int, ...] = ()       # extra stop token ids besides the model's EOS ids
    ignore_eos: bool = False                   # keep generating through EOS (benchmarks)
    logprobs: int | None = None                # None = off; k >= 0: sampled token's + top k
    prompt_logprobs: int | None = None         # None = off; k >= 0 (-1 = whole vocabulary, if
                                               #   it fits MAX_LOGPROBS): per prompt token, its
                                               #   logprob and the top k (raw logits)
    skip_special_tokens: bool = True           # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # false (special tokens shown): no space
                                               #   between two added tokens in a row
    structured: StructuredOutput | None = None  # the output must match this JSON schema /
                                               #   regex / choice / grammar (atombatch/api/structured.py)

    def __post_init__(self) -> None:
        _check_int(self, "n", 1, MAX_N)
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", 1, None)
        _check_int(self, "min_tokens", 0, self.max_tokens, "max_tokens")
        _check_float(self, "temperature", 0.0, None)
        _check_float(self, "top_p", 0.0, 1.0, low_open=True)
        _check_int(self, "top_k", -1, None)
        _check_float(self, "min_p", 0.0, 1.0)
        if self.seed is not None:
            _check_int(self, "seed", 0, 2**64 - 1)
        _check_float(self, "presence_penalty", -2.0, 2.0)
        _check_float(self, "frequency_penalty", -2.0, 2.0)
        _check_float(self, "repetition_penalty", 0.0, None, low_open=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name}={getattr(self, name)!r} must be a bool", param=name)
        if self.logprobs is not None:
            _check_int(self, "logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            # -1 (vLLM: the whole vocabulary) is resolved against the model's vocabulary at submit
            _check_int(self, "prompt_logprobs", -1, MAX_LOGPROBS)
        _set(self, "stop", _strings(self.stop, "stop"))
        _set(self, "bad_words", _strings(self.bad_words, "bad_words"))
        _set(self, "stop_token_ids", _ids(self.stop_token_ids, "stop_token_ids"))
        if self.allowed_token_ids is not None:
            allowed = _ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise RequestError("allowed_token_ids=() must name at least one token id "
                                   "(None turns it off)", param="allowed_token_ids")
            _set(self, "allowed_token_ids", allowed)
        if self.logit_bias is not None:
            _set(self, "logit_bias", _bias(self.logit_bias))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise RequestError(f"structured={self.structured!r} must be a StructuredOutput",
                               param="structured")

    # -- derived ------------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Takes the argmax (after penalties, bias and masks)."""
        return self.temperature < GREEDY_EPS

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: no penalty, bias, mask or min_tokens, no logprobs."""
        return (self.temperature < GREEDY_EPS and self.presence_penalty == 0.0 and
                self.frequency_penalty == 0.0 and self.repetition_penalty == 1.0 and
                not self.logit_bias and self.allowed_token_ids is None and not self.bad_words and
                self.min_tokens == 0 and self.logprobs is None and self.structured is None)


def stop_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
    """The ids that end a request with "stop", written once: its `stop_token_ids`, then the
    model's EOS ids unless `ignore_eos`. A request resolves them once (`Request.stop_ids`); the
    decode-step kernel's bind, the stop check, the sampler's `min_tokens` mask and validation
    read that."""
    if params.ignore_eos:
        return tuple(params.stop_token_ids)
    return (*params.stop_token_ids, *(int(t) for t in eos_token_ids))


def _set(params: SamplingParams, name: str, value: object) -> None:
    msgspec.structs.force_setattr(params, name, value)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(params: SamplingParams, name: str, low: int, high: int | None,
               high_name: str | None = None) -> None:
    value = getattr(params, name)
    if type(value) is int and value >= low and (high is None or value <= high):
        return  # the common case: already a plain int in range (nothing to convert)
    if not _is_int(value):
        raise RequestError(f"{name}={value!r} must be an integer", param=name)
    value = int(value)
    _set(params, name, value)
    if value < low:
        raise RequestError(f"{name}={value} must be >= {low}", param=name)
    if high is not None and value > high:
        bound = f"{high_name}={high}" if high_name else str(high)
        raise RequestError(f"{name}={value} must be <= {bound}", param=name)


def _check_float(params: SamplingParams, name: str, low: float, high: float | None, *,
                 low_open: bool = False) -> None:
    value = getattr(params, name)
    if type(value) is float and (low < value if low_open else low <= value) and \
            (value <= high if high is not None else value < math.inf):
        return  # the common case: already a finite float in range (NaN fails every comparison)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise RequestError(f"{name}={value!r} must be a number", param=name)
    value = float(value)
    _set(params, name, value)
    rule = (f"in ({low}, {high}]" if low_open else f"in [{low}, {high}]") if high is not None \
        else (f"> {low}" if low_open else f">= {low}")
    if not math.isfinite(value) or (value <= low if low_open else value < low) or \
            (high is not None and value > high):
        raise RequestError(f"{name}={value} must be a finite number {rule}", param=name)


def _strings(value: object, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise RequestError(f"{name}={value!r} must be a string or a list of strings", param=name)
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError(f"{name} has {len(value)} strings, at most {MAX_STOP_STRINGS} are "
                           "allowed", param=name)
    for item in value:
        if not isinstance(item, str) or not item:
            raise RequestError(f"{name} entry {item!r} must be a non-empty string", param=name)
        if len(item) > MAX_STOP_CHARS:
            raise RequestError(f"{name} entry of {len(item)} characters exceeds "
                               f"{MAX_STOP_CHARS}", param=name)
    return tuple(value)


def _ids(value: object, name: str) -> tuple[int, ...]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise RequestError(f"{name}={value!r} must be a list of token ids", param=name)
    if len(value) > MAX_LIST_ITEMS:
        raise RequestError(f"{name} has {len(value)} ids, at most {MAX_LIST_ITEMS} are allowed",
                           param=name)
    for item in value:
        if not _is_int(item) or item < 0:
            raise RequestError(f"{name} entry {item!r} must be a token id (an integer >= 0)",
                               param=name)
    return tuple(int(item) for item in value)


def _bias(value: object) -> dict[int, float]:
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias={value!r} must map token ids to numbers",
                           param="logit_bias")
    if len(value) > MAX_LIST_ITEMS:
        raise RequestError(f"logit_bias has {len(value)} entries, at most {MAX_LIST_ITEMS}",
                           param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
            token = int(key)  # JSON object keys are strings
        if not _is_int(token) or token < 0:
            raise RequestError(f"logit_bias key {key!r} must be a token id (an integer >= 0)",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                not -100.0 <= float(bias) <= 100.0:
            raise RequestError(f"logit_bias[{key}]={bias!r} must be a number in [-100, 100]",
                               param="logit_bias")
        out[int(token)] = float(bias)
    return out


class TokenLogprob(msgspec.Struct, frozen=True):
    """One candidate token at one position."""

    token_id: int
    logprob: float                        # natural log of its probability
    rank: int                             # 1 = the most likely id at this position


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Logprobs at one generated position: the sampled token's and the top candidates'."""

    token_id: int                         # the sampled token
    logprob: float                        # its logprob
    rank: int                             # its rank among all ids (1 = most likely)
    top: tuple[TokenLogprob, ...] = ()    # the `SamplingParams.logprobs` most likely ids, best first


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
    index: int = 0                        # which of the request's `n` choices this is
    text: str | None = None               # the generated text (engines with a tokenizer)
    logprobs: tuple[TokenLogprobs, ...] | None = None  # per generated token, when asked for
    stop_reason: str | int | None = None  # the stop string or stop/EOS id that ended it
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # per prompt token (the
                                          #   first is None), when asked for and computed
    cached_tokens: int = 0                # prompt tokens its first prefix-cache lookup saved
                                          #   (vLLM's `num_cached_tokens`)


class RequestOutput(msgspec.Struct, frozen=True):
    """What one step produced for one choice of one request (streamed to the caller).

    With `n > 1` every choice streams under the request's id, told apart by `index`; a choice's
    last output carries its `finish_reason` and `completion`, and `finished` is True once, on the
    last output of the last choice to end.
    """

    request_id: str                       # the id submit() returned
    new_token_ids: tuple[int, ...]        # tokens generated since the previous output
    finished: bool                        # True exactly once per request, on its last output
    finish_reason: FinishReason | None = None  # set when this choice ended
    error: str | None = None              # set when finish_reason == "error"
    completion: Completion | None = None  # this choice's whole result, on its last output only
    index: int = 0                        # which choice (0..n-1)
    text: str | None = None               # new text (engines with a tokenizer; stop strings held
                                          #   back until they are ruled out)
    logprobs: tuple[TokenLogprobs, ...] | None = None  # for `new_token_ids`, when asked for
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # per prompt token (the
                                          #   first is None): once, on the request's first output
    error_param: str | None = None        # with an error: the request field that caused it (its
                                          #   constraint or masks left nothing to sample, or a
                                          #   structured-output constraint past its limits): the
                                          #   client's error (HTTP 400), not the engine's
    cached_tokens: int | None = None      # on a choice's first output: prompt tokens its first
                                          #   prefix-cache lookup saved (vLLM's num_cached_tokens)
