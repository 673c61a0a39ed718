"""`SimRuntime`: a device-time model of a compiled ATOM artifact. No math, a virtual clock.

Theory of operation
-------------------
Every `prefill` / `decode` call advances a virtual clock by what a `CostModel` says the device would
take, and returns deterministic pseudo-logits. The `Batcher` picks the clock up (`runtime.clock`),
so every timestamp of a simulated run (arrival, first token, finish) is virtual: a c16 x 8192-token
matrix runs in seconds and says what B4 would do to queueing before anyone spends device time.

The cost model is physical in shape and calibrated in scale. Two effective rates are fitted to the
origin issue's KONI B1/k1 figures (8192 in / 128 out at c16, strictly serial: 64 prefill chunks of
128, then 127 decode steps per request) and every model is then costed from its own shapes:

* decode is memory-bound. One step streams the weights once (`decode_weight_bytes`) plus each
  decoding lane's KV (`kv_read_bytes`, growing with its context) at `memory_bandwidth`. Every lane
  beyond the first adds `per_lane_fraction` of the weight-streaming time (its activations, its share
  of compute, sampling). A static B4 graph also computes its idle, padded lanes; they cost
  `idle_lane_fraction` of a decoding lane's share, without KV. So a B4 step costs more than a B1 step
  but far less than four of them. `per_lane_fraction` and `idle_lane_fraction` are assumptions: the
  B1 figures cannot identify them (sweep them with `--per-lane-fraction`).
* prefill is compute-bound. A chunk costs the larger of streaming the weights once and its FLOPs at
  `prefill_flops` FLOP/s: the linear layers (2 x parameters per token, billed for the whole padded
  chunk because the graph's shape is fixed) plus attention (4 x heads x head_dim per attended key per
  layer, for the real tokens; it grows with the chunk's start position; Gemma3's sliding layers see
  at most `sliding_window` keys).
* each call adds a fixed `*_call_s` host/launch overhead (assumed, not measured), and with tensor
  parallelism each layer adds `tp_sync_s_per_layer` for its all-reduces; bytes and FLOPs are per device.

Other models therefore scale from KONI by their weight bytes, KV bytes and FLOPs; that the same two
rates hold across model sizes is an assumption, stated next to every prediction.

Prefill/decode disaggregation (docs/pd.md) runs on the engine's real consumer path. A `SimProducer`
(an RNGD or another ATOM) prefills prompts one at a time in arrival order, each in the decoder
artifact's native prefill time divided by `producer_speed`, layer by layer (an equal share per
layer), and sends each layer's K/V over one serial link at `transfer_bandwidth`. Every request gets
a `SimKVSource` (`Batcher.submit(..., kv=source)`) whose `poll` hands out what has arrived by the
engine's virtual clock:

* "whole": after the producer's prefill, all layers cross the link back to back; the header and
  every layer are handed out together when the last byte is in (as the in-process and ZeroMQ
  sources do in "whole" mode).
* "layer-stream": layer i crosses as soon as the producer's compute for it is done and the link is
  free (transfer overlapped with compute). The header carries the producer's first token, which
  exists only after its last layer, so by default (`pd_header="first-token"`) the header, and with
  it admission, comes when the producer's prefill ends; layers that crossed earlier are handed out
  with it. `pd_header="producer-start"` is the what-if of a protocol that sends the header when the
  producer starts and the first token later (the current `KVHeader` cannot: a full-prefix header
  must carry `first_token`); the request then holds a lane or the spare while its layers stream in.

The engine validates the header and each layer and plans "import" steps; each `write_layer_kv`
advances the decoder's clock by `import_call_s` plus the layer's K/V bytes (per device, in the
artifact's `kv_dtype`) at `import_bandwidth`. The sources' K/V are zero-stride float32 arrays of
the header's shapes (nothing is allocated per layer, and `LayerKV.float32()` passes float32 through
without a copy); link and import costs are charged in the artifact's `kv_dtype`, what a real
producer would send. The producer's first token follows the same pseudo-logits rule as this
runtime's last prefill chunk, so greedy PD output equals native output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch import plan
from atombatch.config import SLIDING, ArtifactConfig, ModelSpec
from atombatch.errors import ConfigError, KVTransferError, StateError
from atombatch.pd.wire import KVHeader, LayerKV, Mode, expected_layer_tokens, model_identity
from atombatch.runtime.base import DecodeArrays, PrefillArrays
from atombatch.sampling import sample
from atombatch.structs import SamplingParams

Route = Literal["native", "pd-whole", "pd-layer-stream"]
ROUTES: tuple[str, ...] = ("native", "pd-whole", "pd-layer-stream")
#: The producer's pacing for each PD route.
PD_MODES: dict[str, Mode] = {"pd-whole": "whole", "pd-layer-stream": "layer-stream"}
#: When a layer-streaming producer's header (with its first token) reaches the decoder.
PD_HEADERS: tuple[str, ...] = ("first-token", "producer-start")


# -- calibration records ----------------------------------------------------------------------------
class ObservedFigures(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Figures measured on a device run that a cost model is fitted to (single-block B1, serial)."""

    model: str = "koni-8b"                 # preset name of the model that ran
    input_len: int = 8192                  # prompt tokens per request
    output_len: int = 128                  # generated tokens per request (first one from prefill)
    concurrency: int = 16                  # requests, all submitted together
    max_seq_len: int = 9216                # the artifact's context
    prefill_chunk_size: int = 128          # tokens per prefill call
    throughput_tok_s: float = 7.7847       # aggregate output tokens / s
    max_first_token_s: float = 253.93      # latest first token (s after submit)
    max_completion_s: float = 263.08       # latest completion (s after submit)
    source: str = ("origin issue: PR #266 evidence f1d9117, KONI native ATOM B1/ctx9216/k1, "
                   "8192 in / 128 out, c16")


