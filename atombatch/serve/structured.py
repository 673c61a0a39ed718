"""Structured output as OpenAI and vLLM clients ask for it, turned into a `StructuredOutput`.

Three spellings, on chat and completions alike (docs/server.md lists the deviations):

- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`
  (the schema is enforced whether `strict` is true or not, as in vLLM);
- vLLM `structured_outputs`: exactly one of `json` (a schema, object or JSON text), `regex`,
  `choice` (a list of strings), `grammar` (Lark or GBNF), `json_object: true`, plus
  `whitespace_pattern`, `disable_any_whitespace` and the accepted-and-ignored `backend`,
  `disable_fallback`, `disable_additional_properties`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern` (and `guided_decoding_backend`, ignored).

At most one of them may constrain a request. The front checks the constraint before the request
reaches the engine: its size (`max_chars`, 400 naming the field and the limit) and a JSON
schema's nesting (`structured.MAX_SCHEMA_DEPTH`) on the event loop, before anything parses it;
then its lowering and compile against the model's tokenizer in a grammar worker process
(atombatch/sampling/grammar_check.py: a grammar that overflows the compiler's stack, exhausts its memory
or outlasts its time budget kills that worker and is a 400 naming the budget; the server runs
on). The checked constraint carries its lowered grammar to the engine, which only compiles it,
on its compile thread. Checks are remembered (`grammar_check.CHECKED_COUNT`), so a client that
sends the same schema every time pays once. At most `MAX_PENDING_CHECKS` new constraints wait
for the workers; past it a request is answered 429 (a client sending a stream of distinct
schemas cannot queue unbounded work, nor delay others' checks without bound).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from atombatch.api.structured import StructuredOutput
from atombatch.errors import CapacityError, ConfigError, RequestError
from atombatch.logs import logger
from atombatch.sampling.grammar_check import GRAMMAR_WALL_SECONDS, GrammarWorkers

DEFAULT_MAX_STRUCTURED_CHARS = 64 * 1024   # characters of one schema / regex / grammar / choices
MAX_PENDING_CHECKS = 16                    # new constraints waiting for the grammar workers
# JSON whitespace when a client asks for vLLM's default (`disable_any_whitespace: false`)
ANY_WHITESPACE = r"[\x20\x0A\x0D\x09]+"

log = logger("atombatch.serve")

_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_VLLM_IGNORED = ("backend", "disable_fallback", "disable_additional_properties")
_VLLM_OPTIONS = ("whitespace_pattern", "disable_any_whitespace")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
T = TypeVar("T")


class StructuredRequests:
    """Reads and checks the structured-output fields of request bodies for one server.

    Args:
        tokenizer: the codec's `tokenizers.Tokenizer`, or None (token-id text: a constraint is
            then a 400, there is no text to constrain).
        vocab_size, eos_token_ids: the model's (what the engine masks with).
        max_chars: bound on a constraint's size, checked before it is parsed or compiled.
        workers: grammar worker processes (`GrammarWorkers`), and threads that wait for them.
        worker_target: the workers' check function (`GrammarWorkers`'s `target`: tests).
        wall_seconds: a check's wall-time budget (`GrammarWorkers`).
    """

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_chars: int = DEFAULT_MAX_STRUCTURED_CHARS, workers: int = 1,
                 worker_target: str | None = None,
                 wall_seconds: float = GRAMMAR_WALL_SECONDS) -> None:
        self.checker: GrammarWorkers | None = None
        self.unavailable: str | None = None     # why structured output cannot be served here
        if tokenizer is not None:
            try:
                self.checker = GrammarWorkers(tokenizer, vocab_size, eos_token_ids,
                                              workers=workers, target=worker_target,
                                              wall_seconds=wall_seconds)
            except ConfigError as exc:
                self.unavailable = str(exc)
        self.max_chars = max_chars
        self._waiters = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="atombatch-structured-check")
        self.pending = 0                        # checks queued or running (event loop only)

    def warm(self) -> None:
        """Start the grammar workers in the background (each builds llguidance's tokenizer:
        about a second for a 152k vocabulary), so the first constrained request does not wait."""
        if self.checker is not None:
            self.checker.warm()

    def resolve(self, body: Any) -> StructuredOutput | None:
        """The checked constraint of a body (`check_off_loop` checked it first), lowered.

        Raises:
            RequestError: naming the field (`param`) and the rule.
            CapacityError: its check was forgotten since (a storm of distinct constraints):
                answered 429, the client retries.
        """
        structured = read(body, self.max_chars)
        if structured is None:
            return None
        checker = self._checker(structured)
        checked = checker.known(structured)
        if checked is None:  # never compiled on the event loop: the client asks again
            raise CapacityError(f"{structured.param}: too many new structured-output "
                                "constraints were checked at once; retry")
        return checked

    def _checker(self, structured: StructuredOutput) -> GrammarWorkers:
        if self.checker is None:
            if self.unavailable is not None:
                raise RequestError(f"{structured.param}: structured output is unavailable on "
                                   f"this server: {self.unavailable}", param=structured.param)
            raise RequestError(f"{structured.param}: structured output needs a tokenizer and "
                               "this server serves token ids (start it with a checkpoint that "
                               "has tokenizer.json, or --tokenizer)", param=structured.param)
        return self.checker

    async def check_off_loop(self, body: Any) -> None:
        """Check the body's constraint in a grammar worker unless it was checked lately (a
        compile may take a while; the event loop keeps streaming meanwhile).

        Raises:
            RequestError: as `resolve`; GrammarBudgetError: past a check's budget.
            CapacityError: as `run_check`.
        """
        structured = read(body, self.max_chars)
        if structured is None:
            return
        checker = self._checker(structured)
        if checker.known(structured) is None:
            await self.run_check(self.check, structured)

    def check(self, structured: StructuredOutput) -> StructuredOutput:
        """`structured` checked and lowered, in a grammar worker (blocking: a waiter thread's).

        Raises:
            RequestError: naming the field and the rule (or the budget).
        """
        try:
            return self._checker(structured).check(structured)
        except ConfigError as exc:
            raise RequestError(f"{structured.param}: structured output is unavailable on this "
                               f"server: {exc}", param=structured.param) from None

    async def run_check(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a compile check) on a waiter thread.

        Raises:
            CapacityError: `MAX_PENDING_CHECKS` checks already wait (answered 429).
        """
        if self.pending >= MAX_PENDING_CHECKS:
            raise CapacityError(f"{self.pending} new structured-output constraints are being "
                                f"compiled, at most MAX_PENDING_CHECKS={MAX_PENDING_CHECKS}: "
                                "retry later (a constraint already seen is not compiled again)")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._waiters, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
        if self.checker is not None:
            self.checker.close()


def read(body: Any, max_chars: int) -> StructuredOutput | None:
    """The constraint a body asks for, shape-checked, or None (see the module docstring).

    Raises:
        RequestError: two fields constrain the request, a field has the wrong shape, or a
            constraint is longer than `max_chars`.
    """
    found: list[StructuredOutput] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt, max_chars)
        if spec is not None:
            found.append(spec)
    options = getattr(body, "structured_outputs", None)
    if options is not None:
        spec = _structured_outputs(options, max_chars)
        if spec is not None:
            found.append(spec)
    spec = _guided(body, max_chars)
    if spec is not None:
        found.append(spec)
    if len(found) > 1:
        raise RequestError(f"{found[1].param}: a request takes one structured-output constraint, "
                           f"and {found[0].param} already sets one", param=found[1].param)
    return found[0] if found else None


