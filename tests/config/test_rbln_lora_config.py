"""`lora_config` in optimum-rbln directories: the fixture compiler writes what optimum-rbln 0.12's
own classes write (`tests/fakerebel/optimum_lora.json`, recorded by tools/optimum_lora_record.py),
atombatch reads it, adds `lora_int_ids` to every graph's inputs, refuses what optimum-rbln refuses,
and names the field and the rule for every bad value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakerebel.compiler import compile_dir, lora_adapter, lora_config
from support.hf_models import save_checkpoint

from atombatch import ConfigError
from atombatch.artifact.rbln_config import (
    LORA_TARGET_MODULES,
    MAX_COMPILED_ADAPTERS,
    GraphInput,
    derive_inputs,
    load,
    read_lora_config,
)

RECORD = json.loads((Path(__file__).resolve().parents[1] / "fakerebel" / "optimum_lora.json")
                    .read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def adapter_dirs(tmp_path):
    """The recorded cases' PEFT adapter directories (their adapter_config.json)."""
    root = tmp_path / "adapters"
    for name, config in RECORD["adapter_configs"].items():
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text(json.dumps(config))
    return root


def written(adapters, max_rank, root):
    filled = [{k: (v.replace("{dir}", str(root)) if isinstance(v, str) else v)
               for k, v in a.items()} for a in adapters]
    return lora_config([lora_adapter(**a) for a in filled], max_rank)


def unfill(config, root):
    return json.loads(json.dumps(config).replace(str(root), "{dir}"))


# -- what optimum-rbln writes -------------------------------------------------------------------------
def test_the_record_is_optimum_rbln_0_12():
    assert RECORD["optimum_rbln_version"].startswith("0.12")
    assert set(RECORD["accepted"]) == {"defaults", "fields_given"}


@pytest.mark.parametrize("case", ["defaults", "fields_given"])
def test_fixture_compiler_writes_what_optimum_rbln_classes_write(adapter_dirs, case):
    recorded = RECORD["accepted"][case]
    mine = written(recorded["adapters"], recorded["max_lora_rank"], adapter_dirs)
    assert unfill(mine, adapter_dirs) == recorded["lora_config"]


@pytest.mark.parametrize("case", ["defaults", "fields_given"])
def test_recorded_lora_config_reads_into_the_compiled_adapters(adapter_dirs, case):
    recorded = RECORD["accepted"][case]["lora_config"]
    raw = json.loads(json.dumps(recorded).replace("{dir}", str(adapter_dirs)))
    lora = read_lora_config(raw)
    assert lora is not None
    assert lora.max_lora_rank == recorded["max_lora_rank"]
    assert lora.ids == (0, *range(1, len(recorded["adapters"]) + 1))
    for adapter, entry in zip(lora.adapters, sorted(raw["adapters"],
                                                    key=lambda a: a["lora_int_id"]), strict=True):
        assert (adapter.lora_int_id, adapter.lora_name, adapter.lora_path, adapter.r,
                adapter.lora_alpha, list(adapter.target_modules), adapter.use_rslora,
                adapter.scaling_factor) == (
            entry["lora_int_id"], entry["lora_name"], entry["lora_path"], entry["r"],
            float(entry["lora_alpha"]), entry["target_modules"], entry["use_rslora"],
            entry["scaling_factor"])


@pytest.mark.parametrize("case", sorted(RECORD["refused"]))
def test_atombatch_refuses_what_optimum_rbln_refuses(adapter_dirs, case):
    recorded = RECORD["refused"][case]
    raw = written(recorded["adapters"], recorded["max_lora_rank"], adapter_dirs)
    with pytest.raises(ConfigError, match="lora_config"):
        read_lora_config(raw)


# -- the graphs' inputs ---------------------------------------------------------------------------------
BASE = dict(max_seq_len=256, block_size=64, global_attention=True, local_attention=False,
            logits_to_keep=1, use_attention_mask=False, use_position_ids=False, dtype="float32")


