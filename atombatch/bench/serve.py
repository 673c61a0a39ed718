"""`python -m atombatch.bench serve`: the origin issue's serving matrix on the simulator.

Every cell runs a real `Batcher` (the scheduler that will drive the device) on a `SimRuntime` whose
virtual clock is advanced by a `CostModel` calibrated to the origin issue's KONI B1/k1 figures:

    python -m atombatch.bench serve                         # 4 models x 3 routes x 4 inputs x 2
                                                            # outputs x B1/k1,B1/k3,B1/k5,B4/k5,
                                                            # B4/k5/dbs1,2,4 (buckets), c16
    python -m atombatch.bench serve --models koni-8b --inputs 8192 --outputs 128 \\
        --artifacts B1/k1,B4/k5 --ignore-fit --json koni.json

Cells (model x route x input x output x artifact x policy) report TTFT p50/p99/max and completion
p50/max of the requests that finished within the timeout (requests over it count as failures and are
kept out of the latency figures), aggregate output tok/s, the histogram of decoding lanes per decode
step, device time by kind (prefill, PD import, decode), the artifact identity and its `plan.fit`
verdict. An artifact that does
not fit the device is reported and not run (`--ignore-fit` runs it anyway, marked as such).

Load: `--concurrency` clients (default 16) each send one request, then the next when the previous
one finishes (`--requests` in total, default one per client), all starting together as in the
origin; `--arrivals poisson --rate R` submits open-loop Poisson arrivals instead.

PD routes ("pd-whole", "pd-layer-stream") run the engine's real consumer path: each request is
submitted with `kv=` a `SimKVSource` from one `SimProducer` (a serial producer; see
`atombatch.runtime.sim`), so the decoder runs "import" steps instead of prefill chunks. When every
request waits on the producer and the Batcher has nothing to run, the virtual clock jumps to the
producer's next header or layer.

`--runtime numpy` runs the same harness on `NumpyRuntime.random` with small specs of the same
families and real wall time (native route only): a B4/B1 ratio measured on real compute.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

import atombatch
from atombatch import plan
from atombatch.bench import provenance
from atombatch.bench.plot import require_matplotlib
from atombatch.bench.progress import CellProgress
from atombatch.config import ArtifactConfig, ModelSpec
from atombatch.engine import Batcher
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.runtime.sim import PD_HEADERS, PD_MODES, ROUTES, CostModel, SimProducer, SimRuntime
from atombatch.scheduler import Policy
from atombatch.structs import Completion, SamplingParams

MODELS = ("qwen3-0.6b", "qwen3-4b", "koni-8b", "gemma3-1b")
INPUTS = (128, 512, 2048, 8192)
OUTPUTS = (32, 128)
ARTIFACTS = ("B1/k1", "B1/k3", "B1/k5", "B4/k5", "B4/k5/dbs1,2,4")
POLICIES = ("stall-free:4", "prefill-first", "decode-first", "interleave:4")
CONTEXT = 9216
CHUNK = 128
CONCURRENCY = 16
TIMEOUT_S = 180.0

# Origin issue: device bytes in use while KONI B1/ctx9216/k1 (TP1) was serving.
OBSERVED_MODEL = "koni-8b"
OBSERVED_USED_BYTES = 16_357_785_600

# `--runtime numpy` defaults: small specs, real compute, wall time.
NUMPY_INPUTS = (64, 192)
NUMPY_OUTPUTS = (16,)
NUMPY_CONTEXT = 256
NUMPY_CHUNK = 32


# -- records ----------------------------------------------------------------------------------------
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


# -- helpers ----------------------------------------------------------------------------------------
def parse_artifact(text: str, model: ModelSpec, context: int, chunk: int,
                   kv_dtype: str = "bfloat16") -> tuple[dict[str, Any], ArtifactConfig | str]:
    """`B4/k5`, optionally `/ctx9216`, `/bs1024`, `/tp2`, `/dbs1,2,4` (compiled decode batch
    sizes); returns (shape fields, artifact | error)."""
    fields: dict[str, Any] = {"batch_size": 0, "num_blocks": 0, "max_seq_len": context,
                              "block_size": 0, "tensor_parallel": 1, "decoder_batch_sizes": ()}
    for part in text.strip().lower().split("/"):
        sizes = part[3:].split(",") if part.startswith("dbs") else []
        if sizes and all(size.isdigit() for size in sizes):
            fields["decoder_batch_sizes"] = tuple(int(size) for size in sizes)
            continue
        for prefix, key in (("ctx", "max_seq_len"), ("bs", "block_size"), ("tp", "tensor_parallel"),
                            ("b", "batch_size"), ("k", "num_blocks")):
            if part.startswith(prefix) and part[len(prefix):].isdigit():
                fields[key] = int(part[len(prefix):])
                break
        else:
            raise ConfigError(f"artifact {text!r}: part {part!r} is not Bn, kn, ctxN, bsN, tpN or "
                              "dbsN,M,...")
    if not fields["batch_size"] or not fields["num_blocks"]:
        raise ConfigError(f"artifact {text!r} needs a batch size (B4) and a block count (k5)")
    fields["block_size"] = fields["block_size"] or fields["max_seq_len"]
    try:
        artifact = ArtifactConfig(model=model, prefill_chunk_size=chunk, kv_dtype=kv_dtype,
                                  **fields)
    except ConfigError as exc:
        return fields, str(exc)
    return fields, artifact


def fit_verdict(artifact: ArtifactConfig, device_bytes: int = plan.ATOM_DEVICE_BYTES) -> FitVerdict:
    """plan.fit, projected from the origin observation for KONI on one device at its context."""
    observed_used, observed = None, None
    if artifact.model.name == OBSERVED_MODEL and artifact.tensor_parallel == 1:
        observed_used = OBSERVED_USED_BYTES
        observed = ArtifactConfig(model=artifact.model, batch_size=1,
                                  max_seq_len=CONTEXT, block_size=CONTEXT, num_blocks=1,
                                  prefill_chunk_size=artifact.prefill_chunk_size)
    result = plan.fit(artifact, device_bytes=device_bytes, observed_used_bytes=observed_used,
                      observed_artifact=observed)
    return FitVerdict(fits=result.fits, projected_bytes=result.projected_bytes,
                      device_bytes=result.device_bytes, method=result.method, basis=result.basis)


def small_spec(name: str) -> ModelSpec:
    """A small spec of a preset's family (real math on the host in seconds)."""
    preset = ModelSpec.preset(name)
    hybrid = preset.is_hybrid
    return msgspec.structs.replace(
        preset, name=f"{preset.name}-small", vocab_size=1024, hidden_size=128,
        intermediate_size=384, num_layers=2 if not hybrid else 3, num_heads=4, num_kv_heads=2,
        head_dim=32, sliding_window=16 if hybrid else 0,
        layer_types=("sliding_attention", "sliding_attention", "full_attention") if hybrid else (),
        query_pre_attn_scalar=32.0 if hybrid else 0.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,))


