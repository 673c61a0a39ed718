"""The OpenAI-compatible wire format: request bodies (validated) and response bodies (encoded).

Request bodies are decoded straight into these Structs with `forbid_unknown_fields=True`: a field
the server does not know is rejected (422), never silently ignored. Fields that exist in the
OpenAI API but that this server does not implement are declared so they can be *rejected with a
reason* when set to a non-default value (`echo`, `prompt_logprobs`).

Extensions beyond the OpenAI API, with vLLM's names (documented in docs/server.md): `top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `allowed_token_ids`, `bad_words`, `skip_special_tokens`;
`prompt` may be a list of token ids.
- response: every choice (streamed chunk or whole response) carries `token_ids`, the generated
  token ids it covers, so a client can check ids when the server has no tokenizer.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False          # send a last chunk with `usage` and empty `choices`


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None             # must name the served model when given
    temperature: float = 1.0             # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # extension; 0 (or -1, vLLM's spelling) = off
    min_p: float = 0.0                   # extension
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # stop strings (need a tokenizer)
    stop_token_ids: list[int] = []       # extension: extra stop token ids besides EOS
    include_stop_str_in_output: bool = False  # extension
    ignore_eos: bool = False             # extension: generate through EOS (benchmarks)
    n: int = 1                           # choices per prompt
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0      # extension
    min_tokens: int = 0                  # extension
    logit_bias: dict[str, float] | None = None  # token id (as a string key) -> bias
    allowed_token_ids: list[int] | None = None  # extension
    bad_words: list[str] = []            # extension (needs a tokenizer)
    skip_special_tokens: bool = True     # extension
    prompt_logprobs: int | None = None   # extension: not served (see docs/server.md)
    user: str | None = None              # accepted and ignored


class CompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/completions`."""

    prompt: str | list[int]              # text (needs a tokenizer, or "<id>" pieces) or token ids
    max_tokens: int = 16                 # OpenAI's default for completions
    echo: bool = False                   # only False is served
    logprobs: int | None = None          # top candidates per token (0..20), with the sampled one


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str                            # system | user | assistant | tool | developer
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_tokens: int | None = None        # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False               # return the sampled tokens' logprobs
    top_logprobs: int | None = None      # and this many top candidates (0..20; needs logprobs)


# -- responses -------------------------------------------------------------------------------------
class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]                 # extension: the generated ids this choice covers
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or stop id that ended it


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    token_ids: list[int]                 # extension
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or stop id that ended it


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    token_ids: list[int]                 # extension
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or stop id that ended it


class ChatResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    atombatch: dict[str, Any]            # extension: artifact shapes (vocab, context, lanes, ...)
    max_model_len: int                   # vLLM's field name for the context length
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
