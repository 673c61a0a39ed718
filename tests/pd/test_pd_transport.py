"""PD payload, producer and transports: what crosses the wire, and every way a transfer can fail."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from support.numerics import assert_f32_close, assert_same_argmax, reduction_length
from support.producers import run_producer_process
from support.zmq_peers import bound_router

from atombatch.api.structs import SamplingParams
from atombatch.artifact.config import FULL, SLIDING, ArtifactConfig, ModelSpec
from atombatch.errors import RequestError
from atombatch.kernel.blocks import PrefillInputs
from atombatch.pd import (
    END,
    ERROR,
    HEADER,
    LAYER,
    InProcessSource,
    KVHeader,
    KVPayload,
    KVSource,
    KVTransferError,
    LayerKV,
    Producer,
    ZmqSource,
    decode_header,
    decode_layer,
    encode_header,
    layer_frames,
    model_identity,
    validate_header,
    validate_layer,
)
from atombatch.runtime.numpy_runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

WINDOW = 8
SPECS = {
    "llama": ModelSpec(name="tiny-llama", family="llama", vocab_size=128, hidden_size=32,
                       intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, rms_norm_eps=1e-5),
    "qwen3": ModelSpec(name="tiny-qwen3", family="qwen3", vocab_size=128, hidden_size=32,
                       intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                       head_dim=16, tie_word_embeddings=True),
    "gemma3": ModelSpec(name="tiny-gemma3", family="gemma3", vocab_size=128, hidden_size=32,
                        intermediate_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                        head_dim=8, sliding_window=WINDOW, layer_types=(SLIDING, SLIDING, FULL) * 2,
                        query_pre_attn_scalar=12.0, final_logit_softcapping=30.0,
                        tie_word_embeddings=True),
}
# The producer's artifact: one lane, blocks of 32, chunk 16, a bigger context.
PRODUCER_ART = dict(batch_size=1, max_seq_len=128, block_size=32, num_blocks=5,
                    prefill_chunk_size=16, kv_dtype="float32")
# The decoder's artifact: three lanes, partitioned blocks of 16, chunk 8.
DECODER_ART = dict(batch_size=3, max_seq_len=64, block_size=16, num_blocks=13,
                   prefill_chunk_size=8, kv_dtype="float32")
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 128, size=37)]


def close(family: str, actual: np.ndarray, desired: np.ndarray) -> None:
    """Equal up to float32 reordering: the producer and the decoder chunk the prompt differently
    (16 vs 8 tokens), so their matrix shapes, and with them the BLAS kernels' sums, differ."""
    spec = SPECS[family]
    assert_f32_close(actual, desired, reduction=reduction_length(spec, PRODUCER_ART["max_seq_len"]),
                     depth=spec.num_layers + 1)


def runtime(family: str, layout: dict[str, Any], seed: int = 0) -> NumpyRuntime:
    return NumpyRuntime.random(ArtifactConfig(model=SPECS[family], **layout), seed=seed)


def native_prefill(rt: NumpyRuntime, prompt: list[int], row: list[int], slot: int) -> np.ndarray:
    """The decoder's own chunked prefill of `prompt` through `row`/`slot`; the last logits."""
    art = rt.artifact
    inputs = PrefillInputs(art.prefill_chunk_size, art.blocks_per_seq)
    logits = None
    for start in range(0, len(prompt), art.prefill_chunk_size):
        inputs.build(np.asarray(prompt), start, row, len(row), slot)
        logits = rt.prefill(inputs)
    assert logits is not None
    return logits


def decode_one(rt: NumpyRuntime, lane: int, token: int, position: int, row: list[int],
               spare: int) -> np.ndarray:
    """One decode step with `lane` feeding `token` at `position`, idle lanes on `spare`."""
    art = rt.artifact
    b, bps = art.batch_size, art.blocks_per_seq
    ids = np.zeros((b, 1), np.int64)
    pos = np.zeros((b, 1), np.int32)
    tables = np.full((b, bps), spare, np.int16)
    ids[lane, 0], pos[lane, 0] = token, position
    tables[lane, : len(row)] = row
    tables[lane, len(row):] = row[-1]
    local = np.arange(b, dtype=np.int16).reshape(b, 1)

    class Inputs:
        input_ids, cache_position, block_tables, local_block_tables = ids, pos, tables, local

    return rt.decode(Inputs)[lane]


