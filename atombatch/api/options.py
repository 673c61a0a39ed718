"""The engine's and the engine core's options that are plain data, each default written once."""

from __future__ import annotations

from typing import Literal

import msgspec

from atombatch.api.policy import DEFAULT_POLICY
from atombatch.api.speculative import SpeculativeConfig

# seconds an engine core process with requests in flight may send nothing before its front
# counts it hung and kills it (`CoreClient(hang_timeout=)`, the server's --core-hang-timeout)
DEFAULT_CORE_HANG_TIMEOUT = 60.0
# seconds a front of a shared engine core may read nothing, more than a window of the core's
# messages waiting, before the core aborts its requests (atombatch/core/shared.py, the server's
# --front-stall-timeout)
DEFAULT_FRONT_STALL_TIMEOUT = 5.0

LogprobsMode = Literal["raw", "processed"]
# Requests without a lane that a Batcher keeps by default; past it `submit` raises CapacityError.
# Each waiting request holds its prompt (at most max_seq_len int64 ids) and a little bookkeeping.
DEFAULT_MAX_WAITING = 4096


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A `Batcher`'s options that are plain data, each default written here once: the
    `Batcher(...)` keywords default to these fields, `Batcher.options` is the struct a built
    engine runs with, and the server's command line builds one from its flags
    (`atombatch.serve.cli.engine_options`). A msgspec struct: it pickles into the engine core
    process and encodes as msgpack. What is not data (the runtime, a clock, a tokenizer, a
    `Policy` object) is given to `Batcher` beside it. See `Batcher` for each field.
    """

    prefix_cache: bool = False
    host_cache_bytes: int = 0
    policy: str = DEFAULT_POLICY             # its label: "stall-free:8", "prefill-first", ...
    seed: int = 0
    # requests without a lane `submit` admits (the queue bound: validation.queue_limit); None:
    # unbounded
    max_waiting: int | None = DEFAULT_MAX_WAITING
    pd_timeout: float = 300.0                # seconds a PD request waits for its producer's next
    pd_deadline: float | None = None         #   message; its whole import (None: 2 * pd_timeout)
    logprobs_mode: LogprobsMode = "raw"
    detokenize: bool = True
    argmax_threads: int | None = None
    overlap: bool = False
    log_requests: bool = True                # a request's info events logged (quiet_requests)
    speculative: SpeculativeConfig | None = None  # n-gram drafts (docs/speculative.md)


ENGINE_DEFAULTS = EngineOptions()
