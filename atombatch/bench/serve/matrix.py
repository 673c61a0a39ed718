"""Running the serving matrix: the defaults, the load (`Load`), one cell (`run_cell`: a real
`Batcher` on a `SimRuntime` or `NumpyRuntime`) and the matrix (`run`)."""

from __future__ import annotations

import heapq
import math
import os
import platform
import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

import atombatch
from atombatch.api.structs import Completion, SamplingParams
from atombatch.artifact import plan
from atombatch.artifact.config import (
    QUANT_ACTIVATIONS,
    QUANT_KV_CACHES,
    QUANT_WEIGHTS,
    ArtifactConfig,
    ModelSpec,
    Quantization,
)
from atombatch.artifact.lora import TARGET_MODULES, LoraAdapter
from atombatch.bench import provenance
from atombatch.bench.progress import CellProgress
from atombatch.bench.serve.records import Cell, FitVerdict, Latency, Machine, RequestRecord, ServeReport
from atombatch.engine.batcher import Batcher
from atombatch.engine.scheduler import Policy
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.runtime.sim import PD_MODES, ROUTES, CostModel, SimProducer, SimRuntime

MODELS = ("qwen3-0.6b", "qwen3-4b", "koni-8b", "gemma3-1b")
INPUTS = (128, 512, 2048, 8192)
OUTPUTS = (32, 128)
ARTIFACTS = ("B1/k1", "B1/k3", "B1/k5", "B4/k5", "B4/k5/dbs1,2,4")
POLICIES = ("stall-free:8", "prefill-first", "decode-first", "interleave:4")
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


# -- helpers ----------------------------------------------------------------------------------------
def parse_artifact(text: str, model: ModelSpec, context: int, chunk: int,
                   kv_dtype: str = "bfloat16") -> tuple[dict[str, Any], ArtifactConfig | str]:
    """`B4/k5`, optionally `/ctx9216`, `/bs1024`, `/tp2`, `/dbs1,2,4` (compiled decode batch
    sizes) and a quantization (docs/planning.md): `/wint4` | `/wint8` | `/wfp8` (weights),
    `/aint8` | `/afp8` (activations), `/kvfp8` (fp8 KV caches); returns (shape fields,
    artifact | error)."""
    fields: dict[str, Any] = {"batch_size": 0, "num_blocks": 0, "max_seq_len": context,
                              "block_size": 0, "tensor_parallel": 1, "decoder_batch_sizes": ()}
    quant: dict[str, Any] = {}
    for part in text.strip().lower().split("/"):
        sizes = part[3:].split(",") if part.startswith("dbs") else []
        if sizes and all(size.isdigit() for size in sizes):
            fields["decoder_batch_sizes"] = tuple(int(size) for size in sizes)
            continue
        quant_part = _quant_part(part)
        if quant_part is not None:
            quant[quant_part[0]] = quant_part[1]
            continue
        for prefix, key in (("ctx", "max_seq_len"), ("bs", "block_size"), ("tp", "tensor_parallel"),
                            ("b", "batch_size"), ("k", "num_blocks")):
            if part.startswith(prefix) and part[len(prefix):].isdigit():
                fields[key] = int(part[len(prefix):])
                break
        else:
            raise ConfigError(f"artifact {text!r}: part {part!r} is not Bn, kn, ctxN, bsN, tpN, "
                              "dbsN,M,..., w{int4,int8,fp8}, a{int8,fp8} or kvfp8")
    if not fields["batch_size"] or not fields["num_blocks"]:
        raise ConfigError(f"artifact {text!r} needs a batch size (B4) and a block count (k5)")
    fields["block_size"] = fields["block_size"] or fields["max_seq_len"]
    try:
        quantization = Quantization(**quant) if quant else None
        if quantization is not None and quantization.kv_dtype:
            kv_dtype = quantization.kv_dtype
        artifact = ArtifactConfig(model=model, prefill_chunk_size=chunk, kv_dtype=kv_dtype,
                                  quantization=quantization, **fields)
    except ConfigError as exc:
        return fields, str(exc)
    return fields, artifact


