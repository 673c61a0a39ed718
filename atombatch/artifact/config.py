"""Model specs and compiled-artifact shapes, with the admission rules of docs/rules.md.

An `ArtifactConfig` is one compiled model: its shape fields decide the device's tensors, so every
one of them goes into `identity`; two artifacts with different identities never share a compiled
graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import msgspec

from atombatch.artifact.kv_dtype import FLOAT8
from atombatch.errors import ConfigError
from atombatch.kernel.codes import check_buckets

Family = Literal["llama", "qwen3", "gemma3"]
FULL = "full_attention"
SLIDING = "sliding_attention"

# bytes per element of a weight, activation or KV dtype; float8_e4m3fn is a KV dtype only
# (optimum-rbln's `quantization.kv_caches="fp8"`, atombatch/artifact/kv_dtype.py)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
MODEL_DTYPES = ("bfloat16", "float16", "float32")

# optimum-rbln 0.12 `RBLNQuantizationConfig` (transformers/utils/rbln_quantization.py): the values
# of rbln_config.json's `quantization` block.
QUANT_WEIGHTS = ("int4", "int8", "fp8", "fp16")
QUANT_ACTIVATIONS = ("int8", "fp8", "fp16")
QUANT_KV_CACHES = ("fp8", "fp16")
#: Bits of one stored weight element by format (optimum-rbln's `nbits_per_param`; fp16 is 16).
WEIGHT_BITS = {"int4": 4, "int8": 8, "fp8": 8, "fp16": 16}
#: The KV cache dtype an artifact with `kv_caches: fp8` records on its past_key_values inputs.
FP8_KV_DTYPE = FLOAT8


class Quantization(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `quantization` block of an optimum-rbln 0.12 `rbln_config.json` (what the planner and
    the simulator count: weight bytes by `weights`, KV bytes by `kv_caches`).

    optimum-rbln replaces the q/k/v/o and gate/up/down projections by quantized linears whose
    weights are stored in `weights` format with one scale per output channel (`[out, 1]`), adds a
    one-element input scale per projection for static int8/fp8 activations, and a scalar K and V
    scale per attention layer for fp8 KV caches; embeddings, LM head and norms keep the model's
    dtype.
    """

    format: str = "rbln"          # the only format optimum-rbln 0.12 knows
    weights: str = "fp16"         # int4 | int8 | fp8 | fp16
    activations: str = "fp16"     # int8 | fp8 | fp16
    kv_caches: str = "fp16"       # fp8 | fp16
    dynamic: bool = False         # dynamic activation quantization (no stored input scale)

    def __post_init__(self) -> None:
        for field, allowed in (("format", ("rbln",)), ("weights", QUANT_WEIGHTS),
                               ("activations", QUANT_ACTIVATIONS),
                               ("kv_caches", QUANT_KV_CACHES)):
            value = getattr(self, field)
            if value not in allowed:
                raise ConfigError(f"quantization.{field}={value!r} is not one of "
                                  f"{', '.join(allowed)}")

    @property
    def weight_bits(self) -> int:
        """Bits of one stored projection weight."""
        return WEIGHT_BITS[self.weights]

    @property
    def quantized_weights(self) -> bool:
        return self.weights != "fp16"

    @property
    def static_input_scale(self) -> bool:
        """A stored one-element input scale per projection (static int8/fp8 activations)."""
        return self.activations != "fp16" and not self.dynamic

    @property
    def kv_dtype(self) -> str | None:
        """The KV dtype this block fixes (fp8 caches), or None (the artifact's own dtype)."""
        return FP8_KV_DTYPE if self.kv_caches == "fp8" else None

    @property
    def label(self) -> str:
        """e.g. `wint4`, `wfp8/afp8`, `kvfp8` (the parts that differ from fp16), '' for none."""
        parts = [f"w{self.weights}"] if self.weights != "fp16" else []
        if self.activations != "fp16":
            parts.append(f"a{self.activations}")
        return "/".join(parts)