def _latency(values: Sequence[float]) -> Latency:
    if not values:
        return Latency(count=0, p50=None, p99=None, max=None, mean=None)
    array = np.asarray(values, dtype=np.float64)
    return Latency(count=len(values), p50=float(np.percentile(array, 50)),
                   p99=float(np.percentile(array, 99)), max=float(array.max()),
                   mean=float(array.mean()))


class _WallTimed:
    """Wraps a host runtime to accumulate wall time per call kind (no clock: the Batcher uses
    `time.perf_counter`)."""

    def __init__(self, runtime: Any) -> None:
        self.inner = runtime
        self.artifact = runtime.artifact
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.prefill_calls = 0
        self.decode_calls = 0

    def prefill(self, inputs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.prefill(inputs)
        finally:
            self.prefill_s += time.perf_counter() - start
            self.prefill_calls += 1

    def decode(self, inputs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.decode(inputs)
        finally:
            self.decode_s += time.perf_counter() - start
            self.decode_calls += 1

    def copy_block(self, src: int, dst: int) -> None:
        self.inner.copy_block(src, dst)

    def read_block(self, block: int) -> Any:
        return self.inner.read_block(block)

    def write_block(self, block: int, data: Any) -> None:
        self.inner.write_block(block, data)


# -- one cell ---------------------------------------------------------------------------------------
class Load(msgspec.Struct, frozen=True):
    """How requests arrive."""

    concurrency: int = CONCURRENCY       # closed-loop clients ("together")
    requests: int | None = None          # total; default one per client
    arrivals: str = "together"           # "together" | "poisson"
    rate: float | None = None            # poisson: requests / s
    timeout_s: float | None = TIMEOUT_S  # None: no timeout
    timeout_action: str = "count"        # "count" (fail after the fact) | "abort" (free the lane)
    seed: int = 0
    pd_timeout_s: float | None = None    # PD: the Batcher's pd_timeout (None: never)

    @property
    def total(self) -> int:
        return self.requests if self.requests is not None else self.concurrency


def _serve(batcher: Batcher, clock: Callable[[], float], wait_until: Callable[[float], None],
           prompts: list[np.ndarray], params: SamplingParams, load: Load,
           producer: SimProducer | None = None) -> tuple[dict[int, float], dict[int, Completion],
                                                         float]:
    """Drive one load through the Batcher; returns arrivals, completions and the start time.

    With a `producer` (PD routes) every request is submitted with its `SimKVSource`, queued on the
    producer at its arrival time.
    """
    start = clock()
    total = len(prompts)
    arrivals: dict[int, float] = {}
    done: dict[int, Completion] = {}
    queue: list[tuple[float, int]] = []   # (arrival time, request index)
    next_index = 0

    def arrive(index: int, when: float) -> None:
        arrivals[index] = when
        heapq.heappush(queue, (when, index))

    if load.arrivals == "poisson":
        rng = np.random.default_rng(load.seed + 7)
        when = start
        for index in range(total):
            when += float(rng.exponential(1.0 / float(load.rate or 1.0)))
            arrive(index, when)
        next_index = total
    else:
        for index in range(min(load.concurrency, total)):
            arrive(index, start)
        next_index = min(load.concurrency, total)

    in_flight: dict[str, int] = {}
    while queue or batcher.has_unfinished():
        now = clock()
        while queue and queue[0][0] <= now:
            when, index = heapq.heappop(queue)
            rid = f"r{index}"
            kv = None if producer is None else \
                producer.source(rid, prompts[index], params, arrival=when)
            batcher.submit(prompts[index], params, request_id=rid, kv=kv)
            in_flight[rid] = index
        if load.timeout_action == "abort" and load.timeout_s is not None:
            for rid, index in list(in_flight.items()):
                if now - arrivals[index] > load.timeout_s:
                    batcher.abort(rid)
        if not batcher.has_unfinished():
            if queue:
                wait_until(queue[0][0])
            continue
        steps_before = batcher.scheduler.counters.steps
        outputs = batcher.step()
        for out in outputs:
            if out.finished and out.completion is not None:
                index = in_flight.pop(out.request_id)
                done[index] = out.completion
                if load.arrivals != "poisson" and next_index < total:
                    arrive(next_index, clock())
                    next_index += 1
        if not outputs and batcher.scheduler.counters.steps == steps_before and \
                clock() <= now:
            # nothing ran: every request waits for an arrival or for its producer
            wake = [queue[0][0]] if queue else []
            if producer is not None:
                ready = producer.next_event()
                if ready is not None:
                    wake.append(ready)
            if not wake or min(wake) <= now:
                raise AtomBatchError("the Batcher has work but schedules nothing")
            wait_until(min(wake))
    return arrivals, done, start


def run_cell(model: str, route: str, input_len: int, output_len: int, artifact_spec: str,
             policy: str, *, runtime: str = "sim", costs: CostModel | None = None,
             load: Load | None = None, context: int = CONTEXT, chunk: int = CHUNK,
             ignore_fit: bool = False, device_bytes: int = plan.ATOM_DEVICE_BYTES) -> Cell:
    """Run (or refuse) one cell of the matrix."""
    load = load or Load()
    wall_start = time.perf_counter()
    numpy_runtime = runtime == "numpy"
    spec = small_spec(model) if numpy_runtime else ModelSpec.preset(model)
    fields, built = parse_artifact(artifact_spec, spec, context, chunk,
                                   kv_dtype="float32" if numpy_runtime else "bfloat16")
    policy_label = Policy.parse(policy).label
    common: dict[str, Any] = dict(model=model, route=route, input_len=input_len,
                                  output_len=output_len, artifact=artifact_spec,
                                  policy=policy_label, prefill_chunk_size=chunk, **fields)
    if isinstance(built, str):
        return Cell(label=f"{spec.name} {artifact_spec}", identity=None,
                    fit=FitVerdict(fits=None, rejected=built), status="rejected", error=built,
                    **common)
    artifact = built
    fit = FitVerdict(fits=None, basis="not assessed: small spec on the host") if numpy_runtime \
        else fit_verdict(artifact, device_bytes)
    base = dict(label=artifact.label, identity=artifact.identity, fit=fit, **common)
    if fit.fits is False and not ignore_fit:
        return Cell(status="not-run: does not fit", **base)
    if input_len + output_len > artifact.max_seq_len:
        return Cell(status="rejected", error=f"input {input_len} + output {output_len} exceeds "
                    f"max_seq_len={artifact.max_seq_len}", **base)
    if numpy_runtime and route != "native":
        return Cell(status="rejected", error="the numpy runtime runs the native route only", **base)

    load_start = time.perf_counter()
    sim: SimRuntime | None = None
    timed: _WallTimed | None = None
    if numpy_runtime:
        from atombatch.runtime.numpy_runtime import NumpyRuntime
        timed = _WallTimed(NumpyRuntime.random(artifact, seed=load.seed))
        rt: Any = timed
        clock: Callable[[], float] = time.perf_counter

        def wait_until(when: float) -> None:
            time.sleep(max(0.0, when - time.perf_counter()))
        calibration = "real wall time (NumpyRuntime.random, small spec)"
    else:
        costs = costs or CostModel.default()
        sim = SimRuntime(artifact, costs, seed=load.seed)
        rt = sim
        clock = sim.clock
        wait_until = sim.advance_to
        calibration = costs.calibration.describe() if costs.calibration else "uncalibrated"
    load_s = time.perf_counter() - load_start

    producer = SimProducer(sim, PD_MODES[route]) if sim is not None and route in PD_MODES \
        else None
    try:
        batcher = Batcher(rt, policy=policy, pd_timeout=load.pd_timeout_s or math.inf)
    except ConfigError as exc:
        return Cell(status="rejected", error=str(exc), runtime_load_s=load_s, **base)

    rng = np.random.default_rng(load.seed)
    prompts = [rng.integers(3, spec.vocab_size, input_len, dtype=np.int64)
               for _ in range(load.total)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    try:
        arrivals, done, start = _serve(batcher, clock, wait_until, prompts, params, load, producer)
    except Exception as exc:  # a harness or engine failure is reported, the matrix goes on
        return Cell(status="error", error=f"{type(exc).__name__}: {exc}", runtime_load_s=load_s,
                    **base)

    records: list[RequestRecord] = []
    ttfts, e2es, first_all, last_all = [], [], [], []
    max_gap = 0.0  # the longest pause between two tokens of an on-time request
    tokens_all = tokens_ok = 0
    timeouts = errors = 0
    last_finish = start
    for index in sorted(arrivals):
        completion = done.get(index)
        arrival = arrivals[index]
        if completion is None or completion.timings is None:
            reason: str = completion.finish_reason if completion else "lost"
            if reason == "abort" and load.timeout_action == "abort":
                timeouts += 1  # the client gave up before the request got a lane
                reason = "timeout"
            else:
                errors += 1
            records.append(RequestRecord(arrival - start, None, None, 0, True, reason))
            continue
        timings = completion.timings
        ttft = timings.first_token - arrival
        e2e = timings.finished - arrival
        last_finish = max(last_finish, timings.finished)
        tokens = len(completion.token_ids)
        tokens_all += tokens
        first_all.append(ttft)
        last_all.append(e2e)
        reason = completion.finish_reason
        failed = reason in ("error", "abort")
        if not failed and load.timeout_s is not None and e2e > load.timeout_s:
            failed, reason = True, "timeout"
        if reason == "abort" and load.timeout_action == "abort":
            reason = "timeout"  # aborted by the harness at the deadline
        if reason == "timeout":
            timeouts += 1
        elif failed:
            errors += 1
        if not failed:
            ttfts.append(ttft)
            e2es.append(e2e)
            tokens_ok += tokens
            # from the second token on: a staged request's first token is out before it has a
            # lane, so its first gap is the wait for one, not a stall of a decoding stream
            max_gap = max(max_gap, max(timings.inter_token[1:], default=0.0))
        records.append(RequestRecord(arrival - start, ttft, e2e, tokens, failed, reason))

    stats = batcher.stats()
    makespan = last_finish - start
    histogram = stats.lane_histogram
    steps = sum(histogram)
    mean_lanes = sum(i * n for i, n in enumerate(histogram)) / steps if steps else 0.0
    import_calls = 0
    if sim is not None:
        device = sim.device
        prefill_s, import_s, decode_s = device.prefill_s, device.import_s, device.decode_s
        prefill_calls, decode_calls = device.prefill_calls, device.decode_calls
        import_calls = device.import_calls
    else:
        assert timed is not None
        prefill_s, import_s, decode_s = timed.prefill_s, 0.0, timed.decode_s
        prefill_calls, decode_calls = timed.prefill_calls, timed.decode_calls
    decode_rows = sum(rows * n for rows, n in stats.bucket_steps.items())
    return Cell(
        status="ok", hypothetical=fit.fits is False, requests=len(arrivals),
        completed=len(ttfts), timeouts=timeouts, errors=errors, ttft=_latency(ttfts),
        completion=_latency(e2es), max_first_token_all=max(first_all, default=None),
        max_completion_all=max(last_all, default=None), max_gap_s=max_gap if ttfts else None,
        makespan_s=makespan,
        output_tok_s=tokens_all / makespan if makespan > 0 else 0.0,
        goodput_tok_s=tokens_ok / makespan if makespan > 0 else 0.0,
        lane_histogram=histogram, mean_decoding_lanes=mean_lanes, prefill_device_s=prefill_s,
        import_device_s=import_s, decode_device_s=decode_s,
        producer_busy_s=producer.busy_s if producer is not None else 0.0,
        prefill_calls=prefill_calls, import_calls=import_calls, import_steps=stats.imports,
        decode_calls=decode_calls, decode_rows=decode_rows, rotations=stats.rotations,
        staged_chunks=stats.staged_chunks, runtime_load_s=load_s,
        wall_s=time.perf_counter() - wall_start, calibration=calibration,
        request_records=records, **base)


# -- the matrix -------------------------------------------------------------------------------------
def run(models: Sequence[str] = MODELS, routes: Sequence[str] = ROUTES,
        inputs: Sequence[int] = INPUTS, outputs: Sequence[int] = OUTPUTS,
        artifacts: Sequence[str] = ARTIFACTS, policies: Sequence[str] = POLICIES, *,
        runtime: str = "sim", costs: CostModel | None = None, load: Load | None = None,
        context: int = CONTEXT, chunk: int = CHUNK, ignore_fit: bool = False,
        device_bytes: int = plan.ATOM_DEVICE_BYTES, progress: bool = False,
        argv: Sequence[str] | None = None) -> ServeReport:
    """Run the matrix; returns the report (cells in model, route, input, output, artifact,
    policy order).

    Raises:
        ConfigError: an unknown model, route, policy or runtime, or no NumpyRuntime available.
    """
    load = load or Load()
    for model in models:
        ModelSpec.preset(model)
    for route in routes:
        if route not in ROUTES:
            raise ConfigError(f"route={route!r} is not one of {', '.join(ROUTES)}")
    for policy in policies:
        Policy.parse(policy)
    if runtime not in ("sim", "numpy"):
        raise ConfigError(f"runtime={runtime!r} is not sim or numpy")
    if runtime == "numpy":
        try:
            from atombatch.runtime.numpy_runtime import NumpyRuntime  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"--runtime numpy needs atombatch.runtime.numpy_runtime "
                              f"({exc})") from None
    if load.arrivals not in ("together", "poisson"):
        raise ConfigError(f"arrivals={load.arrivals!r} is not together or poisson")
    if load.arrivals == "poisson" and not (load.rate and load.rate > 0):
        raise ConfigError("--arrivals poisson needs --rate R > 0 (requests per second)")
    if load.timeout_action not in ("count", "abort"):
        raise ConfigError(f"timeout_action={load.timeout_action!r} is not count or abort")
    if runtime == "sim":
        costs = costs or CostModel.default()

    grid = [(m, r, i, o, a, p) for m in models for r in routes for i in inputs for o in outputs
            for a in artifacts for p in policies]
    started = time.perf_counter()
    cells: list[Cell] = []
    meter = CellProgress(len(grid), enabled=progress)
    for model, route, input_len, output_len, artifact, policy in grid:
        what = f"{model} {route} {input_len}/{output_len} {artifact} {policy}"
        meter.start(what)
        cells.append(run_cell(model, route, input_len, output_len, artifact, policy,
                              runtime=runtime, costs=costs, load=load, context=context,
                              chunk=chunk, ignore_fit=ignore_fit, device_bytes=device_bytes))
        meter.finish(what, cells[-1].status)
    meter.close()
    argv = list(argv) if argv is not None else []
    params = dict(models=list(models), routes=list(routes), inputs=list(inputs),
                  outputs=list(outputs), artifacts=list(artifacts), policies=list(policies),
                  runtime=runtime, context=context, chunk=chunk, ignore_fit=ignore_fit,
                  device_bytes=device_bytes, load=msgspec.to_builtins(load))
    return ServeReport(
        command=shlex.join(["python", "-m", "atombatch.bench", "serve", *argv]), argv=argv,
        version=atombatch.__version__, commit=provenance.git_commit(), sdk_version=provenance.sdk_version(),
        machine=Machine(platform=platform.platform(), python=platform.python_version(),
                        node=platform.node(), cpu_count=os.cpu_count()),
        runtime=runtime, params=params, cost_model=costs if runtime == "sim" else None,
        max_rss_bytes=provenance.max_rss_bytes(), runtime_load_s=sum(c.runtime_load_s for c in cells),
        wall_s=time.perf_counter() - started, cells=cells)


# -- output -----------------------------------------------------------------------------------------
_DIGITS = [1]  # decimals of the table's seconds: 1 on the simulator, 3 for wall-time runs


def _f(value: float | None, digits: int | None = None) -> str:
    return "-" if value is None else f"{value:.{_DIGITS[0] if digits is None else digits}f}"


def _histogram(histogram: Sequence[int]) -> str:
    return " ".join(f"{lanes}:{n}" for lanes, n in enumerate(histogram) if n) or "-"


def format_table(report: ServeReport) -> str:
    """A readable fixed-width table, one row per cell, with the calibration above it."""
    load = report.params["load"]
    unit = "virtual s" if report.runtime == "sim" else "wall s"
    _DIGITS[0] = 1 if report.runtime == "sim" else 3
    lines = []
    if report.cost_model is not None:
        lines.append(report.cost_model.describe())
    timeout = load["timeout_s"]
    lines.append(f"load: c{load['concurrency']}, {load['requests'] or load['concurrency']} "
                 f"requests, arrivals {load['arrivals']}"
                 + (f" at {load['rate']}/s" if load["arrivals"] == "poisson" else "")
                 + f"; timeout {timeout} s ({load['timeout_action']}); times in {unit}; latency "
                 "figures exclude failed requests")
    header = (f"{'model':<11} {'route':<15} {'in/out':>9} {'artifact':<14} {'policy':<13} "
              f"{'ok/n':>5} {'t/o':>3} {'TTFT p50':>8} {'p99':>7} {'max':>7} {'done p50':>8} "
              f"{'max':>7} {'gap max':>7} {'tok/s':>7} {'all max':>7} {'prefill':>8} {'import':>7} "
              f"{'decode':>8}  lanes/step")
    lines += [header, "-" * len(header)]
    previous = None
    for cell in report.cells:
        group = (cell.model, cell.route)
        if previous is not None and group != previous:
            lines.append("")
        previous = group
        head = (f"{cell.model:<11} {cell.route:<15} {cell.input_len:>4}/{cell.output_len:<4} "
                f"{cell.artifact:<14} {cell.policy:<13}")
        if cell.status != "ok":
            why = cell.status
            if cell.status == "not-run: does not fit" and cell.fit.projected_bytes is not None:
                why += (f" ({cell.fit.projected_bytes / 1e9:.2f} GB projected of "
                        f"{(cell.fit.device_bytes or 0) / 1e9:.2f} GB, {cell.fit.method})")
            elif cell.error:
                why += ": " + _first_sentence(cell.error)
            lines.append(f"{head} {why}")
            continue
        ttft, done = cell.ttft, cell.completion
        assert ttft is not None and done is not None
        mark = "*" if cell.hypothetical else ""
        lines.append(
            f"{head} {cell.completed:>2}/{cell.requests:<2} {cell.timeouts:>3} "
            f"{_f(ttft.p50):>8} {_f(ttft.p99):>7} {_f(ttft.max):>7} {_f(done.p50):>8} "
            f"{_f(done.max):>7} {_f(cell.max_gap_s, 2):>7} {cell.output_tok_s:>7.2f} "
            f"{_f(cell.max_completion_all):>7} "
            f"{_f(cell.prefill_device_s):>8} {_f(cell.import_device_s, 2):>7} "
            f"{_f(cell.decode_device_s):>8}  {_histogram(cell.lane_histogram)}"
            f"{mark}")
    lines.append("")
    lines.append("t/o = requests over the timeout (failures); 'gap max' = the longest pause "
                 "between two decoded tokens of an on-time request (from its second token: a "
                 "staged request's first gap is its wait for a lane); 'all max' = latest "
                 "completion over "
                 "every request, timed out or not (how the origin figures were measured); "
                 "prefill/import/decode = the decoder's device seconds (import: PD KV writes; "
                 "the producer's prefill is not in them); lanes/step = decode steps by decoding "
                 "lanes"
                 + ("; * = does not fit the device, run with --ignore-fit (hypothetical)"
                    if any(c.hypothetical for c in report.cells) else ""))
    comparison = format_comparison(report)
    if comparison:
        lines += ["", comparison]
    return "\n".join(lines)


def _first_sentence(text: str) -> str:
    """A reason's first sentence, whole (never cut mid-word): the rest is in the JSON."""
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def format_comparison(report: ServeReport) -> str:
    """Each multi-lane artifact vs the single-lane one with the fewest blocks at the same context and
    split, under the same load: throughput, worst first token and timeouts."""
    ok = [c for c in report.cells if c.status == "ok"]
    rows = []
    for cell in ok:
        if cell.batch_size == 1:
            continue
        refs = [r for r in ok if r.batch_size == 1 and (r.model, r.route, r.input_len,
                r.output_len, r.policy, r.max_seq_len, r.block_size, r.tensor_parallel) ==
                (cell.model, cell.route, cell.input_len, cell.output_len, cell.policy,
                 cell.max_seq_len, cell.block_size, cell.tensor_parallel)]
        if not refs:
            continue
        ref = min(refs, key=lambda r: r.num_blocks)
        if not ref.output_tok_s:
            continue
        rows.append(
            f"{cell.model:<11} {cell.route:<15} {cell.input_len:>4}/{cell.output_len:<4} "
            f"{cell.policy:<13} {ref.artifact:>9} -> {cell.artifact:<9} "
            f"{ref.output_tok_s:>7.2f} -> {cell.output_tok_s:>7.2f} tok/s "
            f"(x{cell.output_tok_s / ref.output_tok_s:.2f}); max first token "
            f"{_f(ref.max_first_token_all)} -> {_f(cell.max_first_token_all)} s; timeouts "
            f"{ref.timeouts} -> {cell.timeouts}" + (" *" if cell.hypothetical or ref.hypothetical
                                                    else ""))
    sections = []
    if rows:
        sections += ["multi-lane vs single-lane (same load, context and split):", *rows]
    buckets = format_bucket_comparison(ok)
    if buckets:
        sections += ([""] if sections else []) + buckets
    return "\n".join(sections)


def _shape_key(cell: Cell) -> tuple[Any, ...]:
    return (cell.model, cell.route, cell.input_len, cell.output_len, cell.policy, cell.batch_size,
            cell.num_blocks, cell.max_seq_len, cell.block_size, cell.tensor_parallel)


def format_bucket_comparison(ok: Sequence[Cell]) -> list[str]:
    """Each artifact with decode buckets vs the same artifact with its full decode batch only: the
    rows its decode steps ran, decode device time, throughput and the worst first token."""
    plain = {_shape_key(c): c for c in ok if len(c.decoder_batch_sizes) <= 1}
    rows = []
    for cell in ok:
        ref = plain.get(_shape_key(cell)) if len(cell.decoder_batch_sizes) > 1 else None
        if ref is None or not ref.output_tok_s or not ref.decode_device_s:
            continue
        rows.append(
            f"{cell.model:<11} {cell.route:<15} {cell.input_len:>4}/{cell.output_len:<4} "
            f"{cell.policy:<13} {ref.artifact:>9} -> {cell.artifact:<14} rows/step "
            f"{ref.decode_rows / max(ref.decode_calls, 1):.2f} -> "
            f"{cell.decode_rows / max(cell.decode_calls, 1):.2f}; decode "
            f"{_f(ref.decode_device_s)} -> {_f(cell.decode_device_s)} s "
            f"(x{cell.decode_device_s / ref.decode_device_s:.3f}); "
            f"{ref.output_tok_s:.2f} -> {cell.output_tok_s:.2f} tok/s; max first token "
            f"{_f(ref.max_first_token_all)} -> {_f(cell.max_first_token_all)} s"
            + (" *" if cell.hypothetical or ref.hypothetical else ""))
    if not rows:
        return []
    return ["decode buckets vs the full decode batch only (same load and artifact):", *rows]


def write_plot(report: ServeReport, path: Path) -> list[Path]:
    """Box plots of every model, route, input, output and artifact (see atombatch.bench.plot)."""
    from atombatch.bench import plot
    return plot.write_plot(report, path)


# -- command line -----------------------------------------------------------------------------------
def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    return parse


def _artifact_list(text: str) -> list[str]:
    """Comma-separated artifact specs; a comma inside `dbs1,2,4` stays with its artifact (a comma
    followed by a digit continues a bucket list; a new spec starts with a part name, in any
    order, like `parse_artifact` takes them)."""
    return [part.strip() for part in re.split(r",(?!\s*\d)", text) if part.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m atombatch.bench serve",
        description="Serving matrix (models x routes x inputs x outputs x artifacts x policies) on "
                    "the calibrated simulator, or on the NumPy runtime with small specs.")
    parser.add_argument("--models", type=_csv(str), default=None,
                        help=f"comma list (default {','.join(MODELS)})")
    parser.add_argument("--routes", type=_csv(str), default=None,
                        help=f"comma list of {','.join(ROUTES)} (default all; numpy: native)")
    parser.add_argument("--inputs", type=_csv(int), default=None,
                        help=f"prompt lengths (default {','.join(map(str, INPUTS))}; numpy "
                             f"{','.join(map(str, NUMPY_INPUTS))})")
    parser.add_argument("--outputs", type=_csv(int), default=None,
                        help=f"output lengths (default {','.join(map(str, OUTPUTS))}; numpy "
                             f"{','.join(map(str, NUMPY_OUTPUTS))})")
    parser.add_argument("--artifacts", type=_artifact_list, default=None,
                        help="Bn/kn[/ctxN][/bsN][/tpN][/dbsN,M,...] list, dbs = compiled decode "
                             f"batch sizes (default {','.join(ARTIFACTS)})")
    parser.add_argument("--policies", type=_csv(str), default=None,
                        help=f"scheduling policies (default {','.join(POLICIES)})")
    parser.add_argument("--context", type=int, default=None,
                        help=f"context of every artifact (default {CONTEXT}; numpy {NUMPY_CONTEXT})")
    parser.add_argument("--chunk", type=int, default=None,
                        help=f"prefill chunk size (default {CHUNK}; numpy {NUMPY_CHUNK})")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="clients (default 16)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in total (default: one per client)")
    parser.add_argument("--arrivals", choices=("together", "poisson"), default="together")
    parser.add_argument("--rate", type=float, default=None, help="poisson arrivals per second")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help="seconds after arrival; later completions are failures (default 180;"
                             " 0 = none)")
    parser.add_argument("--timeout-action", choices=("count", "abort"), default="count",
                        help="count: fail late requests after the fact (default); abort: the "
                             "client gives up and the request is aborted, freeing its lane")
    parser.add_argument("--ignore-fit", action="store_true",
                        help="also run artifacts that plan.fit says do not fit (marked *)")
    parser.add_argument("--device-bytes", type=int, default=plan.ATOM_DEVICE_BYTES)
    parser.add_argument("--runtime", choices=("sim", "numpy"), default="sim")
    parser.add_argument("--costs", type=Path, default=None, metavar="PATH",
                        help="cost model JSON (CostModel.save); default: the origin calibration")
    parser.add_argument("--save-costs", type=Path, default=None, metavar="PATH",
                        help="write the cost model used as JSON")
    parser.add_argument("--per-lane-fraction", type=float, default=None,
                        help="decode cost of each lane past the first, x weight streaming "
                             "(default 0.05; recalibrates)")
    parser.add_argument("--idle-lane-fraction", type=float, default=None,
                        help="cost of a padded idle lane relative to a decoding lane's share "
                             "(default 1.0)")
    parser.add_argument("--producer-speed", type=float, default=None,
                        help="PD producer prefill speed relative to the ATOM (default 1.0)")
    parser.add_argument("--transfer-bandwidth", type=float, default=None,
                        help="PD KV transfer bytes/s (default 12e9)")
    parser.add_argument("--import-bandwidth", type=float, default=None,
                        help="PD decoder-side KV write bytes/s per device (default 32e9)")
    parser.add_argument("--import-call-s", type=float, default=None,
                        help="PD decoder-side seconds per imported layer (default 2e-4)")
    parser.add_argument("--pd-header", choices=PD_HEADERS, default=None,
                        help="layer-stream: the header (first token) arrives when the producer's "
                             "prefill ends (first-token, default) or when it starts "
                             "(producer-start, a what-if)")
    parser.add_argument("--pd-timeout", type=float, default=0.0,
                        help="the Batcher's pd_timeout in seconds (default 0 = none: a simulated "
                             "producer never stalls)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="PNG of TTFT and completion distributions: every model, route, "
                             "input, output and artifact, one file per policy (needs the plot "
                             "extra: matplotlib, checked before the run)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (default: a bar on a terminal, else one "
                             "line per finished cell with elapsed and remaining time)")
    return parser


