"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list
of strings, or a Lark/EBNF grammar (`SamplingParams.structured`).

`StructuredOutput` is a plain value: it says *what* is allowed and nothing about how. The engine
turns it into a grammar and a matcher per request (atombatch/sampling/grammar.py) whose token bitmask
masks the logits before sampling (docs/sampling.md); the server builds it from OpenAI's
`response_format` and vLLM's `structured_outputs` / `guided_*` fields (atombatch/serve/structured.py).

Shape rules are checked when the value is built (`RequestError` naming the field); whether the
grammar compiles, and whether the model's tokenizer can satisfy it, is checked at submit.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
import numpy as np

from atombatch.errors import RequestError

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# Characters of a schema / regex / grammar / all choices together, at most. A server may set a
# lower bound (`--max-structured-chars`); this one holds for every embedder.
MAX_STRUCTURED_CHARS = 1 << 20
MAX_CHOICES = 1024                         # strings in a `choice` constraint at most
MAX_AFTER_IDS = 64                         # ids in `after` (the end of a preamble) at most
# Nesting of a JSON schema's text (arrays and objects), at most: checked before anything parses
# it recursively (a string nested 3 000 deep raised RecursionError in the JSON parsers)
MAX_SCHEMA_DEPTH = 128
MAX_LOWERED_CHARS = 4 * MAX_STRUCTURED_CHARS   # `lowered` grammar text at most


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A constraint on the generated text. Build it with the class methods:

        StructuredOutput.json_schema({"type": "object", ...})
        StructuredOutput.json_object()
        StructuredOutput.regex(r"[0-9]{3}")
        StructuredOutput.choice(["yes", "no"])
        StructuredOutput.grammar('start: "a"+')      # Lark (llguidance's dialect) or GBNF

    The whole generated text (up to EOS, a stop token, or `max_tokens`) must match; the request
    stops with EOS once the constraint admits nothing more. With `after` (e.g. the ids of a
    reasoning parser's `</think>`), the text up to and including the first occurrence of those
    ids is free and the constraint covers what follows (every constructor takes `after=`, or
    `msgspec.structs.replace(spec, after=ids)`).
    """

    kind: StructuredKind                       # which of the five constraints
    value: str = ""                            # json_schema: the schema as JSON text; regex: the
                                               #   pattern; grammar: the grammar text; else ""
    choices: tuple[str, ...] = ()              # choice: the allowed strings, exactly
    whitespace_pattern: str | None = None      # JSON kinds: a regex for the whitespace allowed
                                               #   between tokens (None: llguidance's default)
    param: str = "structured"                  # the request field it came from, named in errors
    after: tuple[int, ...] = ()                # token ids ending a preamble the constraint does
                                               #   not cover (a reasoning block's `</think>`):
                                               #   it applies to the output after their first
                                               #   occurrence; () = from the first token
    lowered: str = ""                          # the llguidance grammar it compiles to, as a
                                               #   checker made it (atombatch/sampling/grammar_check.py;
                                               #   "": the engine makes it on its compile thread)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(f"{self.param}: kind={self.kind!r} must be one of "
                               f"{', '.join(STRUCTURED_KINDS)}", param=self.param)
        if not isinstance(self.value, str):
            raise RequestError(f"{self.param}: the {self.kind} must be a string",
                               param=self.param)
        if self.kind in ("json_schema", "regex", "grammar") and not self.value:
            raise RequestError(f"{self.param}: the {self.kind} is empty", param=self.param)
        if self.kind in ("json_object", "choice") and self.value:
            raise RequestError(f"{self.param}: a {self.kind} constraint takes no value",
                               param=self.param)
        if self.kind == "choice":
            if not self.choices:
                raise RequestError(f"{self.param}: choice needs at least one string",
                                   param=self.param)
            if len(self.choices) > MAX_CHOICES:
                raise RequestError(f"{self.param}: {len(self.choices)} choices, at most "
                                   f"{MAX_CHOICES}", param=self.param, limit=MAX_CHOICES)
            if not all(isinstance(c, str) for c in self.choices):
                raise RequestError(f"{self.param}: every choice must be a string",
                                   param=self.param)
        elif self.choices:
            raise RequestError(f"{self.param}: choices are only for kind='choice'",
                               param=self.param)
        if self.whitespace_pattern is not None:
            if self.kind not in ("json_schema", "json_object"):
                raise RequestError(f"{self.param}: whitespace_pattern applies only to JSON",
                                   param="whitespace_pattern")
            if not isinstance(self.whitespace_pattern, str):
                raise RequestError("whitespace_pattern must be a string",
                                   param="whitespace_pattern")
        if not isinstance(self.after, tuple) or len(self.after) > MAX_AFTER_IDS or \
                not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        for t in self.after):
            raise RequestError(f"{self.param}: after={self.after!r} must be at most "
                               f"{MAX_AFTER_IDS} token ids", param=self.param)
        if self.chars > MAX_STRUCTURED_CHARS:
            raise RequestError(f"{self.param}: {self.chars} characters of {self.kind}, at most "
                               f"{MAX_STRUCTURED_CHARS}", param=self.param,
                               limit=MAX_STRUCTURED_CHARS)
        if not isinstance(self.lowered, str) or len(self.lowered) > MAX_LOWERED_CHARS:
            raise RequestError(f"{self.param}: the lowered grammar must be a string of at most "
                               f"{MAX_LOWERED_CHARS} characters", param=self.param,
                               limit=MAX_LOWERED_CHARS)
        if self.kind == "json_schema" and not self.lowered:  # (lowered: checked; never parsed)
            depth = json_depth(self.value)
            if depth > MAX_SCHEMA_DEPTH:
                raise RequestError(f"{self.param}: the JSON schema nests {depth} arrays and "
                                   f"objects deep, at most {MAX_SCHEMA_DEPTH}", param=self.param,
                                   limit=MAX_SCHEMA_DEPTH)

    @property
    def chars(self) -> int:
        """The size the limits count: characters of the value, the choices and the pattern."""
        return (len(self.value) + sum(len(c) for c in self.choices) +
                len(self.whitespace_pattern or ""))

    # -- constructors -----------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, *,
                    whitespace_pattern: str | None = None, param: str = "structured",
                    after: tuple[int, ...] = ()) -> StructuredOutput:
        """Output is one JSON value that validates against `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            text = schema
        else:
            try:
                text = msgspec.json.encode(schema).decode()
            except (TypeError, msgspec.EncodeError) as exc:
                raise RequestError(f"{param}: the JSON schema cannot be encoded: {exc}",
                                   param=param) from None
        return cls(kind="json_schema", value=text, whitespace_pattern=whitespace_pattern,
                   param=param, after=after)

    @classmethod
    def json_object(cls, *, whitespace_pattern: str | None = None, param: str = "structured",
                    after: tuple[int, ...] = ()) -> StructuredOutput:
        """Output is one JSON object (any keys and values)."""
        return cls(kind="json_object", whitespace_pattern=whitespace_pattern, param=param,
                   after=after)

    @classmethod
    def regex(cls, pattern: str, *, param: str = "structured",
              after: tuple[int, ...] = ()) -> StructuredOutput:
        """Output matches `pattern` as a whole (Rust regex syntax, as llguidance reads it)."""
        return cls(kind="regex", value=pattern, param=param, after=after)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...], *, param: str = "structured",
               after: tuple[int, ...] = ()) -> StructuredOutput:
        """Output is exactly one of `choices`."""
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
            raise RequestError(f"{param}: choice must be a list of strings", param=param)
        return cls(kind="choice", choices=tuple(choices), param=param, after=after)

    @classmethod
    def grammar(cls, text: str, *, param: str = "structured",
                after: tuple[int, ...] = ()) -> StructuredOutput:
        """Output is derived from the grammar's `start` rule (Lark, or GBNF with `root ::=`)."""
        return cls(kind="grammar", value=text, param=param, after=after)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text` (strings skipped), without a recursive
    parse: what may be handed to one is bounded by this first. Malformed text gets a number too
    (its parser then says what is wrong)."""
    brackets = "".join(_BRACKET.findall(_JSON_STRING.sub("", text)))
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.encode(), dtype=np.uint8)
    opens = (steps == ord("[")) | (steps == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1)).max())