def poll_until(source: KVSource, timeout: float = 15.0) -> tuple[KVHeader, list[LayerKV], int]:
    """Poll until done (or raise); returns header, layers and the number of polls that gave any."""
    deadline = time.monotonic() + timeout
    header, layers, busy = None, [], 0
    while not source.done():
        if time.monotonic() > deadline:
            raise TimeoutError("source neither finished nor failed")
        header, got = source.poll()
        layers += got
        busy += bool(got)
        if not got:
            time.sleep(0.002)
    assert header is not None
    return header, layers, busy


def assert_same_payload(a: KVPayload | tuple[KVHeader, list[LayerKV]],
                        b: KVPayload | tuple[KVHeader, list[LayerKV]]) -> None:
    ha, la = (a.header, a.layers) if isinstance(a, KVPayload) else a
    hb, lb = (b.header, b.layers) if isinstance(b, KVPayload) else b
    assert msgspec.structs.replace(ha, request_id="") == msgspec.structs.replace(hb, request_id="")
    assert [x.layer for x in la] == [x.layer for x in lb]
    for x, y in zip(la, lb, strict=True):
        assert x.k.dtype == y.k.dtype and np.array_equal(x.k, y.k)
        assert x.v.dtype == y.v.dtype and np.array_equal(x.v, y.v)


@pytest.fixture(scope="module")
def gemma_producer() -> Producer:
    return Producer(runtime("gemma3", PRODUCER_ART, seed=3))


@pytest.fixture(scope="module")
def gemma_payload(gemma_producer: Producer) -> KVPayload:
    return gemma_producer.produce("req-1", PROMPT)


# -- payload and wire encoding ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_payload_round_trips_through_msgpack_header_and_raw_frames(dtype: str) -> None:
    producer = Producer(runtime("gemma3", PRODUCER_ART, seed=3), dtype=dtype)
    payload = producer.produce("req-rt", PROMPT)
    exact = Producer(runtime("gemma3", PRODUCER_ART, seed=3)).produce("req-rt", PROMPT)
    assert payload.header.dtype == dtype
    wire_header = encode_header(payload.header)
    assert isinstance(msgspec.msgpack.decode(wire_header), dict)   # a map keyed by field name
    header = decode_header(wire_header)
    assert header == payload.header
    layers = [decode_layer(header, [bytes(memoryview(f)) for f in layer_frames(layer)])
              for layer in payload.layers]
    assert_same_payload(payload, (header, layers))
    tolerance = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    for mine, ref in zip(layers, exact.layers, strict=True):
        k, v = mine.float32()
        k_ref, v_ref = ref.float32()
        assert k.dtype == np.float32 and k.shape == k_ref.shape
        for x, y in ((k, k_ref), (v, v_ref)):
            np.testing.assert_allclose(x, y, rtol=tolerance, atol=1e-6 if tolerance else 0)


def test_bfloat16_encoding_rounds_to_nearest_even_and_widens_exactly() -> None:
    x = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, np.inf, np.nan],
                 np.float32).reshape(1, 7, 1)
    layer = LayerKV.from_float32(0, x, x, "bfloat16")
    assert layer.k.dtype == np.dtype("<u2")
    k, _ = layer.float32()
    expected = [1.0, -2.5, 1.0, 1 + 4 * 2**-8, 1 + 2 * 2**-8, np.inf]
    assert k.reshape(-1)[:6].tolist() == expected
    assert np.isnan(k.reshape(-1)[6])


