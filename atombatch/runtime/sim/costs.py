"""The simulator's cost model: per-call device time of an artifact, calibrated to observed
figures.

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
* LoRA adapters (`LoraCost`, from an adapter's rank and target modules): a call streams the A and B
  matrices of every distinct adapter its rows use once, at `memory_bandwidth`, and computes
  `2 r (in + out)` FLOPs per adapted linear layer per token of every row that uses one, at
  `prefill_flops`. A decode step adds both (the base step's compute is hidden in its weight
  streaming, an adapter's gathered matrices are not); a prefill chunk bills them with its own bytes
  and FLOPs (the larger of the two). Rows of the base model cost nothing extra.

Other models therefore scale from KONI by their weight bytes, KV bytes and FLOPs; that the same two
rates hold across model sizes is an assumption, stated next to every prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from atombatch.artifact import plan
from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.artifact.lora import ATTENTION_MODULES, module_shapes
from atombatch.errors import ConfigError

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
    def prefill_chunk_s(self, artifact: ArtifactConfig, start: int, length: int,
                        lora: LoraCost | None = None) -> float:
        """Native compute time of one prefill chunk of `length` real tokens from position `start`
        (under adapter `lora`: its matrices streamed and its FLOPs per billed token too)."""
        shapes = _shapes(artifact)
        billed = artifact.prefill_chunk_size if self.bill_padded_chunk else length
        flops = billed * shapes.linear_flops_per_token + \
            shapes.attention_flops_per_key * _attended_keys(shapes, start, length)
        streamed = shapes.decode_weight_bytes
        if lora is not None:
            flops += billed * lora.flops_per_token
            streamed += lora.bytes
        compute = flops / self.prefill_flops
        stream = streamed / self.memory_bandwidth
        return self.prefill_call_s + max(compute, stream) + shapes.sync_layers * \
            self.tp_sync_s_per_layer

    def lora_step_s(self, adapters: Sequence[tuple[LoraCost, int]]) -> float:
        """What adapters add to a decode step: `(adapter, rows using it)` per distinct adapter;
        each streams its matrices once and computes its FLOPs for each of its rows."""
        return sum(cost.bytes / self.memory_bandwidth +
                   rows * cost.flops_per_token / self.prefill_flops for cost, rows in adapters)

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
                      rows: int | None = None,
                      adapters: Sequence[tuple[LoraCost, int]] = ()) -> float:
        """One decode step of a compiled batch of `rows` (default: batch_size); `contexts` are the
        decoding lanes' attended lengths (position + 1). The other rows are padding. `adapters`:
        `(adapter, rows using it)` per distinct LoRA adapter of the step (`lora_step_s`)."""
        shapes = _shapes(artifact)
        active = len(contexts)
        idle = (artifact.batch_size if rows is None else rows) - active
        weights = shapes.decode_weight_bytes / self.memory_bandwidth
        lanes = max(active - 1, 0) + self.idle_lane_fraction * idle
        kv = sum(_kv_read_bytes(shapes, c) for c in contexts)
        step = self.decode_call_s + weights * (1.0 + self.per_lane_fraction * lanes) + \
            kv / self.memory_bandwidth + shapes.sync_layers * self.tp_sync_s_per_layer
        return step + self.lora_step_s(adapters) if adapters else step

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


class LoraCost(msgspec.Struct, frozen=True):
    """What one LoRA adapter costs the device, per device (see `lora_cost`)."""

    bytes: int                          # its A and B matrices, in the model's dtype
    flops_per_token: float              # 2 r (in + out) per adapted linear layer, summed


def lora_cost(artifact: ArtifactConfig, r: int, target_modules: Sequence[str],
              num_layers: int | None = None) -> LoraCost:
    """The device cost of an adapter of rank `r` on `target_modules` of `num_layers` layers
    (default: every layer). With tensor parallelism a column-parallel module (q, k, v, gate, up)
    keeps A whole and splits B's rows; a row-parallel one (o, down) splits A's columns and keeps B
    whole; KV projections split as `plan.kv_heads_per_device` says."""
    spec, tp = artifact.model, artifact.tensor_parallel
    shapes = module_shapes(spec)
    kv_split = spec.num_kv_heads / plan.kv_heads_per_device(spec, tp)
    elements = 0.0
    for module in target_modules:
        in_dim, out_dim = shapes[module]
        if module in ("o_proj", "down_proj"):
            elements += r * in_dim / tp + r * out_dim
        else:
            split = kv_split if module in ATTENTION_MODULES[1:3] else tp
            elements += r * in_dim + r * out_dim / split
    layers = spec.num_layers if num_layers is None else num_layers
    return LoraCost(bytes=int(layers * elements * spec.dtype_bytes),
                    flops_per_token=2.0 * layers * elements)


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
