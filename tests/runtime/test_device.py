"""RebelRuntime on optimum-rbln directories, through the emulated `rebel` (tests/fakerebel).

The emulator checks every call's positional inputs against the graph's compiled input list and
computes with the NumPy decoder on device-resident KV shared by all graphs of a directory, so
these tests prove the whole device path: reading the directory, building inputs by name, picking
the decode graph by rows, and moving KV through the runtime's KV methods. Greedy tokens must equal
transformers' for Llama, Qwen3 and Gemma3, eager and flash layouts, with prefix and host caching,
and with PD import (whole and layer-stream).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fakerebel.compiler import compile_dir
from support.device_cases import (  # noqa: F401
    _CASES,
    GREEDY,
    LAYOUTS,
    NEW_TOKENS,
    B,
    make_case,
)
from support.driving import run_to_end
from support.hf_models import FAMILIES

from atombatch import ArtifactConfig, Batcher, ConfigError, StateError
from atombatch.artifact.rbln_config import load_artifact
from atombatch.kernel.blocks import PrefillInputs
from atombatch.pd import InProcessSource, Producer
from atombatch.runtime import NumpyRuntime, RebelRuntime, Runtime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    return make_case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_case("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_case("qwen3", tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_case("gemma3", tmp_path_factory)


def compiled(tmp_path, path, layout, **options):
    return compile_dir(tmp_path / "compiled", path, batch_size=B, max_seq_len=128,
                       prefill_chunk_size=16, **{**LAYOUTS[layout], **options})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batcher_equals_transformers_with_caches(fake_rebel, tmp_path, case, layout):
    family, path, prompts, references = case
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, layout))
    # hybrid models too: their hits restore sliding-slot checkpoints (docs/prefix-cache.md)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=1 << 20)
    together = [c.token_ids for c in batcher.generate(prompts, GREEDY)]
    assert together == references
    one_by_one = [batcher.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert one_by_one == references
    batcher.check_invariants()
    assert fake_rebel.CALLS and all(rows == B for name, rows in fake_rebel.CALLS
                                    if name.startswith("decoder"))
    # the repeats resume from cached (or host-restored) prefixes
    assert batcher.stats().prefix_hits >= 3
    if family == "gemma3":
        assert batcher.stats().slot_restores >= 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eviction_and_host_restore_through_the_kv_methods(fake_rebel, tmp_path, request, family):
    _, path, prompts, references = request.getfixturevalue(family)
    # two lanes, 16-token blocks, 9 blocks (oversubscribed): the prompts evict each other's
    # cached blocks, and the repeats come back from the host cache
    d = compile_dir(tmp_path / "c", path, batch_size=2, max_seq_len=128, prefill_chunk_size=16,
                    kvcache_block_size=16, kvcache_num_blocks=9)
    batcher = Batcher(RebelRuntime.from_optimum(d), prefix_cache=True, host_cache_bytes=1 << 20)
    sequence = prompts + prompts[::-1]
    got = [batcher.generate([p], GREEDY)[0].token_ids for p in sequence]
    assert got == references + references[::-1]
    stats = batcher.stats()
    assert stats.evictions > 0 and stats.host_restores > 0
    assert fake_rebel.KV_CALLS["_fetch_kv_cache"] > 0
    assert fake_rebel.KV_CALLS["_update_kv_cache"] > 0


def test_prefix_copy_goes_through_copy_kv_cache(fake_rebel, tmp_path, llama):
    family, path, prompts, references = llama
    d = compile_dir(tmp_path / "c", path, batch_size=2, max_seq_len=128, prefill_chunk_size=8,
                    kvcache_block_size=16, kvcache_num_blocks=17)
    batcher = Batcher(RebelRuntime.from_optimum(d), prefix_cache=True)
    # prompts[4] (49 tokens) is cached first; run again it resumes at 48 and pins blocks 0-2;
    # prompts[3] shares its first 40 tokens and resumes at 40, inside pinned block 2: a copy
    assert batcher.generate([prompts[4]], GREEDY)[0].token_ids == references[4]
    ids = [batcher.submit(p, GREEDY) for p in (prompts[4], prompts[3])]
    finals = run_to_end(batcher)
    assert [finals[i].completion.token_ids for i in ids] == [references[4], references[3]]
    assert fake_rebel.KV_CALLS["_copy_kv_cache"] >= 1


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pd_import_equals_transformers(fake_rebel, tmp_path, case, mode, layout):
    family, path, prompts, references = case
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, layout))
    producer_art = ArtifactConfig(model=rt.spec, batch_size=1, max_seq_len=128, block_size=32,
                                  num_blocks=5, prefill_chunk_size=32)
    producer = Producer(NumpyRuntime.from_pretrained(path, artifact=producer_art))
    batcher = Batcher(rt)
    ids = [batcher.submit(p, GREEDY, kv=InProcessSource.from_producer(
        producer, f"pd-{i}", p, GREEDY, mode=mode)) for i, p in enumerate(prompts)]
    finals = run_to_end(batcher)
    assert [finals[i].completion.token_ids for i in ids] == references
    assert rt.prefill_calls == 0                      # the device never prefilled
    assert fake_rebel.KV_CALLS["_update_kv_cache"] > 0


def test_the_device_as_a_pd_producer(fake_rebel, tmp_path, case):
    family, path, prompts, references = case
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "flash"))
    producer = Producer(rt)
    decoder_art = ArtifactConfig(model=rt.spec, batch_size=2, max_seq_len=128, block_size=128,
                                 num_blocks=3, prefill_chunk_size=16)
    batcher = Batcher(NumpyRuntime.from_pretrained(path, artifact=decoder_art))
    ids = [batcher.submit(p, GREEDY, kv=InProcessSource.from_producer(producer, f"x{i}", p,
                                                                      GREEDY, mode="whole"))
           for i, p in enumerate(prompts)]
    finals = run_to_end(batcher)
    assert [finals[i].completion.token_ids for i in ids] == references
    assert fake_rebel.KV_CALLS["_fetch_kv_cache"] > 0


OPTIONS = {
    "logits_to_keep=0": dict(logits_to_keep=0),
    "4-D chunk mask": dict(use_attention_mask=True, use_position_ids=False),
    "2-D mask + position_ids": dict(use_attention_mask=True, use_position_ids=True),
    "input_info derived": dict(record_input_info=False),
}


@pytest.mark.parametrize("option", OPTIONS)
def test_compile_options_change_the_inputs_not_the_tokens(fake_rebel, tmp_path, case, option):
    family, path, prompts, references = case
    d = compiled(tmp_path, path, "eager", **OPTIONS[option])
    rt = RebelRuntime.from_optimum(d)
    names = rt.compiled.prefill.input_names
    if option == "logits_to_keep=0":
        assert ("query_position" in names) == (family == "gemma3")  # local attention keeps it
    assert [c.token_ids for c in Batcher(rt).generate(prompts, GREEDY)] == references


# -- the emulator catches what a device would ------------------------------------------------------
def test_a_wrong_input_order_is_caught_by_the_device(fake_rebel, tmp_path, llama):
    family, path, prompts, _ = llama
    d = compiled(tmp_path, path, "eager")
    rt = RebelRuntime.from_optimum(d)
    args = rt._prefill_args
    args.getters[0], args.getters[1] = args.getters[1], args.getters[0]
    inputs = PrefillInputs(16, 1)
    inputs.build(np.asarray(prompts[0]), 0, [0], 1, 0)
    with pytest.raises(fake_rebel.RBLNRuntimeError,
                       match=r"prefill input 0 \(input_ids\) has dtype int32, the graph takes "
                             "int64"):
        rt.prefill(inputs)
    # through the Batcher the failing request ends with an error and frees its blocks
    [completion] = Batcher(rt).generate([prompts[0]], GREEDY)
    assert completion.finish_reason == "error"


def test_a_wrong_dtype_is_caught_by_the_device(fake_rebel, tmp_path, gemma3):
    family, path, prompts, _ = gemma3
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "eager"))
    _, builder = rt._decoders[B]
    index = [name for name, _ in builder.getters].index("attention_mask")
    builder._mask = builder._mask.astype(np.float16)      # compiled as float32
    batcher = Batcher(rt)
    [completion] = batcher.generate([prompts[0]], GREEDY)
    assert completion.finish_reason == "error"
    assert index > 0
    with pytest.raises(fake_rebel.RBLNRuntimeError, match="attention_mask.*float16.*float32"):
        rt.decode(batcher.scheduler.decode_inputs)


def test_an_input_list_that_disagrees_with_the_graph_is_caught(fake_rebel, tmp_path, qwen3):
    family, path, prompts, _ = qwen3
    d = compiled(tmp_path, path, "eager")
    # rbln_config.json claims another order than the graph was compiled with
    cfg = json.loads((d / "rbln_config.json").read_text())
    info = cfg["_compile_cfgs"][1]["input_info"]
    info[0], info[1] = info[1], info[0]
    (d / "rbln_config.json").write_text(json.dumps(cfg))
    rt = RebelRuntime.from_optimum(d)
    [completion] = Batcher(rt).generate([prompts[0]], GREEDY)
    assert completion.finish_reason == "error"
    assert "decoder_batch_4 input 0 (input_ids) has dtype int32" in str(completion.error)


def test_missing_kv_method_names_the_method_and_feature(fake_rebel, tmp_path, llama,
                                                       monkeypatch):
    family, path, prompts, _ = llama
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "flash"))
    monkeypatch.delattr(fake_rebel.Runtime, "_copy_kv_cache")
    monkeypatch.delattr(fake_rebel.Runtime, "_update_kv_cache")
    with pytest.raises(ConfigError, match=r"copy_block \(prefix-cache copies\) needs "
                                          r"rebel.Runtime._copy_kv_cache"):
        rt.copy_block(0, 1)
    with pytest.raises(ConfigError, match=r"write_layer_kv \(PD import\) needs "
                                          r"rebel.Runtime._update_kv_cache"):
        rt.write_layer_kv(0, np.zeros((2, 3, 16)), np.zeros((2, 3, 16)), [0])


def test_kv_moves_are_exact_and_host_buffers_aligned(fake_rebel, tmp_path, case):
    family, path, prompts, _ = case
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "flash"))
    assert rt._staging.ctypes.data % 4096 == 0
    spec = rt.spec
    rng = np.random.default_rng(0)
    layer = spec.global_layers[-1]
    k = rng.standard_normal((spec.num_kv_heads, 70, spec.head_dim)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    rt.write_layer_kv(layer, k, v, [5, 2, 9])           # 70 tokens over 32-token blocks
    got_k, got_v = rt.read_layer_kv(layer, [5, 2, 9], 70)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
    block = rt.read_block(2)
    rt.copy_block(2, 11)
    assert np.array_equal(rt.read_block(11), block)
    rt.write_block(12, block)
    assert np.array_equal(rt.read_layer_kv(layer, [12], 32)[0], k[:, 32:64])
    with pytest.raises(StateError, match="block=17 is outside"):
        rt.copy_block(17, 0)
    if spec.is_hybrid:
        sliding = spec.sliding_layers[0]
        w = spec.sliding_window
        k = rng.standard_normal((spec.num_kv_heads, w, spec.head_dim)).astype(np.float32)
        rt.write_layer_kv(sliding, k, k, [], slot=3)
        assert np.array_equal(rt.read_layer_kv(sliding, [], 50, slot=3)[1], k)
    unaligned = np.empty(spec.num_kv_heads * 32 * spec.head_dim + 1, np.float32)[1:]
    with pytest.raises(fake_rebel.RBLNRuntimeError, match="not 4096-byte aligned"):
        rt._prefill._fetch_kv_cache(unaligned, 0, 0, 32, rt.cache_name(layer, False))


def test_bfloat16_directory_moves_kv_as_bfloat16(fake_rebel, tmp_path, gemma3):
    family, path, prompts, _ = gemma3
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "eager", dtype="bfloat16"))
    assert rt.compiled.prefill.inputs[5].dtype == "bfloat16"    # the 2-D attention mask
    spec = rt.spec
    k = np.random.default_rng(1).standard_normal((spec.num_kv_heads, 20, spec.head_dim))
    k = k.astype(np.float32)
    rt.write_layer_kv(spec.global_layers[0], k, k, [1])
    got, _ = rt.read_layer_kv(spec.global_layers[0], [1], 20)
    assert np.abs(got - k).max() <= np.abs(k).max() * 2 ** -8     # bfloat16 rounding
    assert not np.array_equal(got, k)
    assert rt.read_block(1).dtype == np.uint16
    tokens = Batcher(rt).generate([prompts[1]], GREEDY)[0]
    assert tokens.finish_reason == "length"


def test_serve_takes_a_compiled_directory(fake_rebel, tmp_path, llama):
    from atombatch.serve.cli import build_engine, parser

    _, path, prompts, references = llama
    d = compiled(tmp_path, path, "flash", decoder_batch_sizes=[1, B])
    batcher, name, _ = build_engine(parser().parse_args(["--runtime", "rebel", "--model",
                                                         str(d)]))
    assert isinstance(batcher.runtime, RebelRuntime) and isinstance(batcher.runtime, Runtime)
    assert batcher.artifact == load_artifact(d)
    assert batcher.artifact.blocks_per_seq == 4 and name == "compiled"
    assert batcher.generate([prompts[0]], GREEDY)[0].token_ids == references[0]


def test_a_smaller_decode_graph_runs_by_row_count(fake_rebel, tmp_path, case):
    """Rows, not lanes: a 2-row decode runs decoder_batch_2; the sequence sits on row 0 with its
    own blocks and slot 1 while the padding row points at block 0 and slot 0."""
    from types import SimpleNamespace

    family, path, prompts, references = case
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "flash",
                                            decoder_batch_sizes=[1, 2, B]))
    prompt = prompts[2]                                   # 33 tokens: three 16-token chunks
    prefill = PrefillInputs(16, 4)
    for start in range(0, len(prompt), 16):
        prefill.build(np.asarray(prompt), start, np.array([3, 7], np.int32), 2, 1)
        logits = rt.prefill(prefill)
    tokens = [int(np.argmax(logits))]
    decode = SimpleNamespace(input_ids=np.zeros((2, 1), np.int64),
                             cache_position=np.zeros((2, 1), np.int32),
                             block_tables=np.array([[3, 7, 7, 7], [0, 0, 0, 0]], np.int16),
                             local_block_tables=np.array([[1], [0]], np.int16))
    for step in range(NEW_TOKENS - 1):
        decode.input_ids[0, 0] = tokens[-1]
        decode.cache_position[0, 0] = len(prompt) + step
        tokens.append(int(np.argmax(rt.decode(decode)[0])))
    assert tuple(tokens) == references[2]
    assert rt.decode_calls_by_batch == {1: 0, 2: NEW_TOKENS - 1, B: 0}
    assert {name for name, _ in fake_rebel.CALLS} == {"prefill", "decoder_batch_2"}
    three = SimpleNamespace(**{k: np.concatenate([v, v[:1]]) for k, v in vars(decode).items()})
    with pytest.raises(StateError, match="3 rows.*decoder_batch_sizes=\\[1, 2, 4\\]"):
        rt.decode(three)


def test_a_device_cache_size_that_contradicts_the_config_is_refused(fake_rebel, tmp_path, llama,
                                                                    monkeypatch):
    _, path, _, _ = llama
    d = compiled(tmp_path, path, "eager")
    size = fake_rebel.Runtime._get_kv_cache_size
    monkeypatch.setattr(fake_rebel.Runtime, "_get_kv_cache_size",
                        lambda self, name: size(self, name) * (2 if name.endswith("_3") else 1))
    with pytest.raises(ConfigError, match=r"KV cache past_key_values_3 holds 163840 bytes on the "
                                          r"device, rbln_config.json gives \[5, 2, 128, 16\]"):
        RebelRuntime.from_optimum(d)


def test_a_missing_input_is_caught_by_the_device(fake_rebel, tmp_path, llama):
    _, path, prompts, _ = llama
    rt = RebelRuntime.from_optimum(compiled(tmp_path, path, "eager"))
    rt._decoders[B][1].getters.pop()                     # block_tables left out
    [completion] = Batcher(rt).generate([prompts[0]], GREEDY)
    assert completion.finish_reason == "error"
    assert "decoder_batch_4: 2 inputs given, the graph takes 3 (input_ids, cache_position, " \
           "block_tables)" in str(completion.error)
