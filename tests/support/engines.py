"""Engine factories a spawned engine core can import (module-level, so they pickle)."""

from __future__ import annotations

from typing import Any

from atombatch import ArtifactConfig, Batcher, ModelSpec
from atombatch.runtime import NumpyRuntime

SPEC = ModelSpec(name="core-test", family="llama", vocab_size=256, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 bos_token_id=1, eos_token_ids=(2,), dtype="float32")
ART = ArtifactConfig(model=SPEC, batch_size=4, max_seq_len=128, block_size=32, num_blocks=17,
                     prefill_chunk_size=32, kv_dtype="float32")


def numpy_batcher(seed: int = 7, max_waiting: int | None = 64, **options: Any) -> Batcher:
    """The tiny Llama on the NumPy runtime: real math, four lanes, partitioned blocks."""
    return Batcher(NumpyRuntime.random(ART, seed=seed), max_waiting=max_waiting, **options)


def slow_prefill_batcher(prefill_ms: float, step_ms: float = 1.0, **options: Any) -> Batcher:
    """A null device (atombatch/runtime/null.py) whose every prefill chunk waits `prefill_ms`:
    a long prompt's chunks, none of which has an output, take long in all (`options`: the
    Batcher's, e.g. overlap=True)."""
    from atombatch.runtime.null import NullRuntime

    art = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=2048, block_size=32,
                         num_blocks=2 * 64 + 1, prefill_chunk_size=32, kv_dtype="float32")
    return Batcher(NullRuntime(art, step_ms=step_ms, prefill_ms=prefill_ms), **options)


def failing_factory(message: str) -> Batcher:
    from atombatch.errors import ConfigError
    raise ConfigError(message)


def submit_message(request_id: str, prompt: list[int], params: Any) -> Any:
    """The `Submit` a front sends the core for `prompt` (int64 bytes)."""
    import numpy as np

    from atombatch.core.messages import Submit

    return Submit(request_id, np.asarray(prompt, dtype=np.int64).tobytes(), params)


class _TrustingBatcher(Batcher):
    def validate(self, prompt: Any, params: Any) -> Any:
        raise AssertionError("the engine core validated a request the front had validated")


def trusting_batcher(**options: Any) -> Batcher:
    """`numpy_batcher` whose own `validate` fails: a core built from it serves a request only if
    it trusts the front that validated it (each request is validated once)."""
    return _TrustingBatcher(NumpyRuntime.random(ART, seed=7), max_waiting=64, **options)
