"""The OpenAI-compatible wire format: request bodies (validated) and response bodies (encoded).

Request bodies are decoded into these Structs by `atombatch.serve.schema`: a field they do not
declare is dropped and reported (a response header and a warning in the log), or rejected with
`--strict-protocol`; `null` for an optional field means its default. Fields that exist in the
OpenAI API but that this server cannot honour are declared so they are *rejected with a reason*
when set (`tools`, `suffix`, ...) and accepted when null or at their default. Structured output
(`response_format`, vLLM's `structured_outputs` and `guided_*`) is read by
`atombatch.serve.structured`.

Extensions beyond the OpenAI API (documented in docs/server.md):
- request, with vLLM's names: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
  `stop_token_ids`, `include_stop_str_in_output`, `allowed_token_ids`, `bad_words`,
  `skip_special_tokens`, `spaces_between_special_tokens`; `prompt` may be a list of token ids, or
  a batch (a list of strings or of token-id lists); vLLM's `stream_options.continuous_usage_stats`
  and chat template fields (`chat_template_kwargs`, `documents`, `add_generation_prompt`,
  `continue_final_message`).
- response: every choice (streamed chunk or whole response) carries `token_ids`, the generated
  token ids it covers, so a client can check ids when the server has no tokenizer.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False          # send a last chunk with `usage` and empty `choices`
    continuous_usage_stats: bool = False  # vLLM: with include_usage, `usage` on every chunk too


class _SamplingFields(msgspec.Struct, kw_only=True):
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
    spaces_between_special_tokens: bool = True  # extension (with skip_special_tokens false)
    prompt_logprobs: int | None = None   # extension: per prompt token, its logprob + the top k
    truncate_prompt_tokens: int | None = None  # extension: keep the last k prompt tokens
                                         #   (-1: the context length), as vLLM does
    use_beam_search: bool = False        # extension: only False is served (no beam search)
    length_penalty: float = 1.0          # extension: beam search only; no effect without it
    user: str | None = None              # accepted and ignored
    # Structured output (atombatch/serve/structured.py reads these; one of them at most).
    response_format: dict[str, Any] | None = None  # OpenAI: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM: json, regex, choice, grammar, ...
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored (llguidance serves all)


class CompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/completions`."""

    # text (needs a tokenizer, or "<id>" pieces), token ids, or a batch: strings or id lists
    prompt: str | list[int | str | list[int]]
    max_tokens: int = 16                 # OpenAI's default for completions; 0 only with echo
    echo: bool = False                   # the prompt's text (and with logprobs, its logprobs)
                                         #   first; see atombatch/serve/echo.py
    logprobs: int | None = None          # top candidates per token (0..20), with the sampled one
    suffix: str | None = None            # only None or "" is served
    best_of: int | None = None           # only None or 1 is served
    add_special_tokens: bool = True      # a text prompt gets the tokenizer's special tokens
                                         #   (its post-processor: e.g. Llama's BOS), as in vLLM


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(msgspec.Struct):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (to the template)
    tool_call_id: str | None = None      # a tool result's call id (to the template)
    reasoning_content: str | None = None  # an assistant's earlier reasoning (to the template)


class ContentPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_tokens: int | None = None        # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False               # return the sampled tokens' logprobs
    top_logprobs: int | None = None      # and this many top candidates (0..20; needs logprobs)
    # Tool calling (atombatch/serve/tools.py): tools shown to the chat template; tool_choice
    # none / auto (needs --tool-call-parser) / required / a named function.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # deprecated OpenAI form of tools
    function_call: str | dict[str, Any] | None = None
    # Chat template inputs (vLLM extensions), passed to the template as transformers does.
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None     # a per-request template: rejected (not trusted)


# -- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int                   # prompt tokens whose prefill the prefix cache saved


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # with --enable-prompt-tokens-details only (as vLLM: absent otherwise)
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]   # None: the first prompt token when echoed (no context)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's `Logprob` of one candidate at one prompt position."""

    logprob: float                       # -inf is sent as -9999.0 (as vLLM and OpenAI do)
    rank: int                            # 1 = the most likely id at this position
    decoded_token: str                   # the id's text (or "<id>" without a tokenizer)


# vLLM's prompt_logprobs: one entry per prompt token, None for the first; each maps token ids
# (JSON object keys, so strings) to their Logprob: the prompt token and the top k candidates
PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]                 # extension: the generated ids this choice covers
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or stop id that ended it
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM extension: when asked for (streamed
                                         #   once, with the prompt's first generated token)


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str                       # JSON text, as the model wrote it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None              # with the call's first delta
    arguments: str | None = None         # the next piece of the arguments' text


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int                           # the call's position among the message's calls
    id: str | None = None                # with the call's first delta
    type: str | None = None              # "function", with the call's first delta
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # vLLM: with --reasoning-parser
    tool_calls: list[ToolCallDelta] | None = None


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
    content: str | None
    tool_calls: list[ToolCall] | None = None  # parsed calls (tools with a parser or a choice)
    reasoning_content: str | None = None  # vLLM: the thinking, with --reasoning-parser


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
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM extension: when asked for


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
    root: str | None = None              # vLLM: the model the id serves (an adapter: its path)
    parent: str | None = None            # vLLM: an adapter's base model (None for a base model)
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