def _bounded(value: Any, param: str, max_chars: int) -> None:
    """Bound the size of a client's constraint before anything parses or compiles it."""
    if isinstance(value, str):
        size = len(value)
    elif isinstance(value, (list, tuple)):
        size = sum(len(v) if isinstance(v, str) else 1 for v in value)
    else:  # a schema object: its JSON text
        import msgspec

        size = len(msgspec.json.encode(value))
    if size > max_chars:
        raise RequestError(f"{param}: {size} characters, at most max_structured_chars="
                           f"{max_chars}", param=param, limit=max_chars)


def _response_format(fmt: dict[str, Any], max_chars: int) -> StructuredOutput | None:
    param = "response_format"
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object(param=param)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise RequestError("response_format: type json_schema needs a json_schema object "
                               "({\"name\": ..., \"schema\": {...}})", param=param)
        schema = inner.get("schema", inner.get("json_schema"))
        if schema is None:
            raise RequestError("response_format.json_schema.schema is missing", param=param)
        _bounded(schema, param, max_chars)
        return StructuredOutput.json_schema(_schema(schema, param), param=param)
    raise RequestError(f"response_format type {kind!r} is not supported (text, json_object, "
                       "json_schema)", param=param)


def _schema(schema: Any, param: str) -> dict[str, Any] | bool | str:
    if isinstance(schema, (dict, bool, str)):
        return schema
    raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}",
                       param=param)