def test_model_identity_ignores_names_and_artifacts_but_not_math() -> None:
    spec = SPECS["llama"]
    renamed = msgspec.structs.replace(spec, name="other", bos_token_id=1, eos_token_ids=(2,))
    assert model_identity(renamed) == model_identity(spec)
    assert model_identity(msgspec.structs.replace(spec, rope_theta=5e5)) != model_identity(spec)
    assert model_identity(SPECS["qwen3"]) != model_identity(spec)
    assert len(model_identity(spec)) == 16 and int(model_identity(spec), 16) >= 0


# -- producer vs the decoder's own prefill ---------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_producer_with_another_layout_gives_the_decoders_own_kv(family: str) -> None:
    producer = Producer(runtime(family, PRODUCER_ART, seed=5))
    payload = producer.produce("req-x", PROMPT)
    spec = SPECS[family]
    assert payload.header.layer_tokens == tuple(
        min(len(PROMPT), WINDOW) if kind == SLIDING else len(PROMPT) for kind in spec.layer_kinds)

    native = runtime(family, DECODER_ART, seed=5)
    native_row, native_slot = [7, 2, 11], 1
    native_logits = native_prefill(native, PROMPT, native_row, native_slot)
    assert payload.header.first_token == int(np.argmax(native_logits))
    assert payload.header.first_token == int(np.argmax(native.reference_logits(PROMPT)[-1]))

    decoder = runtime(family, DECODER_ART, seed=5)
    import_row, import_slot = [4, 9, 0], 2
    validate_header(payload.header, decoder.artifact, PROMPT, require_full=spec.is_hybrid)
    seen: set[int] = set()
    for layer in payload.layers:
        validate_layer(payload.header, layer, seen)
        decoder.write_layer_kv(layer.layer, *layer.float32(), import_row, import_slot)
    assert decoder.import_calls == spec.num_layers
    for i in range(spec.num_layers):
        got = decoder.read_layer_kv(i, import_row, len(PROMPT), import_slot)
        want = native.read_layer_kv(i, native_row, len(PROMPT), native_slot)
        for x, y in zip(got, want, strict=True):
            close(family, x, y)

    # Decoding after the import continues as the native sequence does.
    token = payload.header.first_token
    for position in range(len(PROMPT), len(PROMPT) + 4):
        mine = decode_one(decoder, import_slot, token, position, import_row, spare=12)
        theirs = decode_one(native, native_slot, token, position, native_row, spare=12)
        close(family, mine, theirs)
        assert_same_argmax(mine, theirs, reduction=reduction_length(spec, PRODUCER_ART["max_seq_len"]),
                           depth=spec.num_layers + 1)
        token = int(np.argmax(theirs))


def test_partial_prefix_carries_the_first_tokens_only() -> None:
    producer = Producer(runtime("llama", PRODUCER_ART, seed=5))
    payload = producer.produce("req-p", PROMPT, covered_len=20)
    assert payload.header.covered_len == 20 and payload.header.first_token is None
    assert payload.header.layer_tokens == (20, 20)
    decoder = runtime("llama", DECODER_ART, seed=5)
    validate_header(payload.header, decoder.artifact, PROMPT, require_full=False)
    with pytest.raises(RequestError, match="full prefix"):
        validate_header(payload.header, decoder.artifact, PROMPT, require_full=True)
    native = runtime("llama", DECODER_ART, seed=5)
    native_prefill(native, PROMPT, [0, 1, 2], 0)
    for layer in payload.layers:
        want = native.read_layer_kv(layer.layer, [0, 1, 2], 20)
        for x, y in zip(layer.float32(), want, strict=True):
            close("llama", x, y)


def test_sampled_first_token_uses_the_request_seed(gemma_producer: Producer) -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    first = {gemma_producer.produce("s", PROMPT, params).header.first_token for _ in range(3)}
    assert len(first) == 1


def test_producer_rejects_bad_requests(gemma_producer: Producer) -> None:
    with pytest.raises(RequestError, match="vocabulary"):
        gemma_producer.produce("bad", [1, 2, 500])
    with pytest.raises(RequestError, match="covered_len=0"):
        gemma_producer.produce("bad", [1, 2, 3], covered_len=0)
    with pytest.raises(RequestError, match="max_seq_len=128"):
        gemma_producer.produce("bad", [1] * 129)
    with pytest.raises(RequestError, match="mode"):
        gemma_producer.stream("bad", [1, 2], mode="bulk")  # type: ignore[arg-type]


