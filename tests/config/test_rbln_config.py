"""Reading optimum-rbln compiled directories: the input table field by field, derived shapes, and
a ConfigError naming the field for every missing, contradicting or unsupported option."""

from __future__ import annotations

import json

import msgspec
import pytest
from fakerebel.compiler import compile_dir
from support.hf_models import save_checkpoint

from atombatch import ConfigError, ModelSpec
from atombatch.artifact.rbln_config import GraphInput, derive_inputs, load, load_artifact


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: save_checkpoint(family, tmp_path_factory.mktemp(family))
            for family in ("llama", "gemma3")}


def rows(graph):
    return [(i.name, list(i.shape), i.dtype) for i in graph]


# -- the input table (docs/device.md), one case per row ------------------------------------------------
BASE = dict(max_seq_len=256, block_size=64, global_attention=True, local_attention=False,
            logits_to_keep=1, use_attention_mask=False, use_position_ids=False, dtype="float32")


def test_prefill_default_causal_lm_inputs():
    got = derive_inputs(batch=1, query_length=128, **BASE)
    assert rows(got) == [("input_ids", [1, 128], "int64"), ("cache_position", [1, 128], "int32"),
                         ("block_tables", [4], "int16"), ("query_position", [], "int16")]


def test_decode_default_inputs_have_no_query_position():
    got = derive_inputs(batch=4, query_length=1, **BASE)
    assert rows(got) == [("input_ids", [4, 1], "int64"), ("cache_position", [4, 1], "int32"),
                         ("block_tables", [4, 4], "int16")]


def test_logits_to_keep_zero_drops_query_position_without_local_attention():
    got = derive_inputs(batch=1, query_length=64, **{**BASE, "logits_to_keep": 0})
    assert [i.name for i in got] == ["input_ids", "cache_position", "block_tables"]


def test_local_attention_keeps_query_position_even_with_logits_to_keep_zero():
    cfg = {**BASE, "logits_to_keep": 0, "local_attention": True}
    prefill = derive_inputs(batch=1, query_length=64, **cfg)
    decode = derive_inputs(batch=2, query_length=1, **cfg)
    assert rows(prefill)[3:] == [("local_block_tables", [1], "int16"),
                                 ("query_position", [], "int16")]
    assert rows(decode)[3:] == [("local_block_tables", [2, 1], "int16")]


def test_mask_with_position_ids_is_2d_then_position_ids():
    cfg = {**BASE, "use_attention_mask": True, "use_position_ids": True, "dtype": "bfloat16"}
    prefill = derive_inputs(batch=1, query_length=64, **cfg)
    decode = derive_inputs(batch=4, query_length=1, **cfg)
    assert rows(prefill)[-2:] == [("attention_mask", [1, 256], "bfloat16"),
                                  ("position_ids", [1, 64], "int32")]
    assert rows(decode)[-2:] == [("attention_mask", [4, 256], "bfloat16"),
                                 ("position_ids", [4, 1], "int32")]


def test_mask_without_position_ids_is_the_4d_chunk_mask():
    cfg = {**BASE, "use_attention_mask": True}
    prefill = derive_inputs(batch=1, query_length=64, **cfg)
    decode = derive_inputs(batch=2, query_length=1, **cfg)
    assert rows(prefill)[-1] == ("attention_mask", [1, 1, 64, 256], "float32")
    assert rows(decode)[-1] == ("attention_mask", [2, 1, 1, 256], "float32")


def test_gemma3_order_tables_query_position_mask_position_ids():
    cfg = {**BASE, "local_attention": True, "use_attention_mask": True, "use_position_ids": True}
    assert [i.name for i in derive_inputs(batch=1, query_length=64, **cfg)] == [
        "input_ids", "cache_position", "block_tables", "local_block_tables", "query_position",
        "attention_mask", "position_ids"]


# -- deriving the artifact ---------------------------------------------------------------------------
def test_eager_directory_gives_the_artifact_and_graphs(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5, prefill_chunk_size=32, decoder_batch_sizes=[1, 2, 4])
    art = load_artifact(d)
    assert (art.batch_size, art.max_seq_len, art.block_size, art.num_blocks,
            art.prefill_chunk_size, art.tensor_parallel, art.kv_dtype) == (
                4, 128, 128, 5, 32, 1, "float32")
    assert art.model == ModelSpec.from_pretrained(d)
    compiled = load(d / "rbln_config.json")
    assert compiled.decoder_batch_sizes == (1, 2, 4)
    assert [g.name for g in compiled.decoders] == ["decoder_batch_1", "decoder_batch_2",
                                                    "decoder_batch_4"]
    assert compiled.decoder(2).inputs[0] == GraphInput("input_ids", (2, 1), "int64")
    assert compiled.prefill.recorded and compiled.attn_impl == "eager"
    assert [c.name for c in compiled.kv_caches] == [f"past_key_values_{i}" for i in range(4)]
    assert compiled.kv_caches[0].shape == (5, 2, 128, 16)


