"""One chat choice's generated text as an assistant message: reasoning, content and tool calls.

The text goes through the reasoning parser (`--reasoning-parser`, atombatch/serve/reasoning.py)
and then its content through the tool-call parser the request asks for (atombatch/serve/tools.py).
Both are incremental, so a stream's deltas (`ChatDelta` with `content`, `reasoning_content` and
OpenAI's `tool_calls` deltas) add up to the non-streamed message, which is built by running the
same parsers over the whole text at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from atombatch.api.structs import SamplingParams
from atombatch.errors import RequestError
from atombatch.serve.protocol import (
    ChatDelta,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from atombatch.serve.reasoning import make_reasoning_parser, reasoning_end_ids
from atombatch.serve.tools import CallDelta, Delta, ToolParser, ToolPlan

if TYPE_CHECKING:
    from atombatch.serve.structured import StructuredRequests


class UnservableConstraint(RequestError):
    """A constraint this server cannot run (no tokenizer to constrain text with)."""


class ChatConstraints:
    """The constraints a chat request gets besides its own `response_format`: a `required` or
    named tool choice's JSON schema (checked and lowered by the grammar workers, which remember
    it), and with a reasoning parser the room to think before any constraint
    (`StructuredOutput.after`: the constraint starts after `</think>`)."""

    def __init__(self, structured: StructuredRequests, reasoning_parser: str | None,
                 tokenizer: Any | None) -> None:
        self.structured = structured      # the server's checker of constraints
        self.reasoning_parser = reasoning_parser
        self.tokenizer = tokenizer

    def needs_check(self, plan: ToolPlan) -> bool:
        """Whether `apply` may compile (then run it off the event loop)."""
        constraint = plan.constraint() if plan.mode in ("required", "named") else None
        checker = self.structured.checker
        if constraint is None or checker is None:
            return False
        return checker.known(constraint) is None

    def apply(self, params: SamplingParams, plan: ToolPlan, prompt: Sequence[int]
              ) -> SamplingParams:
        """Raises: UnservableConstraint, RequestError (both naming the field)."""
        constraint = plan.constraint()
        if constraint is not None:
            if params.structured is not None:
                raise RequestError(f"tool_choice={plan.mode} constrains the output to tool "
                                   f"calls, and {params.structured.param} constrains it too: "
                                   "send one", param="tool_choice")
            if self.structured.checker is None:
                raise UnservableConstraint(f"tool_choice={plan.mode} needs constrained "
                                           "decoding, which needs a tokenizer (this server "
                                           "serves token ids)", param="tool_choice")
            try:
                checked = self.structured.check(constraint)
            except RequestError as exc:
                raise RequestError(f"tool_choice={plan.mode}: the tools' schema cannot be "
                                   f"enforced: {exc}", param="tools",
                                   limit=exc.limit) from None
            params = msgspec.structs.replace(params, structured=checked)
        if self.reasoning_parser is None or params.structured is None:
            return params
        after = reasoning_end_ids(self.tokenizer, prompt)
        if not after:
            return params
        return msgspec.structs.replace(
            params, structured=msgspec.structs.replace(params.structured, after=after))


class Piece(msgspec.Struct):
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = []


class ChatOutput:
    """The parsers of one choice (None of them: the text is the content, unchanged)."""

    def __init__(self, tools: ToolPlan | None, reasoning_parser: str | None) -> None:
        self.reasoning = make_reasoning_parser(reasoning_parser)
        self.tools: ToolParser | None = tools.parser_for_output() if tools is not None else None
        self.mode = tools.mode if tools is not None else None
        self.content: list[str] = []   # the text the tool parser read (past any reasoning)
        self.saw_reasoning = False
        # parallel_tool_calls=false: the model's first call only (later ones are dropped)
        self.keep = 1 if tools is not None and not tools.parallel else None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.count > 0

    def feed(self, text: str) -> Piece:
        """Raises: ToolCallError (a parser bound)."""
        return self._piece(*self._split(text), final=False)

    def finish(self) -> Piece:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._piece(reasoning, content, final=True)

    def _split(self, text: str) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        return self.reasoning.feed(text)

    def _piece(self, reasoning: str, content: str, final: bool) -> Piece:
        if self.reasoning is not None and self.reasoning.saw_reasoning:
            self.saw_reasoning = True
        if self.tools is None:
            return Piece(reasoning=reasoning, content=content)
        self.content.append(content)
        delta: Delta = self.tools.feed(content) if content else Delta()
        if final:
            last = self.tools.finish()
            delta = Delta(content=delta.content + last.content, calls=delta.calls + last.calls)
        calls = delta.calls if self.keep is None else \
            [c for c in delta.calls if c.index < self.keep]
        return Piece(reasoning=reasoning, content=delta.content, calls=calls)


def delta_of(piece: Piece) -> ChatDelta:
    """A streamed piece as OpenAI's chat delta (empty fields left out)."""
    calls = None
    if piece.calls:
        calls = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                               function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                 for c in piece.calls]
    return ChatDelta(content=piece.content or None, reasoning_content=piece.reasoning or None,
                     tool_calls=calls)


def chat_finish_reason(finish: str | None, output: ChatOutput) -> str | None:
    """A chat choice's `finish_reason` as vLLM resolves it: "tool_calls" only when the choice
    carries calls and the model stopped on its own; a cut by `max_tokens` stays "length" (a
    client can tell a truncated call from a whole one), and a named `tool_choice` reports
    "stop" (the call was forced, as OpenAI reports it)."""
    if finish == "stop" and output.made_calls and output.mode != "named":
        return "tool_calls"
    return finish


def message_of(output: ChatOutput, text: str, finish: str | None = None) -> ChatResponseMessage:
    """The whole message of a finished choice whose text is `text` (ended with `finish`).

    A call cut by `max_tokens` (`finish` "length", the parser ended inside a call) is returned
    as vLLM returns it: `auto` gives no calls and the text as content, as written (vLLM's
    parsers fail on the cut JSON); `required` gives no calls and empty content (the array does
    not validate); a named choice keeps its one call with the arguments as far as written."""
    if not output.active:
        return ChatResponseMessage("assistant", text)
    first, last = output.feed(text), output.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    raw = first.calls + last.calls
    if finish == "length" and output.tools is not None and output.tools.unfinished and \
            output.mode in ("auto", "required"):
        content = "".join(output.content) if output.mode == "auto" else ""
        return ChatResponseMessage(
            "assistant", content if content or output.mode == "required" or
            not output.saw_reasoning else None,
            reasoning_content=reasoning if output.saw_reasoning else None)
    calls: list[ToolCall] = []
    for call in raw:
        if call.id is not None:
            calls.append(ToolCall(id=call.id, function=FunctionCall(name=call.name or "",
                                                                    arguments=call.arguments)))
        else:
            calls[call.index].function.arguments += call.arguments
    return ChatResponseMessage(
        "assistant", content if content or not (calls or output.saw_reasoning) else None,
        tool_calls=calls or None,
        reasoning_content=reasoning if output.saw_reasoning else None)
