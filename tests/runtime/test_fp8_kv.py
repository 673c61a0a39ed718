"""fp8 KV on the NumPy runtime: K/V stored as float8_e4m3fn, the math real over the rounded values.

The reference is transformers' own model, recomputing the whole sequence in float32 with a cache
whose `update` rounds every K and V through torch's float8_e4m3fn (saturating at +-448) before
attention sees them: an independent statement of "round each K/V through e4m3, then attend".

Rounding is discontinuous: where an exact K/V value sits within float32's reordering bound of a
rounding midpoint, two correct evaluations may round it to neighbouring e4m3 values. The check
therefore reads the runtime's stored bytes and (1) requires them to equal the reference's rounding
wherever the rounding is decided, and (2) lets the reference take the runtime's value where it is
not (both are right there); the logits of every position must then agree within the float32 bound.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import hf_models as hf
from support.numerics import f32_atol, greedy_reference, hf_margin_atol, reduction_length

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.errors import ConfigError
from atombatch.kernel._blocks_py import PrefillInputs
from atombatch.runtime.numpy_runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

FP8 = "float8_e4m3fn"
NEW_TOKENS = 8
# Gemma3's prompt fits its sliding window (16), so the slot still holds every position's K/V when
# the test reads the stored bytes; the others go past a block and a chunk boundary.
PROMPT_LEN = {"llama": 37, "qwen3": 37, "gemma3": hf.SLIDING_WINDOW}
TABLE = np.array([3, 1, 5, 7], dtype=np.int32)   # blocks of the prompt, not in order


def torch_e4m3(x: np.ndarray) -> np.ndarray:
    """`x` rounded through torch's float8_e4m3fn (nearest even, saturating), as float32."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32).numpy()


def rounding_logits(model: Any, tokens: list[int],
                    decide: Callable[[int, int, np.ndarray], np.ndarray] | None = None
                    ) -> np.ndarray:
    """transformers' logits [T, vocab] of `tokens` by full recompute, every K/V rounded to e4m3
    (`decide(layer, 0 for K | 1 for V, exact)` picks the rounded values when given)."""
    import torch
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):  # type: ignore[misc]
        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any,
                   **kwargs: Any) -> Any:
            rounded = []
            for which, states in enumerate((key_states, value_states)):
                exact = states[0].numpy()                                # [kv_heads, T, d]
                chosen = decide(layer_idx, which, exact) if decide else torch_e4m3(exact)
                rounded.append(torch.from_numpy(np.ascontiguousarray(chosen))[None])
            return super().update(rounded[0], rounded[1], layer_idx, *args, **kwargs)

    # transformers 5.x names the argument `cache`, earlier versions `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]), use_cache=True,
                    **{name: RoundingCache(config=model.config)})
    return out.logits[0].float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    made = {}
    for family in hf.FAMILIES:
        path = hf.save_checkpoint(family, tmp_path_factory.mktemp(family))
        made[family] = (path, hf.load_float32(path))
    return made


def fp8_runtime(path: Path, kv_dtype: str = FP8) -> NumpyRuntime:
    spec = ModelSpec.from_pretrained(path)
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=128, block_size=32, num_blocks=9,
                         prefill_chunk_size=16, kv_dtype=kv_dtype)
    return NumpyRuntime.from_pretrained(path, artifact=art)


def prompt(family: str) -> list[int]:
    return np.random.default_rng(1).integers(3, 512, size=PROMPT_LEN[family]).tolist()


def prefill_every_position(runtime: NumpyRuntime, tokens: list[int]) -> np.ndarray:
    """Chunked prefill through `TABLE` (lane slot 0); logits of every prompt position."""
    art = runtime.artifact
    inputs = PrefillInputs(art.prefill_chunk_size, art.blocks_per_seq)
    rows = []
    for start in range(0, len(tokens), art.prefill_chunk_size):
        real = inputs.build(tokens, start, TABLE, len(TABLE), 0)
        rows.append(runtime.prefill(inputs, every_position=True)[:real])
    return np.concatenate(rows)


