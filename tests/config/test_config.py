"""Every configuration rule of DESIGN §3, accepted and rejected, plus presets and identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from atombatch.artifact.config import (
    FULL,
    SLIDING,
    ArtifactConfig,
    ModelSpec,
    RopeScaling,
)
from atombatch.artifact.plan import check_serving
from atombatch.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CTX = 9216


def koni() -> ModelSpec:
    return ModelSpec.preset("koni-8b")


def gemma() -> ModelSpec:
    return ModelSpec.preset("gemma3-1b")


def eager(model: ModelSpec, batch_size: int, num_blocks: int, **kw: object) -> ArtifactConfig:
    return ArtifactConfig(model=model, batch_size=batch_size, max_seq_len=CTX, block_size=CTX,
                          num_blocks=num_blocks, **kw)  # type: ignore[arg-type]


# -- single lane, caches off (the origin PR) ---------------------------------------------------

def test_b1_k1_eager_non_hybrid_is_single_block_mode() -> None:
    art = eager(koni(), 1, 1)
    assert art.single_block
    assert not art.oversubscribed
    assert art.blocks_per_seq == 1


def test_b1_k1_accepted_by_check_serving_with_caches_off() -> None:
    # Native and PD serving both build the Batcher with caches off.
    check_serving(eager(koni(), 1, 1), prefix_cache=False, host_cache_bytes=0)
    check_serving(eager(koni(), 1, 1))


def test_b1_k1_with_prefix_cache_rejected() -> None:
    with pytest.raises(ConfigError, match=r"single-block mode \(num_blocks=1\) runs with caches"):
        check_serving(eager(koni(), 1, 1), prefix_cache=True)


def test_b1_k1_with_host_cache_rejected() -> None:
    with pytest.raises(ConfigError, match=r"single-block mode \(num_blocks=1\) runs with caches"):
        check_serving(eager(koni(), 1, 1), prefix_cache=True, host_cache_bytes=1 << 30)


def test_host_cache_needs_prefix_cache() -> None:
    with pytest.raises(ConfigError, match=r"host_cache_bytes=1024 needs prefix_cache=True"):
        check_serving(eager(koni(), 4, 5), host_cache_bytes=1024)


def test_negative_host_cache_rejected() -> None:
    with pytest.raises(ConfigError, match=r"host_cache_bytes=-1 must be >= 0"):
        check_serving(eager(koni(), 4, 5), host_cache_bytes=-1)


def test_caches_accepted_on_lanes_plus_one_non_hybrid() -> None:
    check_serving(eager(koni(), 4, 5), prefix_cache=True, host_cache_bytes=1 << 30)


def test_hybrid_single_block_rejected() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks=1 is single-block mode, which a hybrid "
                                          r"model \(gemma3-1b\) may not use.*num_blocks >= 2"):
        eager(gemma(), 1, 1)


# -- lanes + 1 --------------------------------------------------------------------------------

@pytest.mark.parametrize(("batch_size", "num_blocks", "needed"), [(2, 2, 3), (4, 4, 5), (2, 1, 3)])
def test_eager_below_lanes_plus_one_rejected(batch_size: int, num_blocks: int, needed: int) -> None:
    with pytest.raises(ConfigError, match=rf"num_blocks={num_blocks} breaks the lanes\+1 rule: "
                                          rf"batch_size={batch_size} x 1 blocks per sequence "
                                          rf"\+ 1 spare = {needed}"):
        eager(koni(), batch_size, num_blocks)


@pytest.mark.parametrize(("batch_size", "num_blocks"), [(4, 5), (1, 2), (1, 3), (1, 5), (4, 9)])
@pytest.mark.parametrize("model", ["koni-8b", "gemma3-1b"])
def test_lanes_plus_one_accepted(model: str, batch_size: int, num_blocks: int) -> None:
    art = eager(ModelSpec.preset(model), batch_size, num_blocks)
    assert not art.single_block
    assert not art.oversubscribed


def test_hybrid_prefix_cache_needs_room_for_a_checkpoint() -> None:
    # one checkpoint: 22 sliding layers x K,V x 1 kv head x 512 x 256 x bf16
    need = 22 * 2 * 512 * 256 * 2
    for host in (0, need - 1):
        with pytest.raises(ConfigError, match=rf"host_cache_bytes={host}: the prefix cache of "
                                              rf"hybrid model gemma3-1b .* \({need} bytes"):
            check_serving(eager(gemma(), 4, 5), prefix_cache=True, host_cache_bytes=host)
    check_serving(eager(gemma(), 4, 5), prefix_cache=True, host_cache_bytes=need)


def test_hybrid_caches_off_accepted() -> None:
    check_serving(eager(gemma(), 4, 5))


# -- partitioned oversubscription ---------------------------------------------------------------

def partitioned(batch_size: int, num_blocks: int, model: ModelSpec | None = None) -> ArtifactConfig:
    return ArtifactConfig(model=model or koni(), batch_size=batch_size, max_seq_len=CTX,
                          block_size=1024, num_blocks=num_blocks)


@pytest.mark.parametrize("num_blocks", [10, 20, 36])
def test_partitioned_oversubscription_accepted_from_bps_plus_one(num_blocks: int) -> None:
    art = partitioned(4, num_blocks)  # bps = 9, general rule 4 * 9 + 1 = 37
    assert art.partitioned
    assert art.oversubscribed
    assert not art.single_block


def test_partitioned_at_general_rule_not_oversubscribed() -> None:
    art = partitioned(4, 37)
    assert not art.oversubscribed


def test_partitioned_oversubscription_accepted_for_hybrid() -> None:
    assert partitioned(4, 10, gemma()).oversubscribed


@pytest.mark.parametrize("num_blocks", [9, 5, 1])
def test_partitioned_below_bps_plus_one_rejected(num_blocks: int) -> None:
    with pytest.raises(ConfigError, match=rf"num_blocks={num_blocks} breaks the lanes\+1 rule: "
                                          r"batch_size=4 x 9 blocks per sequence \+ 1 spare = 37.*"
                                          r"num_blocks >= 10"):
        partitioned(4, num_blocks)


def test_partitioned_single_lane_full_sequence_is_single_block_mode() -> None:
    art = partitioned(1, 9)
    assert art.single_block
    with pytest.raises(ConfigError, match=r"single-block mode \(num_blocks=9\)"):
        check_serving(art, prefix_cache=True)


def test_partitioned_single_lane_below_one_sequence_rejected() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks=8 breaks the lanes\+1 rule"):
        partitioned(1, 8)


# -- shape rules --------------------------------------------------------------------------------

def test_max_seq_len_not_multiple_of_block_size_rejected() -> None:
    with pytest.raises(ConfigError,
                       match=r"max_seq_len=9216 must be a multiple of block_size=1000"):
        ArtifactConfig(model=koni(), batch_size=1, max_seq_len=CTX, block_size=1000, num_blocks=20)


def test_max_seq_len_not_multiple_of_prefill_chunk_rejected() -> None:
    with pytest.raises(ConfigError, match=r"max_seq_len=9216 must be a multiple of "
                                          r"prefill_chunk_size=100"):
        eager(koni(), 1, 1, prefill_chunk_size=100)


@pytest.mark.parametrize("field", ["batch_size", "max_seq_len", "block_size", "num_blocks",
                                   "prefill_chunk_size", "tensor_parallel"])
def test_non_positive_shape_rejected(field: str) -> None:
    kw: dict[str, object] = dict(model=koni(), batch_size=1, max_seq_len=CTX, block_size=CTX,
                                 num_blocks=1)
    kw[field] = 0
    with pytest.raises(ConfigError, match=rf"{field}=0 must be a positive integer"):
        ArtifactConfig(**kw)  # type: ignore[arg-type]


def test_kv_dtype_rejected() -> None:
    with pytest.raises(ConfigError, match=r"kv_dtype='int4' is not one of"):
        eager(koni(), 1, 1, kv_dtype="int4")


def test_tensor_parallel_must_divide_heads() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 must divide num_heads=32"):
        eager(koni(), 1, 1, tensor_parallel=3)


def test_tensor_parallel_must_split_or_replicate_kv_heads() -> None:
    spec = msgspec.structs.replace(koni(), num_heads=12, num_kv_heads=6, head_dim=128)
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 must divide num_kv_heads=6 or be a "
                                          r"multiple of it"):
        eager(spec, 1, 1, tensor_parallel=4)


def test_tensor_parallel_above_kv_heads_accepted() -> None:
    eager(gemma(), 1, 2, tensor_parallel=2)  # one KV head, replicated on both devices
    eager(koni(), 1, 1, tensor_parallel=16)  # eight KV heads, each on two devices


def test_int16_tables_limit() -> None:
    with pytest.raises(ConfigError, match=r"must fit the device's int16 tables"):
        eager(koni(), 1, 40000)


# -- model spec rules ---------------------------------------------------------------------------

def test_heads_multiple_of_kv_heads() -> None:
    with pytest.raises(ConfigError, match=r"num_heads=32 must be a multiple of num_kv_heads=5"):
        msgspec.structs.replace(koni(), num_kv_heads=5)


def test_non_positive_model_field_rejected() -> None:
    with pytest.raises(ConfigError, match=r"hidden_size=0 must be positive"):
        msgspec.structs.replace(koni(), hidden_size=0)


def test_layer_types_length_and_values() -> None:
    with pytest.raises(ConfigError, match=r"layer_types has 3 entries, num_layers=26"):
        msgspec.structs.replace(gemma(), layer_types=(FULL,) * 3)
    with pytest.raises(ConfigError, match=r"layer type 'chunked' is neither"):
        msgspec.structs.replace(gemma(), layer_types=("chunked",) * 26)


def test_sliding_layers_need_a_window() -> None:
    with pytest.raises(ConfigError, match=r"sliding_window=0 must be positive"):
        msgspec.structs.replace(gemma(), sliding_window=0)


def test_model_dtype_rejected() -> None:
    with pytest.raises(ConfigError, match=r"dtype='int8' is not one of"):
        msgspec.structs.replace(koni(), dtype="int8")


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'llama-70b'"):
        ModelSpec.preset("llama-70b")


def test_preset_lookup_ignores_case() -> None:
    assert ModelSpec.preset("KONI-8B") == koni()


# -- identity -----------------------------------------------------------------------------------

IDENTITY_SNIPPET = """
from atombatch.artifact.config import ArtifactConfig, ModelSpec
for name, b, k, tp in [("koni-8b", 1, 1, 1), ("koni-8b", 4, 5, 1), ("gemma3-1b", 4, 5, 2)]:
    art = ArtifactConfig(model=ModelSpec.preset(name), batch_size=b, max_seq_len=9216,
                         block_size=9216, num_blocks=k, tensor_parallel=tp)
    print(art.identity)
