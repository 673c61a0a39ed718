"""Decoder-side checks: a header against the decoder's artifact and prompt, a layer against its header.

`validate_header` runs before the decoder takes a block or a lane for the request; it first bounds
the header's fields by themselves (`wire.check_header`), so a hostile header costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import ArtifactConfig
from atombatch.artifact.kv_dtype import FLOAT8
from atombatch.errors import RequestError
from atombatch.pd.wire import (
    WIRE_DTYPES,
    KVHeader,
    LayerKV,
    check_header,
    clip,
    expected_layer_tokens,
    model_identity,
)


def validate_header(header: KVHeader, artifact: ArtifactConfig,
                    prompt: Sequence[int] | npt.NDArray[np.integer[Any]], *,
                    require_full: bool, lora_identity: str | None = None,
                    lora: str | None = None) -> None:
    """Check a producer's header against the decoder's artifact and the request's prompt.

    Args:
        header: what the producer sent.
        artifact: the decoder's artifact.
        prompt: the request's prompt tokens.
        require_full: the decoder's mode needs the whole prompt's KV (single-block and hybrid).
        lora_identity: the identity of the LoRA adapter the request runs under ("" for the base
            model), which the producer must have run; `lora` its name, for the message. None:
            not known here (a transport's early check): the engine checks it.
    Raises:
        RequestError: the first broken rule, naming the field, its value and the rule.
    """
    spec = artifact.model
    window = spec.sliding_window if spec.is_hybrid else 0

    def fail(field: str, value: object, rule: str) -> RequestError:
        return RequestError(f"KV header {field}={clip(repr(value))}: {rule}")

    identity = model_identity(spec)
    if header.model_identity != identity:
        raise fail("model_identity", header.model_identity,
                   f"the decoder's model {spec.name} has identity {identity!r}")
    for field, mine in (("num_layers", spec.num_layers), ("layer_kinds", spec.layer_kinds),
                        ("kv_heads", spec.num_kv_heads), ("head_dim", spec.head_dim),
                        ("sliding_window", window)):
        value = getattr(header, field)
        if value != mine:
            raise fail(field, value, f"the decoder's model has {field}={clip(repr(mine))}")
    check_header(header)  # the rest, field by field (in-process headers skip the wire's check)
    if lora_identity is not None and header.lora_identity != lora_identity:
        ran = "another LoRA adapter" if header.lora_identity else "the base model"
        runs = f"LoRA adapter {lora!r} (identity {lora_identity!r})" if lora_identity else \
            "the base model"
        raise fail("lora_identity", header.lora_identity,
                   f"the producer ran {ran}; the request runs under {runs}, and its producer "
                   "must run the same adapter")
    if header.dtype not in WIRE_DTYPES:
        raise fail("dtype", header.dtype, f"must be one of {sorted(WIRE_DTYPES)}")
    if header.dtype == FLOAT8 and artifact.kv_dtype != FLOAT8:
        # widening is exact, but the decoder would then decode over KV rounded to 3 mantissa
        # bits, not the KV its own prefill keeps: its answer would not be its native one
        raise fail("dtype", header.dtype,
                   f"the decoder keeps KV as kv_dtype={artifact.kv_dtype!r}; a float8_e4m3fn "
                   "payload is imported by float8_e4m3fn decoders only (docs/pd.md)")
    if header.prompt_len != len(prompt):
        raise fail("prompt_len", header.prompt_len,
                   f"the request's prompt has {len(prompt)} tokens")
    if not 0 < header.covered_len <= header.prompt_len:
        raise fail("covered_len", header.covered_len,
                   f"must be in 1..prompt_len={header.prompt_len}")
    if require_full and header.covered_len < header.prompt_len:
        raise fail("covered_len", header.covered_len,
                   f"this decoder needs the full prefix of prompt_len={header.prompt_len} tokens "
                   "(single-block and hybrid PD import full prefixes only)")
    if header.covered_len == header.prompt_len:
        if header.first_token is None:
            raise fail("first_token", None, "a full-prefix payload must carry the first token")
        if not 0 <= header.first_token < spec.vocab_size:
            raise fail("first_token", header.first_token,
                       f"must be in the vocabulary 0..{spec.vocab_size - 1}")
    elif header.first_token is not None:
        raise fail("first_token", header.first_token,
                   f"must be None for a partial prefix (covered_len={header.covered_len} < "
                   f"prompt_len={header.prompt_len})")
    want = expected_layer_tokens(spec.layer_kinds, header.covered_len, window)
    if tuple(header.layer_tokens) != want:
        raise fail("layer_tokens", header.layer_tokens,
                   f"covered_len={header.covered_len} means {clip(repr(want))} (covered_len per global "
                   f"layer, min(covered_len, window={window}) per sliding layer)")
    if header.covered_len + 1 > artifact.max_seq_len:
        raise fail("covered_len", header.covered_len,
                   f"covered_len + 1 must fit the decoder's max_seq_len={artifact.max_seq_len}")


def validate_layer(header: KVHeader, layer: LayerKV, seen: set[int]) -> None:
    """Check one layer against a validated header; on success `layer.layer` is added to `seen`.

    Raises:
        RequestError: an unknown or duplicate layer index, or K/V of the wrong shape or dtype.
    """
    index = layer.layer
    if not 0 <= index < header.num_layers:
        raise RequestError(f"KV layer={index} is outside 0..{header.num_layers - 1}")
    if index in seen:
        raise RequestError(f"KV layer={index} arrived twice")
    shape = (header.kv_heads, header.layer_tokens[index], header.head_dim)
    wire = WIRE_DTYPES[header.dtype]
    for name, x in (("k", layer.k), ("v", layer.v)):
        if not isinstance(x, np.ndarray):
            raise RequestError(f"KV layer={index} {name} is a {type(x).__name__}, not an array")
        if x.shape != shape:
            raise RequestError(f"KV layer={index} {name} has shape {x.shape}, the header says "
                               f"{shape} (kv_heads, layer_tokens[{index}], head_dim)")
        if x.dtype != wire:
            raise RequestError(f"KV layer={index} {name} has dtype {x.dtype}, header dtype="
                               f"{header.dtype!r} is carried as {wire}")
    seen.add(index)
