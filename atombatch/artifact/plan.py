"""Device-memory planner: exact KV-cache bytes of an artifact and whether it fits one ATOM.

Theory of operation. The KV tensors of a compiled artifact are fixed by its shapes (docs/rules.md):
every global-attention layer has a K and a V tensor `[num_blocks, kv_heads, block_size, head_dim]`,
every sliding layer of a hybrid model a K and a V tensor `[batch_size, kv_heads, window, head_dim]`,
all in `kv_dtype`. Those bytes are exact. Everything else on the device (weights, the runtime's
buffers) is either taken from an observation of a running artifact or estimated:

- observed: `projected = observed_used - kv(observed_artifact) + kv(artifact)`. This assumes every
  other allocation stays the same when only the KV shapes change, so it is a conditional estimate
  (a bigger batch also grows activation buffers), never a compiler's verdict.
- estimate: `projected = weight_bytes + kv + runtime_overhead_bytes`, with the overhead a stated,
  unmeasured allowance.

A hybrid model with the prefix cache also keeps sliding-slot checkpoints (docs/prefix-cache.md) in
host memory, inside `host_cache_bytes`: `checkpoint_bytes` is one checkpoint (one lane's sliding
slot in every sliding layer); it is reported, never added to the device projection, and
`check_serving` refuses a host cache too small to hold one.

With `tensor_parallel > 1` every figure is per device: attention heads, KV heads and the MLP are
split across devices; KV heads are replicated when there are fewer of them than devices; embeddings
and norms are counted on every device (conservative).

LoRA adapters (`fit(..., lora=LoraPlan(count, max_rank, target_modules))`) are compiled into the
artifact (optimum-rbln 0.12): every targeted projection of every layer holds its adapters stacked
and zero-padded to `max_lora_rank`, A as `[adapters, in, max_rank]` and B as
`[adapters, max_rank, out]` in the base weight dtype, and the stack has one more entry than the user
adapters (the reserved base adapter 0, all zeros). `lora_bytes` counts exactly that and `fit` adds
it to the non-KV bytes; `max_lora_adapters` says how many adapters of a rank fit beside the lanes.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from atombatch.artifact.config import DTYPE_BYTES, ArtifactConfig, ModelSpec, Quantization
from atombatch.artifact.lora import TARGET_MODULES, module_shapes
from atombatch.errors import ConfigError

#: Capacity reported for one ATOM by the read-only monitor in the origin issue (bytes). It is also
#: optimum-rbln 0.12's available DRAM of an RBLN-CA (ATOM) device: 16 GiB less the 288 MiB system
#: reserve per chiplet, ATOM reporting one chiplet (`utils/runtime_utils.py`).
ATOM_DEVICE_BYTES = 16_877_879_296
ATOM_DRAM_BYTES = 16 * 2**30
ATOM_SYSTEM_RESERVE_BYTES = 288 * 2**20

#: optimum-rbln aligns every device tensor allocation to 2 MiB (`align_2MB` when it sizes the KV
#: cache).
DEVICE_ALLOC_ALIGN = 2**21

#: Allowance for the runtime's own device buffers (activations, I/O staging, command queues) used by
#: the weights + KV estimate. 512 MiB is a round figure, not a measurement: the only observation
#: (KONI B1/k1, origin issue) cannot calibrate it, because its non-KV bytes (15,149,826,048) are
#: below the full BF16 weight estimate (16,060,522,496); the device evidently keeps part of the
#: model elsewhere, so the estimate errs on the side of "does not fit".
DEFAULT_RUNTIME_OVERHEAD_BYTES = 512 * 1024 * 1024

DTYPE_LABELS = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32", "float8_e4m3fn": "FP8"}

Method = Literal["observed", "estimate"]

#: The projections an adapter may target (optimum-rbln 0.12 `lora_architecture`: attention q/k/v/o,
#: MLP gate/up/down), in layer order: `artifact/lora.py`'s list.
LORA_TARGET_MODULES = TARGET_MODULES


class LoraPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Adapters to compile beside an artifact, as the planner counts them.

    optimum-rbln 0.12 stacks every adapter, padded to `max_rank`, plus the reserved base adapter
    (id 0) into each targeted projection; a projection no adapter targets holds nothing.
    """

    count: int                                          # user adapters (ids 1..count)
    max_rank: int                                       # optimum-rbln's max_lora_rank
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES  # union over the adapters

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 0:
            raise ConfigError(f"lora count={self.count!r} must be an integer >= 0")
        if not isinstance(self.max_rank, int) or self.max_rank <= 0:
            raise ConfigError(f"max_lora_rank={self.max_rank!r} must be a positive integer")
        if not self.target_modules:
            raise ConfigError("lora target_modules is empty: name at least one of "
                              f"{', '.join(LORA_TARGET_MODULES)}")
        for module in self.target_modules:
            if module not in LORA_TARGET_MODULES:
                raise ConfigError(f"lora target module {module!r} is not one of "
                                  f"{', '.join(LORA_TARGET_MODULES)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(f"lora target_modules={list(self.target_modules)} names a module "
                              "twice")

    @property
    def stacked_adapters(self) -> int:
        """Entries of each projection's stack: the user adapters plus the reserved base (id 0)."""
        return self.count + 1


