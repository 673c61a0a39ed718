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

Constrained decoding applies after the reasoning: with this parser, a JSON or choice constraint
(`response_format`, `structured_outputs`, `tool_choice` required or named) becomes a grammar
that admits an optional `<think>...</think>` first (`constraint_after_reasoning`).
"""

from __future__ import annotations

import json
from typing import Any

from atombatch.structured import StructuredOutput

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


def constraint_after_reasoning(structured: StructuredOutput, tokenizer: Any
                               ) -> StructuredOutput | None:
    """A JSON or choice constraint that lets the model think first: `<think>`, any text up to
    `</think>`, whitespace, then what `structured` asks for (an llguidance Lark grammar, so the
    engine's one mask covers both parts). None for a regex or a grammar, which keep constraining
    the whole output.

    The tags are the tokenizer's own tokens when it has them as added tokens (Qwen3 does; the
    grammar then names them `<think>`), else text."""
    if structured.kind in ("json_schema", "json_object"):
        schema: Any = {"type": "object"} if structured.kind == "json_object" else \
            json.loads(structured.value)
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            return None
        options: dict[str, Any] = {"whitespace_flexible": False}
        if structured.whitespace_pattern is not None:
            options = {"whitespace_pattern": structured.whitespace_pattern}
        body = "%json " + json.dumps({**schema, "x-guidance": options})
    elif structured.kind == "choice":
        body = " | ".join(json.dumps(c) for c in structured.choices)
    else:
        return None
    added_tokens = set()
    if tokenizer is not None and hasattr(tokenizer, "get_added_tokens_decoder"):
        added_tokens = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    added = {Qwen3ReasoningParser.START, Qwen3ReasoningParser.END} <= added_tokens
    if added:  # the tags are tokens: the lazy thought ends where the </think> token comes
        think = ('think: <think> thought </think> /[ \\t\\r\\n]*/\n'
                 'thought[stop=""]: /(.|\\n)*/\n')
    else:      # the tags are text: the thought stops at (and takes) the text </think>
        think = ('think: "<think>" thought /[ \\t\\r\\n]*/\n'
                 'thought[stop="</think>"]: /(.|\\n)*/\n')
    lark = f"start: think? answer\n{think}answer: {body}\n"
    return StructuredOutput.grammar(lark, param=structured.param)
