"""Incremental detokenization with stop strings, for engines that have a tokenizer.

`Detokenizer` turns one request's generated ids into text as they come (`tokenizers`'
`DecodeStream`, primed with the end of the prompt so the first word is spaced as in the whole
sequence; an incomplete UTF-8 sequence waits for its next byte). With stop strings it holds back
the longest tail of the text that could still become a stop string, so a stop string split across
tokens is found and no part of it is ever streamed; when one matches, the text ends before it
(or after it with `include_stop_str_in_output`) and the request finishes with reason "stop".
Stop strings count only once `min_tokens` tokens were generated, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.structs import SamplingParams

PROMPT_CONTEXT = 8  # prompt tokens that prime the decoder (spacing of the first generated word)


class Detokenizer:
    """The text of one request, streamed in safe pieces."""

    __slots__ = ("_checked", "_hold", "_stream", "include_stop", "min_tokens", "sent", "stop",
                 "stopped", "text", "tokenizer")

    def __init__(self, tokenizer: Any, prompt: Sequence[int] | npt.NDArray[np.integer],
                 params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        context = [int(t) for t in prompt[-PROMPT_CONTEXT:]]
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._hold = max((len(s) for s in self.stop), default=0)
        self.text = ""          # everything decoded so far (cut at a matched stop string)
        self.sent = 0           # characters of `text` already handed out
        self._checked = 0       # `text` before this offset holds no stop string
        self.stopped: str | None = None  # the stop string that matched

    def add(self, token_ids: Sequence[int], generated: int) -> str:
        """Decode new ids (`generated` = tokens generated so far, these included); returns the
        text that may be streamed now. Sets `stopped` when a stop string matched."""
        if self.stopped is not None:
            return ""
        for token in token_ids:
            piece = self._stream.step(self.tokenizer, int(token))
            if piece:
                self.text += piece
        if not self.stop:
            return self._take(len(self.text))
        if generated >= self.min_tokens:
            start = max(0, self._checked - self._hold + 1)
            best = -1
            match = ""
            for stop in self.stop:
                at = self.text.find(stop, start)
                if at >= 0 and (best < 0 or at < best):
                    best, match = at, stop
            if best >= 0:
                end = best + (len(match) if self.include_stop else 0)
                self.text = self.text[:end]
                self.stopped = match
                return self._take(end)
        self._checked = len(self.text)  # before min_tokens, occurrences do not count
        return self._take(len(self.text) - self._tail())

    def flush(self) -> str:
        """The request ended for another reason: whatever was held back."""
        return self._take(len(self.text))

    def _tail(self) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        text = self.text
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece


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
