"""Tool calling: `tools` and `tool_choice` in, `message.tool_calls` out (as vLLM serves them).

Request side (`ToolPlan.from_request`): the tools are checked and bounded, then shown to the
model's chat template (transformers' `tools=` argument). `tool_choice` decides what the output is:

- `none`: plain text (the tools are still shown to the template, as vLLM does);
- `auto` (the default when tools are given): the model writes text and/or calls in its own format,
  which the server's tool-call parser (`--tool-call-parser`) turns into `tool_calls`; without a
  parser, a 400 naming `tool_choice`;
- `required`: the output is constrained (a JSON schema, atombatch/api/structured.py) to a JSON array of
  one or more `{"name": <a tool>, "parameters": <its parameters>}` objects, as vLLM does; each
  becomes a call (no parser needed);
- named (`{"type": "function", "function": {"name": N}}`): the output is constrained to N's
  parameters schema and becomes the arguments of one call to N.

A message with calls has `finish_reason` "tool_calls" when the model stopped on its own (not for a
named choice: "stop", as OpenAI and vLLM report it); a cut by `max_tokens` stays "length"
(atombatch/serve/chat_output.py: `chat_finish_reason`, and what a cut call's message holds).

Response side: a parser is an incremental state machine over the detokenized text. `feed(text)`
takes whatever text arrived and returns a `Delta` (content text, and call deltas: a call's
`index`, `id` and `name` once, then pieces of its `arguments`); `finish()` flushes what it held
back. Non-streamed responses run the same machine over the whole text at once, so a stream's
deltas always add up to the whole response. What a parser holds back is bounded: a possible tag
prefix (a few characters), a whitespace run (`MAX_HELD_WHITESPACE`), a call's text
(`MAX_TOOL_CALL_CHARS`, else `ToolCallError`), at most `MAX_TOOL_CALLS` calls per message.

Formats:
- `hermes` (Qwen2.5 / Qwen3, Hermes): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
  any number of them, with text around them (text before the first call is the content; whitespace
  around calls is dropped);
- `llama3_json` (Llama 3.1 / 3.2, KONI): the whole output is `{"name": N, "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`; an output that does not start
  with `{` is plain content.
A call object may spell its arguments `arguments` or `parameters`, as an object or a JSON string;
a call without a readable name is returned as content text, unchanged.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from atombatch.api.structured import StructuredOutput
from atombatch.errors import RequestError

TOOL_PARSER_NAMES = ("hermes", "llama3_json")

# Bounds on what a client sends (checked before the template renders anything).
MAX_TOOLS = 128                      # tools in one request
MAX_TOOLS_CHARS = 1 << 18            # characters of the tools' JSON together (schemas included)
MAX_TOOL_NAME_CHARS = 64             # OpenAI's rule: [a-zA-Z0-9_-]{1,64}
# Bounds on what a parser holds while the model writes.
MAX_TOOL_CALLS = 64                  # calls in one message
MAX_TOOL_CALL_CHARS = 1 << 18        # characters of one call's text
MAX_HELD_WHITESPACE = 4096           # a longer whitespace run is sent as content at once
MAX_KEY_CHARS = 256                  # a call object's key (name, arguments, ...)

_NAME = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_TOOL_NAME_CHARS}}}")
ToolMode = Literal["none", "auto", "required", "named"]


class NoToolParser(RequestError):
    """`tool_choice` auto on a server started without `--tool-call-parser`."""


class ToolCallError(RequestError):
    """The model's tool-call text broke a parser bound (the request ends with an error)."""

    http_status = 500


