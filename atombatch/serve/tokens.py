"""Text <-> token ids for the server: a Hugging Face tokenizer when there is one, else id pieces.

Without a tokenizer (`IdCodec`) the text of token `t` is the piece `"<t>"`: a completion's text is
its ids written as `<17><3><250>`, and a text prompt (or a chat message) is read back the same way
(whitespace between pieces is ignored; anything else is a 400). This keeps the OpenAI clients
working against a random-weight model and makes every text exactly checkable.

With a tokenizer (`HFCodec`, `tokenizers` + `tokenizer.json`) text is encoded and decoded by it.
Chat messages are rendered with the checkpoint's chat template (`atombatch.serve.chat_template`:
`chat_template.jinja` or `tokenizer_config.json`, rendered as transformers renders them) or,
without one, with the simple template

    <role>: <content>\\n   (one line per message)   then   assistant:

Streamed text is decoded incrementally by `atombatch.sampling.detokenizer.Detokenizer`, the engine's own,
from each request's params (`skip_special_tokens`, `spaces_between_special_tokens`, the stop id
left out), so a request's text is made by one piece of code whichever engine core serves it; an
incomplete UTF-8 sequence is held back until it completes.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from atombatch.api.structs import SamplingParams
from atombatch.errors import ConfigError, RequestError
from atombatch.sampling.detokenizer import Detokenizer
from atombatch.serve.chat_template import (
    ChatTemplate,
    load_chat_template,
    read_json,
    special_tokens_of,
)

# A token id is written with at most this many digits (ids are int32 on the device). A longer
# digit run is refused before it reaches `int()`, so a hostile prompt costs linear time only.
MAX_ID_DIGITS = 10
_PIECE = re.compile(rf"\s*<(\d{{1,{MAX_ID_DIGITS}}})>")
_LONG_PIECE = re.compile(rf"\s*<\d{{{MAX_ID_DIGITS + 1}}}")
_SPACE = re.compile(r"\s*")
_DEFAULT_PARAMS = SamplingParams()


class Codec(Protocol):
    name: str

    @property
    def chat_template_name(self) -> str: ...  # the template in use (startup line, /v1/models)

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]: ...

    def decoder(self, prompt: Sequence[int] = (),
                params: SamplingParams = ...) -> Decoder: ...  # one choice's text

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_text(self, token: int) -> str: ...  # a logprob entry's token string


class Decoder(Protocol):
    def step(self, token_ids: Sequence[int]) -> str: ...

    def step_one(self, token: int) -> str: ...  # `step((token,))`: the per-token path

    def finish(self, token_ids: Sequence[int], stop_id: bool) -> str: ...  # the last ids
    #   (`stop_id`: the request ended on a stop id) and whatever step() held back

    def flush(self) -> str: ...  # at the end: whatever step() held back


class IdCodec:
    """No tokenizer: token `t` reads and writes as `"<t>"`."""

    name = "ids"
    chat_template_name = "none (no tokenizer: message token ids concatenated)"

    def __init__(self, max_ids: int | None = None) -> None:
        self.max_ids = max_ids  # stop parsing past this many ids (the server's max_seq_len)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        while True:
            match = _PIECE.match(text, pos)
            if match is None:
                break
            if self.max_ids is not None and len(ids) >= self.max_ids:
                raise RequestError(f"text has more than {self.max_ids} token ids: a prompt must "
                                   f"fit max_seq_len={self.max_ids}")
            ids.append(int(match.group(1)))
            pos = match.end()
        if _SPACE.fullmatch(text, pos) is None:
            if _LONG_PIECE.match(text, pos):
                raise RequestError(f"token id piece at offset {pos} has more than "
                                   f"{MAX_ID_DIGITS} digits: a token id is in 0..2**31-1")
            raise RequestError(f"text {_clip(text[pos:])!r} at offset {pos} is not a '<id>' piece: "
                               "this server has no tokenizer, so text must be written as token ids "
                               "like '<17><3>' (or send the prompt as a list of ids)")
        return ids

    def render_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]:
        """The messages' ids concatenated in order (roles carry no tokens without a tokenizer)."""
        ids: list[int] = []
        for message in messages:
            ids.extend(self.encode(message.get("content") or ""))
            if self.max_ids is not None and len(ids) > self.max_ids:
                raise RequestError(f"messages have more than {self.max_ids} token ids: a prompt "
                                   f"must fit max_seq_len={self.max_ids}")
        return ids

    def decoder(self, prompt: Sequence[int] = (),
                params: SamplingParams | None = None) -> _IdDecoder:
        return _IdDecoder()

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{t}>" for t in token_ids)

    @staticmethod
    def token_text(token: int) -> str:
        return f"<{token}>"


class _IdDecoder:
    def step(self, token_ids: Sequence[int]) -> str:
        if len(token_ids) == 1:  # the streamed case: one token per event
            return f"<{token_ids[0]}>"
        return "".join([f"<{t}>" for t in token_ids])

    @staticmethod
    def step_one(token: int) -> str:
        """`step((token,))`, for the per-token path (`_Generation.fast_lane`)."""
        return f"<{token}>"

    def finish(self, token_ids: Sequence[int], stop_id: bool) -> str:
        """Every id is written, the stop id too (its piece is its id: there is no text to keep
        it out of)."""
        return self.step(token_ids) if token_ids else ""

    def flush(self) -> str:
        return ""