#: The origin issue's KONI B1/k1 figures, the default calibration target.
ORIGIN_KONI_B1 = ObservedFigures()


class Calibration(msgspec.Struct, frozen=True):
    """How a cost model was fitted, and what it reproduces."""

    figures: ObservedFigures               # the observation fitted to
    request_s: float                       # fitted serial time of one request (prefill + decodes)
    prefill_s: float                       # fitted prefill time of one request (all its chunks)
    decode_step_s: float                   # fitted mean decode step (B1, one lane)
    reproduced_throughput_tok_s: float     # the model's figures on the same serial schedule
    reproduced_max_first_token_s: float
    reproduced_max_completion_s: float
    max_relative_error: float              # largest |reproduced / observed - 1| of the three
    assumptions: tuple[str, ...] = ()      # priors the figures cannot identify

    def describe(self) -> str:
        f = self.figures
        return (f"calibration: {f.model} B1 {f.input_len}/{f.output_len} c{f.concurrency} "
                f"observed {f.throughput_tok_s:.4f} tok/s, max first token "
                f"{f.max_first_token_s:.2f} s, max completion {f.max_completion_s:.2f} s; "
                f"reproduced {self.reproduced_throughput_tok_s:.4f} tok/s, "
                f"{self.reproduced_max_first_token_s:.2f} s, "
                f"{self.reproduced_max_completion_s:.2f} s "
                f"(max error {100 * self.max_relative_error:.3f}%); fitted prefill "
                f"{self.prefill_s:.4f} s/request, decode step {1000 * self.decode_step_s:.3f} ms")


class CostModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-call device time of an artifact; see the module docstring for the formulas.

    Rates are per device. Build the default with `CostModel.default()` (fitted to the origin KONI B1
    figures) or fit your own with `calibrate`.
    """

    memory_bandwidth: float                # effective bytes/s streamed by a decode step (fitted)
    prefill_flops: float                   # effective FLOP/s of a prefill chunk (fitted)
    per_lane_fraction: float = 0.05        # each decoding lane past the first: x weight-stream time
    idle_lane_fraction: float = 1.0        # a padded (idle) lane of a static graph: x a lane's share
    decode_call_s: float = 0.001           # fixed host/launch overhead per decode call (assumed)
    prefill_call_s: float = 0.001          # fixed host/launch overhead per prefill call (assumed)
    bill_padded_chunk: bool = True         # linear layers run over the whole (padded) chunk
    tp_sync_s_per_layer: float = 5e-5      # all-reduce cost per layer per call at tensor_parallel > 1
    producer_speed: float = 1.0            # PD producer prefill time = native prefill time / this
    transfer_bandwidth: float = 12e9       # PD producer -> decoder link, KV bytes/s (assumed)
    import_bandwidth: float = 32e9         # PD decoder-side write of imported KV, B/s per device
                                           #   (assumed: half of ATOM's PCIe Gen5 x16 peak)
    import_call_s: float = 2e-4            # PD fixed cost per imported layer (write_layer_kv call)
    pd_header: str = "first-token"         # layer-stream header: "first-token" | "producer-start"
    calibration: Calibration | None = None  # how the rates were fitted

    def __post_init__(self) -> None:
        if self.pd_header not in PD_HEADERS:
            raise ConfigError(f"pd_header={self.pd_header!r} is not one of "
                              f"{', '.join(PD_HEADERS)}")
        for name in ("memory_bandwidth", "prefill_flops", "producer_speed", "transfer_bandwidth",
                     "import_bandwidth"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        for name in ("per_lane_fraction", "idle_lane_fraction", "decode_call_s",
                     "prefill_call_s", "tp_sync_s_per_layer", "import_call_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")

    # -- persistence ------------------------------------------------------------------------------
    @classmethod
    def default(cls) -> CostModel:
        """Fitted to the origin issue's KONI B1/k1 figures (cached)."""
        global _DEFAULT
        if _DEFAULT is None:
            _DEFAULT = calibrate()
        return _DEFAULT

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model written by `save` (JSON)."""
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)

    def save(self, path: str | Path) -> None:
        """Write this cost model as JSON."""
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")

    # -- formulas ---------------------------------------------------------------------------------
    def prefill_chunk_s(self, artifact: ArtifactConfig, start: int, length: int) -> float:
        """Native compute time of one prefill chunk of `length` real tokens from position `start`."""
        shapes = _shapes(artifact)
        billed = artifact.prefill_chunk_size if self.bill_padded_chunk else length
        flops = billed * shapes.linear_flops_per_token + \
            shapes.attention_flops_per_key * _attended_keys(shapes, start, length)
        compute = flops / self.prefill_flops
        stream = shapes.decode_weight_bytes / self.memory_bandwidth
        return self.prefill_call_s + max(compute, stream) + shapes.sync_layers * \
            self.tp_sync_s_per_layer

    def layer_import_s(self, artifact: ArtifactConfig, tokens: int) -> float:
        """Decoder-side cost of writing one imported layer of `tokens` tokens (PD routes)."""
        return self.import_call_s + _shapes(artifact).layer_kv_bytes_per_token * tokens / \
            self.import_bandwidth

    def layer_transfer_s(self, artifact: ArtifactConfig, tokens: int) -> float:
        """Producer -> decoder link time of one layer of `tokens` tokens (every KV head)."""
        return _shapes(artifact).wire_layer_kv_bytes_per_token * tokens / self.transfer_bandwidth

    def producer_prefill_s(self, artifact: ArtifactConfig, prompt_len: int) -> float:
        """The PD producer's compute for a whole prompt: the decoder artifact's native prefill
        time divided by `producer_speed`."""
        return self.request_prefill_s(artifact, prompt_len) / self.producer_speed

    def decode_step_s(self, artifact: ArtifactConfig, contexts: Sequence[int],
                      rows: int | None = None) -> float:
        """One decode step of a compiled batch of `rows` (default: batch_size); `contexts` are the
        decoding lanes' attended lengths (position + 1). The other rows are padding."""
        shapes = _shapes(artifact)
        active = len(contexts)
        idle = (artifact.batch_size if rows is None else rows) - active
        weights = shapes.decode_weight_bytes / self.memory_bandwidth
        lanes = max(active - 1, 0) + self.idle_lane_fraction * idle
        kv = sum(_kv_read_bytes(shapes, c) for c in contexts)
        return self.decode_call_s + weights * (1.0 + self.per_lane_fraction * lanes) + \
            kv / self.memory_bandwidth + shapes.sync_layers * self.tp_sync_s_per_layer

    def request_prefill_s(self, artifact: ArtifactConfig, prompt_len: int) -> float:
        """Native compute time of a whole prompt, chunk by chunk."""
        q = artifact.prefill_chunk_size
        return sum(self.prefill_chunk_s(artifact, s, min(q, prompt_len - s))
                   for s in range(0, prompt_len, q))

    def describe(self) -> str:
        lines = [f"cost model: memory_bandwidth {self.memory_bandwidth / 1e9:.2f} GB/s, "
                 f"prefill_flops {self.prefill_flops / 1e12:.2f} TFLOP/s (both fitted); "
                 f"per_lane_fraction {self.per_lane_fraction}, idle_lane_fraction "
                 f"{self.idle_lane_fraction}, call overheads decode {self.decode_call_s * 1e3:g} ms"
                 f" / prefill {self.prefill_call_s * 1e3:g} ms (assumed)",
                 f"PD (assumed): producer_speed {self.producer_speed:g}, transfer_bandwidth "
                 f"{self.transfer_bandwidth / 1e9:g} GB/s, import_bandwidth "
                 f"{self.import_bandwidth / 1e9:g} GB/s, import_call_s "
                 f"{self.import_call_s * 1e3:g} ms/layer, pd_header {self.pd_header}"]
        if self.calibration is not None:
            lines.append(self.calibration.describe())
        return "\n".join(lines)


_DEFAULT: CostModel | None = None


# -- shapes -----------------------------------------------------------------------------------------
class _Shapes(msgspec.Struct, frozen=True):
    num_layers: int
    decode_weight_bytes: int           # bytes streamed per call (input embedding excluded if untied)
    linear_flops_per_token: float
    attention_flops_per_key: float     # per attended key, summed over global layers
    sliding_attention_flops_per_key: float
    sliding_window: int
    kv_bytes_per_token: int            # global + sliding layers, K and V, per device
    layer_kv_bytes_per_token: int      # one layer's K and V, per device
    wire_layer_kv_bytes_per_token: int  # one layer's K and V, every KV head (what PD sends)
    global_kv_bytes_per_token: int
    sliding_kv_bytes_per_token: int
    sync_layers: int                   # layers that all-reduce (0 at tensor_parallel 1)