class RopeScaling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Llama-3 style frequency scaling (`rope_type="llama3"`) or linear position scaling."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shapes and math constants of one decoder-only model."""

    name: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Gemma3: sliding layers use their own RoPE base; "layer_types" says which layer is which.
    rope_local_theta: float = 0.0            # sliding layers' RoPE base; 0 = rope_theta
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if value <= 0:
                raise ConfigError(f"{field}={value} must be positive")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even: RoPE rotates the two "
                              "halves of each head")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, "
                              f"num_layers={self.num_layers}")
        for kind in self.layer_types:
            if kind not in (FULL, SLIDING):
                raise ConfigError(f"layer type {kind!r} is neither {FULL!r} nor {SLIDING!r}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window={self.sliding_window} must be positive for a model "
                              "with sliding layers")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {sorted(MODEL_DTYPES)}")

    # -- derived --------------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.layer_types or (FULL,) * self.num_layers

    @property
    def sliding_rope_theta(self) -> float:
        """The RoPE base of sliding-window layers (Gemma3's local base; else `rope_theta`)."""
        return self.rope_local_theta or self.rope_theta

    @property
    def is_hybrid(self) -> bool:
        """True when the model has sliding-window layers (they use lane slots, not blocks)."""
        return SLIDING in self.layer_kinds

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == SLIDING)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shape_fields(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """One of the four origin models, from their public Hugging Face configs."""
        try:
            return PRESETS[name.lower()]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], name: str | None = None) -> ModelSpec:
        """Read a Hugging Face checkpoint directory's `config.json` (older and newer key styles)."""
        config_path = Path(path) / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{config_path} does not exist") from None
        return cls.from_hf_config(raw, name=name or Path(path).name)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], name: str = "model") -> ModelSpec:
        """Build a spec from a parsed Hugging Face `config.json` dictionary."""
        if "text_config" in raw:  # Gemma3 multimodal wrapper: the decoder is the text model
            raw = {**raw["text_config"], "tie_word_embeddings": raw.get(
                "tie_word_embeddings", raw["text_config"].get("tie_word_embeddings", True))}
        model_type = str(raw.get("model_type", ""))
        if model_type.startswith("gemma3"):
            family: Family = "gemma3"
        elif model_type.startswith("qwen3"):
            family = "qwen3"
        elif model_type in ("llama", "mistral"):
            family = "llama"
        else:
            raise ConfigError(f"model_type={model_type!r} is not a supported family "
                              "(llama, qwen3, gemma3)")
        if family == "gemma3":  # multimodal text_configs omit every key left at its default
            raw = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        num_layers = int(raw["num_hidden_layers"])
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)

        # RoPE: older configs use rope_theta/rope_scaling/rope_local_base_freq, newer ones
        # rope_parameters (either flat, or keyed by layer type for Gemma3).
        rope_theta = float(raw.get("rope_theta", 10000.0))
        rope_local = float(raw.get("rope_local_base_freq", 10000.0))
        scaling_raw = raw.get("rope_scaling")
        params = raw.get("rope_parameters")
        if isinstance(params, dict):
            if FULL in params or SLIDING in params:
                full = params.get(FULL) or {}
                local = params.get(SLIDING) or {}
                rope_theta = float(full.get("rope_theta", rope_theta))
                rope_local = float(local.get("rope_theta", rope_local))
                scaling_raw = full
            else:
                rope_theta = float(params.get("rope_theta", rope_theta))
                scaling_raw = params
        rope_scaling = _rope_scaling(scaling_raw)
        if family != "gemma3":
            rope_local = 0.0  # only Gemma3 gives its sliding layers a RoPE base of their own

        layer_types: tuple[str, ...] = ()
        sliding_window = int(raw.get("sliding_window") or 0)
        if family == "gemma3":
            if raw.get("layer_types"):
                layer_types = tuple(raw["layer_types"])
            else:
                pattern = int(raw.get("sliding_window_pattern", 6))
                layer_types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING
                                    for i in range(num_layers))
        elif raw.get("layer_types"):
            layer_types = tuple(raw["layer_types"])
            if SLIDING not in layer_types:
                layer_types = ()
        if SLIDING not in layer_types:
            if sliding_window and family != "gemma3" and raw.get("use_sliding_window", True):
                raise ConfigError(f"sliding_window={sliding_window} without layer_types "
                                  f"({model_type}): every layer would use it, which this runtime "
                                  "does not model; serve it with the window disabled or "
                                  "give layer_types")
            sliding_window = 0

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        tie_default = family == "gemma3"  # transformers: Llama and Qwen3 untied, Gemma3 tied
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        return cls(
            name=name,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_local_theta=rope_local,
            sliding_window=sliding_window,
            layer_types=layer_types,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0.0),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", tie_default)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype if dtype in MODEL_DTYPES else "bfloat16",
        )