class HFCodec:
    """A `tokenizers.Tokenizer` plus the checkpoint's chat template (or the simple one)."""

    name = "tokenizers"

    def __init__(self, tokenizer: Any, chat_template: ChatTemplate | str | None = None,
                 special: dict[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.special = special or {}
        self.config: dict[str, Any] = {}  # tokenizer_config.json, when loaded from a directory
        if isinstance(chat_template, str):
            chat_template = ChatTemplate({"default": chat_template}, "chat_template argument",
                                         self.special)
        self.chat_template = chat_template
        self.max_chars: int | None = None   # set by `bound`: longer text cannot fit the context
        self.chars_per_token = 0

    @property
    def chat_template_name(self) -> str:
        if self.chat_template is None:
            return "none (fallback: '<role>: <content>' lines, then 'assistant:')"
        return self.chat_template.name

    @classmethod
    def from_dir(cls, path: str | Path) -> HFCodec | None:
        """Load `tokenizer.json` (+ `tokenizer_config.json`) from a checkpoint dir; None if absent.

        Raises:
            ConfigError: the files exist but cannot be read, or `tokenizers` is not installed.
        """
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(f"{file} exists but the 'tokenizers' package is not installed "
                              "(pip install 'atombatch[server]')") from None
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ConfigError(f"cannot read {file}: {exc}") from None
        special = special_tokens_of(path)
        codec = cls(tokenizer, load_chat_template(path, special), special)
        codec.config = read_json(path / "tokenizer_config.json") or {}
        return codec

    def bound(self, max_seq_len: int) -> None:
        """Refuse text that cannot fit `max_seq_len` tokens before tokenizing it: no token of this
        vocabulary spells more than `chars_per_token` characters (the longest vocabulary entry,
        x4 when a normalizer may drop characters), so a longer text has too many tokens."""
        longest = max((len(k) for k in self.tokenizer.get_vocab(with_added_tokens=True)),
                      default=1)
        self.chars_per_token = longest * (4 if self.tokenizer.normalizer is not None else 1)
        self.max_chars = max_seq_len * self.chars_per_token

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the tokenizer's post-processor adds
        its special tokens (a Llama tokenizer's BOS). A long text is tokenized with the GIL
        released (`encode_batch`), so a server thread doing it does not stall the event loop.

        Raises:
            RequestError: the text is longer than `max_chars` (it cannot fit the context).
        """
        if self.max_chars is not None and len(text) > self.max_chars:
            raise RequestError(f"text of {len(text)} characters cannot fit the context: at most "
                               f"{self.chars_per_token} characters per token x max_seq_len = "
                               f"max_prompt_chars={self.max_chars}", param="prompt",
                               limit=self.max_chars)
        if len(text) > _LONG_TEXT:
            return list(self.tokenizer.encode_batch(
                [text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]:
        """Render with the chat template (see `ChatTemplate.render` for `template`) and encode
        without adding special tokens, as `apply_chat_template(tokenize=True)` does."""
        if self.chat_template is not None:
            text = self.chat_template.render(messages, max_chars=self.max_chars, **template)
        else:
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + \
                "assistant:"
        return self.encode(text)

    def decoder(self, prompt: Sequence[int] = (),
                params: SamplingParams = _DEFAULT_PARAMS) -> Detokenizer:
        """The text of one choice, made from its request's own params by the engine's
        `Detokenizer` (atombatch/sampling/detokenizer.py: the one maker of a request's text in every
        engine-core mode), primed with the end of `prompt`."""
        return Detokenizer(self.tokenizer, prompt, params)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        """A logprob entry's token string, as vLLM writes it: the id decoded alone with special
        tokens shown, and with a Metaspace (SentencePiece) pre-tokenizer the leading spaces
        that a lone decode strips put back (`"▁the"` is `" the"`, not `"the"`)."""
        text = str(self.tokenizer.decode([token], skip_special_tokens=False))
        marker = self._space_marker
        if marker is None:
            return text
        raw = self.tokenizer.id_to_token(token) or ""
        markers = len(raw) - len(raw.lstrip(marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    @functools.cached_property
    def _space_marker(self) -> str | None:
        """The Metaspace pre-tokenizer's replacement character (None: another pre-tokenizer,
        whose lone decodes keep their spaces)."""
        try:
            pre = json.loads(self.tokenizer.to_str()).get("pre_tokenizer") or {}
        except (AttributeError, ValueError):
            return None
        for sub in [pre, *(pre.get("pretokenizers") or [])]:
            if isinstance(sub, dict) and sub.get("type") == "Metaspace":
                return str(sub.get("replacement", "\u2581"))
        return None


_LONG_TEXT = 4096  # characters: longer texts are tokenized with the GIL released


def _clip(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