def test_runtime_layer_io_rejects_bad_shapes() -> None:
    rt = runtime("gemma3", DECODER_ART)
    k = np.zeros((2, 5, 8), np.float32)
    with pytest.raises(Exception, match="kv_heads"):
        rt.write_layer_kv(2, k[:1], k[:1], [0])
    with pytest.raises(Exception, match="window=8"):
        rt.write_layer_kv(0, np.zeros((2, 9, 8), np.float32), np.zeros((2, 9, 8), np.float32), [0])
    with pytest.raises(Exception, match="need 2"):
        rt.write_layer_kv(2, np.zeros((2, 17, 8), np.float32), np.zeros((2, 17, 8), np.float32),
                          [0])
    with pytest.raises(Exception, match="layer=6"):
        rt.read_layer_kv(6, [0], 4)
    with pytest.raises(Exception, match="sliding slot 3"):
        rt.read_layer_kv(0, [0], 4, slot=3)


# -- header and layer checks -----------------------------------------------------------------------
def _decoder_art(**changes: Any) -> ArtifactConfig:
    return ArtifactConfig(model=SPECS["gemma3"], **{**DECODER_ART, **changes})


HEADER_REJECTIONS = [
    ({"model_identity": "0" * 16}, "model_identity='0000000000000000'.*identity"),
    ({"num_layers": 5}, "num_layers=5.*num_layers=6"),
    ({"layer_kinds": (FULL,) * 6}, "layer_kinds=.*layer_kinds="),
    ({"kv_heads": 1}, "kv_heads=1.*kv_heads=2"),
    ({"head_dim": 16}, "head_dim=16.*head_dim=8"),
    ({"sliding_window": 16}, "sliding_window=16.*sliding_window=8"),
    ({"dtype": "int8"}, "dtype='int8'.*must be one of"),
    ({"prompt_len": 36}, "prompt_len=36.*37 tokens"),
    ({"covered_len": 0}, "covered_len=0.*1..prompt_len=37"),
    ({"covered_len": 38}, "covered_len=38.*1..prompt_len=37"),
    ({"covered_len": 30, "first_token": None}, "covered_len=30.*full prefix"),
    ({"first_token": None}, "first_token=None.*must carry the first token"),
    ({"first_token": 128}, "first_token=128.*vocabulary 0..127"),
    ({"first_token": -1}, "first_token=-1.*vocabulary"),
    ({"layer_tokens": (8, 8, 37, 8, 8, 36)}, "layer_tokens=.*min\\(covered_len, window=8\\)"),
    ({"layer_tokens": (8, 8, 37)}, "layer_tokens="),
]


@pytest.mark.parametrize(("changes", "message"), HEADER_REJECTIONS,
                         ids=[next(iter(c)) + str(i) for i, (c, _) in
                              enumerate(HEADER_REJECTIONS)])
def test_validate_header_rejects(gemma_payload: KVPayload, changes: dict[str, Any],
                                 message: str) -> None:
    header = msgspec.structs.replace(gemma_payload.header, **changes)
    with pytest.raises(RequestError, match=message):
        validate_header(header, _decoder_art(), PROMPT, require_full=True)


def test_validate_header_partial_prefix_rules(gemma_payload: KVPayload) -> None:
    partial = msgspec.structs.replace(gemma_payload.header, covered_len=30, first_token=None,
                                      layer_tokens=(8, 8, 30, 8, 8, 30))
    validate_header(partial, _decoder_art(), PROMPT, require_full=False)
    with pytest.raises(RequestError, match=r"first_token=5.*must be None for a partial prefix"):
        validate_header(msgspec.structs.replace(partial, first_token=5), _decoder_art(), PROMPT,
                        require_full=False)
    validate_header(gemma_payload.header, _decoder_art(), PROMPT, require_full=True)