def test_lora_int_ids_comes_last_in_prefill_and_decode():
    prefill = derive_inputs(batch=1, query_length=64, lora=True, **BASE)
    decode = derive_inputs(batch=4, query_length=1, lora=True, **BASE)
    assert prefill[-1] == GraphInput("lora_int_ids", (1,), "int32")
    assert decode[-1] == GraphInput("lora_int_ids", (4,), "int32")
    gemma = {**BASE, "local_attention": True, "use_attention_mask": True,
             "use_position_ids": True}
    assert [i.name for i in derive_inputs(batch=2, query_length=1, lora=True, **gemma)] == [
        "input_ids", "cache_position", "block_tables", "local_block_tables", "attention_mask",
        "position_ids", "lora_int_ids"]


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "derived"])
def test_a_lora_directory_gives_every_graph_lora_int_ids(tmp_path, checkpoint, adapter_dirs,
                                                         recorded):
    config = written(RECORD["accepted"]["defaults"]["adapters"], None, adapter_dirs)
    d = compile_dir(tmp_path / "c", checkpoint, batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5, decoder_batch_sizes=[1, 2, 4], lora_config=config,
                    record_input_info=recorded)
    compiled = load(d)
    assert compiled.lora is not None and compiled.prefill.recorded is recorded
    assert [a.lora_name for a in compiled.lora.adapters] == ["sql", "chat"]
    assert compiled.prefill.inputs[-1] == GraphInput("lora_int_ids", (1,), "int32")
    for graph in compiled.decoders:
        assert graph.inputs[-1] == GraphInput("lora_int_ids", (graph.batch,), "int32")
        written_info = json.loads((d / f"{graph.name}.rbln").read_text())["input_info"]
        host = [tuple(i) for i in written_info if not i[0].startswith("past_key_values_")]
        assert [(i.name, list(i.shape), i.dtype) for i in graph.inputs] == host


def test_a_directory_without_lora_has_no_lora_input(tmp_path, checkpoint):
    d = compile_dir(tmp_path / "c", checkpoint, batch_size=2, max_seq_len=128,
                    kvcache_num_blocks=3)
    compiled = load(d)
    assert compiled.lora is None
    assert "lora_int_ids" not in compiled.prefill.input_names + compiled.decoder(2).input_names