# -- request side ---------------------------------------------------------------------------------
class ToolPlan:
    """What `tools` / `tool_choice` / `parallel_tool_calls` ask of one chat request.

    Raises (from `from_request`):
        RequestError: a bound is broken, a tool is malformed, the choice names no given tool, or
            `auto` is asked of a server without a tool-call parser.
    """

    __slots__ = ("mode", "name", "parallel", "parser", "tools")

    def __init__(self, mode: ToolMode, tools: list[dict[str, Any]] | None, name: str | None,
                 parser: str | None, parallel: bool) -> None:
        self.mode = mode
        self.tools = tools            # what the chat template sees (None: no tools)
        self.name = name              # the named choice's function
        self.parser = parser          # --tool-call-parser
        self.parallel = parallel

    @classmethod
    def from_request(cls, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None,
                     parallel: bool | None, parser: str | None) -> ToolPlan:
        if tools is None:
            if choice not in (None, "none"):
                raise RequestError(f"tool_choice={_clip(choice)} needs tools", param="tool_choice")
            return cls("none", None, None, parser, True)
        checked = check_tools(tools)
        names = [t["function"]["name"] for t in checked]
        if choice is None:
            choice = "auto"
        name = None
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") != "function" or not isinstance(function, dict) or \
                    not isinstance(function.get("name"), str):
                raise RequestError("tool_choice must be none, auto, required or "
                                   '{"type": "function", "function": {"name": ...}}',
                                   param="tool_choice")
            name = function["name"]
            if name not in names:
                raise RequestError(f"tool_choice names {_clip(name)}, which is not among the "
                                   "tools", param="tool_choice")
            mode: ToolMode = "named"
        elif choice in ("none", "auto", "required"):
            mode = choice  # type: ignore[assignment]
        else:
            raise RequestError(f"tool_choice={_clip(choice)} must be none, auto, required or a "
                               "named function", param="tool_choice")
        if mode == "auto" and parser is None:
            raise NoToolParser("tool_choice auto needs a tool-call parser: start the server with "
                               "--tool-call-parser (hermes or llama3_json), or send tool_choice "
                               "none (tools only shown to the template), required or a named "
                               "function", param="tool_choice")
        return cls(mode, checked, name, parser, parallel is not False)

    def constraint(self) -> StructuredOutput | None:
        """The JSON schema the output must match (`required` and named choices)."""
        if self.mode == "named":
            return StructuredOutput.json_schema(self._parameters(self.name), param="tool_choice")
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        variants = [{"type": "object",
                     "properties": {"name": {"type": "string", "enum": [name]},
                                    "parameters": _hoist_defs(self._parameters(name), name,
                                                              defs)},
                     "required": ["name", "parameters"]}
                    for name in self.names]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"anyOf": variants} if len(variants) > 1
                                  else variants[0]}
        if defs:
            schema["$defs"] = defs
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput.json_schema(schema, param="tool_choice")

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or ()]

    def _parameters(self, name: str | None) -> Any:
        for tool in self.tools or ():
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise AssertionError(name)

    def parser_for_output(self) -> ToolParser | None:
        """A fresh parser for one choice's output (None: the output is plain content)."""
        if self.mode == "named":
            assert self.name is not None
            return NamedCallParser(self.name)
        if self.mode == "required":
            return JsonCallsParser(array=True)
        if self.mode == "auto":
            return make_parser(self.parser)
        return None