"""


def test_identity_stable_across_processes() -> None:
    env = dict(os.environ, PYTHONHASHSEED="12345",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", IDENTITY_SNIPPET], env=env, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    here = [eager(koni(), 1, 1).identity, eager(koni(), 4, 5).identity,
            eager(gemma(), 4, 5, tensor_parallel=2).identity]
    assert out == here
    assert all(len(identity) == 16 and int(identity, 16) >= 0 for identity in here)


def test_identity_differs_per_shape_field() -> None:
    base = eager(koni(), 1, 5)
    variants = {
        "B4": eager(koni(), 4, 5),
        "k1": eager(koni(), 1, 1),
        "tp2": eager(koni(), 1, 5, tensor_parallel=2),
        "model": eager(ModelSpec.preset("qwen3-4b"), 1, 5),
        "block": ArtifactConfig(model=koni(), batch_size=1, max_seq_len=CTX, block_size=1024,
                                num_blocks=10),
        "chunk": eager(koni(), 1, 5, prefill_chunk_size=256),
        "kv_dtype": eager(koni(), 1, 5, kv_dtype="float32"),
    }
    identities = {base.identity} | {art.identity for art in variants.values()}
    assert len(identities) == len(variants) + 1


def test_identity_ignores_model_name_and_token_ids() -> None:
    renamed = msgspec.structs.replace(koni(), name="KONI-Llama3.1-8B-Instruct",
                                      bos_token_id=1, eos_token_ids=(2,))
    assert eager(renamed, 4, 5).identity == eager(koni(), 4, 5).identity


def test_identity_changes_with_model_math() -> None:
    other = msgspec.structs.replace(koni(), rope_theta=10000.0)
    assert eager(other, 4, 5).identity != eager(koni(), 4, 5).identity


def test_compiled_cache_dir_distinct_per_identity(tmp_path: Path) -> None:
    arts = [eager(koni(), 1, 1), eager(koni(), 1, 5), eager(koni(), 4, 5),
            eager(koni(), 4, 5, tensor_parallel=2), eager(gemma(), 4, 5),
            eager(ModelSpec.preset("qwen3-0.6b"), 4, 5)]
    dirs = [art.compiled_cache_dir(tmp_path) for art in arts]
    assert len(set(dirs)) == len(arts)
    for art, path in zip(arts, dirs, strict=True):
        assert path.parent == tmp_path
        assert path.name.endswith(art.identity)
    assert dirs[2].name == f"koni-8b-b4-ctx9216-bs9216-k5-tp1-{arts[2].identity}"
    # Same shapes, same directory: a B1 graph is never reused for B4 and vice versa.
    assert eager(koni(), 4, 5).compiled_cache_dir(tmp_path) == dirs[2]


def test_label() -> None:
    assert eager(koni(), 4, 5).label == "koni-8b B4/ctx9216/k5"
    assert eager(koni(), 4, 5, tensor_parallel=2).label == "koni-8b B4/ctx9216/k5/tp2"
    assert partitioned(4, 10).label == "koni-8b B4/ctx9216/bs1024/k10"


# -- presets (public Hugging Face configs) ------------------------------------------------------

PRESET_SHAPES = {
    # name: (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied, rope_theta)
    "qwen3-0.6b": (151936, 1024, 3072, 28, 16, 8, 128, True, 1_000_000.0),
    "qwen3-4b": (151936, 2560, 9728, 36, 32, 8, 128, True, 1_000_000.0),
    "koni-8b": (128256, 4096, 14336, 32, 32, 8, 128, False, 500_000.0),
    "gemma3-1b": (262144, 1152, 6912, 26, 4, 1, 256, True, 1_000_000.0),
}


@pytest.mark.parametrize("name", sorted(PRESET_SHAPES))
def test_preset_shapes(name: str) -> None:
    spec = ModelSpec.preset(name)
    got = (spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers,
           spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.tie_word_embeddings,
           spec.rope_theta)
    assert got == PRESET_SHAPES[name]
    assert spec.dtype == "bfloat16"
    assert spec.name == name


def test_koni_preset_is_llama31_8b() -> None:
    spec = koni()
    assert spec.family == "llama"
    assert spec.rms_norm_eps == 1e-5
    assert spec.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=8192)
    assert not spec.is_hybrid
    assert spec.global_layers == tuple(range(32))


def test_gemma3_preset_layers() -> None:
    spec = gemma()
    assert spec.is_hybrid
    assert spec.sliding_window == 512
    assert spec.global_layers == (5, 11, 17, 23)
    assert len(spec.sliding_layers) == 22
    assert spec.rope_local_theta == 10_000.0
    assert spec.query_pre_attn_scalar == 256.0
    assert spec.attn_logit_softcapping is None
    assert spec.final_logit_softcapping is None


def test_qwen3_presets_not_hybrid() -> None:
    for name in ("qwen3-0.6b", "qwen3-4b"):
        spec = ModelSpec.preset(name)
        assert spec.family == "qwen3"
        assert not spec.is_hybrid
        assert spec.rope_scaling is None
        assert spec.max_position_embeddings == 40960


# -- Hugging Face configs: older and newer keys -------------------------------------------------

LLAMA_BASE = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 131072,
    "bos_token_id": 128000, "eos_token_id": [128001, 128009], "hidden_act": "silu",
}
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}
QWEN3_BASE = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 40960,
    "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False,
}
GEMMA3_BASE = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6, "sliding_window": 512,
    "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "max_position_embeddings": 32768, "bos_token_id": 2,
    "eos_token_id": [1, 106], "hidden_activation": "gelu_pytorch_tanh",
}

OLDER_AND_NEWER = {
    "koni-8b": (
        {**LLAMA_BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING,
         "torch_dtype": "bfloat16"},
        {**LLAMA_BASE, "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0},
         "dtype": "bfloat16"},
    ),
    "qwen3-0.6b": (
        {**QWEN3_BASE, "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": None,
         "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16"},
        {**QWEN3_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
         "layer_types": [FULL] * 28, "sliding_window": None, "dtype": "bfloat16"},
    ),
    "gemma3-1b": (
        {**GEMMA3_BASE, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
         "rope_scaling": None, "sliding_window_pattern": 6, "torch_dtype": "bfloat16"},
        {**GEMMA3_BASE, "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)],
         "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1000000.0},
                             SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
         "dtype": "bfloat16"},
    ),
}


@pytest.mark.parametrize("name", sorted(OLDER_AND_NEWER))
def test_from_hf_config_older_and_newer_keys_agree(name: str) -> None:
    older, newer = OLDER_AND_NEWER[name]
    spec_old = ModelSpec.from_hf_config(older, name=name)
    spec_new = ModelSpec.from_hf_config(newer, name=name)
    assert spec_old == spec_new
    assert spec_old == ModelSpec.preset(name)


def test_from_hf_config_gemma3_multimodal_wrapper() -> None:
    older = OLDER_AND_NEWER["gemma3-1b"][0]
    wrapped = {"model_type": "gemma3", "text_config": older, "tie_word_embeddings": True}
    assert ModelSpec.from_hf_config(wrapped, name="gemma3-1b") == gemma()


def test_from_hf_config_linear_rope_scaling() -> None:
    older = {**OLDER_AND_NEWER["gemma3-1b"][0], "rope_scaling": {"rope_type": "linear",
                                                                 "factor": 8.0}}
    newer = {**OLDER_AND_NEWER["gemma3-1b"][1]}
    newer["rope_parameters"] = {**newer["rope_parameters"],
                                FULL: {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1000000.0}}
    a = ModelSpec.from_hf_config(older)
    assert a == ModelSpec.from_hf_config(newer)
    assert a.rope_scaling is not None and a.rope_scaling.rope_type == "linear"
    assert a.rope_scaling.factor == 8.0


def test_from_hf_config_unsupported_family() -> None:
    with pytest.raises(ConfigError, match=r"model_type='gpt2' is not a supported family"):
        ModelSpec.from_hf_config({"model_type": "gpt2"})


def test_from_hf_config_unsupported_rope_type() -> None:
    raw = {**LLAMA_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match=r"rope_type='yarn' is not supported"):
        ModelSpec.from_hf_config(raw)


def test_from_pretrained_reads_config_json(tmp_path: Path) -> None:
    (tmp_path / "koni").mkdir()
    (tmp_path / "koni" / "config.json").write_text(json.dumps(OLDER_AND_NEWER["koni-8b"][0]))
    spec = ModelSpec.from_pretrained(tmp_path / "koni")
    assert spec.name == "koni"
    assert msgspec.structs.replace(spec, name="koni-8b") == koni()


def test_from_pretrained_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config.json does not exist"):
        ModelSpec.from_pretrained(tmp_path)


def test_prefill_chunk_must_fit_the_int16_query_position():
    spec = ModelSpec.preset("qwen3-0.6b")
    ArtifactConfig(model=spec, batch_size=1, max_seq_len=32768, block_size=32768, num_blocks=2,
                   prefill_chunk_size=32768)
    with pytest.raises(ConfigError, match="prefill_chunk_size=65536 must be <= 32768"):
        ArtifactConfig(model=spec, batch_size=1, max_seq_len=65536, block_size=65536,
                       num_blocks=2, prefill_chunk_size=65536)


def test_odd_head_dim_and_model_wide_sliding_window_are_rejected():
    with pytest.raises(ConfigError, match="head_dim=7 must be even"):
        ModelSpec(name="x", family="llama", vocab_size=8, hidden_size=14, intermediate_size=8,
                  num_layers=1, num_heads=2, num_kv_heads=2, head_dim=7)
    mistral = {"model_type": "mistral", "vocab_size": 32, "hidden_size": 16,
               "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "sliding_window": 4096}
    with pytest.raises(ConfigError, match="sliding_window=4096 without layer_types"):
        ModelSpec.from_hf_config(mistral)
    assert ModelSpec.from_hf_config({**mistral, "sliding_window": None}).sliding_window == 0
