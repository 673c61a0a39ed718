"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), as vLLM serves it.

A Responses request is a chat request in another shape, so this module turns it into one and
reuses the chat route's pieces (atombatch/serve/app.py): the same sampling checks, chat template,
tool plan and constraints (atombatch/serve/tools.py), structured output
(atombatch/serve/structured.py), reasoning parser (atombatch/serve/reasoning.py) and the same
generations. Only the input items and the output's shape are its own:

- input: a string (one user message) or items: messages (`role` + text or `input_text` /
  `output_text` parts), `function_call` items (merged into the assistant message before them,
  as vLLM does), `function_call_output` items (`role: tool` messages) and `reasoning` items
  (the assistant's `reasoning_content`). `instructions` is a system message first; it does not
  carry over to a later response.
- output: a `reasoning` item (with `--reasoning-parser`), a `message` item with one
  `output_text` part, and a `function_call` item per call, in that order. A response cut by
  `max_output_tokens` has `status: "incomplete"` and `incomplete_details.reason =
  "max_output_tokens"`, its last item `incomplete` too.
- streaming: vLLM's typed events (`event: <type>` + `data: <json>` with `sequence_number`), from
  `response.created` and `response.in_progress` to `response.completed` (or
  `response.incomplete`); a stream and a whole response carry the same items, because the whole
  one is built by the same `_Items` fed the whole text at once.
- `store` (default true) keeps a finished response in a bounded LRU (`ResponseStore`: at most
  `max_count` responses and `max_bytes` bytes), for `previous_response_id` (its conversation
  and output continue) and `GET /v1/responses/{id}`. An id that is not there (unknown, sent with
  `store: false`, or evicted) answers 400 naming it.

docs/server.md ("Responses API") lists every deviation from vLLM.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from atombatch.api.structs import SamplingParams
from atombatch.errors import RequestError
from atombatch.serve.api_error import ApiError
from atombatch.serve.chat_output import ChatOutput, Piece
from atombatch.serve.chat_template import check_template_kwargs
from atombatch.serve.protocol import ChatCompletionRequest
from atombatch.serve.reasoning import Qwen3ReasoningParser
from atombatch.serve.sse import SSEResponse
from atombatch.serve.tools import MAX_TOOLS, ToolCallError, ToolPlan

MAX_INPUT_ITEMS = 1024               # items in one request's `input`
MAX_INCLUDE = 16                     # entries of `include`
DEFAULT_MAX_STORED = 1024            # responses the store keeps (least recently used go first)
DEFAULT_MAX_STORED_BYTES = 64 << 20  # bytes of JSON the store keeps (responses + conversations)

_ENCODER = msgspec.json.Encoder()
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The app's server and its generations (atombatch/serve/app.py's `_Server` and `_Generation`): not
# imported, the app imports this module.
Server = Any
Generation = Any
_TEXT_PARTS = ("input_text", "output_text", "text")


