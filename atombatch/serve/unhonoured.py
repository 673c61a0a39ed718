"""Request fields that would change the result and that this server does not honour: a 400.

Unknown fields are dropped and listed in `X-Ignored-Fields` (atombatch/serve/schema.py), which is
right for fields that change nothing (`store`, `metadata`, `service_tier`, `priority`,
`cache_salt`, ...). It is wrong for a field whose value changes what is generated or returned:
a client that asks vLLM for guided JSON and gets unconstrained text with a 200 has been lied to.
Every field below is refused (400 `unsupported_value` naming it) unless its value is one that
changes nothing (its default); a field the request Struct declares is never looked up here (the
server handles it), so declaring a field there retires its entry.
"""

from __future__ import annotations

from typing import Any

# name -> (values that change nothing, what the server would have had to do)
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "guided_json": ((None,), "structured output (guided decoding)"),
    "guided_regex": ((None,), "structured output (guided decoding)"),
    "guided_choice": ((None,), "structured output (guided decoding)"),
    "guided_grammar": ((None,), "structured output (guided decoding)"),
    "guided_decoding_backend": ((None,), "structured output (guided decoding)"),
    "guided_whitespace_pattern": ((None,), "structured output (guided decoding)"),
    "structured_outputs": ((None,), "structured output"),
    "response_format": ((None, {"type": "text"}), "structured output"),
    "return_tokens_as_token_ids": ((None, False), "token strings written as 'token_id:N'"),
    "add_special_tokens": ((None, False), "adding the tokenizer's special tokens to the chat "
                           "template's output (the template writes them)"),
    "logits_processors": ((None, []), "custom logits processors"),
    "vllm_xargs": ((None, {}), "vLLM plugin arguments"),
    "kv_transfer_params": ((None,), "vLLM's KV transfer (atombatch's PD is docs/pd.md)"),
    "prompt_embeds": ((None,), "prompt embeddings"),
    "mm_processor_kwargs": ((None, {}), "multimodal processing"),
    "reasoning_effort": ((None,), "a reasoning effort"),
    "prediction": ((None,), "predicted outputs"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "output modalities other than text"),
    "web_search_options": ((None,), "web search"),
    "thinking_token_budget": ((None,), "a thinking token budget"),
    "echo": ((None, False), "echoing the last message (chat)"),
    "top_logprobs": ((None,), "top_logprobs (completions take logprobs=k)"),
}


def refused(raw: dict[str, Any], declared: set[str]) -> tuple[str, str] | None:
    """The first field of a decoded body that changes results and is not honoured:
    (name, reason), or None."""
    for name, value in raw.items():
        entry = UNHONOURED.get(name)
        if entry is None or name in declared:
            continue
        harmless, what = entry
        if any(value == ok and type(value) is type(ok) for ok in harmless):
            continue
        return name, what
    return None