def test_validate_header_needs_room_for_a_decode_step(gemma_producer: Producer) -> None:
    prompt = PROMPT + PROMPT[:27]                                  # 64 tokens
    header = gemma_producer.produce("long", prompt).header
    with pytest.raises(RequestError, match=r"covered_len=64.*max_seq_len=64"):
        validate_header(header, _decoder_art(), prompt, require_full=True)
    validate_header(header, _decoder_art(max_seq_len=80), prompt, require_full=True)


def _layer(payload: KVPayload, index: int, **changes: Any) -> LayerKV:
    layer = payload.layers[index]
    return LayerKV(changes.get("layer", layer.layer), changes.get("k", layer.k),
                   changes.get("v", layer.v))


def test_validate_layer_rejects(gemma_payload: KVPayload) -> None:
    header = gemma_payload.header
    good = gemma_payload.layers[2]
    cases = [
        (_layer(gemma_payload, 2, layer=6), set(), "layer=6 is outside 0..5"),
        (_layer(gemma_payload, 2, layer=-1), set(), "layer=-1 is outside"),
        (good, {2}, "layer=2 arrived twice"),
        (_layer(gemma_payload, 2, k=good.k[:, :-1]), set(),
         r"layer=2 k has shape \(2, 36, 8\).*\(2, 37, 8\)"),
        (_layer(gemma_payload, 0, v=gemma_payload.layers[2].v), set(),
         r"layer=0 v has shape \(2, 37, 8\).*\(2, 8, 8\)"),
        (_layer(gemma_payload, 2, k=good.k.astype(np.float16)), set(),
         "layer=2 k has dtype float16.*'float32'"),
        (_layer(gemma_payload, 2, v=good.v.tolist()), set(), "not an array"),
    ]
    for layer, seen, message in cases:
        before = set(seen)
        with pytest.raises(RequestError, match=message):
            validate_layer(header, layer, seen)
        assert seen == before
    seen = set()
    for layer in gemma_payload.layers:
        validate_layer(header, layer, seen)
    assert seen == set(range(6))


# -- in-process source: pacing and fault injection -------------------------------------------------
def items_of(payload: KVPayload) -> list[Any]:
    return list(payload.items())


def dropped(payload: KVPayload, index: int) -> list[Any]:
    return [payload.header, *(x for x in payload.layers if x.layer != index)]


def duplicated(payload: KVPayload, index: int) -> list[Any]:
    return [*items_of(payload), payload.layers[index]]


def truncated(payload: KVPayload, keep: int) -> list[Any]:
    return [payload.header, *payload.layers[:keep]]


def failing(payload: KVPayload, at: int) -> list[Any]:
    return [payload.header, *payload.layers[:at], RuntimeError("device lost"),
            *payload.layers[at:]]


def test_whole_hands_out_everything_in_one_poll(gemma_producer: Producer,
                                                gemma_payload: KVPayload) -> None:
    source = InProcessSource.from_producer(gemma_producer, "req-1", PROMPT, mode="whole")
    assert not source.done()
    header, layers = source.poll()
    assert source.done() and source.polls == 1
    assert_same_payload(gemma_payload, (header, layers))
    assert source.poll() == (header, [])     # same header object, nothing new
    assert source.poll()[0] is header
    source.close()
    source.close()


def test_layer_stream_hands_out_one_layer_per_poll(gemma_producer: Producer,
                                                   gemma_payload: KVPayload) -> None:
    source = InProcessSource.from_producer(gemma_producer, "req-1", PROMPT)
    seen: list[int] = []
    header = None
    for i in range(6):
        assert not source.done()
        got_header, layers = source.poll()
        header = header or got_header
        assert got_header is header and [x.layer for x in layers] == [i]
        seen.append(i)
    assert source.done()             # known with the last layer, not one poll later
    assert source.polls == 6
    source.close()