def _hoist_defs(parameters: Any, tool: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters schema moved under the array schema of a `required` choice: its
    `$defs` / `definitions` go to the root (where its `#/$defs/...` references point), renamed
    `<tool>.<name>` when another tool defines the same name differently."""
    if not isinstance(parameters, dict):
        return parameters
    own = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not own:
        return parameters
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    renames: dict[str, str] = {}
    for name, definition in own.items():
        target = name if defs.get(name, definition) == definition else f"{tool}.{name}"
        defs[target] = definition
        if target != name:
            renames[name] = target

    def relink(value: Any) -> Any:
        if isinstance(value, dict):
            out = {k: relink(v) for k, v in value.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix):
                        name = ref[len(prefix):]
                        out["$ref"] = "#/$defs/" + renames.get(name, name)
            return out
        if isinstance(value, list):
            return [relink(v) for v in value]
        return value

    body = relink(body)
    for name in own:  # the definitions' own references, too
        target = renames.get(name, name)
        defs[target] = relink(defs[target])
    return body


def check_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """The tools, checked against OpenAI's shape and this server's bounds."""
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"{len(tools)} tools, more than MAX_TOOLS={MAX_TOOLS}",
                           param="tools", limit=MAX_TOOLS)
    if not tools:
        raise RequestError("tools is empty: leave it out, or give at least one", param="tools")
    size = len(msgspec.json.encode(tools))
    if size > MAX_TOOLS_CHARS:
        raise RequestError(f"the tools take {size} bytes of JSON, more than "
                           f"MAX_TOOLS_CHARS={MAX_TOOLS_CHARS}", param="tools",
                           limit=MAX_TOOLS_CHARS)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise RequestError(f'{where} must be {{"type": "function", "function": {{...}}}}',
                               param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"{where}.function.name={_clip(name)} must be 1..."
                               f"{MAX_TOOL_NAME_CHARS} of [A-Za-z0-9_.-]",
                               param=f"{where}.function.name", limit=MAX_TOOL_NAME_CHARS)
        if name in seen:
            raise RequestError(f"{where}: a second tool named {name!r}",
                               param=f"{where}.function.name")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict | bool):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object",
                               param=f"{where}.function.parameters")
    return [dict(t, type="function") for t in tools]


# -- response side --------------------------------------------------------------------------------
class CallDelta(msgspec.Struct):
    """A piece of one call: its id and name come once, with the call's first delta."""

    index: int                       # the call's position in the message
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Delta(msgspec.Struct):
    content: str = ""
    calls: list[CallDelta] = []


class ToolParser(abc.ABC):
    """An incremental parser of one choice's output text."""

    def __init__(self) -> None:
        self.count = 0                  # calls started
        # set by finish(): the output ended inside a call (its JSON is not whole), so a parser
        # run over the whole text fails, as vLLM's does (a `length` cut: atombatch/serve/chat_output.py)
        self.unfinished = False

    @abc.abstractmethod
    def feed(self, text: str) -> Delta:
        """The content and call pieces `text` (the next output text) completes."""

    @abc.abstractmethod
    def finish(self) -> Delta:
        """What was held back, once the output ended."""

    def _start(self, name: str, out: list[CallDelta]) -> None:
        if self.count >= MAX_TOOL_CALLS:
            raise ToolCallError(f"the model wrote more than MAX_TOOL_CALLS={MAX_TOOL_CALLS} tool "
                                "calls in one message", limit=MAX_TOOL_CALLS)
        out.append(CallDelta(index=self.count, id=f"call_{uuid.uuid4().hex[:24]}", name=name))
        self.count += 1

    def _delta(self) -> Delta:
        """The content released and the call pieces made since the last delta (parsers that
        keep `content` and `calls`)."""
        delta = Delta(content=self.content.take(), calls=self.calls)  # type: ignore[attr-defined]
        self.calls: list[CallDelta] = []
        return delta

    def _arguments(self, text: str, out: list[CallDelta]) -> None:
        if not text:
            return
        if out and out[-1].index == self.count - 1:
            out[-1].arguments += text
        else:
            out.append(CallDelta(index=self.count - 1, arguments=text))


def make_parser(name: str | None) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return JsonCallsParser()
    raise RequestError(f"tool-call parser {name!r} is not one of {', '.join(TOOL_PARSER_NAMES)}")


class _CallObject:
    """One call object `{"name": N, "arguments" | "parameters": V, ...}`, scanned a character at a
    time. The name is reported once read; the arguments (an object or array) as they are read, a
    string or scalar value once complete; before the name is known they are held."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.raw: list[str] = []          # every character fed (the fallback content)
        self.state = "start"
        self.in_string = False
        self.escape = False
        self.key: list[str] = []
        self.value_key = ""
        self.value: list[str] = []        # the current value's characters (name, string args)
        self.kind = ""                    # "string", "container" or "scalar"
        self.depth = 0                    # nesting inside a container value
        self.name: str | None = None
        self.held_arguments: list[str] = []  # read before the name
        self.ready: list[str] = []        # arguments to report (after the name)
        self.got_arguments = False
        self.started = False              # the parser reported the call (its name is known)

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def broken(self) -> bool:
        return self.state == "bad"

    def feed(self, ch: str) -> None:
        self.raw.append(ch)
        if len(self.raw) > MAX_TOOL_CALL_CHARS:
            raise ToolCallError(f"a tool call of more than MAX_TOOL_CALL_CHARS="
                                f"{MAX_TOOL_CALL_CHARS} characters", limit=MAX_TOOL_CALL_CHARS)
        state = self.state
        if state in ("done", "bad"):
            if state == "done" and not ch.isspace():
                self.state = "bad"
            return
        if state == "value":
            self._value(ch)
            return
        if state == "key":
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.state = "colon"
                return
            self.key.append(ch)
            if len(self.key) > MAX_KEY_CHARS:
                self.state = "bad"
            return
        if ch.isspace():
            return
        if state == "start":
            self.state = "key_or_end" if ch == "{" else "bad"
        elif state in ("key_or_end", "key_next"):
            if ch == '"':
                self.key = []
                self.state = "key"
            elif ch == "}" and state == "key_or_end":
                self.state = "done"
            else:
                self.state = "bad"
        elif state == "colon":
            self.state = "value_start" if ch == ":" else "bad"
        elif state == "value_start":
            self.value_key = _decode_string("".join(self.key)) or ""
            self.value = [ch]
            self.depth = 0
            if ch == '"':
                self.kind, self.in_string = "string", True
            elif ch in "{[":
                self.kind, self.depth = "container", 1
            else:
                self.kind = "scalar"
            self.state = "value"
            if self.kind == "container":
                self._argument(ch)
        elif state == "after_value":
            self._after_value(ch)

    def _value(self, ch: str) -> None:
        if self.in_string:
            self.value.append(ch)
            self._argument(ch)
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.kind == "string":
                    self._end_value()
            return
        if self.kind == "scalar":
            if ch in ",}" or ch.isspace():
                self._end_value()
                if not ch.isspace():
                    self._after_value(ch)
                return
            self.value.append(ch)
            return
        self.value.append(ch)
        self._argument(ch)
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_value()

    def _argument(self, ch: str) -> None:
        """A character of a container argument value, streamed as it comes."""
        if self.kind != "container" or self.value_key not in self.ARGUMENT_KEYS or \
                self.got_arguments:
            return
        (self.ready if self.name is not None else self.held_arguments).append(ch)

    def _end_value(self) -> None:
        self.state = "after_value"
        raw = "".join(self.value)
        if self.value_key == "name":
            name = _decode_string(raw) if self.kind == "string" else None
            if name is None or self.name is not None:
                self.state = "bad"
                return
            self.name = name
            self.ready.extend(self.held_arguments)
            self.held_arguments = []
        elif self.value_key in self.ARGUMENT_KEYS and not self.got_arguments:
            if self.kind != "container":  # a JSON string holding the arguments, or a scalar
                text = _decode_string(raw) if self.kind == "string" else raw
                (self.ready if self.name is not None else self.held_arguments).append(
                    raw if text is None else text)
            self.got_arguments = True

    def _after_value(self, ch: str) -> None:
        if ch == ",":
            self.state = "key_next"
        elif ch == "}":
            self.state = "done"
        else:
            self.state = "bad"

    def take(self) -> str:
        """The arguments read since the last call (once the name is known)."""
        if not self.ready:
            return ""
        text = "".join(self.ready)
        self.ready = []
        return text

    @property
    def in_json_string(self) -> bool:
        return self.in_string or self.state == "key"


def _decode_string(raw: str) -> str | None:
    try:
        value = json.loads(raw if raw.startswith('"') else f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _Text:
    """Content text with whitespace runs held until something follows them."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.held: list[str] = []
        self.held_chars = 0

    def char(self, ch: str) -> None:
        if ch.isspace():
            self.held.append(ch)
            self.held_chars += 1
            if self.held_chars > MAX_HELD_WHITESPACE:
                self.flush()
            return
        self.flush()
        self.out.append(ch)

    def text(self, text: str) -> None:
        for ch in text:
            self.char(ch)

    def flush(self) -> None:
        self.out.extend(self.held)
        self.drop()

    def drop(self) -> None:
        self.held = []
        self.held_chars = 0

    def take(self) -> str:
        text = "".join(self.out)
        self.out = []
        return text


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks among text (Qwen3, Hermes)."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.content = _Text()
        self.tag = ""                       # characters that may begin START (text) or END (call)
        self.call: _CallObject | None = None
        self.calls: list[CallDelta] = []
        self.before = ""                    # whitespace dropped before the current block
        self.after_call = False             # whitespace right after a call is dropped

    def feed(self, text: str) -> Delta:
        for ch in text:
            self._char(ch)
        return self._delta()

    def finish(self) -> Delta:
        self.unfinished = self.call is not None
        if self.call is not None:
            for ch in self.tag:
                self.call.feed(ch)
            self.tag = ""
            self._close(terminated=False)
        else:
            self.content.text(self.tag)
            self.tag = ""
            if self.count == 0:
                self.content.flush()
        self.content.drop()
        return self._delta()

    def _char(self, ch: str) -> None:
        if self.call is None:
            if self.after_call:
                if ch.isspace():
                    return
                self.after_call = False
            if self.tag or ch == "<":
                if self.START.startswith(self.tag + ch):
                    self.tag += ch
                    if self.tag == self.START:
                        self.tag = ""
                        self.before = "".join(self.content.held)
                        self.content.drop()       # whitespace before a call is not content
                        self.call = _CallObject()
                    return
                pending, self.tag = self.tag, ""
                self.content.text(pending)
                self._char(ch)
                return
            self.content.char(ch)
            return
        call = self.call
        if not call.in_json_string and (self.tag or ch == "<"):
            if self.END.startswith(self.tag + ch):
                self.tag += ch
                if self.tag == self.END:
                    self.tag = ""
                    self._close(terminated=True)
                return
            pending, self.tag = self.tag, ""
            for c in pending:
                self._call_char(c)
            self._char(ch)
            return
        self._call_char(ch)

    def _call_char(self, ch: str) -> None:
        call = self.call
        assert call is not None
        call.feed(ch)
        if call.name is not None and not call.started:
            self._start(call.name, self.calls)
            call.started = True
        if call.started:
            self._arguments(call.take(), self.calls)

    def _close(self, terminated: bool) -> None:
        call = self.call
        assert call is not None
        self.call = None
        if call.started:
            self._arguments(call.take(), self.calls)
            self.after_call = True
            return
        # no readable name: the block is content, as the model wrote it
        self.content.text(self.before + self.START + "".join(call.raw) +
                          (self.END if terminated else ""))


class JsonCallsParser(ToolParser):
    """Call objects as the whole output: Llama 3 JSON (`{...}; {...}`, optionally after
    `<|python_tag|>`) or, with `array`, the JSON array a `required` choice is constrained to."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, array: bool = False) -> None:
        super().__init__()
        self.array = array
        self.state = "start"                # start, tag, objects, between, content, end
        self.content = _Text()
        self.tag = ""
        self.call: _CallObject | None = None
        self.calls: list[CallDelta] = []
        self.raw_prefix: list[str] = []     # what preceded the first object (the fallback)

    def feed(self, text: str) -> Delta:
        for ch in text:
            self._char(ch)
        return self._delta()

    def finish(self) -> Delta:
        # an open object, or (`required`) an array not closed yet
        self.unfinished = self.call is not None or (self.array and self.state == "between")
        if self.call is not None:
            self._close()
        if self.state in ("start", "tag"):
            self.content.text(self.tag)
            self.content.flush()
        elif self.state == "content":
            self.content.flush()
        self.content.drop()
        return self._delta()

    def _char(self, ch: str) -> None:
        state = self.state
        if state == "content":
            self.content.char(ch)
        elif state == "start":
            if ch.isspace():
                self.content.char(ch)
            elif ch == "[" and self.array:
                self.content.drop()
                self.state = "between"
            elif ch == "{" and not self.array:
                self.content.drop()
                self._open(ch)
            elif ch == "<" and not self.array:
                self.tag = ch
                self.state = "tag"
            else:
                self._to_content(ch)
        elif state == "tag":
            if self.PYTHON_TAG.startswith(self.tag + ch):
                self.tag += ch
                if self.tag == self.PYTHON_TAG:
                    self.tag = ""
                    self.content.drop()
                    self.state = "between"
                return
            pending, self.tag = self.tag, ""
            self._to_content(pending)
            self._char(ch)
        elif state == "objects":
            call = self.call
            assert call is not None
            call.feed(ch)
            if call.name is not None and not call.started:
                self._start(call.name, self.calls)
                call.started = True
            if call.started:
                self._arguments(call.take(), self.calls)
            if call.done or call.broken:
                self._close()
        elif state == "between":
            if ch.isspace() or (ch in ";," and self.count):
                return
            if ch == "{":
                self._open(ch)
            elif ch == "]" and self.array:
                self.state = "end"
            else:
                self._to_content(ch)
        elif state == "end" and not ch.isspace():
            self._to_content(ch)

    def _open(self, ch: str) -> None:
        self.call = _CallObject()
        self.state = "objects"
        self.call.feed(ch)

    def _close(self) -> None:
        call = self.call
        assert call is not None
        self.call = None
        self.state = "between"
        if call.started:
            self._arguments(call.take(), self.calls)
            if call.broken:
                self.state = "content"
            return
        self._to_content("".join(call.raw))

    def _to_content(self, text: str) -> None:
        self.state = "content"
        self.content.flush()
        self.content.text(text)


class NamedCallParser(ToolParser):
    """A named `tool_choice`: the whole output is the arguments of one call."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.size = 0

    def feed(self, text: str) -> Delta:
        calls: list[CallDelta] = []
        if self.count == 0:
            self._start(self.name, calls)
        self.size += len(text)
        if self.size > MAX_TOOL_CALL_CHARS:
            raise ToolCallError(f"a tool call of more than MAX_TOOL_CALL_CHARS="
                                f"{MAX_TOOL_CALL_CHARS} characters", limit=MAX_TOOL_CALL_CHARS)
        self._arguments(text, calls)
        return Delta(calls=calls)

    def finish(self) -> Delta:
        return self.feed("") if self.count == 0 else Delta()


class Assembled(msgspec.Struct):
    """A whole message out of a parser's deltas."""

    content: str
    calls: list[CallDelta]           # one per call, its arguments joined


def assemble(deltas: Sequence[Delta]) -> Assembled:
    content: list[str] = []
    calls: list[CallDelta] = []
    for delta in deltas:
        content.append(delta.content)
        for call in delta.calls:
            if call.id is not None:
                calls.append(CallDelta(index=call.index, id=call.id, name=call.name,
                                       arguments=call.arguments))
            else:
                calls[call.index].arguments += call.arguments
    return Assembled(content="".join(content), calls=calls)


def _clip(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
