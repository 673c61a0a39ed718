"""One chat choice's generated text as an assistant message: reasoning, content and tool calls.

The text goes through the reasoning parser (`--reasoning-parser`, atombatch/serve/reasoning.py)
and then its content through the tool-call parser the request asks for (atombatch/serve/tools.py).
Both are incremental, so a stream's deltas (`ChatDelta` with `content`, `reasoning_content` and
OpenAI's `tool_calls` deltas) add up to the non-streamed message, which is built by running the
same parsers over the whole text at once.
"""

from __future__ import annotations

import msgspec

from atombatch.serve.protocol import (
    ChatDelta,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from atombatch.serve.reasoning import make_reasoning_parser
from atombatch.serve.tools import CallDelta, Delta, ToolParser, ToolPlan


class Piece(msgspec.Struct):
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = []


class ChatOutput:
    """The parsers of one choice (None of them: the text is the content, unchanged)."""

    def __init__(self, tools: ToolPlan | None, reasoning_parser: str | None) -> None:
        self.reasoning = make_reasoning_parser(reasoning_parser)
        self.tools: ToolParser | None = tools.parser_for_output() if tools is not None else None
        self.saw_reasoning = False

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
        delta: Delta = self.tools.feed(content) if content else Delta()
        if final:
            last = self.tools.finish()
            delta = Delta(content=delta.content + last.content, calls=delta.calls + last.calls)
        return Piece(reasoning=reasoning, content=delta.content, calls=delta.calls)


def delta_of(piece: Piece) -> ChatDelta:
    """A streamed piece as OpenAI's chat delta (empty fields left out)."""
    calls = None
    if piece.calls:
        calls = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                               function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                 for c in piece.calls]
    return ChatDelta(content=piece.content or None, reasoning_content=piece.reasoning or None,
                     tool_calls=calls)


def message_of(output: ChatOutput, text: str) -> ChatResponseMessage:
    """The whole message of a finished choice whose text is `text`."""
    if not output.active:
        return ChatResponseMessage("assistant", text)
    first, last = output.feed(text), output.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    calls: list[ToolCall] = []
    for call in first.calls + last.calls:
        if call.id is not None:
            calls.append(ToolCall(id=call.id, function=FunctionCall(name=call.name or "",
                                                                    arguments=call.arguments)))
        else:
            calls[call.index].function.arguments += call.arguments
    return ChatResponseMessage(
        "assistant", content if content or not (calls or output.saw_reasoning) else None,
        tool_calls=calls or None,
        reasoning_content=reasoning if output.saw_reasoning else None)