# -- request ---------------------------------------------------------------------------------------
class ResponsesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses` (OpenAI's fields, and vLLM's sampling extensions)."""

    input: str | list[dict[str, Any]]    # one user message, or input items
    model: str | None = None
    instructions: str | None = None      # a system message first (not carried over)
    max_output_tokens: int | None = None  # None: up to the context length
    temperature: float | None = None     # None: 1.0
    top_p: float | None = None           # None: 1.0
    tools: list[dict[str, Any]] | None = None  # function tools: {"type", "name", "parameters"}
    tool_choice: str | dict[str, Any] | None = None  # auto (default) / none / required / named
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None   # {"format": {"type": "text" | "json_object" |
                                         #   "json_schema", "name", "schema", "strict"}}
    previous_response_id: str | None = None
    store: bool = True                   # keep the response (previous_response_id, GET)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # returned as sent
    reasoning: dict[str, Any] | None = None  # returned as sent (effort is not used)
    user: str | None = None
    truncation: str | None = None        # "disabled" (default) or "auto": keep the last tokens
    include: list[str] | None = None     # nothing extra can be included (empty only)
    background: bool = False             # only false is served
    top_logprobs: int | None = None      # only 0 is served
    max_tool_calls: int | None = None    # returned as sent (it limits built-in tools, none here)
    service_tier: str | None = None      # accepted and ignored
    prompt_cache_key: str | None = None  # accepted and ignored
    safety_identifier: str | None = None  # accepted and ignored
    prompt: dict[str, Any] | None = None  # a stored prompt template: refused
    conversation: str | dict[str, Any] | None = None  # OpenAI's conversations: refused
    # vLLM's extensions (as on chat)
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- response --------------------------------------------------------------------------------------
class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str                          # in_progress, completed, incomplete
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    id: str
    content: list[ReasoningText] | None
    status: str | None
    summary: list[Any] = []
    encrypted_content: str | None = None


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str                         # what a function_call_output answers
    name: str
    arguments: str                       # JSON text, as the model wrote it
    status: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0               # prompt tokens whose prefill the prefix cache saved
                                         #   (vLLM's num_cached_tokens; reported whatever
                                         #   --enable-prompt-tokens-details says, as vLLM)


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0            # generated tokens between <think> and </think>


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str                          # "max_output_tokens"


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: str                          # in_progress, completed, incomplete
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    metadata: dict[str, Any] | None
    parallel_tool_calls: bool
    temperature: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    max_output_tokens: int
    max_tool_calls: int | None
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    text: dict[str, Any] | None
    truncation: str
    user: str | None
    background: bool = False
    service_tier: str = "auto"
    top_logprobs: int | None = None
    object: str = "response"


# -- the store -------------------------------------------------------------------------------------
class Stored(msgspec.Struct):
    response: ResponseObject
    conversation: list[dict[str, Any]]   # input and output as chat messages (no instructions)
    size: int                            # bytes of both as JSON


class ResponseStore:
    """The last responses sent with `store: true`, least recently used evicted first: at most
    `max_count` of them and `max_bytes` bytes of JSON (a response larger than that is not
    kept). Used from the event loop only."""

    def __init__(self, max_count: int = DEFAULT_MAX_STORED,
                 max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, response_id: str) -> Stored | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> bool:
        """Keep `response`; False when it alone is larger than `max_bytes`."""
        size = len(_ENCODER.encode(response)) + len(_ENCODER.encode(conversation))
        if size > self.max_bytes:
            return False
        old = self.entries.pop(response.id, None)
        if old is not None:
            self.bytes -= old.size
        self.entries[response.id] = Stored(response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.max_count or self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.size
        return True


# -- input items -> chat messages ----------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    """A message's (or a tool output's) content: a string or text parts, joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: content part type {_clip(repr(kind))} is not "
                               f"served (text only: {', '.join(_TEXT_PARTS)} with a text "
                               "string)", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input` (the chat template's `messages`).

    Raises:
        RequestError: too many items, or an item that is malformed or not served (naming it).
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if len(items) > MAX_INPUT_ITEMS:
        raise RequestError(f"input has {len(items)} items, more than MAX_INPUT_ITEMS="
                           f"{MAX_INPUT_ITEMS}", param="input", limit=MAX_INPUT_ITEMS)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role={_clip(repr(role))} must be user, system, "
                                   "developer or assistant", param=f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                raise RequestError(f"{where}.encrypted_content is not supported",
                                   param=f"{where}.encrypted_content")
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(
                    isinstance(p, dict) and p.get("type") in ("reasoning_text", "summary_text")
                    and isinstance(p.get("text"), str) for p in parts):
                raise RequestError(f"{where}.content must be a list of reasoning_text parts",
                                   param=f"{where}.content")
            reasoning = "\n".join(p["text"] for p in parts)
            if last is not None and "reasoning_content" not in last:
                last["reasoning_content"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None,
                                 "reasoning_content": reasoning})
        else:
            raise RequestError(f"{where}: input item type {_clip(repr(kind))} is not served "
                               "(message, function_call, function_call_output, reasoning)",
                               param=f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "parameters", ...}`) in the chat
    shape the tool plan reads (it bounds and checks them)."""
    if tools is None:
        return None
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"{len(tools)} tools, more than MAX_TOOLS={MAX_TOOLS}",
                           param="tools", limit=MAX_TOOLS)
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: tool type {_clip(repr(tool.get('type')))} is not "
                               "served (function tools only)", param=f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError('tool_choice must be none, auto, required or {"type": "function", '
                           '"name": ...}', param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat route's `response_format` (atombatch/serve/structured.py)."""
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", param="text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


# param names the chat pieces report, in this API's spelling
_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens",
           "messages": "input"}


def _respelled(exc: ApiError) -> ApiError:
    error = exc.body.error
    param = error.param
    if param is None:
        return exc
    if param in _PARAMS:
        error.message = error.message.replace(param, _PARAMS[param])
        error.param = _PARAMS[param]
    elif param.startswith("tools[") and ".function." in param:
        error.param = param.replace(".function.", ".", 1)
        error.message = error.message.replace(".function.", ".")
    return exc


# -- output ------------------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Items:
    """The output items of one generation, built from its parsed pieces (reasoning, content,
    call deltas) in order; each call returns the stream events of what it added or closed
    (as dicts without `sequence_number`)."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.open: str | None = None      # reasoning, message, call (the last item is open)
        self.text: list[str] = []         # the open item's text (or arguments)
        self.call_index = -1              # the open call's index among the calls

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            if self.open != "reasoning":
                events += self.close("completed")
                events += self._open_reasoning()
            events.append(self._delta("response.reasoning_text.delta", piece.reasoning))
        if piece.content:
            if self.open != "message":
                events += self.close("completed")
                events += self._open_message()
            events.append(self._delta("response.output_text.delta", piece.content))
        for call in piece.calls:
            if call.id is not None:
                events += self.close("completed")
                events += self._open_call(call.id, call.name or "", call.index)
            if call.arguments and self.open == "call" and call.index == self.call_index:
                self.text.append(call.arguments)
                item = self.items[-1]
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": item.id, "output_index": len(self.items) - 1,
                               "delta": call.arguments})
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close the open item with `status` (the last item's: incomplete when cut)."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        index = len(self.items) - 1
        item = self.items[index]
        text = "".join(self.text)
        if kind == "reasoning":
            assert isinstance(item, ReasoningItem)
            part = ReasoningText(text)
            item.content, item.status = [part], status
            return [{"type": "response.reasoning_text.done", "item_id": item.id,
                     "output_index": index, "content_index": 0, "text": text},
                    {"type": "response.content_part.done", "item_id": item.id,
                     "output_index": index, "content_index": 0, "part": part},
                    {"type": "response.output_item.done", "output_index": index, "item": item}]
        if kind == "message":
            assert isinstance(item, MessageItem)
            out = OutputText(text)
            item.content, item.status = [out], status
            return [{"type": "response.output_text.done", "item_id": item.id,
                     "output_index": index, "content_index": 0, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", "item_id": item.id,
                     "output_index": index, "content_index": 0, "part": out},
                    {"type": "response.output_item.done", "output_index": index, "item": item}]
        assert isinstance(item, FunctionCallItem)
        item.arguments, item.status = text, status
        return [{"type": "response.function_call_arguments.done", "item_id": item.id,
                 "output_index": index, "name": item.name, "arguments": text},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _open_reasoning(self) -> list[dict[str, Any]]:
        item = ReasoningItem(id=_new_id("rs"), content=None, status="in_progress")
        return self._added(item, "reasoning", {"type": "reasoning_text", "text": ""})

    def _open_message(self) -> list[dict[str, Any]]:
        item = MessageItem(id=_new_id("msg"), content=[], status="in_progress")
        return self._added(item, "message", OutputText("", logprobs=[]))

    def _open_call(self, call_id: str, name: str, index: int) -> list[dict[str, Any]]:
        self.call_index = index
        item = FunctionCallItem(id=_new_id("fc"), call_id=call_id, name=name, arguments="",
                                status="in_progress")
        return self._added(item, "call", None)

    def _added(self, item: OutputItem, kind: str, part: Any) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open, self.text = kind, []
        index = len(self.items) - 1
        # the item as it is now (encoded at once: it changes as it fills)
        events: list[dict[str, Any]] = [{"type": "response.output_item.added",
                                         "output_index": index,
                                         "item": msgspec.json.decode(_ENCODER.encode(item))}]
        if part is not None:
            events.append({"type": "response.content_part.added", "item_id": item.id,
                           "output_index": index, "content_index": 0, "part": part})
        return events

    def _delta(self, kind: str, text: str) -> dict[str, Any]:
        self.text.append(text)
        return {"type": kind, "item_id": self.items[-1].id, "output_index": len(self.items) - 1,
                "content_index": 0, "delta": text,
                **({"logprobs": []} if kind == "response.output_text.delta" else {})}


def output_messages(items: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if isinstance(item, ReasoningItem):
            message["reasoning_content"] = "".join(p.text for p in item.content or ())
        elif isinstance(item, MessageItem):
            message["content"] = "".join(p.text for p in item.content)
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
    return [message] if len(message) > 2 or message["content"] is not None else []


class _Turn:
    """One accepted request: what its response echoes and what its store entry continues."""

    def __init__(self, body: ResponsesRequest, params: SamplingParams, plan: ToolPlan,
                 conversation: list[dict[str, Any]], prompt_len: int, max_tokens: int) -> None:
        self.body = body
        self.params = params
        self.plan = plan
        self.conversation = conversation
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.model = ""                       # the id it answers with (an adapter's name when
                                              #   the request names one)


# -- the endpoints ---------------------------------------------------------------------------------
class ResponsesAPI:
    """The Responses routes of one server (`create_app` registers them)."""

    def __init__(self, server: Server, store: ResponseStore | None = None) -> None:
        self.server = server
        self.store = store if store is not None else ResponseStore()

    def _check_features(self, body: ResponsesRequest) -> None:
        refusals = (("background", body.background, "background responses are not served"),
                    ("prompt", body.prompt is not None, "stored prompt templates are not "
                     "served"),
                    ("conversation", body.conversation is not None, "conversations are not "
                     "served (use previous_response_id)"),
                    ("top_logprobs", bool(body.top_logprobs), "logprobs are not served on "
                     "this route"))
        for name, refused, why in refusals:
            if refused:
                raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_value")
        if body.include:
            raise ApiError(400, f"include={_clip(repr(body.include[:MAX_INCLUDE]))}: nothing "
                           "extra can be included (no logprobs, no encrypted reasoning)",
                           param="include", code="unsupported_value")
        if body.truncation not in (None, "disabled", "auto"):
            raise ApiError(400, f"truncation={_clip(repr(body.truncation))} must be disabled "
                           "or auto", param="truncation", code="invalid_value")

    def _chat_request(self, body: ResponsesRequest) -> ChatCompletionRequest:
        """The chat request the same sampling, tools and constraint are read from."""
        return ChatCompletionRequest(
            messages=[], model=body.model,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
            logit_bias=body.logit_bias, skip_special_tokens=body.skip_special_tokens,
            response_format=response_format(body.text),
            structured_outputs=body.structured_outputs,
            truncate_prompt_tokens=-1 if body.truncation == "auto" else None,
            tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls,
            chat_template_kwargs=body.chat_template_kwargs)

    async def create(self, request: Request) -> Response:
        try:
            return await self._create(request)
        except ApiError as exc:
            raise _respelled(exc) from None

    async def _create(self, request: Request) -> Response:
        server = self.server
        body = await server.decode(request, ResponsesRequest)
        self._check_features(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(400, f"previous_response_id "
                               f"{_clip(repr(body.previous_response_id))} is not a stored "
                               "response: unknown, sent with store=false, or evicted (the "
                               f"server keeps the last {self.store.max_count} responses, "
                               f"{self.store.max_bytes} bytes)", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored.conversation
        try:
            conversation = history + input_messages(body.input)
            chat = self._chat_request(body)
            check_template_kwargs(body.chat_template_kwargs or {})
            await server.structured.check_off_loop(chat)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        plan = server.tool_plan(chat)
        messages = ([{"role": "system", "content": body.instructions}]
                    if body.instructions else []) + conversation
        template: dict[str, Any] = dict(body.chat_template_kwargs or {})
        template.update(add_generation_prompt=True, continue_final_message=False)
        if plan.tools is not None:
            template["tools"] = plan.tools
        params = server.params(chat, body.max_output_tokens)
        try:
            prompt = await server.off_loop(functools.partial(server.codec.render_chat, messages,
                                                             **template))
        except RequestError as exc:
            raise ApiError(400, str(exc), param="input", code="invalid_value") from None
        params = await server.constrain(params, plan, prompt)
        prompts = server.truncate([prompt], chat)
        server.check_response_size(prompts, params, body.max_output_tokens)
        server.check_samplable(params)
        gens = server.submit_all("resp", prompts, params, "input",
                                 server.check_model(body.model))
        room = server.artifact.max_seq_len - len(prompts[0])
        turn = _Turn(body, params, plan, conversation, len(prompts[0]),
                     room if params.max_tokens is None else params.max_tokens)
        turn.model = gens[0].model
        try:  # until a response owns them, a failure aborts the generations
            headers = server.headers(request)
            if body.stream:
                return SSEResponse(self._stream(gens[0], turn), gens,
                                   {**_SSE_HEADERS, **(headers or {})})
            await server._collect(request, gens)
        except BaseException:
            for gen in gens:
                gen.abandon()
            raise
        gen = gens[0]
        response = await server.in_worker(self._whole, gen, turn)
        self._keep(turn, response)
        return Response(_ENCODER.encode(response), headers=headers,
                        media_type="application/json")

    def _output(self, turn: _Turn) -> ChatOutput:
        return ChatOutput(turn.plan, self.server.reasoning_parser)

    def _whole(self, gen: Generation, turn: _Turn) -> ResponseObject:
        """A finished non-streamed generation as its response (built on the text worker)."""
        output, items = self._output(turn), _Items()
        choice = gen.choices[0]
        text = "".join(choice.text)
        try:
            piece = output.feed(text) if output.active else Piece(content=text)
            if output.active:
                last = output.finish()
                piece = Piece(reasoning=piece.reasoning + last.reasoning,
                              content=piece.content + last.content,
                              calls=piece.calls + last.calls)
        except ToolCallError as exc:
            raise ApiError(400, str(exc), param="tools", code="tool_call_limit") from None
        items.feed(piece)
        items.close(_item_status(choice.finish_reason))
        return self._response(turn, gen, items.items, choice.finish_reason)

    def _response(self, turn: _Turn, gen: Generation | None, items: list[OutputItem],
                  finish: str | None) -> ResponseObject:
        body = turn.body
        usage = None
        status = "in_progress"
        if gen is not None:
            status = "incomplete" if finish == "length" else "completed"
            reasoning = self._reasoning_tokens(gen.token_ids)
            usage = ResponseUsage(
                input_tokens=turn.prompt_len, output_tokens=gen.generated,
                total_tokens=turn.prompt_len + gen.generated,
                input_tokens_details=InputTokensDetails(cached_tokens=gen.cached_tokens or 0),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))
        return ResponseObject(
            id=turn.id, created_at=turn.created, model=turn.model, output=items,
            status=status, usage=usage,
            incomplete_details=IncompleteDetails("max_output_tokens")
            if status == "incomplete" else None,
            instructions=body.instructions, metadata=body.metadata,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=turn.params.temperature, tool_choice=body.tool_choice or "auto",
            tools=body.tools or [], top_p=turn.params.top_p, max_output_tokens=turn.max_tokens,
            max_tool_calls=body.max_tool_calls, previous_response_id=body.previous_response_id,
            reasoning=body.reasoning, text=body.text or {"format": {"type": "text"}},
            truncation=body.truncation or "disabled", user=body.user,
            service_tier=body.service_tier or "auto")

    def _reasoning_tokens(self, ids: list[int]) -> int:
        """Generated tokens inside `<think>`...`</think>` (as vLLM counts them: only when each
        tag is one token)."""
        tokenizer = getattr(self.server.codec, "tokenizer", None)
        if self.server.reasoning_parser is None or tokenizer is None:
            return 0
        start = tokenizer.encode(Qwen3ReasoningParser.START, add_special_tokens=False).ids
        end = tokenizer.encode(Qwen3ReasoningParser.END, add_special_tokens=False).ids
        if len(start) != 1 or len(end) != 1:
            return 0
        count = depth = 0
        for token in ids:
            if token == start[0]:
                depth += 1
            elif token == end[0]:
                depth = max(0, depth - 1)
            elif depth:
                count += 1
        return count

    def _keep(self, turn: _Turn, response: ResponseObject) -> None:
        if turn.body.store:
            self.store.put(response, turn.conversation + output_messages(response.output))

    async def _stream(self, gen: Generation, turn: _Turn) -> AsyncIterator[bytes]:
        sequence = 0

        def event(data: dict[str, Any]) -> bytes:
            nonlocal sequence
            data["sequence_number"] = sequence
            sequence += 1
            return b"event: " + data["type"].encode() + b"\ndata: " + _ENCODER.encode(data) + \
                b"\n\n"

        start = self._response(turn, None, [], None)
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        output, items = self._output(turn), _Items()
        async with contextlib.aclosing(gen.run(0)) as events:
            async for _, (_new, text, out) in events:
                finish = out.finish_reason
                if finish == "error":
                    yield event(self._error_event(gen))
                    return
                try:
                    piece = output.feed(text) if output.active else Piece(content=text)
                    if finish is not None and output.active:
                        last = output.finish()
                        piece = Piece(reasoning=piece.reasoning + last.reasoning,
                                      content=piece.content + last.content,
                                      calls=piece.calls + last.calls)
                except ToolCallError as exc:
                    yield event({"type": "error", "code": "tool_call_limit", "message": str(exc),
                                 "param": "tools"})
                    return
                for data in items.feed(piece):
                    yield event(data)
        ended = gen.choices[0].finish_reason
        for data in items.close(_item_status(ended)):
            yield event(data)
        final = self._response(turn, gen, items.items, ended)
        self._keep(turn, final)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield event({"type": kind, "response": final})

    def _error_event(self, gen: Generation) -> dict[str, Any]:
        if gen.error_param is not None:
            return {"type": "error", "code": "constraint_failed",
                    "message": gen.error or "request failed", "param": gen.error_param}
        code = "engine_unavailable" if self.server.core_died else "engine_error"
        return {"type": "error", "code": code, "message": gen.error or "request failed",
                "param": None}

    async def retrieve(self, request: Request) -> Response:
        """`GET /v1/responses/{response_id}`: a stored response (404 when it is not stored)."""
        stored = self._stored(request)
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise ApiError(400, "stream: only background responses can be streamed again, and "
                           "none are served", param="stream", code="unsupported_value")
        return Response(_ENCODER.encode(stored.response), media_type="application/json")

    async def cancel(self, request: Request) -> Response:
        """`POST /v1/responses/{response_id}/cancel`: as vLLM, only a background response can
        be cancelled, and none are served."""
        self._stored(request)
        raise ApiError(400, "Cannot cancel a synchronous response.", param="response_id",
                       code="invalid_value")

    def _stored(self, request: Request) -> Stored:
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id {_clip(repr(response_id))} not found.",
                           param="response_id", code="not_found")
        return stored


def _clip(text: str, limit: int = 80) -> str:
    """Client-supplied text quoted in an error, cut to `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _item_status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"
