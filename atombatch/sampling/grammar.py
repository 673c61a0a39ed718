"""Grammar masks for structured output (`SamplingParams.structured`), with llguidance.

Theory of operation:

- **Compile, off the hot path.** `Grammars.compile` only checks, at submit, what is cheap and
  bounded (a JSON schema's nesting and syntax: a `RequestError` there); lowering the constraint
  to an llguidance grammar (`grammar_text`: the GBNF conversion is pure Python, quadratic in a
  chain of rules) and building its `LLMatcher` run on the compile thread, whose stack is
  `COMPILE_STACK_BYTES` (llguidance parses grammars recursively: a long chain of rules overflows
  an ordinary thread's stack). A server hands the engine constraints its grammar workers have
  already lowered and compiled in a process of their own (`StructuredOutput.lowered`,
  atombatch/sampling/grammar_check.py): the engine then converts nothing, and compiles text that compiled
  on a smaller stack. The request waits in the queue meanwhile (`Request.compiling`: the
  scheduler admits it only once its matcher is ready); the engine polls the compile at the start
  of every step. The tokenizer llguidance needs (`LLTokenizer`, about a second for a 152k
  vocabulary) is built once, on that thread, by the first compile.
- **One matcher per choice.** Every choice of a request holds its own `RequestGrammar` (a copy
  of the compiled matcher for choices 1..n-1), which follows the choice's output tokens.
- **Advance lazily.** `RequestGrammar.advance(output)` consumes the tokens of `output` it has
  not seen yet. The sampler calls it for every constrained row before it masks, so whatever
  put a token into the output (a prefill's first token, a decode step, a PD producer's first
  token, a fork) is seen once and in order. A preempted request keeps its output (it is
  recomputed, not re-sampled), so its matcher stays valid and nothing is rolled back; should an
  output ever be shorter than what the matcher consumed, the matcher is reset and replays it.
- **One mask pass per step.** `apply_masks` fills the bitmask rows of every constrained row of
  a step in one `LLExecutor` call (its threads compute the rows in parallel, without the GIL),
  unpacks the bits for those rows at once (`np.unpackbits`) and sets the disallowed logits to
  -inf: no Python per vocabulary entry, and rows without a constraint are not touched.
- **After the grammar ends** only EOS is allowed (llguidance's own mask), so a request ends with
  "stop" as soon as its text is complete; with `ignore_eos` it keeps generating EOS.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.structured import StructuredOutput
from atombatch.errors import ConfigError, RequestError

_NEG_INF = np.float32(-np.inf)


class ConstraintFailed(RequestError):
    """A request's output can no longer follow its constraint (a token broke it, or the
    constraint ran past llguidance's limits mid-generation): the client's constraint failed
    the request, not the engine."""

# compiled constraints an engine keeps to copy: each holds the lexer its first mask built (up to
# ~32 MiB at INITIAL_LEXER_FUEL for a pathological regex; 64 of them held 1.4 GiB and more), and
# their grammar text at most COMPILED_CACHE_CHARS characters together
COMPILED_CACHE = 16
COMPILED_CACHE_CHARS = 8 << 20
# the compile thread's stack: four times a grammar worker's (grammar_check.CHECK_STACK_BYTES), so
# what a worker compiled compiles here too (llguidance needs ~2.5 KiB per chained Lark rule)
COMPILE_STACK_BYTES = 256 << 20
COMPILE_NICE = 10                      # the compile thread's niceness (the loop's is the process's)
# llguidance's budget for building a constraint's lexer and its first mask (its default is
# 1 000 000): a 15-character regex such as `(a{1000}){1000}` spent 3 s and 250 MiB of it before
# failing; at this budget it fails in 0.3 s and 25 MiB, while real schemas (128 tools of a
# `required` choice, formats, patterns) need well under it. Per-step work keeps llguidance's own
# bounds (`step_lexer_fuel`, `step_max_items`, `max_items_in_row`).
INITIAL_LEXER_FUEL = 200_000


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ConfigError("structured output needs the 'llguidance' package "
                          "(pip install llguidance)") from None
    return llguidance


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (its syntax is checked when it compiles).

    JSON is compact by default (no whitespace between tokens, `,` and `:` as separators), so a
    model cannot pad its output with whitespace forever; `whitespace_pattern` allows more.

    Raises:
        RequestError: a JSON schema that is not a JSON object or boolean, or a grammar that is
            neither Lark nor GBNF.
    """
    llg = _llguidance()
    matcher = llg.LLMatcher
    param = structured.param
    kind = structured.kind
    if kind in ("json_schema", "json_object"):
        options: dict[str, Any] = {"whitespace_flexible": False}
        if structured.whitespace_pattern is not None:
            options = {"whitespace_pattern": structured.whitespace_pattern}
        if kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json.loads(structured.value)
            except ValueError as exc:
                raise RequestError(f"{param}: the JSON schema is not valid JSON: {exc}",
                                   param=param) from None
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise RequestError(f"{param}: a JSON schema must be an object (or true), got "
                                   f"{type(schema).__name__}", param=param)
        try:
            return str(matcher.grammar_from_json_schema(schema, overrides=options))
        except (ValueError, TypeError) as exc:
            raise RequestError(f"{param}: the JSON schema is invalid: {exc}",
                               param=param) from None
    if kind == "regex":
        return str(matcher.grammar_from_regex(structured.value))
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in structured.choices)
        return str(matcher.grammar_from_lark(lark))
    text = structured.value
    try:
        return str(llg.grammar_from("grammar", text))
    except ValueError as exc:
        raise RequestError(f"{param}: the grammar is neither Lark nor GBNF: {exc}",
                           param=param) from None