def test_empty_stream_is_an_error() -> None:
    source = InProcessSource(iter(()), mode="layer-stream")
    with pytest.raises(KVTransferError, match="ended before the header"):
        source.poll()


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize(("fault", "message"), [
    (lambda p: dropped(p, 2), r"ended after 5 of num_layers=6 layers \(missing \[2\]\)"),
    (lambda p: duplicated(p, 4), "layer 4 is extra"),
    (lambda p: truncated(p, 3), r"ended after 3 of num_layers=6 layers \(missing \[3, 4, 5\]\)"),
    (lambda p: truncated(p, 0), "ended after 0 of"),
    (lambda p: [x for x in duplicated(p, 1) if not (isinstance(x, LayerKV) and x.layer == 5)],
     r"missing \[5\]"),
    (lambda p: failing(p, 3), "KV producer failed: RuntimeError: device lost"),
    (lambda p: failing(p, 0), "device lost"),
    (lambda p: p.layers[:1], "layer 0 arrived before the header"),
    (lambda p: [p.header, p.header], "a second header"),
    (lambda p: [p.header, "junk"], "got a str"),
], ids=["drop", "duplicate", "truncate", "header-only", "dup-and-drop", "raise-mid",
        "raise-first", "no-header", "two-headers", "junk"])
def test_in_process_faults_raise_kv_transfer_error(
        gemma_payload: KVPayload, mode: str, fault: Callable[[KVPayload], list[Any]],
        message: str) -> None:
    source = InProcessSource(fault(gemma_payload), mode=mode)  # type: ignore[arg-type]
    handed: list[int] = []
    with pytest.raises(KVTransferError, match=message) as caught:
        for _ in range(20):
            _, layers = source.poll()
            handed += [x.layer for x in layers]
    assert isinstance(caught.value, RequestError)
    assert not source.done()
    if mode == "whole":
        assert handed == []           # whole never hands out part of a broken payload
    with pytest.raises(KVTransferError, match=message):
        source.poll()                 # sticky
    source.close()


def test_layer_stream_fault_comes_after_the_layers_before_it(gemma_payload: KVPayload) -> None:
    source = InProcessSource(failing(gemma_payload, 3), mode="layer-stream")
    for i in range(3):
        assert [x.layer for x in source.poll()[1]] == [i]
    with pytest.raises(KVTransferError, match="device lost") as caught:
        source.poll()
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_raising_producer_iterator_and_closed_source(gemma_payload: KVPayload) -> None:
    def producer() -> Iterator[Any]:
        yield gemma_payload.header
        raise MemoryError("out of host memory")
    source = InProcessSource(producer(), mode="layer-stream")
    with pytest.raises(KVTransferError, match="MemoryError: out of host memory"):
        source.poll()
    closed = InProcessSource(items_of(gemma_payload))
    closed.close()
    with pytest.raises(KVTransferError, match="closed"):
        closed.poll()
    with pytest.raises(RequestError, match="mode"):
        InProcessSource([], mode="bulk")  # type: ignore[arg-type]


def test_wrong_dtype_layer_passes_the_source_and_fails_validate_layer(
        gemma_payload: KVPayload) -> None:
    bad = [gemma_payload.header, *gemma_payload.layers[:2],
           _layer(gemma_payload, 2, k=gemma_payload.layers[2].k.astype(np.float16)),
           *gemma_payload.layers[3:]]
    header, layers, _ = poll_until(InProcessSource(bad, mode="whole"))
    seen: set[int] = set()
    with pytest.raises(RequestError, match="dtype float16"):
        for layer in layers:
            validate_layer(header, layer, seen)


