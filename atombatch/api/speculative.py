"""`SpeculativeConfig`: vLLM's `--speculative-config` (n-gram / prompt-lookup drafts), parsed
with a typed error naming each bad field. See docs/speculative.md."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from atombatch.errors import ConfigError

# vLLM's defaults: prompt_lookup_max falls back to prompt_lookup_min and the other way round,
# both to 5 when neither is given
DEFAULT_PROMPT_LOOKUP = 5
# bounds of ours (not vLLM's): a draft of more tokens than a prefill chunk holds cannot be
# verified in one call anyway, and the proposer's work per step is bounded by these
MAX_SPECULATIVE_TOKENS = 64
MAX_PROMPT_LOOKUP = 64
MAX_LOOKUP_WINDOW = 8192
DEFAULT_LOOKUP_WINDOW = 1024
MAX_CONFIG_BYTES = 4096


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding with n-gram (prompt-lookup) drafts, verified in one prefill-graph
    call (an artifact compiled with `logits_to_keep=0`).

    - `num_speculative_tokens`: draft tokens per verify call (k).
    - `prompt_lookup_max` / `prompt_lookup_min`: the n-gram sizes tried, longest first.
    - `lookup_window` (ours): the proposer searches only the last `lookup_window` tokens of a
      request's sequence, so its work per step is bounded (O(window * prompt_lookup_max)).
    - `auto_off` (ours): speculation turns itself off per request while its measured
      acceptance would make it slower than plain decoding (docs/speculative.md).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    lookup_window: int = DEFAULT_LOOKUP_WINDOW
    auto_off: bool = True  # ours: a request whose drafts do not pay decodes plainly

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ConfigError(f"speculative_config.method={self.method!r}: only 'ngram' "
                              f"(prompt-lookup drafts) is supported")
        _bounded("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        _bounded("prompt_lookup_max", self.prompt_lookup_max, MAX_PROMPT_LOOKUP)
        _bounded("prompt_lookup_min", self.prompt_lookup_min, MAX_PROMPT_LOOKUP)
        _bounded("lookup_window", self.lookup_window, MAX_LOOKUP_WINDOW)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} "
                              f"must be <= prompt_lookup_max={self.prompt_lookup_max}")


def _bounded(name: str, value: Any, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ConfigError(f"speculative_config.{name}={value!r} must be an integer in "
                          f"1..{limit}")


# vLLM fields that change nothing about n-gram drafts here, accepted as vLLM accepts them
_IGNORED = frozenset({"model", "disable_by_batch_size", "disable_logprobs"})


def parse_speculative_config(text: str | dict[str, Any]) -> SpeculativeConfig:
    """vLLM's `--speculative-config` JSON (or its dict) -> `SpeculativeConfig`.

    Raises:
        ConfigError: not JSON, not an object, an unknown or unsupported field, or a value out
            of its range (the message names the field).
    """
    if isinstance(text, str):
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"speculative_config is {len(text)} characters; at most "
                              f"{MAX_CONFIG_BYTES}")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"speculative_config is not JSON: {exc}") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ConfigError(f"speculative_config must be a JSON object, not "
                          f"{type(data).__name__}")
    fields = dict(data)
    if fields.get("model") not in (None, "ngram", "[ngram]"):
        raise ConfigError(f"speculative_config.model={fields['model']!r}: draft models are not "
                          f"supported (method 'ngram' only)")
    method = fields.get("method")
    if method is None and fields.get("model") in ("ngram", "[ngram]"):
        method = "ngram"  # vLLM's older spelling
    if method is None:
        raise ConfigError("speculative_config.method is required (only 'ngram' is supported)")
    fields["method"] = method
    if "num_speculative_tokens" not in fields:
        raise ConfigError("speculative_config.num_speculative_tokens is required")
    for name in list(fields):
        if name in _IGNORED:
            del fields[name]
        elif name not in SpeculativeConfig.__struct_fields__:
            raise ConfigError(f"speculative_config.{name} is not supported (fields: "
                              f"{', '.join(SpeculativeConfig.__struct_fields__)})")
    lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    fields["prompt_lookup_min"], fields["prompt_lookup_max"] = lo, hi
    try:
        return msgspec.convert(fields, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"speculative_config: {exc}") from None