_SHAPES_CACHE: dict[str, _Shapes] = {}


def _shapes(artifact: ArtifactConfig) -> _Shapes:
    key = artifact.identity
    cached = _SHAPES_CACHE.get(key)
    if cached is not None:
        return cached
    spec = artifact.model
    tp = artifact.tensor_parallel
    weights = plan.weight_bytes(spec, tp)
    embed = spec.vocab_size * spec.hidden_size * spec.dtype_bytes
    # An untied input embedding is gathered (one row per token), not streamed.
    streamed = weights - (0 if spec.tie_word_embeddings else embed)
    params_per_token = (streamed - embed) / spec.dtype_bytes  # the LM head runs once per call
    q_dim = spec.num_heads // tp * spec.head_dim
    kv_heads = plan.kv_heads_per_device(spec, tp)
    per_layer_kv = 2 * kv_heads * spec.head_dim * plan.DTYPE_BYTES[artifact.kv_dtype]
    n_global, n_sliding = len(spec.global_layers), len(spec.sliding_layers)
    shapes = _Shapes(
        num_layers=spec.num_layers, decode_weight_bytes=streamed,
        linear_flops_per_token=2.0 * params_per_token,
        attention_flops_per_key=4.0 * q_dim * n_global,
        sliding_attention_flops_per_key=4.0 * q_dim * n_sliding,
        sliding_window=plan.sliding_window_len(artifact) if n_sliding else 0,
        kv_bytes_per_token=per_layer_kv * spec.num_layers,
        layer_kv_bytes_per_token=per_layer_kv,
        wire_layer_kv_bytes_per_token=2 * spec.num_kv_heads * spec.head_dim *
        plan.DTYPE_BYTES[artifact.kv_dtype],
        global_kv_bytes_per_token=per_layer_kv * n_global,
        sliding_kv_bytes_per_token=per_layer_kv * n_sliding,
        sync_layers=spec.num_layers if tp > 1 else 0)
    _SHAPES_CACHE[key] = shapes
    return shapes


def _sum_keys(lo: int, hi: int) -> float:
    """Sum of x for x in lo..hi (inclusive)."""
    return 0.0 if hi < lo else (lo + hi) * (hi - lo + 1) / 2.0


def _attended_keys(shapes: _Shapes, start: int, length: int) -> float:
    """Attention work of a chunk in units of `attention_flops_per_key` (sliding layers folded in)."""
    lo, hi = start + 1, start + length  # token at position p attends p + 1 keys
    total = _sum_keys(lo, hi)
    if shapes.sliding_attention_flops_per_key:
        w = shapes.sliding_window
        sliding = _sum_keys(lo, min(hi, w)) + max(0, hi - max(lo - 1, w)) * w
        total += sliding * shapes.sliding_attention_flops_per_key / max(
            shapes.attention_flops_per_key, 1e-30)
    return total


def _kv_read_bytes(shapes: _Shapes, context: int) -> float:
    read = shapes.global_kv_bytes_per_token * context
    if shapes.sliding_kv_bytes_per_token:
        read += shapes.sliding_kv_bytes_per_token * min(context, shapes.sliding_window)
    return read


# -- calibration ------------------------------------------------------------------------------------
def origin_artifact(figures: ObservedFigures = ORIGIN_KONI_B1) -> ArtifactConfig:
    """The single-block B1 artifact the figures were measured on."""
    return ArtifactConfig(model=ModelSpec.preset(figures.model), batch_size=1,
                          max_seq_len=figures.max_seq_len, block_size=figures.max_seq_len,
                          num_blocks=1, prefill_chunk_size=figures.prefill_chunk_size)


def fit_serial_times(figures: ObservedFigures) -> tuple[float, float]:
    """Solve the serial B1 schedule for (prefill time P, request time T = P + (out - 1) D).

    Requests run one after another, so the last completion is n T, the last first token
    (n - 1) T + P, and the throughput n out / (n T). Three equations, two unknowns: least squares
    on relative residuals.
    """
    n, out = figures.concurrency, figures.output_len
    rows = np.array([[0.0, n], [1.0, n - 1.0], [0.0, 1.0]])
    targets = np.array([figures.max_completion_s, figures.max_first_token_s,
                        out / figures.throughput_tok_s])
    solution, *_ = np.linalg.lstsq(rows / targets[:, None], np.ones(3), rcond=None)
    prefill, request = float(solution[0]), float(solution[1])
    if not 0 < prefill < request:
        raise ConfigError(f"figures give prefill {prefill:.3f} s and request {request:.3f} s: "
                          "they do not describe a serial B1 run")
    return prefill, request


