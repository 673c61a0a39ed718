"""Incremental detokenization with stop strings, for engines that have a tokenizer.

`Detokenizer` turns one request's generated ids into text as they come (`tokenizers`'
`DecodeStream`, primed with the end of the prompt so the first word is spaced as in the whole
sequence; an incomplete UTF-8 sequence waits for its next byte). With stop strings it holds back
the longest tail of the text that could still become a stop string, so a stop string split across
tokens is found and no part of it is ever streamed; when one matches, the text ends before it
(or after it with `include_stop_str_in_output`) and the request finishes with reason "stop".
Stop strings count only once `min_tokens` tokens were generated, as in vLLM.

It is the one maker of a request's text, from that request's own params, wherever the text is
made: in the engine (a Batcher built with a tokenizer; the engine core for requests with stop
strings, whose match decides when the request ends) and in a server's front for every other
request (`HFCodec.decoder`, atombatch/serve/tokens.py), in every engine-core mode. The params it
reads, as vLLM's `FastIncrementalDetokenizer` does: `skip_special_tokens` (special tokens left
out of the text), `spaces_between_special_tokens` (false, with special tokens shown: two added
tokens in a row are written as their bare content, without the space a decoder may put before
the second), `stop`, `include_stop_str_in_output`, `min_tokens`; and a request that ends on a
stop id (EOS or `stop_token_ids`) does not decode that id unless `include_stop_str_in_output`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.api.structs import SamplingParams

PROMPT_CONTEXT = 8  # prompt tokens that prime the decoder (spacing of the first generated word)
# Above this many (character x stop string) automaton steps, new text is searched in C instead.
_CHAR_STEPS = 4096


class Detokenizer:
    """The text of one request, streamed in safe pieces.

    Stop strings are matched by one Knuth-Morris-Pratt automaton per string, fed character by
    character: the cost per generated character is O(number of stop strings) whatever their
    length, and each automaton's state (the longest end of the text that begins its string) is
    exactly what must be held back."""

    __slots__ = ("_added", "_context", "_failure", "_ids", "_last_added", "_pending",
                 "_released", "_skip_special", "_states", "_stream", "include_stop", "min_tokens",
                 "stop", "stopped", "tokenizer")

    def __init__(self, tokenizer: Any, prompt: Sequence[int] | npt.NDArray[np.integer],
                 params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        context = [int(t) for t in prompt[-PROMPT_CONTEXT:]]
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self._context = context
        self._skip_special = params.skip_special_tokens
        # spaces_between_special_tokens=false with special tokens shown: the added tokens'
        # contents by id (None otherwise: the per-token path then tests one attribute)
        self._added: dict[int, str] | None = None
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            added = {int(i): str(t.content)
                     for i, t in tokenizer.get_added_tokens_decoder().items()}
            self._added = added or None
        self._last_added = False
        self._ids: list[int] = []         # generated ids (for the end-of-stream flush)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._failure = [_prefix_function(stop) for stop in self.stop]
        self._states = [0] * len(self.stop)
        self._released: list[str] = []   # text handed out, in pieces
        self._pending = ""                # decoded, not handed out (could begin a stop string)
        self.stopped: str | None = None   # the stop string that matched

    @property
    def text(self) -> str:
        """Everything decoded so far (ending before a matched stop string, or after it with
        `include_stop_str_in_output`)."""
        return "".join(self._released) + self._pending

    def add(self, token_ids: Sequence[int], generated: int, stop_id: bool = False) -> str:
        """Decode new ids (`generated` = tokens generated so far, these included); returns the
        text that may be streamed now. Sets `stopped` when a stop string matched. `stop_id`:
        the last id ended the request as a stop id (EOS or `stop_token_ids`); it is not
        decoded unless `include_stop_str_in_output` (vLLM's rule)."""
        if self.stopped is not None:
            return ""
        if stop_id and not self.include_stop and token_ids:
            token_ids = token_ids[:-1]
        new = []
        for token in token_ids:
            piece = self._piece(int(token))
            if piece:
                new.append(piece)
        added = "".join(new)
        if not self.stop:
            return self._release(added)
        base = len(self._pending)
        self._pending += added
        counts = generated >= self.min_tokens  # before min_tokens a match does not count
        if len(added) * len(self.stop) > _CHAR_STEPS:
            return self._add_long(base, counts)
        states, stops, failures = self._states, self.stop, self._failure
        for offset, char in enumerate(added):
            for j, stop in enumerate(stops):
                state = _advance(stop, failures[j], states[j], char)
                states[j] = state
                if state == len(stop) and counts:
                    end = base + offset + 1
                    return self._stop_at(j, end)
        return self._hold_back()

    def _piece(self, token: int) -> str:
        self._ids.append(token)
        piece = self._stream.step(self.tokenizer, token)
        if self._added is not None:
            piece = self._spaced(token, piece)
        return piece or ""

    # -- a front's decoder (atombatch/serve/tokens.py `Decoder`): text without stop strings, which
    # -- the engine matches (it sends that text itself) ------------------------------------------
    def step(self, token_ids: Sequence[int]) -> str:
        return self.add(token_ids, len(self._ids) + len(token_ids))

    def step_one(self, token: int) -> str:
        """`step((token,))`: the per-token path of a plain stream (`_Generation.fast_lane`)."""
        if self.stop:
            return self.add((token,), len(self._ids) + 1)
        self._ids.append(token)
        piece = self._stream.step(self.tokenizer, token)
        if self._added is not None:
            piece = self._spaced(token, piece)
        if piece:
            self._released.append(piece)
            return piece  # type: ignore[no-any-return]
        return ""

    def _spaced(self, token: int, piece: str | None) -> str | None:
        """spaces_between_special_tokens=false: an added token right after another is its bare
        content (vLLM's rule)."""
        assert self._added is not None
        content = self._added.get(token)
        if content is not None and self._last_added:
            piece = content
        self._last_added = content is not None
        return piece

    def finish(self, token_ids: Sequence[int], stop_id: bool) -> str:
        """The last ids of a request that ended (`stop_id`: on a stop id) and whatever was held
        back."""
        return self.add(token_ids, len(self._ids) + len(token_ids), stop_id) + self.flush()

    def _add_long(self, base: int, counts: bool) -> str:
        """`add` for a long piece of text (a long token, or many at once): each stop string is
        searched with `str.find` (C) from where a match could end in the new text, and each
        automaton is rebuilt from the text's last `len(stop)` characters (its state depends on no
        more), so the cost is C per character plus O(sum of the stop lengths) in Python."""
        text, stops = self._pending, self.stop
        if counts:
            ends = [(text.find(stop, max(0, base - len(stop) + 1)), j)
                    for j, stop in enumerate(stops)]
            hits = [(at + len(stops[j]), j) for at, j in ends if at >= 0]
            if hits:
                end, j = min(hits)
                return self._stop_at(j, end)
        for j, stop in enumerate(stops):
            state, failure = 0, self._failure[j]
            for char in text[-len(stop):]:
                state = _advance(stop, failure, state, char)
            self._states[j] = state
        return self._hold_back()

    def _stop_at(self, j: int, end: int) -> str:
        """Stop string `j` matched ending at `end` of the pending text."""
        stop = self.stop[j]
        keep = end if self.include_stop else end - len(stop)
        text, self._pending = self._pending[:keep], ""
        self.stopped = stop
        return self._release(text)

    def _hold_back(self) -> str:
        """Release the pending text but what could still become a stop string (a whole match
        ignored before min_tokens counts only by its longest proper border)."""
        stops, states, failures = self.stop, self._states, self._failure
        hold = max((state if state < len(stop) else failures[j][state - 1]
                    for j, (stop, state) in enumerate(zip(stops, states, strict=True))), default=0)
        cut = len(self._pending) - hold
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return self._release(text)

    def flush(self) -> str:
        """The request ended for another reason: whatever was held back, including an incomplete
        UTF-8 sequence at the very end (shown as U+FFFD, as a whole decode shows it)."""
        if self.stopped is None and self._ids:
            skip = self._skip_special
            head = self.tokenizer.decode(self._context, skip_special_tokens=skip)
            whole = self.tokenizer.decode(self._context + self._ids, skip_special_tokens=skip)
            seen = "".join(self._released) + self._pending
            if whole.startswith(head) and whole[len(head):].startswith(seen):
                self._pending += whole[len(head) + len(seen):]
        text, self._pending = self._pending, ""
        return self._release(text)

    def _release(self, text: str) -> str:
        if text:
            self._released.append(text)
        return text


def _prefix_function(pattern: str) -> list[int]:
    """KMP failure function: for each prefix, the length of its longest proper border."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure


def _advance(pattern: str, failure: list[int], state: int, char: str) -> int:
    """The automaton's next state: the longest prefix of `pattern` ending the text + `char`."""
    while state and (state == len(pattern) or pattern[state] != char):
        state = failure[state - 1]
    if pattern[state] == char:
        state += 1
    return state


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Token sequences to ban for `bad_words`: each word as written and with one leading space
    (how it is tokenized inside a sentence), as vLLM does."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
            if ids and ids not in out:
                out.append(ids)
    return out