def stored(runtime: NumpyRuntime, layer: int, which: int, length: int) -> np.ndarray:
    """The e4m3 values the runtime holds for positions 0..length-1 of `layer`, as float32."""
    spec, size = runtime.spec, runtime.artifact.block_size
    if spec.layer_kinds[layer] == "full_attention":
        cache = runtime.kv[spec.global_layers.index(layer), which]
        positions = np.arange(length)
        values = cache[TABLE[positions // size], :, positions % size]    # [T, kv_heads, d]
        return values.astype(np.float32).transpose(1, 0, 2)
    slot = runtime.sliding_kv[spec.sliding_layers.index(layer), which, 0]
    return slot[:, :length].astype(np.float32)


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fp8_kv_matches_a_full_recompute_that_rounds_each_kv(
        family: str, checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, model = checkpoints[family]
    runtime = fp8_runtime(path)
    spec = runtime.spec
    tokens = prompt(family)
    ours = prefill_every_position(runtime, tokens)
    assert runtime.kv.dtype.name == FP8 and runtime.kv.itemsize == 1
    if spec.is_hybrid:
        assert runtime.sliding_kv.dtype.name == FP8

    checked = {"decided": 0, "undecided": 0}
    reduction = reduction_length(spec, len(tokens))

    def decide(layer: int, which: int, exact: np.ndarray) -> np.ndarray:
        mine = torch_e4m3(exact)
        held = stored(runtime, layer, which, len(tokens))
        # how far two float32 evaluations of this K/V may lie apart: `layer + 1` layers deep
        bound = f32_atol(exact, reduction=reduction, depth=layer + 1)
        undecided = torch_e4m3(exact - bound) != torch_e4m3(exact + bound)
        np.testing.assert_array_equal(held[~undecided], mine[~undecided],
                                      err_msg=f"layer {layer} {'KV'[which]}: stored e4m3 values")
        # where either rounding is right, the stored one is one of the two neighbours
        assert np.all((held == torch_e4m3(exact - bound)) | (held == torch_e4m3(exact + bound))
                      | ~undecided)
        checked["decided"] += int((~undecided).sum())
        checked["undecided"] += int(undecided.sum())
        return np.where(undecided, held, mine)

    reference = rounding_logits(model, tokens, decide)
    atol = hf_margin_atol(model.config, reference, len(tokens))
    np.testing.assert_allclose(ours, reference, rtol=0, atol=atol,
                               err_msg=f"{family}: fp8 prefill logits (derived atol {atol:.3g})")
    assert checked["decided"] > 10 * checked["undecided"]

    # the rounding is real: transformers without it differs far beyond the bound, and so does
    # the float32-KV runtime from the fp8 one
    plain = hf.hf_logits(model, tokens)
    assert np.abs(plain - reference).max() > 100 * atol
    wide = prefill_every_position(fp8_runtime(path, "float32"), tokens)
    assert np.abs(wide - ours).max() > 100 * atol


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fp8_kv_greedy_tokens_equal_the_rounding_reference(
        family: str, checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, model = checkpoints[family]
    tokens = np.random.default_rng(2).integers(3, 512, size=29).tolist()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = Batcher(fp8_runtime(path)).generate([tokens], params)[0].token_ids
    reference = greedy_reference(model, tokens, NEW_TOKENS,
                                 lambda m, seq: rounding_logits(m, seq)[-1])
    assert reference == list(ours)


def test_fp8_blocks_and_slots_move_as_bytes(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, _ = checkpoints["gemma3"]
    runtime = fp8_runtime(path)
    wide = fp8_runtime(path, "float32")
    tokens = prompt("gemma3")
    prefill_every_position(runtime, tokens)
    block = runtime.read_block(int(TABLE[0]))
    assert block.dtype.name == FP8
    assert block.nbytes * 4 == wide.read_block(0).nbytes
    assert runtime.slot_bytes * 4 == wide.slot_bytes
    runtime.write_block(8, block)
    np.testing.assert_array_equal(runtime.read_block(8).view(np.uint8), block.view(np.uint8))
    runtime.copy_block(8, 6)
    np.testing.assert_array_equal(runtime.read_block(6).view(np.uint8), block.view(np.uint8))
    slot = runtime.read_slot(0)
    runtime.write_slot(1, slot)
    np.testing.assert_array_equal(runtime.read_slot(1).view(np.uint8), slot.view(np.uint8))
    # PD export widens exactly; an import of those values stores the same bytes again
    for layer in range(runtime.spec.num_layers):
        k, v = runtime.read_layer_kv(layer, TABLE, len(tokens), slot=0)
        assert k.dtype == np.float32
        before = runtime.kv.copy(), runtime.sliding_kv.copy()
        runtime.write_layer_kv(layer, k, v, TABLE, slot=0)
        np.testing.assert_array_equal(runtime.kv.view(np.uint8), before[0].view(np.uint8))
        np.testing.assert_array_equal(runtime.sliding_kv.view(np.uint8),
                                      before[1].view(np.uint8))


def test_fp8_import_rounds_and_saturates_as_the_own_write() -> None:
    spec = ModelSpec(name="tiny", family="llama", vocab_size=64, hidden_size=16,
                     intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    art = ArtifactConfig(model=spec, batch_size=1, max_seq_len=16, block_size=16, num_blocks=1,
                         prefill_chunk_size=16, kv_dtype=FP8)
    runtime = NumpyRuntime.random(art)
    k = np.array([1.0625, 1.1875, -500.0, 1e-4, 3.3, 448.0, 464.0, -0.0],
                 dtype=np.float32).reshape(1, 8, 1).repeat(8, axis=2)
    runtime.write_layer_kv(0, k, -k, [0])
    got_k, got_v = runtime.read_layer_kv(0, [0], 8)
    want = np.array([1.0, 1.25, -448.0, 0.0, 3.25, 448.0, 448.0, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(got_k[0, :, 0], want)
    np.testing.assert_array_equal(got_v[0, :, 0], -want)
    np.testing.assert_array_equal(got_k[0, :, 0], torch_e4m3(k[0, :, 0]))


def test_quantized_checkpoint_weights_are_refused_by_name(
        checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    import json
    import shutil

    path, _ = checkpoints["llama"]
    copy = Path(shutil.copytree(path, tmp_path / "quantized"))
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantization_config \(quant_method='fp8'\) is set: "
                                          "NumpyRuntime computes with float weights"):
        NumpyRuntime.from_pretrained(copy)


# -- the device path: an fp8-KV optimum-rbln directory through the emulated rebel -------------------
QUANTIZED = {"format": "rbln", "weights": "int8", "activations": "fp16", "kv_caches": "fp8"}


def fp8_directory(tmp_path: Path, path: Path, **options: Any) -> Path:
    from fakerebel.compiler import compile_dir

    fields: dict[str, Any] = dict(batch_size=2, max_seq_len=128, prefill_chunk_size=16,
                                  kvcache_block_size=16, kvcache_num_blocks=9,
                                  quantization=QUANTIZED)
    fields.update(options)
    return compile_dir(tmp_path, path, **fields)


def device_prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    system = rng.integers(3, 512, size=40).tolist()
    return [rng.integers(3, 512, size=17).tolist(), system + [7, 9, 11],
            system + rng.integers(3, 512, size=9).tolist()]


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fp8_device_tokens_equal_the_rounding_reference_with_caches(
        family: str, checkpoints: dict[str, tuple[Path, Any]], fake_rebel: Any,
        tmp_path: Path) -> None:
    from atombatch.runtime import RebelRuntime

    path, model = checkpoints[family]
    rt = RebelRuntime.from_optimum(fp8_directory(tmp_path / "c", path))
    assert rt.compiled.kv_dtype == FP8 and rt.read_block(0).dtype == np.uint8
    assert rt._staging.ctypes.data % 4096 == 0
    prompts = device_prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    references = [greedy_reference(model, p, NEW_TOKENS,
                                   lambda m, seq: rounding_logits(m, seq)[-1]) for p in prompts]
    # two lanes, 16-token blocks, 9 blocks: prompts evict each other's cached blocks, repeats
    # come back from the host cache (hybrid models: with their sliding-slot checkpoints)
    batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=1 << 20)
    sequence = prompts + prompts[::-1]
    got = [list(batcher.generate([p], params)[0].token_ids) for p in sequence]
    assert got[:3] == references and got[3:] == references[::-1]
    batcher.check_invariants()
    stats = batcher.stats()
    assert stats.prefix_hits >= 2 and stats.evictions > 0 and stats.host_restores > 0
    assert fake_rebel.KV_CALLS["_fetch_kv_cache"] and fake_rebel.KV_CALLS["_update_kv_cache"]
    host = batcher.host_cache
    assert host is not None and len(host) > 0
    assert {entry.data.dtype for entry in host._lru.values()} == {np.dtype(np.uint8)}


def test_fp8_host_cache_holds_half_the_bytes_of_bfloat16(
        checkpoints: dict[str, tuple[Path, Any]], fake_rebel: Any, tmp_path: Path) -> None:
    from atombatch.runtime import RebelRuntime

    path, _ = checkpoints["llama"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    per_block = {}
    for name, options in (("bf16", dict(dtype="bfloat16", quantization=None)),
                          ("fp8", {})):
        rt = RebelRuntime.from_optimum(fp8_directory(tmp_path / name, path, **options))
        batcher = Batcher(rt, prefix_cache=True, host_cache_bytes=1 << 20)
        for p in device_prompts() * 2:
            batcher.generate([p], params)
        host = batcher.host_cache
        assert host is not None and host.stores > 0
        sizes = {int(entry.data.nbytes) for entry in host._lru.values()}
        assert len(sizes) == 1 and host.used_bytes == len(host) * sizes.pop()
        per_block[name] = host.used_bytes // len(host)
    spec = ModelSpec.from_pretrained(path)
    assert per_block["fp8"] == 2 * spec.num_layers * spec.num_kv_heads * 16 * spec.head_dim
    assert per_block["bf16"] == 2 * per_block["fp8"]


def test_the_emulated_device_enforces_float8_caches(
        checkpoints: dict[str, tuple[Path, Any]], fake_rebel: Any, tmp_path: Path) -> None:
    import json

    from atombatch.runtime import RebelRuntime

    path, _ = checkpoints["llama"]
    d = fp8_directory(tmp_path / "c", path)
    rt = RebelRuntime.from_optimum(d)
    spec = rt.spec
    # a host buffer of another dtype is refused by the KV methods
    wide = np.zeros(spec.num_kv_heads * 16 * spec.head_dim + 4096, np.uint16)
    start = (-wide.ctypes.data) % 4096 // 2
    host = wide[start : start + spec.num_kv_heads * 16 * spec.head_dim]
    with pytest.raises(fake_rebel.RBLNRuntimeError, match="uint16 is not the cache's "
                                                          "float8_e4m3fn"):
        rt._prefill._fetch_kv_cache(host, 0, 0, 16, rt.cache_name(0, False))
    # the device's caches hold e4m3 values: what the prefill wrote is exactly representable
    rt.write_layer_kv(0, np.full((spec.num_kv_heads, 3, spec.head_dim), 3.3, np.float32),
                      np.full((spec.num_kv_heads, 3, spec.head_dim), -1000.0, np.float32), [4])
    k, v = rt.read_layer_kv(0, [4], 3)
    assert set(np.unique(k)) == {3.25} and set(np.unique(v)) == {-448.0}
    device = fake_rebel._device(d, 0)
    assert device.rt.kv.dtype.name == FP8
    # a graph compiled with other caches than the device holds does not load
    graph = json.loads((d / "decoder_batch_2.rbln").read_text())
    graph["input_info"][-1][2] = "bfloat16"
    (d / "decoder_batch_2.rbln").write_text(json.dumps(graph))
    with pytest.raises(fake_rebel.RBLNRuntimeError, match="past_key_values_3 is declared "
                                                          "bfloat16, the device's caches are "
                                                          "float8_e4m3fn"):
        fake_rebel.Runtime(str(d / "decoder_batch_2.rbln"), tensor_type="np")
