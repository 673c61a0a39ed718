"""PD with fp8 KV: the wire names the dtype, and producers and decoders of different KV dtypes
convert where the decoder's answer stays its own and refuse where it would not.

- fp8 producer -> fp8 decoder: the bytes as they are (exact).
- float32 / float16 / bfloat16 payload -> fp8 decoder: each value rounded to e4m3 exactly as the
  decoder's own write rounds it. From an fp8 producer (its KV is e4m3 values, which every wider
  dtype carries exactly) that is the decoder's own KV: with the producer's chunking the output
  equals a decoder that computed the prefill itself, token for token. A float32-KV producer
  attends over unrounded KV, so its deeper layers differ from an fp8 prefill by the fp8 effect
  itself: there the test checks the conversion, byte for byte.
- fp8 producer -> a wider decoder: refused naming both dtypes (widening is exact, but the decoder
  would decode over 3-bit-mantissa KV its own prefill never keeps: not its native answer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.driving import run_to_end
from support.pd_models import PARAMS, SEED, SPECS, prompts

from atombatch import ArtifactConfig, Batcher
from atombatch.artifact.kv_dtype import to_float8
from atombatch.errors import KVTransferError
from atombatch.pd import InProcessSource, LayerKV, Producer
from atombatch.pd.wire import decode_header, decode_layer, encode_header, layer_frames
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

FP8 = "float8_e4m3fn"


def art(spec: Any, batch_size: int, num_blocks: int, kv_dtype: str, *, block_size: int = 96,
        chunk: int = 16) -> ArtifactConfig:
    return ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=96,
                          block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=chunk,
                          kv_dtype=kv_dtype)


def producer(spec: Any, kv_dtype: str, wire: str) -> Producer:
    # another layout than the decoders: partitioned, batch 2, chunk 32
    runtime = NumpyRuntime.random(art(spec, 2, 7, kv_dtype, block_size=32, chunk=32), SEED)
    return Producer(runtime, dtype=wire)


def decoders(spec: Any, kv_dtype: str) -> dict[str, ArtifactConfig]:
    """Other block layouts than the producer's, its chunk size: the decoder's own prefill computes
    the producer's float32 K/V bit for bit, so one rounding gives the same e4m3 bytes."""
    layouts = {"B4/k5": art(spec, 4, 5, kv_dtype, chunk=32)}
    if not spec.is_hybrid:
        layouts["B1/k1 single-block"] = art(spec, 1, 1, kv_dtype, chunk=32)
    return layouts


def native(layout: ArtifactConfig, work: list[list[int]]) -> list[tuple[int, ...]]:
    """The decoder computing every prefill itself."""
    return [tuple(c.token_ids) for c in
            Batcher(NumpyRuntime.random(layout, SEED)).generate(work, PARAMS)]


