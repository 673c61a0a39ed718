"""`--reasoning-parser`: a model's thinking split out as `reasoning_content` (as vLLM does).

`qwen3`: an output that begins with `<think>` (after leading whitespace) is reasoning up to
`</think>`, and content after it; the text between the tags is `reasoning_content` exactly as
written, the text after `</think>` the content. As vLLM's Qwen3 parser, both tags are needed:
an output without `<think>` at its start is all content (`enable_thinking: false` renders an empty
think block into the prompt, so the model writes only the answer); an output cut off before
`</think>` is all reasoning (content null).

The parser is incremental (`feed(text) -> (reasoning, content)`, then `finish()`) and holds back
only a possible tag prefix and the leading whitespace (at most `MAX_LEADING_WHITESPACE`
characters); a non-streamed response runs it over the whole text. Its content goes on to the
tool-call parser when the request has tools (atombatch/serve/tools.py).

Constrained decoding applies after the reasoning, as in vLLM: with this parser, every constraint
(`response_format`, `structured_outputs`, `tool_choice` required or named) waits for the ids of
`</think>` (`StructuredOutput.after`, `reasoning_end_ids`), unless the prompt already closed the
think block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REASONING_PARSER_NAMES = ("qwen3",)
MAX_LEADING_WHITESPACE = 4096


class Qwen3ReasoningParser:
    START = "<think>"
    END = "</think>"

    def __init__(self) -> None:
        self.state = "start"          # start, reasoning, content
        self.held = ""                # leading whitespace, or a possible tag prefix
        self.saw_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for ch in text:
            self._char(ch, reasoning, content)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held

    def _char(self, ch: str, reasoning: list[str], content: list[str]) -> None:
        if self.state == "content":
            content.append(ch)
        elif self.state == "start":
            stripped = self.held.lstrip()
            if not stripped and ch.isspace() and len(self.held) < MAX_LEADING_WHITESPACE:
                self.held += ch
            elif self.START.startswith(stripped + ch):
                self.held += ch
                if stripped + ch == self.START:
                    self.held = ""
                    self.state = "reasoning"
                    self.saw_reasoning = True
            else:
                content.append(self.held + ch)
                self.held = ""
                self.state = "content"
        else:
            if self.held or ch == "<":
                if self.END.startswith(self.held + ch):
                    self.held += ch
                    if self.held == self.END:
                        self.held = ""
                        self.state = "content"
                    return
                pending, self.held = self.held, ""
                reasoning.append(pending)
                self._char(ch, reasoning, content)
                return
            reasoning.append(ch)


def make_reasoning_parser(name: str | None) -> Qwen3ReasoningParser | None:
    if name is None:
        return None
    if name == "qwen3":
        return Qwen3ReasoningParser()
    raise ValueError(f"reasoning parser {name!r} is not one of {', '.join(REASONING_PARSER_NAMES)}")



def reasoning_end_ids(tokenizer: Any, prompt: Sequence[int]) -> tuple[int, ...]:
    """The ids a constraint waits for (`StructuredOutput.after`): those of `</think>`, so the
    constraint covers the answer after the thinking. () when the prompt already closed the
    think block (Qwen3's template with `enable_thinking: false` renders an empty one), or the
    tokenizer is not there."""
    if tokenizer is None:
        return ()
    start = tuple(tokenizer.encode(Qwen3ReasoningParser.START, add_special_tokens=False).ids)
    end = tuple(tokenizer.encode(Qwen3ReasoningParser.END, add_special_tokens=False).ids)
    if not end:
        return ()
    last_start, last_end = _last(prompt, start), _last(prompt, end)
    if last_end >= 0 and last_end > last_start:
        return ()
    return end


def _last(ids: Sequence[int], needle: tuple[int, ...]) -> int:
    """The start of the last occurrence of `needle` in `ids`, or -1."""
    n = len(needle)
    if not n:
        return -1
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == needle:
            return i
    return -1
