"""Tiny random Hugging Face checkpoints and their transformers reference outputs (test helpers).

Every model here is built by transformers itself, re-randomized with a fixed seed so that its
logits are well spread (HF's default init, std 0.02, gives near-ties that would make greedy parity
flaky), and written with `save_pretrained` as safetensors in float32 and bfloat16. The reference
outputs come from transformers in float32 with eager attention, so they say what "the same model"
means for the NumPy runtime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen3", "gemma3")
SLIDING_WINDOW = 16  # Gemma3's tiny window: prompts in the tests are longer


def _quiet() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def hf_config(family: str) -> Any:
    """A tiny transformers config of `family` (llama3 RoPE scaling, tied Qwen3, hybrid Gemma3)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    common: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0)
    if family == "llama":
        # original_max_position_embeddings=64 puts the llama3 smoothing band inside head_dim 16's
        # wavelengths, so the scaling really changes the RoPE frequencies.
        return LlamaConfig(**common, num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64},
                           tie_word_embeddings=False)
    if family == "qwen3":
        # head_dim * heads (128) != hidden (64), as in the real Qwen3 models.
        return Qwen3Config(**common, num_hidden_layers=3, head_dim=32, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                           tie_word_embeddings=True)
    if family == "gemma3":
        # Two global layers among six so global KV spans more than one layer; query_pre_attn_scalar
        # differs from head_dim so the scale is really the configured one.
        layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
        return Gemma3TextConfig(**common, num_hidden_layers=6, head_dim=16, rms_norm_eps=1e-6,
                                sliding_window=SLIDING_WINDOW, layer_types=layer_types,
                                rope_parameters={
                                    "full_attention": {"rope_type": "default",
                                                       "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10_000.0}},
                                query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")


def build_model(family: str, seed: int = 0, config: Any = None) -> Any:
    """A float32 eval-mode transformers model of `family` (or of `config`, a variant of its
    tiny config) with spread-out random weights."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet()
    config = config if config is not None else hf_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    gemma = family == "gemma3"
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * _std(name, param.shape[-1],
                                                                             config.hidden_size))
            param.add_(_offset(name, gemma))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _std(name: str, fan_in: int, hidden: int) -> float:
    """Init scale of one weight (mirrors `atombatch.runtime.numpy_runtime.random_weights`).

    Embeddings/lm_head std 3/sqrt(hidden) give unit-RMS final states logits of std ~3; q/k, output
    and down projections at 3/sqrt(fan_in) (and q/k norms near 3) make attention sharp and layer
    outputs large against the token's own embedding, so greedy decoding wanders instead of
    repeating one token at once (tied random models otherwise sit on a fixed point).
    """
    if name.endswith("norm.weight"):
        return 0.1
    if "embed_tokens" in name or name.startswith("lm_head"):
        return 3.0 / math.sqrt(hidden)
    if any(part in name for part in ("q_proj", "k_proj", "o_proj", "down_proj")):
        return 3.0 / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def _offset(name: str, gemma: bool) -> float:
    """Norm weights sit near their gain: w for Llama-style norms, 1 + w for Gemma3's."""
    if not name.endswith("norm.weight"):
        return 0.0
    gain = 3.0 if any(part in name for part in ("q_norm", "k_norm", "post_attention_layernorm",
                                                   "post_feedforward_layernorm")) else 1.0
    if not gemma and "post_" in name:
        gain = 1.0  # Llama/Qwen3's post_attention_layernorm is the pre-MLP norm
    return gain - 1.0 if gemma else gain


def save_checkpoint(family: str, directory: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """`save_pretrained` a tiny `family` model as safetensors in `dtype` into `directory`."""
    import torch

    model = build_model(family, seed=seed)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"dtype={dtype!r} is not float32 or bfloat16")
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_float32(directory: Path) -> Any:
    """A saved checkpoint loaded by transformers in float32 (bf16 weights widened exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def hf_logits(model: Any, token_ids: Sequence[int]) -> np.ndarray:
    """transformers' full-sequence logits [T, vocab] (one forward pass, no cache)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(model: Any, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (its own KV cache), new tokens only."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=0)
    return [int(t) for t in out[0, len(token_ids):]]