def _check_writable(path: Path) -> None:
    """Fail before the run when an output file cannot be written."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create its folder ({exc.strerror})") from None
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{path}: not writable (checked before the run)")


def _costs_from_args(args: argparse.Namespace) -> CostModel:
    from atombatch.runtime.sim import calibrate
    costs = CostModel.load(args.costs) if args.costs is not None else CostModel.default()
    priors = {name: value for name, value in (
        ("per_lane_fraction", args.per_lane_fraction),
        ("idle_lane_fraction", args.idle_lane_fraction)) if value is not None}
    if priors:  # lane priors do not change the B1 fit, but recalibrate to record them
        kept = {f: getattr(costs, f) for f in ("decode_call_s", "prefill_call_s",
                                               "bill_padded_chunk", "tp_sync_s_per_layer")}
        figures = costs.calibration.figures if costs.calibration else None
        costs = calibrate(figures, **kept, **priors) if figures else \
            msgspec.structs.replace(costs, **priors)
    pd = {name: value for name, value in (
        ("producer_speed", args.producer_speed), ("transfer_bandwidth", args.transfer_bandwidth),
        ("import_bandwidth", args.import_bandwidth), ("import_call_s", args.import_call_s),
        ("pd_header", args.pd_header)) if value is not None}
    return msgspec.structs.replace(costs, **pd) if pd else costs


def main(argv: list[str] | None = None) -> int:
    """Run the matrix from the command line; returns 0, or 2 on a configuration error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    numpy_runtime = args.runtime == "numpy"
    try:
        if args.plot is not None:
            require_matplotlib()
        for path in (args.json, args.plot):
            if path is not None:
                _check_writable(path)
        costs = None if numpy_runtime else _costs_from_args(args)
        if costs is not None and args.save_costs is not None:
            costs.save(args.save_costs)
        load = Load(concurrency=args.concurrency, requests=args.requests, arrivals=args.arrivals,
                    rate=args.rate, timeout_s=args.timeout or None,
                    timeout_action=args.timeout_action, seed=args.seed,
                    pd_timeout_s=args.pd_timeout or None)
        report = run(
            models=args.models or MODELS,
            routes=args.routes or (("native",) if numpy_runtime else ROUTES),
            inputs=args.inputs or (NUMPY_INPUTS if numpy_runtime else INPUTS),
            outputs=args.outputs or (NUMPY_OUTPUTS if numpy_runtime else OUTPUTS),
            artifacts=args.artifacts or ARTIFACTS, policies=args.policies or POLICIES,
            runtime=args.runtime, costs=costs, load=load,
            context=args.context or (NUMPY_CONTEXT if numpy_runtime else CONTEXT),
            chunk=args.chunk or (NUMPY_CHUNK if numpy_runtime else CHUNK),
            ignore_fit=args.ignore_fit, device_bytes=args.device_bytes,
            progress=not args.no_progress, argv=argv)
    except (ConfigError, OSError, msgspec.DecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    if args.plot is not None:
        try:
            for path in write_plot(report, args.plot):
                print(f"plot: {path}", file=sys.stderr)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