def build_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's `LLTokenizer` for a `tokenizers.Tokenizer` (or a transformers fast
    tokenizer), sized to the model's logits (`vocab_size` may exceed the tokenizer's ids).

    Raises:
        ConfigError: the tokenizer cannot be read by llguidance.
    """
    llg = _llguidance()
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise ConfigError(f"structured output needs a Hugging Face `tokenizers` tokenizer, got "
                          f"{type(tokenizer).__name__}")
    eos = [int(t) for t in eos_token_ids] or None
    try:
        return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except Exception as exc:
        raise ConfigError(f"llguidance cannot read the tokenizer: {exc}") from None


def check_matcher(matcher: Any, structured: StructuredOutput, vocab_size: int) -> None:
    """Raise the `RequestError` for a matcher that did not compile, or whose first token no
    id of the vocabulary can be (the tokenizer cannot spell what the grammar asks for)."""
    param = structured.param
    if matcher.is_error():
        raise RequestError(f"{param}: the {structured.kind} does not compile: "
                           f"{_first_lines(matcher.get_error())}", param=param)
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    if matcher.is_error() or not np.unpackbits(mask, bitorder="little")[:vocab_size].any():
        detail = f" ({_first_lines(matcher.get_error())})" if matcher.is_error() else ""
        raise RequestError(f"{param}: no token of the model's vocabulary can start text that "
                           f"matches the {structured.kind}{detail}", param=param)


def compile_matcher(tokenizer: Any, text: str, structured: StructuredOutput,
                    vocab_size: int) -> Any:
    """The `LLMatcher` of grammar `text` (`grammar_text`'s) for `tokenizer`, checked and reset,
    within `INITIAL_LEXER_FUEL`.

    Raises:
        RequestError: see `check_matcher`.
    """
    llg = _llguidance()
    matcher = llg.LLMatcher(tokenizer, text, log_level=0,
                            limits=llg.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL))
    check_matcher(matcher, structured, vocab_size)
    matcher.reset()  # check_matcher computed a mask; the copies start from the beginning
    return matcher


def check_schema_text(structured: StructuredOutput) -> None:
    """A JSON schema constraint's text parses as a JSON object or boolean (its nesting was
    bounded when the value was built: `structured.MAX_SCHEMA_DEPTH`).

    Raises:
        RequestError: naming the field.
    """
    if structured.kind != "json_schema" or structured.lowered:
        return
    param = structured.param
    try:
        schema = msgspec.json.decode(structured.value)
    except msgspec.DecodeError as exc:
        raise RequestError(f"{param}: the JSON schema is not valid JSON: {exc}",
                           param=param) from None
    if not isinstance(schema, dict | bool):
        raise RequestError(f"{param}: a JSON schema must be an object (or true), got "
                           f"{type(schema).__name__}", param=param)


def _first_lines(text: str, lines: int = 3, chars: int = 400) -> str:
    out = " ".join(line.strip() for line in text.strip().splitlines()[:lines])
    return out if len(out) <= chars else out[:chars] + "..."


class RequestGrammar:
    """One choice's matcher and how much of its output it has consumed."""

    __slots__ = ("consumed", "error", "masks", "matcher", "start", "structured")

    def __init__(self, matcher: Any, structured: StructuredOutput, masks: Grammars) -> None:
        self.matcher = matcher
        self.structured = structured
        self.masks = masks                      # the engine's mask buffers and executor
        self.consumed = 0                       # output tokens the matcher has seen
        self.error: str | None = None           # set once a token broke the grammar
        # where the constrained text starts in the output: 0, or (with `structured.after`) just
        # past the first occurrence of those ids; None while that preamble goes on
        self.start: int | None = None if structured.after else 0

    @property
    def active(self) -> bool:
        """The row is masked this step (its constraint has started and holds)."""
        return self.start is not None and self.error is None

    def mask_error(self) -> str | None:
        """Why the last mask could not be computed (llguidance's limits), or None."""
        if not self.matcher.is_error():
            return None
        self.error = (f"the {self.structured.param} constraint ({self.structured.kind}) failed: "
                      f"{_first_lines(self.matcher.get_error())}")
        return self.error

    def advance(self, output: Sequence[int]) -> str | None:
        """Consume the output tokens not seen yet; the error message if one breaks the grammar
        (a PD producer's first token can: it was sampled without the grammar)."""
        if self.error is not None:
            return self.error
        n = len(output)
        matcher = self.matcher
        if n < self.consumed:  # never happens (outputs only grow): replay from the start
            self.masks.settle()
            matcher.reset()
            self.consumed = 0
            self.start = None if self.structured.after else 0
        if n == self.consumed:
            return None
        if self.start is None:
            self.start = _end_of(self.structured.after, output, self.consumed)
            if self.start is None:  # still in the preamble: nothing to consume, no mask
                self.consumed = n
                return None
        self.masks.settle()  # never consume while the mask thread reads this matcher
        for position in range(max(self.consumed, self.start), n):
            token = int(output[position])
            if matcher.is_stopped():  # the grammar ended: EOS only (ignore_eos keeps going)
                continue
            if not matcher.consume_token(token):
                self.consumed = n
                self.error = (f"token {token} at output position {position} does not match the "
                              f"{self.structured.param} constraint ({self.structured.kind}): "
                              f"{_first_lines(matcher.get_error())}")
                return self.error
        self.consumed = n
        return None


