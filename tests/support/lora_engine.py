"""LoRA adapters through the engine (test helpers): a tiny checkpoint with PEFT adapters made by
peft itself (`support.lora_models`), NumPy runtimes for it in the engine's layouts, the
transformers + peft greedy reference of a prompt under an adapter, and a runtime wrapper that
records the `lora_int_ids` of every call it forwards to the real NumPy runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atombatch import Batcher
from atombatch.api.structs import SamplingParams
from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.runtime.numpy_runtime import NumpyRuntime, load_safetensors_dir
from support import hf_models as hf
from support import lora_models as lm
from support.numerics import GreedyTokens, greedy_reference

CONTEXT = 128
ADAPTERS = ("attn-r4", "all-linear-r2")   # two of lora_models' cases: they move greedy tokens


@dataclass
class LoraFamily:
    """One family's checkpoint, its adapters' PEFT directories and reference models."""

    family: str
    checkpoint: Path
    spec: ModelSpec
    weights: dict[str, np.ndarray]
    adapter_dirs: dict[str, Path]
    models: dict[str | None, Any]        # adapter name (None: the base) -> transformers model
    greedy: dict[tuple[str | None, tuple[int, ...], int], GreedyTokens] = field(
        default_factory=dict)

    def artifact(self, batch: int, *, block_size: int = 16, chunk: int = 16,
                 num_blocks: int | None = None, decoder_batch_sizes: Any = None
                 ) -> ArtifactConfig:
        bps = CONTEXT // block_size
        extra = {} if decoder_batch_sizes is None else \
            {"decoder_batch_sizes": tuple(decoder_batch_sizes)}
        return ArtifactConfig(model=self.spec, batch_size=batch, max_seq_len=CONTEXT,
                              block_size=block_size,
                              num_blocks=num_blocks if num_blocks is not None else batch * bps + 1,
                              prefill_chunk_size=chunk, kv_dtype="float32", **extra)

    def runtime(self, batch: int, **kw: Any) -> NumpyRuntime:
        """A NumPy runtime with no adapter loaded (the engine loads them: `engine`)."""
        return NumpyRuntime(self.artifact(batch, **kw), self.weights)

    def engine(self, runtime: Any, adapters: tuple[str, ...] = ADAPTERS, **kw: Any) -> Batcher:
        """A Batcher over `runtime` with `adapters` loaded through `Batcher.load_lora`."""
        batcher = Batcher(runtime, **kw)
        for name in adapters:
            batcher.load_lora(name, str(self.adapter_dirs[name]))
        return batcher

    def reference(self, adapter: str | None, prompt: list[int], new_tokens: int) -> GreedyTokens:
        """transformers + peft's greedy tokens of `prompt` under `adapter` (None: the base),
        by full recompute; computed once."""
        key = (adapter, tuple(prompt), new_tokens)
        if key not in self.greedy:
            self.greedy[key] = greedy_reference(self.models[adapter], prompt, new_tokens,
                                                lambda m, s: hf.hf_logits(m, s)[-1])
        return self.greedy[key]


def make_family(family: str, root: Path, adapters: tuple[str, ...] = ADAPTERS) -> LoraFamily:
    checkpoint, models, dirs = lm.save_family(family, root, adapters)
    return LoraFamily(family, checkpoint, ModelSpec.from_pretrained(checkpoint),
                      load_safetensors_dir(checkpoint), dirs, models)


def core_batcher(checkpoint: str, adapters: tuple[tuple[str, str], ...], batch: int = 4,
                 **options: Any) -> Batcher:
    """An engine core's factory (picklable with functools.partial): the checkpoint's NumPy
    runtime, partitioned blocks, with `adapters` ((name, PEFT directory), ...) loaded."""
    spec = ModelSpec.from_pretrained(Path(checkpoint))
    art = ArtifactConfig(model=spec, batch_size=batch, max_seq_len=CONTEXT, block_size=16,
                         num_blocks=batch * (CONTEXT // 16) + 1, prefill_chunk_size=16,
                         kv_dtype="float32")
    batcher = Batcher(NumpyRuntime(art, load_safetensors_dir(Path(checkpoint))), **options)
    for name, path in adapters:
        batcher.load_lora(name, path)
    return batcher


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class RecordingRuntime:
    """Forwards every call to a real runtime and records, per prefill and decode call, the
    `lora_int_ids` it was given (None: not given) with the call's kind and decoding rows."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple[int, ...] | None]] = []

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        ids = kw.get("lora_int_ids")
        self.calls.append(("prefill", None if ids is None else tuple(int(i) for i in ids)))
        return self.inner.prefill(inputs, **kw)

    def decode(self, inputs: Any, **kw: Any) -> Any:
        ids = kw.get("lora_int_ids")
        self.calls.append(("decode", None if ids is None else tuple(int(i) for i in ids)))
        return self.inner.decode(inputs, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def adapters_per_call(self) -> list[set[int]]:
        """The distinct adapters (not the base) of each call."""
        return [{i for i in ids if i} for _, ids in self.calls if ids is not None]
