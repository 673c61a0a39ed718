"""vLLM's operational endpoints beside the OpenAI API: tokenize, detokenize, version, tokenizer info.

Shaped as a vLLM server answers them, so tools written for vLLM (lm-evaluation-harness's remote
tokenizer, load generators that count tokens on the server) work unchanged:

- `POST /tokenize` `{"prompt": "..."}` or `{"messages": [...]}` (rendered with the chat template,
  `tools`, `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`) answers
  `{"count", "max_model_len", "tokens", "token_strs"}`; `add_special_tokens` defaults to true for a
  prompt and false for messages (vLLM's defaults), `return_token_strs` adds the tokens' strings;
- `POST /detokenize` `{"tokens": [...]}` answers `{"prompt": text}`; more ids than the context
  (`max_model_len`: no longer list was ever a model's input or output) is a 400 naming `tokens`,
  checked before the list is iterated; an id outside the vocabulary is a 400 naming `tokens[i]`;
- `GET /version` answers `{"version": atombatch's version}`;
- `GET /tokenizer_info` answers the tokenizer's configuration (`tokenizer_config.json` without
  its file paths) with `tokenizer_class` and the chat template in use, as vLLM's
  `--enable-tokenizer-info-endpoint` does (always on here: it holds nothing the model card does
  not already name).

Sizes: every body is bounded by `--max-body-bytes`; a prompt is bounded by the context as a
generation prompt is (`max_model_len`), so counting tokens never costs more than submitting them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from atombatch.errors import RequestError
from atombatch.serve.chat_template import check_template_kwargs
from atombatch.serve.protocol import ChatMessage
from atombatch.serve.tokens import Codec, HFCodec
from atombatch.serve.tools import check_tools

# configuration keys that name files on the server (vLLM drops them too)
_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /tokenize`: a prompt, or chat messages (vLLM's two request kinds in one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # None: true for a prompt, false for messages
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /detokenize`."""

    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def tokenize(codec: Codec, body: TokenizeRequest, messages: list[dict[str, Any]] | None,
             max_model_len: int) -> TokenizeResponse:
    """`POST /tokenize` (`messages`: the body's messages as the chat template sees them).

    Raises:
        RequestError: neither or both of prompt and messages, a template failure, or more
            tokens than the context.
    """
    if messages is not None:
        if body.prompt is not None:
            raise RequestError("give prompt or messages, not both", param="prompt")
        if body.add_special_tokens:
            raise RequestError("add_special_tokens=true with messages is not served: the chat "
                               "template adds the special tokens", param="add_special_tokens")
        # the chat route's checks: the same keywords refused, the same tool bounds
        check_template_kwargs(body.chat_template_kwargs or {})
        template: dict[str, Any] = dict(body.chat_template_kwargs or {})
        template.update(add_generation_prompt=body.add_generation_prompt,
                        continue_final_message=body.continue_final_message)
        if body.tools is not None:
            template["tools"] = check_tools(body.tools)
        ids = codec.render_chat(messages, **template)
    elif body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = encode_prompt(codec, body.prompt, special)
    else:
        raise RequestError("give prompt (text) or messages", param="prompt")
    if len(ids) > max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens, more than the context "
                           f"max_model_len={max_model_len}", param="prompt", limit=max_model_len)
    strs = token_strings(codec, ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                            token_strs=strs)


def encode_prompt(codec: Codec, text: str, add_special_tokens: bool) -> list[int]:
    """A prompt's ids; the tokenizer's own special tokens (its post-processor) when asked.
    Text longer than the context can hold is refused before it is tokenized (`HFCodec.bound`)."""
    if isinstance(codec, HFCodec):
        return codec.encode(text, add_special_tokens=add_special_tokens)
    return codec.encode(text)  # "<id>" pieces: no tokenizer, no special tokens of its own


def token_strings(codec: Codec, ids: list[int]) -> list[str]:
    """Each id's vocabulary string (`convert_ids_to_tokens`), or `"<id>"` without a tokenizer."""
    if isinstance(codec, HFCodec):
        return [codec.tokenizer.id_to_token(t) or "" for t in ids]
    return [f"<{t}>" for t in ids]


def check_ids(ids: list[int], vocab_size: int, max_model_len: int, param: str = "tokens") -> None:
    """Refuse a list longer than the context (before it is iterated) or an id outside the
    vocabulary."""
    if len(ids) > max_model_len:
        raise RequestError(f"{param} holds {len(ids)} ids, more than the context "
                           f"max_model_len={max_model_len}", param=param, limit=max_model_len)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise RequestError(f"{param}[{i}]={token} is not a token id of this model "
                               f"(0..{vocab_size - 1})", param=f"{param}[{i}]", limit=vocab_size)


def tokenizer_info(codec: Codec, max_model_len: int) -> dict[str, Any]:
    """What `GET /tokenizer_info` answers (vLLM: the tokenizer's init kwargs, JSON-safe)."""
    if not isinstance(codec, HFCodec):
        return {"tokenizer_class": "atombatch.IdCodec", "model_max_length": max_model_len,
                "note": "no tokenizer: token t is written as the text '<t>'"}
    info = {k: v for k, v in codec.config.items() if k not in _PATH_KEYS}
    info.pop("added_tokens_decoder", None)  # the vocabulary's added tokens: large, not config
    info["tokenizer_class"] = info.get("tokenizer_class") or "PreTrainedTokenizerFast"
    template = codec.chat_template
    if template is not None:
        info["chat_template"] = template.sources.get("default")
    return info