def imported_bytes(layout: ArtifactConfig, layer: LayerKV, tokens: int) -> np.ndarray:
    """What a fresh decoder of `layout` holds for `layer` after importing it, as e4m3 bytes."""
    runtime = NumpyRuntime.random(layout, SEED)
    row = list(range(layout.blocks_per_seq))
    k, v = layer.float32()
    runtime.write_layer_kv(layer.layer, k, v, row, slot=0)
    got_k, got_v = runtime.read_layer_kv(layer.layer, row, tokens, slot=0)
    return np.stack([to_float8(got_k), to_float8(got_v)]).view(np.uint8)


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize("wire", [FP8, "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("family", SPECS)
def test_an_fp8_producer_gives_the_fp8_decoder_its_own_kv(family: str, wire: str,
                                                          mode: str) -> None:
    spec = SPECS[family]
    source = producer(spec, FP8, wire)
    work = prompts()
    payload = source.produce("req-0", work[0])
    assert payload.header.dtype == wire
    own = [source.runtime.read_layer_kv(i, source._row, len(work[0]))
           for i in range(spec.num_layers)]
    for layer in payload.layers:
        # e4m3 values travel exactly in every wire dtype, and land as the producer's bytes
        tokens = payload.header.layer_tokens[layer.layer]
        k, v = own[layer.layer]
        np.testing.assert_array_equal(imported_bytes(art(spec, 4, 5, FP8), layer, tokens),
                                      np.stack([to_float8(k), to_float8(v)]).view(np.uint8))
        if wire == FP8:
            np.testing.assert_array_equal(np.stack([layer.k, layer.v]),
                                          np.stack([to_float8(k), to_float8(v)]).view(np.uint8))
    for label, layout in decoders(spec, FP8).items():
        batcher = Batcher(NumpyRuntime.random(layout, SEED))
        ids = [batcher.submit(p, PARAMS, kv=InProcessSource.from_producer(
            source, f"pd-{i}", p, PARAMS, mode=mode)) for i, p in enumerate(work)]
        finals = run_to_end(batcher)
        assert [tuple(finals[i].completion.token_ids) for i in ids] == native(layout, work), label
        assert batcher.runtime.prefill_calls == 0, label


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("family", SPECS)
def test_a_wider_payload_lands_as_the_fp8_decoders_own_write(family: str, wire: str) -> None:
    """A float32-KV producer attends over unrounded K/V, so from its second layer on its KV is not
    what an fp8 prefill computes; the decoder stores each value as its own write would."""
    spec = SPECS[family]
    source = producer(spec, "float32", wire)
    work = prompts()
    payload = source.produce("req-0", work[0])
    assert payload.header.dtype == wire
    layout = art(spec, 4, 5, FP8)
    for layer in payload.layers:   # each value rounded exactly as the decoder's own write does
        tokens = payload.header.layer_tokens[layer.layer]
        k, v = layer.float32()
        assert not np.array_equal(to_float8(k).astype(np.float32), k)   # there is rounding
        np.testing.assert_array_equal(imported_bytes(layout, layer, tokens),
                                      np.stack([to_float8(k), to_float8(v)]).view(np.uint8))
    batcher = Batcher(NumpyRuntime.random(layout, SEED))
    ids = [batcher.submit(p, PARAMS, kv=InProcessSource.from_producer(
        source, f"pd-{i}", p, PARAMS)) for i, p in enumerate(work)]
    finals = run_to_end(batcher)
    assert all(finals[i].finish_reason == "length" for i in ids)
    assert batcher.runtime.prefill_calls == 0 and batcher.stats().imports >= len(work)


@pytest.mark.parametrize("decoder_dtype", ["bfloat16", "float32"])
def test_an_fp8_payload_into_a_wider_decoder_is_refused_naming_both(decoder_dtype: str) -> None:
    spec = SPECS["llama"]
    source = producer(spec, FP8, FP8)
    layout = art(spec, 2, 3, decoder_dtype)
    work = prompts(3, seed=5)
    batcher = Batcher(NumpyRuntime.random(layout, SEED))
    bad = batcher.submit(work[0], PARAMS,
                         kv=InProcessSource.from_producer(source, "pd-bad", work[0], PARAMS))
    good = [batcher.submit(p, PARAMS) for p in work[1:]]
    finals = run_to_end(batcher)
    assert finals[bad].finish_reason == "error"
    assert "dtype='float8_e4m3fn'" in finals[bad].error
    assert f"kv_dtype={decoder_dtype!r}" in finals[bad].error
    assert [tuple(finals[g].completion.token_ids) for g in good] == native(layout, work)[1:]
    stats = batcher.stats()
    assert stats.occupied_lanes == 0 and stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_the_wire_names_the_fp8_dtype_and_sizes_its_buffers() -> None:
    spec = SPECS["gemma3"]
    payload = producer(spec, FP8, FP8).produce("req-w", prompts(1)[0])
    header = decode_header(encode_header(payload.header))
    assert header.dtype == FP8
    for layer in payload.layers:
        frames = [bytes(memoryview(f)) for f in layer_frames(layer)]
        assert len(frames[1]) == layer.k.size      # one byte per element
        again = decode_layer(header, frames)
        assert again.k.dtype == np.uint8 and np.array_equal(again.k, layer.k)
        k, _ = again.float32()
        np.testing.assert_array_equal(to_float8(k).view(np.uint8), layer.k)   # widening exact
    wide = layer_frames(LayerKV.from_float32(0, *payload.layers[0].float32(), "float16"))
    with pytest.raises(KVTransferError, match=r"k buffer has \d+ bytes, shape .* of "
                                              "float8_e4m3fn needs"):
        decode_layer(header, [bytes(memoryview(f)) for f in wide])


def test_fp8_encoding_rounds_to_nearest_even_and_saturates() -> None:
    x = np.array([1.0625, 1.1875, 500.0, -1e9, 2.0**-10, 3 * 2.0**-11, np.nan],
                 np.float32).reshape(1, 7, 1)
    layer = LayerKV.from_float32(0, x, x, FP8)
    assert layer.k.dtype == np.uint8
    k, _ = layer.float32()
    assert k.reshape(-1)[:6].tolist() == [1.0, 1.25, 448.0, -448.0, 0.0, 2.0**-9]
    assert np.isnan(k.reshape(-1)[6])


# -- the device path (emulated rebel): an fp8 ATOM as decoder and as producer ----------------------
@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from support.hf_models import save_checkpoint

    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_an_fp8_device_imports_and_exports_fp8_kv(fake_rebel: Any, tmp_path: Path,
                                                  llama_checkpoint: Path) -> None:
    from fakerebel.compiler import compile_dir

    from atombatch.runtime import RebelRuntime

    quantized = {"weights": "int8", "kv_caches": "fp8"}
    d = compile_dir(tmp_path / "c", llama_checkpoint, batch_size=2, max_seq_len=128,
                    prefill_chunk_size=16, kvcache_block_size=32, kvcache_num_blocks=9,
                    quantization=quantized)
    device = RebelRuntime.from_optimum(d)
    spec = device.spec
    work = [np.random.default_rng(n).integers(3, 512, size=n).tolist() for n in (19, 41)]
    host_art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=128, block_size=32,
                              num_blocks=9, prefill_chunk_size=16, kv_dtype=FP8)
    want = [tuple(c.token_ids) for c in Batcher(NumpyRuntime.from_pretrained(
        llama_checkpoint, artifact=host_art)).generate(work, PARAMS)]
    # decoder: an fp8 host producer's KV on a float32 wire goes through the device's rounding
    # (e4m3 values: exactly) into its fp8 caches
    wide = Producer(NumpyRuntime.from_pretrained(llama_checkpoint, artifact=ArtifactConfig(
        model=spec, batch_size=1, max_seq_len=128, block_size=64, num_blocks=3,
        prefill_chunk_size=16, kv_dtype=FP8)), dtype="float32")
    batcher = Batcher(device)
    ids = [batcher.submit(p, PARAMS, kv=InProcessSource.from_producer(wide, f"pd-{i}", p,
                                                                      PARAMS))
           for i, p in enumerate(work)]
    finals = run_to_end(batcher)
    assert [tuple(finals[i].completion.token_ids) for i in ids] == want
    assert device.prefill_calls == 0 and fake_rebel.KV_CALLS["_update_kv_cache"] > 0
    # producer: the device's fp8 bytes go out as they are and an fp8 host decoder takes them
    exporter = Producer(device, dtype=FP8)
    payload = exporter.produce("req-dev", work[1])
    assert payload.header.dtype == FP8
    decoder = Batcher(NumpyRuntime.from_pretrained(llama_checkpoint, artifact=host_art))
    rid = decoder.submit(work[1], PARAMS, kv=InProcessSource(list(payload.items()), "whole"))
    assert tuple(run_to_end(decoder)[rid].completion.token_ids) == want[1]
    assert decoder.runtime.prefill_calls == 0