# transformers' Gemma3TextConfig defaults: Gemma3 multimodal configs (e.g. gemma-3-4b-it) give
# only the text_config keys that differ from them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 131_072,
}


def _rope_scaling(raw: Any) -> RopeScaling | None:
    if not isinstance(raw, dict):
        return None
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(raw.get("factor", 8.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(raw.get("factor", 1.0)))
    raise ConfigError(f"rope_type={rope_type!r} is not supported (default, linear, llama3)")


def _gemma3_layers(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


PRESETS: dict[str, ModelSpec] = {
    "qwen3-0.6b": ModelSpec(
        name="qwen3-0.6b", family="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,)),
    "qwen3-4b": ModelSpec(
        name="qwen3-4b", family="qwen3", vocab_size=151936, hidden_size=2560,
        intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,)),
    # KONI-Llama3.1-8B: a Llama-3.1-8B continued-pretraining model, same shapes and RoPE scaling.
    "koni-8b": ModelSpec(
        name="koni-8b", family="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500_000.0, rope_scaling=RopeScaling(),
        tie_word_embeddings=False, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128009)),
    "gemma3-1b": ModelSpec(
        name="gemma3-1b", family="gemma3", vocab_size=262144, hidden_size=1152,
        intermediate_size=6912, num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
        sliding_window=512, layer_types=_gemma3_layers(26), query_pre_attn_scalar=256.0,
        tie_word_embeddings=True, max_position_embeddings=32768, bos_token_id=2,
        eos_token_ids=(1, 106)),
}


class ArtifactConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One compiled artifact: decode batch B, context, KV block size and block count, chunk size.

    Construction checks the shape rules of docs/rules.md and raises `ConfigError` naming the rule.
    The cache options (prefix, host) are checked against the artifact by
    `atombatch.artifact.plan.check_serving`.
    """

    model: ModelSpec
    batch_size: int
    max_seq_len: int
    block_size: int
    num_blocks: int
    prefill_chunk_size: int = 128
    tensor_parallel: int = 1
    kv_dtype: str = "bfloat16"
    # Compiled decode batch sizes ("buckets", optimum-rbln's `decoder_batch_sizes`): each decode
    # step runs the smallest one that holds the decoding lanes. Empty means `(batch_size,)`.
    decoder_batch_sizes: tuple[int, ...] = ()
    # optimum-rbln's `quantization` block (weights, activations, KV caches); None: not quantized.
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        quant = self.quantization
        if quant is not None and (quant.kv_caches == "fp8") != (self.kv_dtype == FP8_KV_DTYPE):
            raise ConfigError(f"kv_dtype={self.kv_dtype!r} contradicts quantization.kv_caches="
                              f"{quant.kv_caches!r}: fp8 KV caches are {FP8_KV_DTYPE}")
        for field in ("batch_size", "max_seq_len", "block_size", "num_blocks",
                      "prefill_chunk_size", "tensor_parallel"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{field}={value!r} must be a positive integer")
        sizes = check_buckets(self.batch_size, self.decoder_batch_sizes or None)
        msgspec.structs.force_setattr(self, "decoder_batch_sizes", sizes)
        if self.kv_dtype not in DTYPE_BYTES:
            raise ConfigError(f"kv_dtype={self.kv_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.max_seq_len % self.block_size:
            raise ConfigError(f"max_seq_len={self.max_seq_len} must be a multiple of "
                              f"block_size={self.block_size}")
        if self.max_seq_len % self.prefill_chunk_size:
            raise ConfigError(f"max_seq_len={self.max_seq_len} must be a multiple of "
                              f"prefill_chunk_size={self.prefill_chunk_size}")
        if self.model.num_heads % self.tensor_parallel:
            raise ConfigError(f"tensor_parallel={self.tensor_parallel} must divide "
                              f"num_heads={self.model.num_heads}")
        kv_heads, tp = self.model.num_kv_heads, self.tensor_parallel
        if kv_heads % tp and tp % kv_heads:
            # KV heads are split across devices, or each replicated on tp // kv_heads devices.
            raise ConfigError(f"tensor_parallel={tp} must divide num_kv_heads={kv_heads} "
                              "or be a multiple of it")
        if self.batch_size > 32767 or self.num_blocks > 32767:
            raise ConfigError(f"batch_size={self.batch_size} and num_blocks={self.num_blocks} "
                              "must fit the device's int16 tables (<= 32767)")
        if self.prefill_chunk_size > 32768:
            raise ConfigError(f"prefill_chunk_size={self.prefill_chunk_size} must be <= 32768: "
                              "query_position is an int16 index into the chunk")
        bps = self.blocks_per_seq
        general = self.batch_size * bps + 1
        if self.num_blocks >= general:
            return
        if self.num_blocks == bps and self.batch_size == 1:
            if self.model.is_hybrid:
                raise ConfigError(
                    f"num_blocks={self.num_blocks} is single-block mode, which a hybrid model "
                    f"({self.model.name}) may not use: its sliding slot cannot rotate; "
                    f"use num_blocks >= {general} (lanes + 1; docs/rules.md)")
            return
        if self.block_size < self.max_seq_len and self.num_blocks >= bps + 1:
            return  # partitioned and oversubscribed: blocks are allocated as sequences grow
        raise ConfigError(
            f"num_blocks={self.num_blocks} breaks the lanes+1 rule: batch_size={self.batch_size} "
            f"x {bps} blocks per sequence + 1 spare = {general} (single-block mode needs "
            f"batch_size=1 and num_blocks={bps}; partitioned oversubscription needs "
            f"block_size < max_seq_len and num_blocks >= {bps + 1}; docs/rules.md)")

    # -- derived --------------------------------------------------------------------------------
    @property
    def blocks_per_seq(self) -> int:
        """Entries of a block-table row: `max_seq_len // block_size`."""
        return self.max_seq_len // self.block_size

    @property
    def single_block(self) -> bool:
        """The origin PR's mode: one lane, no spare; block 0 goes to the lane and comes back."""
        return self.num_blocks < self.batch_size * self.blocks_per_seq + 1 and \
            self.num_blocks == self.blocks_per_seq and self.batch_size == 1

    @property
    def oversubscribed(self) -> bool:
        """Fewer blocks than every lane at full length plus a spare (partitioned layouts only)."""
        return self.num_blocks < self.batch_size * self.blocks_per_seq + 1 and not self.single_block

    @property
    def partitioned(self) -> bool:
        return self.block_size < self.max_seq_len

    @property
    def bucketed(self) -> bool:
        """More than one compiled decode batch size."""
        return len(self.decoder_batch_sizes) > 1

    @property
    def label(self) -> str:
        """Short human label, e.g. `koni-8b B4/ctx9216/k5`, `... B4/ctx9216/k5/dbs1,2,4`."""
        tp = f"/tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        bs = f"/bs{self.block_size}" if self.partitioned else ""
        dbs = "/dbs" + ",".join(map(str, self.decoder_batch_sizes)) if self.bucketed else ""
        quant = f"/{self.quantization.label}" if self.quantization and \
            self.quantization.label else ""
        kv = "/kvfp8" if self.kv_dtype == FP8_KV_DTYPE else ""
        return (f"{self.model.name} B{self.batch_size}/ctx{self.max_seq_len}{bs}"
                f"/k{self.num_blocks}{tp}{dbs}{quant}{kv}")

    @property
    def identity(self) -> str:
        """Stable hex digest of every shape-affecting field (model shapes included)."""
        fields = msgspec.to_builtins(self)
        # A renamed checkpoint with the same shapes compiles the same graph.
        fields["model"].pop("name", None)
        fields["model"].pop("bos_token_id", None)
        fields["model"].pop("eos_token_ids", None)
        if not self.bucketed:  # identities of artifacts compiled before buckets stay as they were
            fields.pop("decoder_batch_sizes")
        if self.quantization is None:  # likewise for artifacts without quantization
            fields.pop("quantization")
        blob = msgspec.json.encode(fields, order="sorted")
        return hashlib.sha256(blob).hexdigest()[:16]

    def compiled_cache_dir(self, root: str | os.PathLike[str]) -> Path:
        """A folder under `root` named for this artifact, distinct for every identity: e.g. where
        to `save_pretrained` its optimum-rbln compile, so a B4 server never opens a B1 directory."""
        tp = f"-tp{self.tensor_parallel}"
        name = (f"{self.model.name}-b{self.batch_size}-ctx{self.max_seq_len}-bs{self.block_size}"
                f"-k{self.num_blocks}{tp}-{self.identity}")
        return Path(root) / name
