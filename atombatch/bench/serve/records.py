"""What `bench serve` records: one `Cell` per configuration run, a `ServeReport` per matrix
(msgspec Structs, written as JSON with the commit, the machine and every parameter)."""

from __future__ import annotations

from typing import Any

import msgspec

from atombatch.runtime.sim import CostModel


class Latency(msgspec.Struct, frozen=True):
    """Distribution of one latency over the requests that finished within the timeout (s)."""

    count: int
    p50: float | None
    p99: float | None
    max: float | None
    mean: float | None


class FitVerdict(msgspec.Struct, frozen=True):
    """`plan.fit` of the cell's artifact, or why it could not be built."""

    fits: bool | None                   # None: not assessed (small numpy specs) or rejected
    projected_bytes: int | None = None
    device_bytes: int | None = None
    method: str | None = None           # "observed" (conditional) | "estimate"
    basis: str | None = None
    rejected: str | None = None         # ConfigError message when the artifact breaks a rule


class RequestRecord(msgspec.Struct, frozen=True, array_like=True):
    """One request: [arrival, ttft, e2e, tokens, failed, reason]; times in s from its arrival."""

    arrival: float
    ttft: float | None
    e2e: float | None
    tokens: int
    failed: bool
    reason: str                          # finish reason, or "timeout"


class Cell(msgspec.Struct, frozen=True):
    """One point of the matrix and what it measured (seconds are virtual on the simulator)."""

    model: str
    route: str
    input_len: int
    output_len: int
    artifact: str                        # spec as given, e.g. "B4/k5"
    policy: str
    label: str                           # ArtifactConfig.label, or the spec when rejected
    identity: str | None                 # ArtifactConfig.identity
    batch_size: int
    num_blocks: int
    max_seq_len: int
    block_size: int
    prefill_chunk_size: int
    tensor_parallel: int
    fit: FitVerdict
    status: str                          # "ok" | "not-run: does not fit" | "rejected" | "error"
    decoder_batch_sizes: tuple[int, ...] = ()  # compiled decode batches ("buckets"); () = (B,)
    hypothetical: bool = False           # ran although plan.fit says it does not fit
    error: str | None = None
    requests: int = 0
    completed: int = 0                   # finished within the timeout
    timeouts: int = 0                    # over the timeout (failures, not in latency figures)
    errors: int = 0                      # error or abort
    ttft: Latency | None = None
    completion: Latency | None = None
    max_first_token_all: float | None = None  # over every request, timed out or not (origin style)
    max_completion_all: float | None = None
    max_gap_s: float | None = None       # longest pause between two decoded tokens of a request
    makespan_s: float = 0.0              # first arrival to last finish
    output_tok_s: float = 0.0            # every generated token / makespan
    goodput_tok_s: float = 0.0           # tokens of on-time requests / makespan
    lane_histogram: tuple[int, ...] = ()  # decode steps by number of decoding lanes
    mean_decoding_lanes: float = 0.0
    prefill_device_s: float = 0.0
    import_device_s: float = 0.0         # PD routes: decoder-side KV import
    decode_device_s: float = 0.0
    lora_device_s: float = 0.0           # --lora-adapters: of prefill and decode, the adapters'
    lora_requests: int = 0               # requests under an adapter (the rest: the base model)
    producer_busy_s: float = 0.0         # PD routes: the serial producer's compute
    prefill_calls: int = 0
    import_calls: int = 0                # PD routes: layers written (write_layer_kv calls)
    import_steps: int = 0                # PD routes: the Batcher's "import" steps
    decode_calls: int = 0
    decode_rows: int = 0                 # rows the decode calls ran (padding rows included)
    rotations: int = 0                   # staged requests that took a finished lane's slot
    staged_chunks: int = 0
    runtime_load_s: float = 0.0          # building the runtime (host wall time)
    wall_s: float = 0.0                  # host wall time of the cell
    calibration: str = ""                # the cost model's calibration, next to the prediction
    request_records: list[RequestRecord] = msgspec.field(default_factory=list)


class Machine(msgspec.Struct, frozen=True):
    platform: str
    python: str
    node: str
    cpu_count: int | None


class ServeReport(msgspec.Struct):
    """What `--json` writes."""

    command: str                         # exact command line
    argv: list[str]
    version: str                         # atombatch version
    commit: str | None                   # git commit (+ "-dirty")
    sdk_version: str | None              # rebel-sdk, when importable
    machine: Machine
    runtime: str                         # "sim" | "numpy"
    params: dict[str, Any]               # every parameter
    cost_model: CostModel | None         # sim only
    max_rss_bytes: int                   # peak resident memory of the process
    runtime_load_s: float                # total host time spent building runtimes
    wall_s: float
    cells: list[Cell]
