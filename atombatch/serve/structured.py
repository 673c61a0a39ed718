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
reaches the engine: its size (`max_chars`, 400 naming the field and the limit), its shape, and
that it compiles against the model's tokenizer and can start with one of its tokens (a 400
naming the field); the engine compiles it again on its own thread. Compiled checks are kept for
the last `CHECK_CACHE` constraints, so a client that sends the same schema every time pays once;
a new one is compiled on the server's one check thread, off its event loop, with llguidance's
budget (`grammar.INITIAL_LEXER_FUEL`) bounding each compile. At most `MAX_PENDING_CHECKS` new
constraints wait for that thread; past it a request is answered 429 (a client sending a stream of
distinct schemas cannot queue unbounded CPU and memory, nor delay others' checks without bound).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from atombatch.errors import CapacityError, ConfigError, RequestError
from atombatch.grammar import Grammars
from atombatch.logs import logger
from atombatch.structured import StructuredOutput

DEFAULT_MAX_STRUCTURED_CHARS = 64 * 1024   # characters of one schema / regex / grammar / choices
CHECK_CACHE = 64                           # constraints whose compile check is remembered
MAX_PENDING_CHECKS = 16                    # new constraints waiting for the check thread
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
    """

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_chars: int = DEFAULT_MAX_STRUCTURED_CHARS) -> None:
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids) \
            if tokenizer is not None else None
        self.max_chars = max_chars
        self._checked: collections.OrderedDict[StructuredOutput, None] = \
            collections.OrderedDict()
        self._lock = threading.Lock()           # `_checked`: the event loop and check threads
        # compile checks: one thread (each compile is bounded by llguidance's budget), and a
        # bound on how many wait for it
        self._checker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="atombatch-structured-check")
        self.pending = 0                        # checks queued or running (event loop only)

    def warm(self) -> None:
        """Build llguidance's tokenizer on a background thread (about a second for a 152k
        vocabulary), so the first constrained request does not wait for it on the event loop."""
        if self.grammars is not None:
            threading.Thread(target=self._build_tokenizer, name="atombatch-llg-tokenizer",
                             daemon=True).start()

    def _build_tokenizer(self) -> None:
        assert self.grammars is not None
        try:
            self.grammars.tokenizer  # noqa: B018 (built and kept on first access)
        except ConfigError as exc:  # answered as a 400 by the first constrained request
            log.warning("structured.unavailable", error=str(exc))

    def resolve(self, body: Any) -> StructuredOutput | None:
        """The checked constraint of a request body (a Completion- or ChatCompletionRequest).

        Raises:
            RequestError: naming the field (`param`) and the rule.
        """
        structured = read(body, self.max_chars)
        if structured is None:
            return None
        if self.grammars is None:
            raise RequestError(f"{structured.param}: structured output needs a tokenizer and "
                               "this server serves token ids (start it with a checkpoint that "
                               "has tokenizer.json, or --tokenizer)", param=structured.param)
        if self._known(structured):
            return structured
        try:
            self.grammars.matcher_now(structured)  # RequestError naming it if it does not compile
        except ConfigError as exc:
            raise RequestError(f"{structured.param}: structured output is unavailable on this "
                               f"server: {exc}", param=structured.param) from None
        with self._lock:
            self._checked[structured] = None
            if len(self._checked) > CHECK_CACHE:
                self._checked.popitem(last=False)
        return structured

    async def check_off_loop(self, body: Any) -> None:
        """`resolve` in a worker thread when the body's constraint was not checked yet (a
        compile may take a while; the event loop keeps streaming meanwhile).

        Raises:
            RequestError: as `resolve`.
        """
        structured = read(body, self.max_chars)
        if structured is None or self.grammars is None or self._known(structured):
            return
        await self.run_check(self.resolve, body)

    async def run_check(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a compile check) on the check thread.

        Raises:
            CapacityError: `MAX_PENDING_CHECKS` checks already wait (answered 429).
        """
        if self.pending >= MAX_PENDING_CHECKS:
            raise CapacityError(f"{self.pending} new structured-output constraints are being "
                                f"compiled, at most MAX_PENDING_CHECKS={MAX_PENDING_CHECKS}: "
                                "retry later (a constraint already seen is not compiled again)")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._checker, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._checker.shutdown(wait=False, cancel_futures=True)

    def _known(self, structured: StructuredOutput) -> bool:
        with self._lock:
            if structured in self._checked:
                self._checked.move_to_end(structured)
                return True
        return False


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