def serial_figures(costs: CostModel, artifact: ArtifactConfig, input_len: int, output_len: int,
                   concurrency: int) -> tuple[float, float, float]:
    """(throughput, max first token, max completion) of the strictly serial B1 schedule."""
    prefill = costs.request_prefill_s(artifact, input_len)
    decode = sum(costs.decode_step_s(artifact, (input_len + 1 + i,))
                 for i in range(output_len - 1))
    request = prefill + decode
    return (concurrency * output_len / (concurrency * request),
            (concurrency - 1) * request + prefill, concurrency * request)


def calibrate(figures: ObservedFigures = ORIGIN_KONI_B1, **priors: float | bool) -> CostModel:
    """Fit `memory_bandwidth` and `prefill_flops` to a serial B1 observation.

    Args:
        figures: the observation (default: the origin issue's KONI B1/k1 figures).
        **priors: any other `CostModel` field (call overheads, per-lane fractions, PD parameters);
            they are held fixed while the two rates are fitted.

    Returns:
        A `CostModel` whose `calibration` records the fit and the figures it reproduces.

    Raises:
        ConfigError: the figures are not a serial B1 run, or the priors leave no time to fit.
    """
    artifact = origin_artifact(figures)
    shapes = _shapes(artifact)
    prefill, request = fit_serial_times(figures)
    steps = figures.output_len - 1
    decode_step = (request - prefill) / steps if steps else 0.0
    probe = CostModel(memory_bandwidth=1.0, prefill_flops=1.0, **priors)  # type: ignore[arg-type]

    # Decode (B1, one lane, contexts input+1 ..): call + (weights + kv(ctx)) / bandwidth.
    streamed = sum(shapes.decode_weight_bytes + _kv_read_bytes(shapes, figures.input_len + 1 + i)
                   for i in range(steps))
    budget = steps * (decode_step - probe.decode_call_s - shapes.sync_layers *
                      probe.tp_sync_s_per_layer)
    if steps and budget <= 0:
        raise ConfigError(f"decode step {decode_step:.4f} s leaves no time after the call overhead")
    bandwidth = streamed / budget if steps else 256e9

    # Prefill: the chunk cost is monotone in prefill_flops; bisect on a log scale.
    def prefill_at(flops: float) -> float:
        costs = msgspec.structs.replace(probe, memory_bandwidth=bandwidth, prefill_flops=flops)
        return costs.request_prefill_s(artifact, figures.input_len)

    lo, hi = 1e9, 1e18
    if prefill_at(hi) > prefill:
        raise ConfigError(f"prefill {prefill:.3f} s is faster than streaming the weights once per "
                          "chunk: the figures and the priors disagree")
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if prefill_at(mid) > prefill:
            lo = mid
        else:
            hi = mid
    flops = math.sqrt(lo * hi)
    costs = msgspec.structs.replace(probe, memory_bandwidth=bandwidth, prefill_flops=flops)
    tput, first, last = serial_figures(costs, artifact, figures.input_len, figures.output_len,
                                       figures.concurrency)
    error = max(abs(tput / figures.throughput_tok_s - 1), abs(first / figures.max_first_token_s - 1),
                abs(last / figures.max_completion_s - 1))
    calibration = Calibration(
        figures=figures, request_s=request, prefill_s=prefill, decode_step_s=decode_step,
        reproduced_throughput_tok_s=tput, reproduced_max_first_token_s=first,
        reproduced_max_completion_s=last, max_relative_error=error,
        assumptions=(
            f"per_lane_fraction={costs.per_lane_fraction} and idle_lane_fraction="
            f"{costs.idle_lane_fraction} are priors: B1 figures cannot identify lane costs",
            f"call overheads decode {costs.decode_call_s} s, prefill {costs.prefill_call_s} s "
            "are priors",
            "other models use the same two rates, scaled by their weight bytes, KV bytes and FLOPs",
            "PD parameters (producer_speed, transfer_bandwidth, import_bandwidth, "
            "import_call_s, pd_header) are priors"))
    return msgspec.structs.replace(costs, calibration=calibration)


# -- the runtime ------------------------------------------------------------------------------------
class DeviceTime(msgspec.Struct):
    """Virtual device seconds and calls, by kind."""

    prefill_s: float = 0.0                 # native prefill compute
    import_s: float = 0.0                  # decoder-side KV import (PD routes)
    decode_s: float = 0.0
    prefill_calls: int = 0
    import_calls: int = 0                  # write_layer_kv calls (one per imported layer)
    decode_calls: int = 0
    decode_rows: int = 0                   # rows billed by decode calls (padding rows included)