# -- ZeroMQ: producer in another process -----------------------------------------------------------
def free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Producers:
    """Producer processes spawned once for the module (their start-up overlaps)."""

    def __init__(self, tmp: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.good = f"ipc://{tmp}/good.sock"
        self.good_tcp = free_tcp_endpoint()
        self.failing = free_tcp_endpoint()
        self.slow = free_tcp_endpoint()
        targets = [
            (self.good, {}),
            (self.good_tcp, {}),
            (self.failing, {"fail_at_layer": 3}),
            (self.slow, {"layer_delay": 0.4}),
        ]
        self.processes: dict[str, Any] = {}
        for endpoint, kwargs in targets:
            process = ctx.Process(target=run_producer_process,
                                  args=(SPECS["gemma3"], PRODUCER_ART, 3, endpoint),
                                  kwargs=kwargs, daemon=True)
            process.start()
            self.processes[endpoint] = process

    def close(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
            process.join(5)


@pytest.fixture(scope="module")
def producers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producers]:
    started = Producers(tmp_path_factory.mktemp("pd"))
    yield started
    started.close()


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_zmq_producer_process_delivers_the_in_process_payload(
        producers: Producers, gemma_payload: KVPayload, mode: str, transport: str) -> None:
    endpoint = producers.good if transport == "ipc" else producers.good_tcp
    source = ZmqSource(endpoint, "req-zmq", PROMPT, mode=mode)  # type: ignore[arg-type]
    try:
        header, layers, busy = poll_until(source)
        assert header.request_id == "req-zmq"
        assert_same_payload(gemma_payload, (header, layers))
        assert not layers[0].k.flags.owndata          # a zero-copy view of the received frame
        if mode == "whole":
            assert busy == 1
        assert source.poll() == (header, [])
    finally:
        source.close()
        source.close()


def test_zmq_serves_concurrent_requests_each_to_its_own_source(
        producers: Producers, gemma_payload: KVPayload) -> None:
    other = PROMPT[:20]
    expected = Producer(runtime("gemma3", PRODUCER_ART, seed=3)).produce("o", other)
    sources = [ZmqSource(producers.good, "a", PROMPT), ZmqSource(producers.good, "b", other)]
    try:
        a, b = (poll_until(s)[:2] for s in sources)
        assert_same_payload(gemma_payload, a)
        assert_same_payload(expected, b)
    finally:
        for s in sources:
            s.close()


def test_zmq_producer_exception_before_the_header(producers: Producers) -> None:
    source = ZmqSource(producers.good, "bad", [1, 2, 999])
    try:
        with pytest.raises(KVTransferError,
                           match=r"RequestError: prompt tokens 1\.\.999 are outside"):
            poll_until(source)
        with pytest.raises(KVTransferError, match="outside"):
            source.poll()
    finally:
        source.close()


def test_zmq_producer_exception_mid_stream(producers: Producers) -> None:
    source = ZmqSource(producers.failing, "mid", PROMPT)
    handed: list[int] = []
    try:
        with pytest.raises(KVTransferError, match="injected producer failure at layer 3"):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                handed += [x.layer for x in source.poll()[1]]
                time.sleep(0.002)
        # Layers that arrived with the error in one poll are not handed out: the request fails.
        assert handed == [0, 1, 2][: len(handed)]
    finally:
        source.close()


def test_zmq_killed_producer_surfaces_as_kv_transfer_error(producers: Producers) -> None:
    process = producers.processes[producers.slow]
    source = ZmqSource(producers.slow, "doomed", PROMPT)
    try:
        deadline = time.monotonic() + 20
        got: list[int] = []
        while not got and time.monotonic() < deadline:   # wait until the stream is under way
            got += [x.layer for x in source.poll()[1]]
            time.sleep(0.005)
        assert got == [0]
        os.kill(process.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(KVTransferError, match=r"disconnected after [12] of 6 layers"):
            while time.monotonic() < killed + 5:
                source.poll()
                time.sleep(0.005)
        assert time.monotonic() - killed < 2.0              # the monitor, not a timeout
    finally:
        source.close()


def test_zmq_bad_endpoint_and_closed_source() -> None:
    with pytest.raises(KVTransferError, match="cannot reach a KV producer at 'nowhere'"):
        ZmqSource("nowhere", "x", [1, 2])
    source = ZmqSource(free_tcp_endpoint(), "x", [1, 2])   # nobody listens: silence
    assert source.poll() == (None, []) and not source.done()
    source.close()
    with pytest.raises(KVTransferError, match="closed"):
        source.poll()


class FakeProducer:
    """A ROUTER socket in the test that answers with whatever frames a case needs."""

    def __init__(self) -> None:
        self.socket, self.endpoint = bound_router()

    def answer(self, messages: Iterable[list[Any]]) -> None:
        assert self.socket.poll(5000)
        peer, kind, _request = self.socket.recv_multipart()
        assert kind == b"R"
        for message in messages:
            self.socket.send_multipart([peer, *message])

    def close(self) -> None:
        self.socket.close()


def _garbles(payload: KVPayload) -> dict[str, tuple[list[list[Any]], str]]:
    header = encode_header(payload.header)
    layer0 = layer_frames(payload.layers[0])
    good = [[LAYER, *layer_frames(x)] for x in payload.layers]
    return {
        "header-bytes": ([[HEADER, b"\xc1garbage"]], "not a valid header"),
        "header-type": ([[HEADER, msgspec.msgpack.encode({"request_id": 3})]],
                        "not a valid header"),
        "short-k": ([[HEADER, header], [LAYER, layer0[0], bytes(layer0[1])[:-4], layer0[2]]],
                    "k buffer has .* bytes"),
        "missing-v": ([[HEADER, header], [LAYER, layer0[0], layer0[1]]], "has 2 frames"),
        "bad-index": ([[HEADER, header], [LAYER, msgspec.msgpack.encode(9), *layer0[1:]]],
                      "layer=9 is outside"),
        "index-not-int": ([[HEADER, header], [LAYER, b"\xa1x", *layer0[1:]]], "not a msgpack int"),
        "unknown-kind": ([[HEADER, header], [b"Q", b""]], "unknown message kind"),
        "layer-first": ([good[0]], "before the header"),
        "end-early": ([[HEADER, header], *good[:4], [END, msgspec.msgpack.encode(4)]],
                      r"ended after 4 of num_layers=6 layers \(missing \[4, 5\]\)"),
        "end-miscount": ([[HEADER, header], *good, [END, msgspec.msgpack.encode(7)]],
                         "says it sent 7 layers, 6 arrived"),
        "extra": ([[HEADER, header], *good, good[0]], "layer 0 is extra"),
        "error-frame": ([[HEADER, header], good[0], [ERROR, "boom ü".encode()]], "failed: boom ü"),
    }


GARBLES = ["header-bytes", "header-type", "short-k", "missing-v", "bad-index", "index-not-int",
           "unknown-kind", "layer-first", "end-early", "end-miscount", "extra", "error-frame"]


@pytest.mark.parametrize("case", GARBLES)
def test_zmq_garbled_frames_raise_kv_transfer_error(gemma_payload: KVPayload, case: str) -> None:
    messages, message = _garbles(gemma_payload)[case]
    fake = FakeProducer()
    source = ZmqSource(fake.endpoint, "garbled", PROMPT)
    try:
        fake.answer(messages)
        with pytest.raises(KVTransferError, match=message):
            poll_until(source, timeout=5)
        with pytest.raises(KVTransferError, match=message):
            source.poll()
        assert not source.done()
    finally:
        source.close()
        fake.close()


def test_zmq_fake_producer_in_another_language_style(gemma_payload: KVPayload) -> None:
    """A producer that builds every frame by hand from docs/pd.md is understood."""
    fake = FakeProducer()
    source = ZmqSource(fake.endpoint, "hand", PROMPT, mode="layer-stream")
    try:
        h = gemma_payload.header
        header_map = {f: getattr(h, f) for f in h.__struct_fields__}
        messages = [[HEADER, msgspec.msgpack.encode(header_map)]]
        for layer in gemma_payload.layers:
            messages.append([LAYER, msgspec.msgpack.encode(layer.layer),
                             layer.k.astype("<f4").tobytes(), layer.v.astype("<f4").tobytes()])
        messages.append([END, msgspec.msgpack.encode(len(gemma_payload.layers))])
        fake.answer(messages)
        assert_same_payload(gemma_payload, poll_until(source)[:2])
    finally:
        source.close()
        fake.close()