def _quant_part(part: str) -> tuple[str, str] | None:
    """`wint4` -> ("weights", "int4"), `afp8` -> ("activations", "fp8"), `kvfp8` ->
    ("kv_caches", "fp8"); None for any other part."""
    for prefix, field, allowed in (("kv", "kv_caches", QUANT_KV_CACHES),
                                   ("w", "weights", QUANT_WEIGHTS),
                                   ("a", "activations", QUANT_ACTIVATIONS)):
        if part.startswith(prefix) and part[len(prefix):] in allowed:
            return field, part[len(prefix):]
    return None


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
MAX_LORA_ADAPTERS = 256  # --lora-adapters: the simulator's adapters of a load


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
    # a mix of LoRA adapters (simulator): `lora_share` of the requests run under one of
    # `lora_adapters` adapters of rank `lora_rank` on every linear layer, in turn; the rest
    # run the base model; `max_loras` caps the distinct adapters of a step (None: no cap)
    lora_adapters: int = 0
    lora_rank: int = 16
    lora_share: float = 1.0
    max_loras: int | None = None

    @property
    def total(self) -> int:
        return self.requests if self.requests is not None else self.concurrency

    def loras(self) -> list[str | None]:
        """The adapter of each request (None: the base model): of every request, the k-th
        whose share comes due (`lora_share` of them, spread evenly) runs adapter k mod N."""
        names: list[str | None] = []
        adapted = 0
        for index in range(self.total):
            due = math.floor((index + 1) * self.lora_share + 1e-9) > adapted
            if self.lora_adapters and due:
                names.append(f"lora-{adapted % self.lora_adapters + 1}")
                adapted += 1
            else:
                names.append(None)
        return names

    def check_lora(self) -> None:
        """The LoRA mix's bounds.

        Raises:
            ConfigError: naming the value and its bound.
        """
        if not 0 <= self.lora_adapters <= MAX_LORA_ADAPTERS:
            raise ConfigError(f"--lora-adapters {self.lora_adapters} must be in "
                              f"0..{MAX_LORA_ADAPTERS}")
        if not 1 <= self.lora_rank <= 512:
            raise ConfigError(f"--lora-rank {self.lora_rank} must be in 1..512")
        if not 0 < self.lora_share <= 1:  # (NaN too)
            raise ConfigError(f"--lora-share {self.lora_share} must be in (0, 1]")
        if self.max_loras is not None and self.max_loras < 1:
            raise ConfigError(f"--max-loras {self.max_loras} must be >= 1")


def lora_adapters(load: Load) -> list[LoraAdapter]:
    """The simulator's adapters of a load (`lora-1`.. on every linear layer)."""
    return [LoraAdapter(name=f"lora-{i}", lora_int_id=i, path="-", r=load.lora_rank,
                        lora_alpha=float(load.lora_rank), target_modules=TARGET_MODULES)
            for i in range(1, load.lora_adapters + 1)]


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
    loras = load.loras()
    while queue or batcher.has_unfinished():
        now = clock()
        while queue and queue[0][0] <= now:
            when, index = heapq.heappop(queue)
            rid = f"r{index}"
            kv = None if producer is None else \
                producer.source(rid, prompts[index], params, arrival=when)
            batcher.submit(prompts[index], params, request_id=rid, kv=kv, lora=loras[index])
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
    if numpy_runtime and (artifact.quantization is not None or artifact.kv_dtype != "float32"):
        return Cell(status="rejected", error="the numpy runtime runs unquantized float32 "
                    "artifacts here; quantized artifacts are costed on the simulator", **base)

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
        sim = SimRuntime(artifact, costs, seed=load.seed, lora_adapters=lora_adapters(load))
        rt = sim
        clock = sim.clock
        wait_until = sim.advance_to
        calibration = costs.calibration.describe() if costs.calibration else "uncalibrated"
    load_s = time.perf_counter() - load_start

    producer = SimProducer(sim, PD_MODES[route]) if sim is not None and route in PD_MODES \
        else None
    try:
        batcher = Batcher(rt, policy=policy, pd_timeout=load.pd_timeout_s or math.inf,
                          max_loras=load.max_loras if load.lora_adapters else None)
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
        lora_device_s=sim.device.lora_s if sim is not None else 0.0,
        lora_requests=sum(1 for name in load.loras() if name),
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
    load.check_lora()
    if load.lora_adapters and runtime != "sim":
        raise ConfigError("--lora-adapters: the mix runs on the simulator (--runtime sim); the "
                          "numpy runtime's adapters are PEFT directories (docs/lora.md)")
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
