"""atombatch: block tables, lanes and PD scheduling for LLM serving on Rebellions ATOM NPUs."""

from atombatch.api.options import EngineOptions
from atombatch.api.structs import (
                              Completion,
                              RequestOutput,
                              RequestTimings,
                              SamplingParams,
                              TokenLogprob,
                              TokenLogprobs,
)
from atombatch.api.structured import StructuredOutput
from atombatch.artifact import plan
from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.engine.aio import AsyncBatcher
from atombatch.engine.batcher import Batcher, EngineStats, StepResult
from atombatch.engine.scheduler import Policy
from atombatch.errors import (
                              AtomBatchError,
                              CapacityError,
                              ConfigError,
                              KVTransferError,
                              RequestError,
                              StateError,
)

__version__ = "0.1.0"

__all__ = [
    "ArtifactConfig", "AsyncBatcher", "AtomBatchError", "Batcher", "CapacityError", "Completion",
    "ConfigError", "EngineOptions", "EngineStats", "KVTransferError", "ModelSpec", "Policy",
    "RequestError", "RequestOutput", "RequestTimings", "SamplingParams", "StateError", "StepResult",
    "StructuredOutput", "TokenLogprob", "TokenLogprobs", "plan",
]
