"""A PD producer in its own process, for tests: a spawn target that builds a NumpyRuntime producer
behind a `ZmqProducerServer` (the library's `pd` package never imports a runtime)."""

from __future__ import annotations

from typing import Any

from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.pd import Producer, ZmqProducerServer
from atombatch.runtime.numpy_runtime import NumpyRuntime


def run_producer_process(spec_or_checkpoint: ModelSpec | str, artifact_kwargs: dict[str, Any],
                         seed: int, endpoint: str, *, dtype: str = "float32",
                         layer_delay: float = 0.0, fail_at_layer: int | None = None) -> None:
    """A `multiprocessing` (spawn) target: build a NumpyRuntime producer and serve forever.

    Args:
        spec_or_checkpoint: a `ModelSpec` (random weights from `seed`) or a Hugging Face
            checkpoint directory (`NumpyRuntime.from_pretrained`).
        artifact_kwargs: `ArtifactConfig` fields besides `model` (the producer's own layout).
        seed: the random weights' seed (ignored for a checkpoint).
        endpoint: where to bind the ROUTER socket.
    """
    if isinstance(spec_or_checkpoint, ModelSpec):
        runtime = NumpyRuntime.random(ArtifactConfig(model=spec_or_checkpoint, **artifact_kwargs),
                                      seed)
    else:
        spec = ModelSpec.from_pretrained(spec_or_checkpoint)
        runtime = NumpyRuntime.from_pretrained(
            spec_or_checkpoint, ArtifactConfig(model=spec, **artifact_kwargs))
    server = ZmqProducerServer(Producer(runtime, dtype=dtype), endpoint,
                               layer_delay=layer_delay, fail_at_layer=fail_at_layer)
    server.serve_forever()