class KVGroup(msgspec.Struct, frozen=True):
    """Identical KV tensors of one kind, as the compiled graph lists them (per device)."""

    kind: Literal["global", "sliding"]  # block-table layers or lane-slot (sliding-window) layers
    count: int                          # number of tensors: 2 (K and V) per layer of this kind
    shape: tuple[int, ...]              # one tensor's shape
    dtype: str                          # kv_dtype, e.g. "bfloat16"
    tensor_bytes: int                   # bytes of one tensor
    total_bytes: int                    # count * tensor_bytes


class FitResult(msgspec.Struct, frozen=True):
    """Whether one artifact fits one device, and how that was worked out. Bytes are per device."""

    label: str                          # artifact label, e.g. "koni-8b B4/ctx9216/k5"
    identity: str                       # ArtifactConfig.identity
    model: str                          # model name
    tensor_parallel: int                # devices the model is split across
    kv_groups: tuple[KVGroup, ...]      # the KV tensors, grouped by shape
    kv_bytes: int                       # exact KV-cache bytes of this artifact
    weight_bytes: int                   # weight estimate from the spec (informational if observed)
    other_bytes: int                    # non-KV bytes projected: observed, or weights + overhead
    projected_bytes: int                # other_bytes + kv_bytes
    device_bytes: int                   # device capacity
    headroom_bytes: int                 # device_bytes - projected_bytes (negative: over capacity)
    fits: bool                          # projected_bytes <= device_bytes
    method: Method                      # "observed" (scaled from a measurement) or "estimate"
    conditional: bool                   # True when other allocations are assumed unchanged
    basis: str                          # one sentence on how projected_bytes was made
    runtime_overhead_bytes: int | None = None  # the stated allowance (estimate only)
    observed_used_bytes: int | None = None     # measured device use (observed only)
    observed_label: str | None = None          # artifact the measurement was taken on
    observed_kv_bytes: int | None = None       # that artifact's exact KV bytes
    checkpoint_bytes: int = 0                  # host bytes of one sliding-slot checkpoint
                                               #   (hybrid prefix cache; 0 without sliding layers)
    lora: LoraPlan | None = None               # the adapters counted, if any
    lora_bytes: int = 0                        # their device bytes (inside other_bytes)
    kv_alloc_bytes: int = 0                    # KV bytes once each tensor is aligned to 2 MiB as
                                               #   optimum-rbln allocates them (informational)