class SimRuntime:
    """A `Runtime` that does no math: a virtual clock advanced by a `CostModel`.

    Args:
        artifact: the compiled shapes to simulate.
        costs: the cost model (default: `CostModel.default()`, fitted to the origin KONI B1 figures).
        seed: varies the pseudo-logits.
        pace: wall seconds each simulated device second takes (0, the default: none, the call
            returns at once and only the virtual clock advances; 1.0: real time). A paced runtime
            sleeps its device time in every call, so a server or a cluster driven by it costs
            what the device would (a prefix hit saves that prefill's wall time), and its clock
            is wall time divided by `pace`.

    The pseudo-logits of a call are a fixed random row plus one spike at a token that is a hash of
    the input token and its position (never an EOS id), so greedy runs are deterministic and differ
    by request. The returned arrays are buffers reused on every call: read them before the next one.
    """

    def __init__(self, artifact: ArtifactConfig, costs: CostModel | None = None,
                 seed: int = 0, pace: float = 0.0) -> None:
        if not (pace >= 0 and math.isfinite(pace)):
            raise ConfigError(f"pace={pace} must be a finite number >= 0")
        self.pace = pace
        self._wall0 = time.perf_counter()
        self.artifact = artifact
        self.spec = artifact.model
        self.costs = costs if costs is not None else CostModel.default()
        self.seed = seed
        self.device = DeviceTime()
        self._now = 0.0
        vocab = self.spec.vocab_size
        base = np.random.default_rng(seed).random(vocab, dtype=np.float32)
        self._decode_logits = np.tile(base, (artifact.batch_size, 1))
        self._decode_spikes = np.zeros(artifact.batch_size, dtype=np.int64)
        self._prefill_logits = base.copy()
        self._prefill_spike = 0
        self._base = base
        self._eos = frozenset(self.spec.eos_token_ids)
        self._vocab = vocab

    # -- clock ------------------------------------------------------------------------------------
    def clock(self) -> float:
        """Virtual seconds since the runtime was built (paced: wall seconds / pace)."""
        if self.pace:
            self._now = max(self._now, (time.perf_counter() - self._wall0) / self.pace)
        return self._now

    def advance_to(self, when: float) -> None:
        """Let virtual time pass with the device idle (waiting for arrivals)."""
        if when > self._now:
            self._now = when

    def _spend(self, cost: float) -> None:
        """The device is busy for `cost` simulated seconds (paced: sleeps them)."""
        if self.pace:
            time.sleep(cost * self.pace)
            self.clock()
        else:
            self._now += cost

    # -- pseudo-logits ----------------------------------------------------------------------------
    def _spike(self, token: int, position: int) -> int:
        h = (token * 2654435761 + position * 40503 + self.seed * 97 + 12345) % self._vocab
        while h in self._eos:
            h = (h + 1) % self._vocab
        return h

    def prompt_logits(self, prompt: Sequence[int] | npt.NDArray[np.integer]
                      ) -> npt.NDArray[np.float32]:
        """The logits the last prefill chunk of `prompt` returns (a fresh array): what a
        simulated PD producer of the same model samples its first token from."""
        row = self._base.copy()
        row[self._spike(int(prompt[-1]), len(prompt) - 1)] = 32.0
        return row

    # -- Runtime protocol -------------------------------------------------------------------------
    every_position_logits = True  # `prefill(every_position=True)` works (prompt logprobs)

    def prefill(self, inputs: PrefillArrays, *, every_position: bool = False
                ) -> npt.NDArray[np.float32]:
        """One chunk's pseudo-logits: the last real token's row (a reused buffer), or with
        `every_position` a fresh `[Q, vocab]` array, row i spiking at the hash of token i (the
        cost model charges the same time: the LM head over Q rows is not modelled)."""
        q = int(inputs.query_position)
        start = int(inputs.cache_position[0, 0])
        cost = self.costs.prefill_chunk_s(self.artifact, start, q + 1)
        self.device.prefill_s += cost
        self.device.prefill_calls += 1
        self._spend(cost)
        if every_position:
            ids = np.asarray(inputs.input_ids).reshape(-1)
            rows = np.tile(self._base, (len(ids), 1))
            for i, token in enumerate(ids.tolist()):
                rows[i, self._spike(int(token), start + i)] = 32.0
            return rows
        row = self._prefill_logits
        row[self._prefill_spike] = self._base[self._prefill_spike]
        spike = self._spike(int(inputs.input_ids[0, q]), start + q)
        row[spike] = 32.0
        self._prefill_spike = spike
        return row

    def decode(self, inputs: DecodeArrays) -> npt.NDArray[np.float32]:
        positions = inputs.cache_position[:, 0]
        rows = len(positions)
        if rows not in self.artifact.decoder_batch_sizes:
            raise StateError(f"decode inputs have {rows} rows; the compiled decode batches are "
                             f"{self.artifact.decoder_batch_sizes}")
        contexts = [int(p) + 1 for p in positions if p > 0]  # padding rows sit at position 0
        cost = self.costs.decode_step_s(self.artifact, contexts, rows)
        self.device.decode_s += cost
        self.device.decode_calls += 1
        self.device.decode_rows += rows
        self._spend(cost)
        logits, spikes, base = self._decode_logits, self._decode_spikes, self._base
        for row in range(rows):
            old = spikes[row]
            logits[row, old] = base[old]
            spike = self._spike(int(inputs.input_ids[row, 0]), int(positions[row]))
            logits[row, spike] = 32.0
            spikes[row] = spike
        return logits[:rows]

    def write_layer_kv(self, layer: int, k: npt.NDArray[np.generic], v: npt.NDArray[np.generic],
                       block_row: Sequence[int], slot: int = 0) -> None:
        """Import one layer's K/V `[kv_heads, tokens, head_dim]` (the decoder side of PD): no data
        moves, the clock advances by `CostModel.layer_import_s` of its tokens.

        Raises:
            StateError: a layer, shape, block row or slot the device could not take.
        """
        spec, art = self.spec, self.artifact
        if not 0 <= layer < spec.num_layers:
            raise StateError(f"layer {layer} is outside 0..{spec.num_layers - 1}")
        tokens = k.shape[1] if k.ndim == 3 else -1
        if k.shape != v.shape or k.shape != (spec.num_kv_heads, tokens, spec.head_dim):
            raise StateError(f"K {k.shape} and V {v.shape} must both be [kv_heads="
                             f"{spec.num_kv_heads}, tokens, head_dim={spec.head_dim}]")
        sliding = spec.layer_kinds[layer] == SLIDING
        limit = plan.sliding_window_len(art) if sliding else art.max_seq_len
        if not 0 < tokens <= limit:
            raise StateError(f"layer {layer} got {tokens} tokens, outside 1..{limit}")
        if sliding:
            if not 0 <= slot < art.batch_size:
                raise StateError(f"slot {slot} is outside 0..{art.batch_size - 1}")
        else:
            if len(block_row) * art.block_size < tokens:
                raise StateError(f"block row {list(block_row)} holds {len(block_row)} blocks of "
                                 f"{art.block_size}, too few for {tokens} tokens")
            bad = [b for b in block_row if not 0 <= b < art.num_blocks]
            if bad:
                raise StateError(f"block {bad[0]} is outside 0..{art.num_blocks - 1}")
        cost = self.costs.layer_import_s(art, tokens)
        self.device.import_s += cost
        self.device.import_calls += 1
        self._spend(cost)

    def copy_block(self, src: int, dst: int) -> None:
        shapes = _shapes(self.artifact)
        cost = 2 * shapes.global_kv_bytes_per_token * self.artifact.block_size / \
            self.costs.memory_bandwidth
        self._spend(cost)

    def copy_slot(self, src: int, dst: int) -> None:
        """A sliding-window slot copy (n > 1 forks on hybrid models): charged like a block."""
        self.copy_block(src, dst)

    def read_slot(self, slot: int) -> npt.NDArray[np.generic]:
        """A sliding-slot checkpoint (hybrid prefix cache): no data, charged like a block
        copy's transfer of the slot's bytes."""
        self._spend(plan.checkpoint_bytes(self.artifact) / self.costs.memory_bandwidth)
        return np.zeros(1, dtype=np.float32)

    def write_slot(self, slot: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a sliding-slot checkpoint: charged like `read_slot`."""
        self._spend(plan.checkpoint_bytes(self.artifact) / self.costs.memory_bandwidth)

    def read_block(self, block: int) -> npt.NDArray[np.generic]:
        return np.zeros(1, dtype=np.float32)

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        return None


# -- the PD producer -------------------------------------------------------------------------------
class SimKVSource:
    """A `KVSource` whose header and layers become available at fixed virtual times.

    `poll` compares the times with `clock` (the decoder's virtual clock) and hands out what has
    arrived; layers never come before the header. Built by `SimProducer.source`.
    """

    def __init__(self, header: KVHeader, header_at: float, layers: Sequence[LayerKV],
                 layer_at: Sequence[float], clock: Callable[[], float]) -> None:
        self.header = header
        self.header_at = header_at               # when the header reaches the decoder
        self.layers = list(layers)
        # a layer is handed out no earlier than the header
        self.layer_at = [max(t, header_at) for t in layer_at]
        self._clock = clock
        self._next = 0                            # first layer not yet handed out
        self._header_out = False
        self._closed = False

    @property
    def ready_at(self) -> float:
        """When the last layer has arrived."""
        return self.layer_at[-1] if self.layer_at else self.header_at

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        if self._closed:
            raise KVTransferError(f"simulated KV source for {self.header.request_id} was closed")
        now = self._clock()
        if now < self.header_at:
            return None, []
        self._header_out = True
        first = self._next
        while self._next < len(self.layers) and self.layer_at[self._next] <= now:
            self._next += 1
        return self.header, self.layers[first:self._next]

    def done(self) -> bool:
        return self._header_out and self._next == len(self.layers)

    def close(self) -> None:
        self._closed = True

    def next_event(self) -> float | None:
        """When `poll` will next hand out something new; None when nothing is left (or closed)."""
        if self._closed:
            return None
        if not self._header_out:
            return self.header_at
        return self.layer_at[self._next] if self._next < len(self.layers) else None


class SimProducer:
    """A simulated PD producer feeding one `SimRuntime` decoder (see the module docstring).

    Prompts are prefilled one at a time in the order `source` is called; the producer's compute is
    `CostModel.producer_prefill_s` on the decoder's artifact, split equally over the layers, and
    its K/V cross one serial link at `transfer_bandwidth` (the link of one prompt overlaps the next
    prompt's compute). The first token is sampled, as `atombatch.pd.Producer` does, from the
    decoder's pseudo-logits for the prompt with `default_rng(params.seed)`: greedy output equals
    native output; sampled output does not (native prefill draws from the request's own RNG).

    Args:
        runtime: the decoder (its clock, cost model, artifact and pseudo-logits).
        mode: "whole" or "layer-stream".
    """

    def __init__(self, runtime: SimRuntime, mode: Mode = "layer-stream") -> None:
        if mode not in ("whole", "layer-stream"):
            raise ConfigError(f"mode={mode!r} is not whole or layer-stream")
        self.runtime = runtime
        self.mode = mode
        self.costs = runtime.costs
        self.artifact = runtime.artifact
        spec = self.artifact.model
        self._window = spec.sliding_window if spec.is_hybrid else 0
        self._identity = model_identity(spec)
        self._zero = np.zeros((), dtype=np.float32)
        self._arrays: dict[int, npt.NDArray[np.float32]] = {}
        self.free_at = 0.0          # the producer's compute is busy until then
        self.link_free_at = 0.0     # the link is busy until then
        self.busy_s = 0.0           # compute time over all prompts
        self.transfer_s = 0.0       # link time over all prompts
        self.requests = 0
        self.sources: list[SimKVSource] = []

    def _kv(self, tokens: int) -> npt.NDArray[np.float32]:
        """A read-only zero-stride float32 K (or V) of `tokens` tokens: no memory per layer."""
        array = self._arrays.get(tokens)
        if array is None:
            spec = self.artifact.model
            array = np.broadcast_to(self._zero, (spec.num_kv_heads, tokens, spec.head_dim))
            self._arrays[tokens] = array
        return array

    def source(self, request_id: str, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, arrival: float | None = None) -> SimKVSource:
        """Queue `prompt` on the producer (at `arrival`, default now); returns its KV source."""
        params = params or SamplingParams(temperature=0.0)  # no params: greedy
        spec, art, costs = self.artifact.model, self.artifact, self.costs
        n = len(prompt)
        now = self.runtime.clock() if arrival is None else arrival
        start = max(now, self.free_at)
        compute = costs.producer_prefill_s(art, n)
        end = start + compute
        self.free_at = end
        self.busy_s += compute
        self.requests += 1
        kinds = spec.layer_kinds
        tokens = expected_layer_tokens(kinds, n, self._window)
        layers = [LayerKV(i, self._kv(t), self._kv(t)) for i, t in enumerate(tokens)]
        link = self.link_free_at
        layer_at: list[float] = []
        per_layer = compute / len(kinds)
        for i, t in enumerate(tokens):
            computed = end if self.mode == "whole" else start + (i + 1) * per_layer
            transfer = costs.layer_transfer_s(art, t)
            link = max(link, computed) + transfer
            self.transfer_s += transfer
            layer_at.append(link)
        self.link_free_at = link
        if self.mode == "whole":
            header_at = link
            layer_at = [link] * len(layer_at)
        else:
            header_at = start if costs.pd_header == "producer-start" else end
        first = sample(self.runtime.prompt_logits(prompt), params,
                       np.random.default_rng(params.seed))
        header = KVHeader(
            request_id=request_id, model_identity=self._identity, num_layers=spec.num_layers,
            layer_kinds=kinds, prompt_len=n, covered_len=n, first_token=first, dtype="float32",
            kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, sliding_window=self._window,
            layer_tokens=tokens)
        source = SimKVSource(header, header_at, layers, layer_at, self.runtime.clock)
        self.sources.append(source)
        return source

    def next_event(self) -> float | None:
        """The earliest time any open source hands out something new (None: nothing pending)."""
        self.sources = [s for s in self.sources if s.next_event() is not None]
        return min((s.next_event() for s in self.sources), default=None)  # type: ignore[type-var]