def _end_of(ids: tuple[int, ...], output: Sequence[int], seen: int) -> int | None:
    """The position just past the first occurrence of `ids` in `output` (looking only at
    occurrences that end at or after position `seen`), or None."""
    k = len(ids)
    for end in range(max(seen + 1, k), len(output) + 1):
        if tuple(output[end - k:end]) == ids:
            return end
    return None


class Grammars:
    """An engine's structured-output machinery: the compile thread, the tokenizer llguidance
    reads, the mask executor and the bitmask buffer of one step.

    Args:
        tokenizer: the engine's `tokenizers.Tokenizer`.
        vocab_size: the model's logits width.
        eos_token_ids: what the grammar allows once it is complete.
        threads: mask-filling threads (`LLExecutor`; None: 80% of the CPUs, up to 32).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 threads: int | None = None) -> None:
        self.source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.threads = threads
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._pool = _CompileThread(COMPILE_STACK_BYTES)
        self._executor: Any = None
        self.words = (vocab_size + 31) // 32
        self.bitmask = np.zeros((0, self.words), dtype=np.int32)  # grown to the rows a step needs
        # a fill started before the device call (`prefetch`): the job, and whose masks at which
        # output length it computes
        self._masker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atombatch-mask")
        self._prefetched: tuple[concurrent.futures.Future[None], list[tuple[int, int]]] | None = None
        self.prefetch_hits = 0                  # fills that found their masks already computed
        # the last COMPILED_CACHE constraints compiled, as untouched matchers to copy: a client
        # that sends the same schema with every request compiles it once
        # constraint -> (its untouched matcher, the characters it counts)
        self._compiled: collections.OrderedDict[StructuredOutput, tuple[Any, int]] = \
            collections.OrderedDict()
        self._compiled_chars = 0
        self._compiled_lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The `LLTokenizer` (built on first use)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(self.source, self.vocab_size,
                                                  self.eos_token_ids)
            return self._tokenizer

    def compile(self, structured: StructuredOutput) -> concurrent.futures.Future[Any]:
        """Start compiling; the future's result is the ready `LLMatcher`, or it raises the
        `RequestError` naming what is wrong.

        Raises:
            RequestError: at once, for what is cheap to check (see `check_schema_text`).
        """
        with self._compiled_lock:
            entry = self._compiled.get(structured)
            if entry is not None:
                self._compiled.move_to_end(structured)
        if entry is not None:
            template = entry[0]
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(template.deep_copy())
            return done
        check_schema_text(structured)
        return self._pool.submit(self._build, structured)

    def _build(self, structured: StructuredOutput, keep: bool = True) -> Any:
        text = structured.lowered or grammar_text(structured)
        matcher = compile_matcher(self.tokenizer, text, structured, self.vocab_size)
        if not keep:
            return matcher
        size = len(text) + structured.chars
        with self._compiled_lock:
            if structured not in self._compiled:
                self._compiled[structured] = (matcher.deep_copy(), size)
                self._compiled_chars += size
            while self._compiled and (len(self._compiled) > COMPILED_CACHE or
                                      self._compiled_chars > COMPILED_CACHE_CHARS):
                _, (_, old_size) = self._compiled.popitem(last=False)
                self._compiled_chars -= old_size
        return matcher

    def matcher_now(self, structured: StructuredOutput) -> Any:
        """Compile on the compile thread and wait (tests and benchmarks); the matcher is not
        kept for later requests to copy."""
        check_schema_text(structured)
        return self._pool.submit(self._build, structured, False).result()

    def close(self) -> None:
        self._pool.shutdown()
        self._masker.shutdown(wait=True)

    def prefetch(self, grammars: Sequence[RequestGrammar]) -> None:
        """Start filling the masks of `grammars` (already advanced over their outputs) on the
        mask thread, while the device runs the step; `fill` with the same grammars in the same
        state then only waits for it."""
        self._wait_prefetched()
        live = [g for g in grammars if g.active]
        if not live:
            return
        mask = self._buffer(len(live))
        job = self._masker.submit(self._compute, live, mask)
        self._prefetched = (job, [(id(g), g.consumed) for g in live])

    def fill(self, grammars: Sequence[RequestGrammar]) -> npt.NDArray[np.int32]:
        """The bitmask rows of `grammars` (row i: bit t set = token t allowed), in one call (or
        the one `prefetch` started for exactly these grammars in this state)."""
        prefetched = self._prefetched
        if prefetched is not None:
            self._wait_prefetched()
            if prefetched[1] == [(id(g), g.consumed) for g in grammars]:
                self.prefetch_hits += 1
                return self.bitmask[:len(grammars)]
        mask = self._buffer(len(grammars))
        self._compute(grammars, mask)
        return mask

    def settle(self) -> None:
        """Wait until a prefetched fill is done (it stays usable by `fill`)."""
        if self._prefetched is not None:
            self._prefetched[0].result()

    def _wait_prefetched(self) -> None:
        if self._prefetched is not None:
            job, _ = self._prefetched
            self._prefetched = None
            job.result()

    def _buffer(self, rows: int) -> npt.NDArray[np.int32]:
        if self.bitmask.shape[0] < rows:
            self.bitmask = np.zeros((max(rows, 2 * self.bitmask.shape[0]), self.words),
                                    dtype=np.int32)
        return self.bitmask[:rows]

    def _compute(self, grammars: Sequence[RequestGrammar], mask: npt.NDArray[np.int32]) -> None:
        if self._executor is None:
            self._executor = _llguidance().LLExecutor(self.threads)
        self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                               mask.ctypes.data, self.words * 4, len(grammars))


def apply_masks(x: npt.NDArray[np.float32], rows: Sequence[int],
                grammars: Sequence[RequestGrammar]) -> None:
    """Set the logits `x[rows[i]]` of tokens that `grammars[i]` does not allow to -inf (every
    row's mask filled in one pass; `x` is `[rows, vocab]` float32, changed in place)."""
    apply_bitmask(x, rows, grammars[0].masks.fill(grammars))


def apply_bitmask(x: npt.NDArray[np.float32], rows: Sequence[int],
                  mask: npt.NDArray[np.int32]) -> None:
    """Set `x[rows[i], t]` to -inf where bit t of `mask[i]` is clear (llguidance's layout: id t
    is bit t % 32 of word t // 32)."""
    vocab = x.shape[1]
    # the packed mask is inverted (32 ids per word), never the unpacked one: one pass less
    banned = np.unpackbits(np.invert(mask.view(np.uint8)), axis=1, bitorder="little",
                           count=vocab).view(np.bool_)
    if len(rows) == x.shape[0]:
        np.putmask(x, banned, _NEG_INF)
        return
    index = np.asarray(rows, dtype=np.intp)
    sub = x[index]
    np.putmask(sub, banned, _NEG_INF)
    x[index] = sub


class _CompileThread:
    """One daemon thread with a stack of its own size that runs jobs in order (a
    `ThreadPoolExecutor` cannot set its threads' stack); started on the first job."""

    def __init__(self, stack_bytes: int) -> None:
        self.stack_bytes = stack_bytes
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        with self._start_lock:
            if self._thread is None:
                with _STACK_SIZE_LOCK:
                    previous = threading.stack_size(self.stack_bytes)
                    try:
                        self._thread = threading.Thread(target=self._run, daemon=True,
                                                        name="atombatch-grammar")
                        self._thread.start()
                    finally:
                        threading.stack_size(previous)
        return future

    def shutdown(self) -> None:
        """Cancel the jobs not started; the thread ends after the one it runs."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)

    def _run(self) -> None:
        # below the engine's loop and mask threads: a storm of compiles (each bounded by the
        # workers' budgets) takes the CPU the steps leave, not the steps' (Linux: per thread)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # the future carries it to whoever waits
                future.set_exception(exc)
            else:
                future.set_result(result)


_STACK_SIZE_LOCK = threading.Lock()   # threading.stack_size is process-wide