def test_recorded_input_info_without_lora_int_ids_contradicts_lora_config(
        tmp_path, checkpoint, adapter_dirs):
    config = written(RECORD["accepted"]["defaults"]["adapters"], None, adapter_dirs)
    d = compile_dir(tmp_path / "c", checkpoint, batch_size=2, max_seq_len=128,
                    kvcache_num_blocks=3, lora_config=config)
    raw = json.loads((d / "rbln_config.json").read_text())
    info = raw["_compile_cfgs"][1]["input_info"]
    lora_row = next(i for i in info if i[0] == "lora_int_ids")
    lora_row[2] = "int64"
    (d / "rbln_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"decoder_batch_2\].input_info lora_int_ids is \[2\] "
                                          "int64.*int32"):
        load(d)
    info.remove(lora_row)
    (d / "rbln_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="lora_int_ids"):
        load(d)


# -- every bad field, named ---------------------------------------------------------------------------
def good_adapter(**fields):
    entry = {"lora_int_id": 1, "lora_name": "sql", "lora_path": "/adapters/sql", "r": 4,
             "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none",
             "use_rslora": False, "scaling_factor": 1.0}
    entry.update(fields)
    return entry


BAD = {
    "not-an-object": ([1, 2], r"lora_config=\[1, 2\] must be an object"),
    "unknown-field": ({"adapters": [good_adapter()], "max_lora_rank": 4, "dropout": 0.1},
                      r"lora_config has unknown fields \['dropout'\]"),
    "no-adapters": ({"adapters": [], "max_lora_rank": 1}, r"lora_config.adapters=\[\] must be"),
    "adapters-not-list": ({"adapters": {"sql": 1}}, "lora_config.adapters="),
    "adapter-not-object": ({"adapters": ["sql"]}, r"lora_config.adapters\[0\]='sql' must be"),
    "adapter-unknown-field": ({"adapters": [good_adapter(lora_dropout=0.1)]},
                              r"adapters\[0\] has unknown fields \['lora_dropout'\]"),
    "id-zero": ({"adapters": [good_adapter(lora_int_id=0)]},
                r"adapters\[0\].lora_int_id=0 is reserved for the base model"),
    "id-type": ({"adapters": [good_adapter(lora_int_id="1")]},
                r"adapters\[0\].lora_int_id='1' must be an integer in 0..1024"),
    "id-bool": ({"adapters": [good_adapter(lora_int_id=True)]}, r"lora_int_id=True"),
    "ids-gap": ({"adapters": [good_adapter(), good_adapter(lora_int_id=3, lora_name="b")]},
                r"have lora_int_id \[1, 3\]: they must be 1..2, each once"),
    "ids-twice": ({"adapters": [good_adapter(), good_adapter(lora_name="b")]},
                  r"have lora_int_id \[1, 1\]"),
    "names-twice": ({"adapters": [good_adapter(), good_adapter(lora_int_id=2)]},
                    r"name 'sql' twice \(lora_int_id 1 and 2\)"),
    "name-empty": ({"adapters": [good_adapter(lora_name="")]},
                   r"adapters\[0\].lora_name='' must be a string of 1..256 characters"),
    "name-long": ({"adapters": [good_adapter(lora_name="x" * 300)]},
                  r"lora_name='xxx.*must be a string of 1..256"),
    "path-type": ({"adapters": [good_adapter(lora_path=None)]}, r"lora_path=None"),
    "rank-zero": ({"adapters": [good_adapter(r=0)]}, r"adapters\[0\].r=0 must be an integer"),
    "rank-huge": ({"adapters": [good_adapter(r=1 << 40)]}, r"\.r=1099511627776 must be"),
    "rank-above-max": ({"adapters": [good_adapter(r=8)], "max_lora_rank": 4},
                       "adapter 'sql' has r=8, above max_lora_rank=4"),
    "max-rank-type": ({"adapters": [good_adapter()], "max_lora_rank": "4"},
                      r"max_lora_rank='4' must be an integer in 1..512"),
    "alpha-zero": ({"adapters": [good_adapter(lora_alpha=0)]},
                   r"lora_alpha=0 must be a positive, finite number"),
    "alpha-nan": ({"adapters": [good_adapter(lora_alpha=float("nan"))]}, r"lora_alpha=nan"),
    "scaling-negative": ({"adapters": [good_adapter(scaling_factor=-1.0)]},
                         r"scaling_factor=-1.0 must be a positive"),
    "modules-none": ({"adapters": [good_adapter(target_modules=None)]},
                     r"target_modules=None must be a list of distinct module names"),
    "modules-regex": ({"adapters": [good_adapter(target_modules="q_proj|v_proj")]},
                      r"target_modules='q_proj\|v_proj' must be a list"),
    "modules-twice": ({"adapters": [good_adapter(target_modules=["q_proj", "q_proj"])]},
                      "target_modules="),
    "module-unknown": ({"adapters": [good_adapter(target_modules=["q_proj", "lm_head"])]},
                       "target_modules has 'lm_head', which optimum-rbln does not adapt"),
    "bias": ({"adapters": [good_adapter(bias="lora_only")]},
             r"bias='lora_only': only 'none' is supported"),
    "rslora-type": ({"adapters": [good_adapter(use_rslora="yes")]},
                    r"use_rslora='yes' must be true or false"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_lora_config_fields_are_named(case):
    raw, message = BAD[case]
    with pytest.raises(ConfigError, match=message):
        read_lora_config(raw)


def test_adapter_count_is_bounded_before_each_is_read():
    raw = {"adapters": [None] * (MAX_COMPILED_ADAPTERS + 1)}
    with pytest.raises(ConfigError, match="lists 1025 adapters, more than atombatch's bound 1024"):
        read_lora_config(raw)


def test_every_module_optimum_rbln_adapts_is_accepted_and_max_rank_defaults():
    lora = read_lora_config({"adapters": [good_adapter(target_modules=list(LORA_TARGET_MODULES),
                                                       r=6)]})
    assert lora is not None and lora.max_lora_rank == 6
    assert lora.adapters[0].target_modules == LORA_TARGET_MODULES


def test_a_bad_lora_config_in_the_file_is_named_by_load(tmp_path, checkpoint):
    d = compile_dir(tmp_path / "c", checkpoint, batch_size=2, max_seq_len=128,
                    kvcache_num_blocks=3,
                    lora_config={"adapters": [good_adapter(bias="all")], "max_lora_rank": 4})
    with pytest.raises(ConfigError, match=r"rbln_config.json: lora_config.adapters\[0\].bias"):
        load(d)