def test_flash_hybrid_directory_and_derived_input_lists(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["gemma3"], batch_size=2, max_seq_len=128,
                    kvcache_block_size=32, kvcache_num_blocks=9, record_input_info=False)
    compiled = load(d)
    assert compiled.attn_impl == "flash_attn" and compiled.cache_impl == "hybrid"
    assert compiled.artifact.blocks_per_seq == 4 and compiled.artifact.model.is_hybrid
    assert not compiled.prefill.recorded
    graph = json.loads((d / "prefill.rbln").read_text())["input_info"]
    assert rows(compiled.prefill.inputs) == [tuple(i) for i in graph
                                             if not i[0].startswith("past_key_values_")]
    kv = {c.name: c.shape for c in compiled.kv_caches}
    assert kv["past_key_values_0"] == (2, 2, 16, 16)     # sliding layer: [batch, kvh, window, d]
    assert kv["past_key_values_4"] == (9, 2, 32, 16)     # global layer: [blocks, kvh, block, d]


def test_tensor_parallel_comes_from_num_devices(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=1, max_seq_len=128,
                    kvcache_num_blocks=2)
    raw = json.loads((d / "rbln_config.json").read_text())
    for cfg in raw["_compile_cfgs"]:
        cfg["num_devices"] = 2
    (d / "rbln_config.json").write_text(json.dumps(raw))
    assert load_artifact(d).tensor_parallel == 2
    raw["_compile_cfgs"][0]["num_devices"] = 4
    (d / "rbln_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="num_devices"):
        load(d)


# -- refusals, each naming its field --------------------------------------------------------------------
REFUSALS = {
    "use_inputs_embeds": (dict(use_inputs_embeds=True), "use_inputs_embeds"),
    "lora-empty": (dict(lora_config={"adapters": []}), r"lora_config.adapters=\[\] must be"),
    "fp8-kv": (dict(quantization={"format": "rbln", "kv_caches": "fp8"}), "kv_caches='fp8'"),
    "batch-sort": (dict(_requires_batch_sort=True), "_requires_batch_sort"),
    "no-decode": (dict(phases=["prefill"]), "phases"),
    "auto-blocks": (dict(kvcache_num_blocks=0), "kvcache_num_blocks=0"),
    "eager-block": (dict(kvcache_block_size=64), "kvcache_block_size=64 contradicts"),
    "attn": (dict(attn_impl="sdpa"), "attn_impl='sdpa'"),
    "buckets": (dict(decoder_batch_sizes=[2, 1]), "decoder_batch_sizes"),
    "bucket-range": (dict(decoder_batch_sizes=[8, 4]), "decoder_batch_sizes"),
    "static-vs-model": (dict(cache_impl="hybrid", sliding_window=8), "cache_impl='hybrid'"),
    "position-ids": (dict(use_position_ids=True, use_attention_mask=False), "use_position_ids"),
    "logits": (dict(logits_to_keep=3), "logits_to_keep=3"),
    "missing-field": (dict(max_seq_len=None), "'max_seq_len' is missing"),
    "wrong-type": (dict(batch_size="4"), "'batch_size'"),
    "lanes+1": (dict(kvcache_num_blocks=4), "kvcache_num_blocks=4.*lanes\\+1"),
    "graph-names": (dict(_compile_cfgs=[{"compiled_model_name": "prefill", "input_info": None}]),
                    "_compile_cfgs names"),
    "dtype": (dict(dtype="int8"), "dtype='int8'"),
    "tp-type": (dict(num_devices=[0, 1]), r"num_devices=\[0, 1\] must be a positive integer"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_name_the_field(tmp_path, checkpoints, case):
    overrides, message = REFUSALS[case]
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5, decoder_batch_sizes=[2, 4], overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        load(d)


def test_gemma3_compiled_static_contradicts_its_sliding_layers(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["gemma3"], batch_size=1, max_seq_len=128,
                    kvcache_num_blocks=2,
                    overrides=dict(cache_impl="static", sliding_window=None))
    with pytest.raises(ConfigError, match="cache_impl='static' contradicts"):
        load(d)
    e = compile_dir(tmp_path / "e", checkpoints["gemma3"], batch_size=1, max_seq_len=128,
                    kvcache_num_blocks=2,
                    overrides=dict(sliding_window=32))
    with pytest.raises(ConfigError, match="sliding_window=32 contradicts"):
        load(e)


def test_missing_graph_file_and_missing_config(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5, decoder_batch_sizes=[1, 4])
    (d / "decoder_batch_1.rbln").unlink()
    with pytest.raises(ConfigError, match="decoder_batch_1.rbln does not exist"):
        load(d)
    with pytest.raises(ConfigError, match="rbln_config.json does not exist"):
        load(tmp_path)


def test_recorded_input_info_must_agree_with_the_options(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=2, max_seq_len=128,
                    kvcache_num_blocks=3)
    raw = json.loads((d / "rbln_config.json").read_text())
    info = raw["_compile_cfgs"][0]["input_info"]
    info[2][1] = [2]                               # block_tables [1] for one eager block
    (d / "rbln_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"_compile_cfgs\[prefill\].input_info block_tables"):
        load(d)
    info[2][1] = [1]
    info.insert(1, ["lora_int_ids", [1], "int32"])
    (d / "rbln_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="lora_int_ids"):
        load(d)
    del info[1]
    info[-1][1] = [3, 2, 128, 16]                  # a KV cache with a wrong head_dim
    info[-1][1][3] = 8
    (d / "rbln_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="past_key_values_3"):
        load(d)


def test_recorded_order_is_the_order_used(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=2, max_seq_len=128,
                    kvcache_num_blocks=3)
    raw = json.loads((d / "rbln_config.json").read_text())
    info = raw["_compile_cfgs"][1]["input_info"]
    info[0], info[1] = info[1], info[0]
    (d / "rbln_config.json").write_text(json.dumps(raw))
    assert load(d).decoder(2).input_names == ("cache_position", "input_ids", "block_tables")


def test_npu_limits_apply_when_the_target_is_recorded(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=1, max_seq_len=128,
                    kvcache_block_size=32, kvcache_num_blocks=5, npu="RBLN-CA22")
    with pytest.raises(ConfigError, match="kvcache_partition_len=32 is outside ATOM's flash_attn "
                                          "range 1024..32768"):
        load(d)


def test_model_spec_must_agree_with_the_directory(tmp_path, checkpoints):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=1, max_seq_len=128,
                    kvcache_num_blocks=2)
    spec = ModelSpec.from_pretrained(d)
    assert load_artifact(d, spec).model == spec
    other = msgspec.structs.replace(spec, num_layers=3)
    with pytest.raises(ConfigError, match="num_layers"):
        load(d, other)


BAD_VALUES = ("x", -1, 0, [1], {"a": 1}, None, True, 1.5)


def test_any_malformed_field_is_a_config_error_or_accepted(tmp_path, checkpoints):
    """Every top-level field, and every field of a compile configuration, replaced by values of
    the wrong kind: load() either accepts the file or raises ConfigError, nothing else."""
    d = compile_dir(tmp_path / "c", checkpoints["gemma3"], batch_size=2, max_seq_len=128,
                    kvcache_block_size=32, kvcache_num_blocks=9, decoder_batch_sizes=[1, 2])
    original = json.loads((d / "rbln_config.json").read_text())
    outcomes = {"accepted": 0, "refused": 0}
    for field in original:
        for bad in BAD_VALUES:
            (d / "rbln_config.json").write_text(json.dumps({**original, field: bad}))
            try:
                load(d)
                outcomes["accepted"] += 1
            except ConfigError:
                outcomes["refused"] += 1
    for key in ("compiled_model_name", "input_info", "num_devices"):
        for bad in BAD_VALUES:
            cfgs = [dict(cfg) for cfg in original["_compile_cfgs"]]
            cfgs[1][key] = bad
            (d / "rbln_config.json").write_text(json.dumps({**original, "_compile_cfgs": cfgs}))
            try:
                load(d)
                outcomes["accepted"] += 1
            except ConfigError:
                outcomes["refused"] += 1
    assert outcomes["refused"] > outcomes["accepted"] > 0
