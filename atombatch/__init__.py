"""atombatch: block tables, lanes and PD scheduling for LLM serving on Rebellions ATOM NPUs."""

from atombatch import plan
from atombatch.aio import AsyncBatcher
from atombatch.config import ArtifactConfig, EngineOptions, ModelSpec
from atombatch.engine import Batcher, EngineStats, StepResult
from atombatch.errors import (
                              AtomBatchError,
                              CapacityError,
                              ConfigError,
                              KVTransferError,
                              RequestError,
                              StateError,
)
from atombatch.scheduler import Policy
from atombatch.structs import (
    Completion,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    TokenLogprob,
    TokenLogprobs,
)
from atombatch.structured import StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "ArtifactConfig", "AsyncBatcher", "AtomBatchError", "Batcher", "CapacityError", "Completion",
    "ConfigError", "EngineOptions", "EngineStats", "KVTransferError", "ModelSpec", "Policy",
    "RequestError", "RequestOutput", "RequestTimings", "SamplingParams", "StateError", "StepResult",
    "StructuredOutput", "TokenLogprob", "TokenLogprobs", "plan",
]