def _structured_outputs(options: dict[str, Any], max_chars: int) -> StructuredOutput | None:
    param = "structured_outputs"
    unknown = sorted(set(options) - set(_VLLM_KINDS) - set(_VLLM_IGNORED) - set(_VLLM_OPTIONS))
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]} is not supported (this server "
                           f"reads {', '.join(_VLLM_KINDS + _VLLM_OPTIONS)})", param=param)
    kinds = [k for k in _VLLM_KINDS if options.get(k) not in (None, False)]
    if len(kinds) > 1:
        raise RequestError(f"structured_outputs sets {' and '.join(kinds)}: give exactly one",
                           param=param)
    whitespace = _whitespace(options.get("whitespace_pattern"),
                             options.get("disable_any_whitespace"), f"{param}.whitespace_pattern")
    if not kinds:
        if whitespace is not None:
            raise RequestError("structured_outputs.whitespace_pattern needs json or json_object",
                               param=param)
        return None
    kind = kinds[0]
    value = options[kind]
    _bounded(value, param, max_chars)
    return _spec(kind, value, whitespace, param)


def _guided(body: Any, max_chars: int) -> StructuredOutput | None:
    given = [name for name in _GUIDED if getattr(body, name, None) is not None]
    whitespace = _whitespace(getattr(body, "guided_whitespace_pattern", None), None,
                             "guided_whitespace_pattern")
    if not given:
        if whitespace is not None:
            raise RequestError("guided_whitespace_pattern needs guided_json",
                               param="guided_whitespace_pattern")
        return None
    if len(given) > 1:
        raise RequestError(f"{given[1]}: a request takes one of {', '.join(_GUIDED)}, and "
                           f"{given[0]} is set too", param=given[1])
    name = given[0]
    value = getattr(body, name)
    _bounded(value, name, max_chars)
    return _spec(name.removeprefix("guided_"), value, whitespace, name)


def _whitespace(pattern: Any, disable_any: Any, param: str) -> str | None:
    if pattern is not None:
        if not isinstance(pattern, str):
            raise RequestError(f"{param} must be a string (a regex)", param=param)
        return pattern
    if disable_any is not None and not isinstance(disable_any, bool):
        raise RequestError("structured_outputs.disable_any_whitespace must be a bool",
                           param="structured_outputs")
    return ANY_WHITESPACE if disable_any is False else None


def _spec(kind: str, value: Any, whitespace: str | None, param: str) -> StructuredOutput:
    if whitespace is not None and kind not in ("json", "json_object"):
        raise RequestError(f"{param}: whitespace_pattern applies only to json", param=param)
    if kind == "json":
        return StructuredOutput.json_schema(_schema(value, param), whitespace_pattern=whitespace,
                                            param=param)
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{param}: json_object must be true", param=param)
        return StructuredOutput.json_object(whitespace_pattern=whitespace, param=param)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise RequestError(f"{param}: choice must be a list of strings", param=param)
        return StructuredOutput.choice(value, param=param)
    if not isinstance(value, str):
        raise RequestError(f"{param}: {kind} must be a string", param=param)
    if kind == "regex":
        return StructuredOutput.regex(value, param=param)
    return StructuredOutput.grammar(value, param=param)
