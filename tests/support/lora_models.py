"""Tiny random PEFT LoRA adapters on the tiny checkpoints of hf_models.py, and their transformers +
peft reference outputs (test helpers).

peft initializes B to zero (an adapter that changes nothing); these adapters re-draw A and B from a
seeded generator so the delta is as large as the base projection it is added to, which moves the
greedy tokens away from the base model's: a runtime that ignored an adapter, applied the wrong one
or the wrong scaling would say other tokens. The reference model is the base checkpoint's model
with the adapter injected by peft, float32, eager attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from support import hf_models as hf

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class AdapterCase(msgspec.Struct, frozen=True):
    """How one test adapter is made."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str      # a list of module names, or "all-linear"
    use_rslora: bool = False
    seed: int = 1
    layers: tuple[int, ...] | None = None      # PEFT's layers_to_transform (None: every layer)


# Adapters that differ in rank, targets, scaling rule and reach: attention only; the MLP and one
# attention projection with rsLoRA; PEFT's "all-linear"; two modules of layer 1 alone (PEFT's
# layers_to_transform: the other layers run the base weights).
CASES = {
    "attn-r4": AdapterCase(r=4, lora_alpha=8.0, target_modules=ATTENTION, seed=1),
    "mlp-r8-rslora": AdapterCase(r=8, lora_alpha=6.0, target_modules=(*MLP, "q_proj"),
                                 use_rslora=True, seed=2),
    "all-linear-r2": AdapterCase(r=2, lora_alpha=2.0, target_modules="all-linear", seed=3),
    "layer1-r16": AdapterCase(r=16, lora_alpha=64.0, target_modules=("o_proj", "down_proj"),
                              seed=4, layers=(1,)),
}


def peft_model(family: str, case: AdapterCase, base_seed: int = 0) -> Any:
    """hf_models' tiny `family` model (seed `base_seed`) with `case`'s adapter injected by peft and
    its A and B matrices redrawn (B nonzero), in eval mode."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = hf.build_model(family, seed=base_seed)
    targets = case.target_modules if isinstance(case.target_modules, str) else \
        list(case.target_modules)
    config = LoraConfig(r=case.r, lora_alpha=case.lora_alpha, target_modules=targets,
                        lora_dropout=0.0, bias="none", use_rslora=case.use_rslora,
                        layers_to_transform=list(case.layers) if case.layers else None)
    wrapped = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for name, param in sorted(wrapped.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    return wrapped.eval()


def save_adapter(family: str, case: AdapterCase, directory: Path, base_seed: int = 0) -> Any:
    """Write `case`'s adapter as a PEFT directory (adapter_config.json + safetensors) and return
    the peft model it came from (the reference)."""
    model = peft_model(family, case, base_seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def reference_logits(model: Any, token_ids: Sequence[int]) -> Any:
    """The peft model's full-sequence logits [T, vocab] (one forward, no cache)."""
    return hf.hf_logits(model, token_ids)


def save_family(family: str, root: Path, names: Sequence[str] | None = None
                ) -> tuple[Path, dict[str | None, Any], dict[str, Path]]:
    """A family's tiny checkpoint under `root/base` and the adapters `names` (default: every
    case) beside it: (the checkpoint, the transformers models by adapter name (None: the base),
    the PEFT directories by name)."""
    checkpoint = hf.save_checkpoint(family, root / "base")
    models: dict[str | None, Any] = {None: hf.build_model(family)}
    dirs: dict[str, Path] = {}
    for name in CASES if names is None else names:
        dirs[name] = root / name
        models[name] = save_adapter(family, CASES[name], dirs[name])
    return checkpoint, models, dirs