def kv_heads_per_device(spec: ModelSpec, tensor_parallel: int = 1) -> int:
    """KV heads each device holds: split across devices, or replicated when fewer than devices."""
    return max(1, spec.num_kv_heads // tensor_parallel)


def sliding_window_len(artifact: ArtifactConfig) -> int:
    """Tokens a sliding slot holds: the model's window, capped by the context."""
    return min(artifact.model.sliding_window, artifact.max_seq_len)


def kv_groups(artifact: ArtifactConfig) -> tuple[KVGroup, ...]:
    """The artifact's KV tensors per device, grouped: global layers first, then sliding layers."""
    spec = artifact.model
    heads = kv_heads_per_device(spec, artifact.tensor_parallel)
    item = DTYPE_BYTES[artifact.kv_dtype]
    groups = []
    for kind, layers, shape in (
        ("global", spec.global_layers,
         (artifact.num_blocks, heads, artifact.block_size, spec.head_dim)),
        ("sliding", spec.sliding_layers,
         (artifact.batch_size, heads, sliding_window_len(artifact), spec.head_dim)),
    ):
        if not layers:
            continue
        tensor_bytes = item
        for dim in shape:
            tensor_bytes *= dim
        count = 2 * len(layers)
        groups.append(KVGroup(kind=kind, count=count, shape=shape,  # type: ignore[arg-type]
                              dtype=artifact.kv_dtype, tensor_bytes=tensor_bytes,
                              total_bytes=count * tensor_bytes))
    return tuple(groups)


def kv_tensor_shapes(artifact: ArtifactConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """Every KV tensor of the artifact (per device) as `(name, shape, dtype)`, in layer order.

    Names are `layers.{i}.key` / `layers.{i}.value`; global layers have the block shape
    `[num_blocks, kv_heads, block_size, head_dim]`, sliding layers the lane-slot shape
    `[batch_size, kv_heads, window, head_dim]`.
    """
    by_kind = {group.kind: group.shape for group in kv_groups(artifact)}
    sliding = set(artifact.model.sliding_layers)
    tensors = []
    for layer in range(artifact.model.num_layers):
        shape = by_kind["sliding" if layer in sliding else "global"]
        for part in ("key", "value"):
            tensors.append((f"layers.{layer}.{part}", shape, artifact.kv_dtype))
    return tensors


def _aligned(nbytes: int) -> int:
    return -(-nbytes // DEVICE_ALLOC_ALIGN) * DEVICE_ALLOC_ALIGN


def kv_alloc_bytes(artifact: ArtifactConfig, num_blocks: int | None = None) -> int:
    """Device bytes the KV tensors take once each is aligned to 2 MiB, as optimum-rbln sizes them;
    `num_blocks` (default the artifact's) rescales the global (block) tensors, sliding slots stay."""
    blocks = artifact.num_blocks if num_blocks is None else num_blocks
    total = 0
    for group in kv_groups(artifact):
        tensor = group.tensor_bytes
        if group.kind == "global":
            tensor = tensor // artifact.num_blocks * blocks
        total += group.count * _aligned(tensor)
    return total


def max_num_blocks(artifact: ArtifactConfig, non_kv_bytes: int,
                   device_bytes: int = ATOM_DEVICE_BYTES) -> int:
    """The KV block count optimum-rbln 0.12 picks when it sizes the cache itself
    (`kvcache_num_blocks=0`): the most blocks, up to `batch_size x blocks_per_seq` (its
    `num_full_blocks`, no spare), whose 2 MiB-aligned KV tensors fit beside `non_kv_bytes` in
    `device_bytes`; 1 when none fits (optimum-rbln then refuses an artifact below its minimum).
    Only the artifact's shapes other than `num_blocks` matter."""
    full = artifact.batch_size * artifact.blocks_per_seq
    budget = device_bytes - non_kv_bytes
    if kv_alloc_bytes(artifact, full) <= budget:
        return full
    lo, hi, best = 1, full - 1, 1
    while lo <= hi:  # KV bytes grow with the block count
        mid = (lo + hi) // 2
        if kv_alloc_bytes(artifact, mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def checkpoint_bytes(artifact: ArtifactConfig) -> int:
    """Host bytes of one sliding-slot checkpoint (one lane's slot in every sliding layer, K and V,
    in `kv_dtype`, per device); 0 for a model without sliding layers."""
    for group in kv_groups(artifact):
        if group.kind == "sliding":
            return group.total_bytes // artifact.batch_size
    return 0


def check_serving(artifact: ArtifactConfig, *, prefix_cache: bool = False,
                  host_cache_bytes: int = 0) -> None:
    """Check the Batcher's cache options against the artifact (docs/rules.md). Raises `ConfigError`."""
    if host_cache_bytes < 0:
        raise ConfigError(f"host_cache_bytes={host_cache_bytes} must be >= 0")
    if host_cache_bytes and not prefix_cache:
        raise ConfigError(f"host_cache_bytes={host_cache_bytes} needs prefix_cache=True: the host "
                          "cache holds evicted prefix-cache blocks")
    if artifact.model.is_hybrid and prefix_cache:
        need = checkpoint_bytes(artifact)
        if host_cache_bytes < need:
            raise ConfigError(f"host_cache_bytes={host_cache_bytes}: the prefix cache of hybrid "
                              f"model {artifact.model.name} keeps sliding-slot checkpoints in "
                              f"the host cache, which must hold at least one ({need} bytes; "
                              "docs/prefix-cache.md)")
    if artifact.single_block and (prefix_cache or host_cache_bytes):
        raise ConfigError(f"prefix_cache={prefix_cache}, host_cache_bytes={host_cache_bytes}: "
                          f"single-block mode (num_blocks={artifact.num_blocks}) runs with caches "
                          "off only: its one block goes back to the lane pool at every finish")


def kv_cache_bytes(artifact: ArtifactConfig) -> int:
    """Exact bytes of the artifact's KV tensors on one device (global blocks plus sliding slots)."""
    return sum(group.total_bytes for group in kv_groups(artifact))


#: Bytes of one quantization scale: optimum-rbln builds a quantized model in float32 (its compiler
#: takes no bfloat16 quantized graph) and gives every scale the model's dtype.
SCALE_BYTES = 4


def projection_shapes(spec: ModelSpec, tensor_parallel: int = 1) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection of one layer on one device: q/k/v and
    gate/up split their outputs across devices, o and down their inputs."""
    hidden, head_dim = spec.hidden_size, spec.head_dim
    q_dim = spec.num_heads // tensor_parallel * head_dim
    kv_dim = kv_heads_per_device(spec, tensor_parallel) * head_dim
    mlp = -(-spec.intermediate_size // tensor_parallel)
    return {"q_proj": (q_dim, hidden), "k_proj": (kv_dim, hidden), "v_proj": (kv_dim, hidden),
            "o_proj": (hidden, q_dim), "gate_proj": (mlp, hidden), "up_proj": (mlp, hidden),
            "down_proj": (hidden, mlp)}


def linear_weight_bytes(out_features: int, in_features: int,
                        quantization: Quantization | None = None, dtype_bytes: int = 2) -> int:
    """Device bytes of one projection's weight (bias excluded) in the artifact's weight format.

    fp16 (or no quantization): `out x in` elements of `dtype_bytes`. int4/int8/fp8: the elements at
    4/8/8 bits (int4 two to a byte, rounded up) plus one `SCALE_BYTES` scale per output channel
    (optimum-rbln's `weight_scale [out, 1]`) and, for static int8/fp8 activations, one
    `SCALE_BYTES` input scale.
    """
    elements = out_features * in_features
    if quantization is None or not quantization.quantized_weights:
        return elements * dtype_bytes
    stored = -(-elements * quantization.weight_bits // 8)
    scales = out_features * SCALE_BYTES
    if quantization.static_input_scale:
        scales += SCALE_BYTES
    return stored + scales


def weight_bytes(spec: ModelSpec, tensor_parallel: int = 1,
                 quantization: Quantization | None = None) -> int:
    """Estimate of the model's weight bytes on one device, by the artifact's weight format.

    Counts the input embedding, the LM head when it is not tied, attention (q/k/v/o, biases when the
    model has them, Qwen3/Gemma3 q/k norms), the gated MLP (gate, up, down) and every RMSNorm.
    Attention heads and the MLP are split across `tensor_parallel` devices (KV projections are
    replicated with the KV heads); embeddings, LM head and norms are counted on every device.
    For the presets at `tensor_parallel=1` without quantization this is the exact parameter count
    times the dtype size (e.g. Llama-3.1-8B: 8,030,261,248 parameters).

    With `quantization` the seven projections are counted by `linear_weight_bytes` (int4 / int8 /
    fp8 elements plus their per-output-channel scales), fp8 KV caches add a scalar K and V scale
    per layer; embeddings, LM head, biases and norms stay in `spec.dtype` (optimum-rbln quantizes
    only the projections).
    """
    if tensor_parallel <= 0:
        raise ConfigError(f"tensor_parallel={tensor_parallel} must be a positive integer")
    if spec.num_heads % tensor_parallel:
        raise ConfigError(f"tensor_parallel={tensor_parallel} must divide "
                          f"num_heads={spec.num_heads}")
    item = spec.dtype_bytes
    hidden, head_dim = spec.hidden_size, spec.head_dim
    shapes = projection_shapes(spec, tensor_parallel)
    linears = sum(linear_weight_bytes(out, inp, quantization, item)
                  for out, inp in shapes.values())
    small = 0  # biases and norms, in the model dtype
    if spec.attention_bias:
        small += shapes["q_proj"][0] + shapes["k_proj"][0] + shapes["v_proj"][0]
    small += 4 * hidden if spec.family == "gemma3" else 2 * hidden  # Gemma3: pre/post attn and MLP
    if spec.family in ("qwen3", "gemma3"):
        small += 2 * head_dim  # q_norm, k_norm
    per_layer = linears + small * item
    if quantization is not None and quantization.kv_caches == "fp8":
        per_layer += 2 * SCALE_BYTES  # k_scale, v_scale

    embeddings = spec.vocab_size * hidden * (1 if spec.tie_word_embeddings else 2)
    return (embeddings + hidden) * item + spec.num_layers * per_layer  # + final norm


def lora_bytes_per_adapter(spec: ModelSpec, max_rank: int,
                           target_modules: tuple[str, ...] = LORA_TARGET_MODULES) -> int:
    """Device bytes one stacked adapter adds: `max_rank x (in + out)` per targeted projection per
    layer, in the model's weight dtype."""
    dims = module_shapes(spec)
    per_layer = sum(max_rank * (dims[m][0] + dims[m][1]) for m in target_modules)
    return spec.num_layers * per_layer * spec.dtype_bytes


def lora_bytes(spec: ModelSpec, lora: LoraPlan | None) -> int:
    """Device bytes of the adapters optimum-rbln 0.12 compiles into an artifact.

    Every targeted projection of every layer holds A `[count + 1, in, max_rank]` and B
    `[count + 1, max_rank, out]` in the weight dtype (the `+ 1` is the reserved base adapter 0).
    Counted whole on every device under tensor parallelism (conservative): 0 without adapters.
    """
    if lora is None or lora.count == 0:  # no adapter: the artifact is compiled without LoRA
        return 0
    return lora.stacked_adapters * lora_bytes_per_adapter(spec, lora.max_rank,
                                                          lora.target_modules)


def max_lora_adapters(artifact: ArtifactConfig, max_rank: int,
                      target_modules: tuple[str, ...] = LORA_TARGET_MODULES,
                      device_bytes: int = ATOM_DEVICE_BYTES,
                      observed_used_bytes: int | None = None,
                      observed_artifact: ArtifactConfig | None = None, *,
                      runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES) -> int:
    """How many user adapters of `max_rank` fit beside the artifact's lanes and KV.

    The largest `count` for which `fit(..., lora=LoraPlan(count, max_rank, target_modules))` fits
    (the reserved base adapter is part of every stack); -1 when the artifact does not fit even
    without adapters. The other arguments are `fit`'s.
    """
    LoraPlan(count=0, max_rank=max_rank, target_modules=target_modules)  # checks the inputs
    base = fit(artifact, device_bytes, observed_used_bytes, observed_artifact,
               runtime_overhead_bytes=runtime_overhead_bytes)
    if not base.fits:
        return -1
    per_adapter = lora_bytes_per_adapter(artifact.model, max_rank, target_modules)
    if per_adapter <= 0:
        raise ConfigError(f"max_lora_rank={max_rank} must be a positive integer")
    # count + 1 stacked adapters must fit in the headroom
    return max(base.headroom_bytes // per_adapter - 1, 0)


def _same_model(a: ModelSpec, b: ModelSpec) -> bool:
    return msgspec.structs.replace(a, name="") == msgspec.structs.replace(b, name="")


def fit(artifact: ArtifactConfig, device_bytes: int = ATOM_DEVICE_BYTES,
        observed_used_bytes: int | None = None, observed_artifact: ArtifactConfig | None = None,
        *, runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES,
        lora: LoraPlan | None = None) -> FitResult:
    """Project the artifact's device use and say whether it fits.

    Args:
        artifact: the artifact to place.
        device_bytes: capacity of one device (default: the ATOM in the origin issue).
        observed_used_bytes: device bytes measured while `observed_artifact` was serving. When
            given, the projection swaps that artifact's KV bytes for this one's and keeps every
            other allocation (a conditional estimate).
        observed_artifact: the artifact the measurement was taken on; defaults to `artifact`. It
            must be the same model with the same `tensor_parallel`.
        runtime_overhead_bytes: without an observation, the allowance added to weights + KV.
        lora: adapters compiled into the artifact (`lora_bytes`), added to the non-KV bytes; an
            observation is taken to have been made without adapters.

    Returns:
        A `FitResult`; `fits` is `projected_bytes <= device_bytes`.

    Raises:
        ConfigError: a negative figure, or an observation taken on a different model or split.
    """
    if device_bytes <= 0:
        raise ConfigError(f"device_bytes={device_bytes} must be positive")
    if runtime_overhead_bytes < 0:
        raise ConfigError(f"runtime_overhead_bytes={runtime_overhead_bytes} must be >= 0")
    groups = kv_groups(artifact)
    kv = sum(group.total_bytes for group in groups)
    weights = weight_bytes(artifact.model, artifact.tensor_parallel, artifact.quantization)
    adapters = lora_bytes(artifact.model, lora)
    adapters_basis = "" if lora is None else (
        f" + LoRA {adapters:,} ({lora.count} adapters + the base, rank {lora.max_rank}, "
        f"{','.join(lora.target_modules)})")
    common = dict(label=artifact.label, identity=artifact.identity, model=artifact.model.name,
                  tensor_parallel=artifact.tensor_parallel, kv_groups=groups, kv_bytes=kv,
                  weight_bytes=weights, device_bytes=device_bytes,
                  checkpoint_bytes=checkpoint_bytes(artifact), lora=lora, lora_bytes=adapters,
                  kv_alloc_bytes=kv_alloc_bytes(artifact))

    if observed_used_bytes is None:
        if observed_artifact is not None:
            raise ConfigError("observed_artifact was given without observed_used_bytes")
        other = weights + runtime_overhead_bytes + adapters
        projected = other + kv
        return FitResult(
            **common, other_bytes=other, projected_bytes=projected,  # type: ignore[arg-type]
            headroom_bytes=device_bytes - projected, fits=projected <= device_bytes,
            method="estimate", conditional=False,
            basis=(f"estimate: weights {weights:,} (from the spec, {_weight_format(artifact)}) + KV "
                   f"{kv:,} + runtime overhead {runtime_overhead_bytes:,} (stated allowance, "
                   f"not measured){adapters_basis}"),
            runtime_overhead_bytes=runtime_overhead_bytes)

    observed = observed_artifact or artifact
    if observed_used_bytes <= 0:
        raise ConfigError(f"observed_used_bytes={observed_used_bytes} must be positive")
    if not _same_model(observed.model, artifact.model):
        raise ConfigError(f"observed artifact model {observed.model.name} differs from "
                          f"{artifact.model.name}: an observation only transfers within one model")
    if observed.tensor_parallel != artifact.tensor_parallel:
        raise ConfigError(f"observed tensor_parallel={observed.tensor_parallel} differs from "
                          f"tensor_parallel={artifact.tensor_parallel}: weights per device differ")
    observed_kv = kv_cache_bytes(observed)
    other = observed_used_bytes - observed_kv
    if other < 0:
        raise ConfigError(f"observed_used_bytes={observed_used_bytes} is below the observed "
                          f"artifact's own KV bytes {observed_kv}")
    observed_weights = weight_bytes(observed.model, observed.tensor_parallel,
                                    observed.quantization)
    weights_basis = ""
    if observed_weights != weights:  # another weight format: swap the weights as well
        other += weights - observed_weights
        weights_basis = (f" - its weights {observed_weights:,} ({_weight_format(observed)}) + "
                         f"these weights {weights:,} ({_weight_format(artifact)})")
    other += adapters
    projected = other + kv
    return FitResult(
        **common, other_bytes=other, projected_bytes=projected,  # type: ignore[arg-type]
        headroom_bytes=device_bytes - projected, fits=projected <= device_bytes,
        method="observed", conditional=True,
        basis=(f"conditional estimate: observed {observed_used_bytes:,} in use at "
               f"{observed.label} - its KV {observed_kv:,} + this KV {kv:,}{weights_basis}"
               f"{adapters_basis}, if "
               "other allocations stay unchanged; not a compiler result"),
        observed_used_bytes=observed_used_bytes, observed_label=observed.label,
        observed_kv_bytes=observed_kv)


def _weight_format(artifact: ArtifactConfig) -> str:
    quant = artifact.quantization
    if quant is None or not quant.quantized_weights:
        return artifact.model.dtype
    return f"{quant.weights} weights, {artifact.model.dtype} embeddings and norms"


def describe(result: FitResult) -> str:
    """A few lines for a terminal: the KV tensors, the projection and the verdict."""
    lines = [f"{result.label}  identity {result.identity}"]
    for group in result.kv_groups:
        shape = ",".join(str(dim) for dim in group.shape)
        lines.append(f"  {group.count} {DTYPE_LABELS.get(group.dtype, group.dtype)} {group.kind} "
                     f"KV tensors of [{shape}] = {group.total_bytes:,} bytes")
    per_device = " per device" if result.tensor_parallel > 1 else ""
    lines.append(f"  KV total{per_device}: {result.kv_bytes:,} bytes")
    if result.kv_alloc_bytes != result.kv_bytes:
        lines.append(f"  KV as allocated (2 MiB-aligned tensors): {result.kv_alloc_bytes:,} bytes")
    lines.append(f"  weights (estimate){per_device}: {result.weight_bytes:,} bytes")
    if result.lora is not None:
        lines.append(f"  LoRA{per_device}: {result.lora_bytes:,} bytes ({result.lora.count} "
                     f"adapters + the base, rank {result.lora.max_rank})")
    lines.append(f"  projected{per_device}: {result.projected_bytes:,} of {result.device_bytes:,} "
                 f"bytes, headroom {result.headroom_bytes:,}")
    lines.append(f"  {result.basis}")
    if result.checkpoint_bytes:
        lines.append(f"  host (prefix cache): {result.checkpoint_bytes:,} bytes per sliding-slot "
                     "checkpoint, inside host_cache_bytes")
    verdict = "fits" if result.fits else "DOES NOT FIT"
    lines.append(f"  verdict: {verdict}" + (" (conditional)" if result.conditional else ""))
    return "\n".join(lines)
