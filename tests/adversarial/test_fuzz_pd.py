"""Hypothesis fuzzing of the PD wire: hostile headers, frames and message orders only ever fail
their own request with a `KVTransferError`/`RequestError`; nothing is sized from unchecked fields,
the engine keeps its invariants and the other request finishes right.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.driving import run_to_end
from support.zmq_peers import bound_router

from atombatch import ArtifactConfig, Batcher, ModelSpec, RequestError, SamplingParams
from atombatch.pd import (
    END,
    ERROR,
    HEADER,
    LAYER,
    InProcessSource,
    KVHeader,
    KVTransferError,
    LayerKV,
    Producer,
    ZmqSource,
    check_header,
    decode_header,
    decode_layer,
    encode_header,
    layer_frames,
    validate_header,
)
from atombatch.runtime import NumpyRuntime

SPEC = ModelSpec(name="pd-fuzz", family="llama", vocab_size=64, hidden_size=16,
                 intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)
ART = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=32, block_size=8, num_blocks=9,
                     prefill_chunk_size=8)
PROMPT = [5, 9, 17, 33, 3, 7]
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PAYLOAD = Producer(NumpyRuntime.random(ART, seed=2)).produce("fuzz", PROMPT)
GOOD = {f: getattr(PAYLOAD.header, f) for f in PAYLOAD.header.__struct_fields__}
NATIVE = Batcher(NumpyRuntime.random(ART, seed=2)).generate([PROMPT], PARAMS)[0].token_ids

HUGE = st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 6, 7, 31, 32, 1024, 1025, 2**31, 2**62,
                        2**64 - 1])
# Layer counts stay <= 10**6 here: f4462de built set(range(num_layers)), and a fuzz run against it
# must cost at most ~100 MiB (the 2**62 case is test_hostile_pd.py's "huge" id).
LAYER_COUNTS = st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 1024, 1025, 10**6])
FIELD_VALUES: dict[str, Any] = {
    "request_id": st.one_of(st.text(max_size=20), st.just("x" * 100_000),
                            st.integers(-2**63, 2**64 - 1)),  # what msgpack can carry
    "model_identity": st.one_of(st.just(GOOD["model_identity"]), st.text(max_size=20)),
    "num_layers": LAYER_COUNTS,
    "layer_kinds": st.one_of(st.just(GOOD["layer_kinds"]),
                             st.lists(st.sampled_from(["full_attention", "sliding_attention",
                                                       "x" * 1000]), max_size=40)),
    "prompt_len": HUGE,
    "covered_len": HUGE,
    "first_token": st.one_of(st.none(), HUGE),
    "dtype": st.sampled_from(["float32", "float16", "bfloat16", "int8", "", "f" * 10_000]),
    "kv_heads": HUGE,
    "head_dim": HUGE,
    "sliding_window": HUGE,
    "layer_tokens": st.one_of(st.just(GOOD["layer_tokens"]), st.lists(HUGE, max_size=40)),
}


@st.composite
def header_maps(draw: st.DrawFn) -> dict[str, Any]:
    """The good header with a few fields replaced by hostile values (or dropped)."""
    fields = dict(GOOD)
    for name in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=4, unique=True)):
        if draw(st.booleans()) and name != "first_token":
            fields[name] = draw(FIELD_VALUES[name])
        elif draw(st.integers(0, 9)) == 0:
            del fields[name]
        else:
            fields[name] = draw(FIELD_VALUES[name])
    return fields


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(fields=header_maps())
def test_a_decoded_header_is_bounded_or_refused(fields: dict[str, Any]) -> None:
    try:
        frame = msgspec.msgpack.encode(fields)
    except OverflowError:  # an int msgpack cannot carry never reaches a decoder
        return
    try:
        header = decode_header(frame)
    except KVTransferError as exc:
        assert len(str(exc)) < 1000
        return
    check_header(header)  # whatever decodes is within the field bounds
    assert header.num_layers <= 1024 and len(header.layer_tokens) == header.num_layers
    try:
        validate_header(header, ART, PROMPT, require_full=False)
    except RequestError as exc:
        assert len(str(exc)) < 1000


@FUZZ
@given(index=st.one_of(HUGE, st.just(0)), k=st.binary(max_size=600),
       v=st.binary(max_size=600), extra=st.lists(st.binary(max_size=8), max_size=2),
       raw_index=st.one_of(st.none(), st.binary(max_size=12)))
def test_a_decoded_layer_matches_its_header_or_is_refused(index: int, k: bytes, v: bytes,
                                                          extra: list[bytes],
                                                          raw_index: bytes | None) -> None:
    header = PAYLOAD.header
    frames = [raw_index if raw_index is not None else msgspec.msgpack.encode(index), k, v, *extra]
    try:
        layer = decode_layer(header, frames)
    except KVTransferError as exc:
        assert len(str(exc)) < 1000
        return
    shape = (header.kv_heads, header.layer_tokens[layer.layer], header.head_dim)
    assert layer.k.shape == layer.v.shape == shape


ITEMS = st.lists(st.one_of(
    st.builds(lambda f: ("header", f), header_maps()),
    st.builds(lambda i: ("layer", i), st.integers(0, 1)),
    st.builds(lambda i: ("layer", i), HUGE),
    st.builds(lambda: ("error", None)),
), max_size=6)


def _items(spec: list[tuple[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for kind, value in spec:
        if kind == "header":
            try:
                out.append(msgspec.convert(value, KVHeader))
            except msgspec.ValidationError:
                out.append(ValueError("unconvertible header"))
        elif kind == "layer":
            good = PAYLOAD.layers[value % 2]
            out.append(LayerKV(value, good.k, good.v))
        else:
            out.append(RuntimeError("producer failed"))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=ITEMS, mode=st.sampled_from(["whole", "layer-stream"]))
def test_hostile_in_process_streams_fail_only_their_request(spec: list[tuple[str, Any]],
                                                            mode: str) -> None:
    batcher = Batcher(NumpyRuntime.random(ART, seed=2), pd_timeout=5.0)
    hostile = batcher.submit(PROMPT, PARAMS, kv=InProcessSource(_items(spec), mode))  # type: ignore[arg-type]
    honest = batcher.submit(PROMPT, PARAMS)
    finals = run_to_end(batcher)  # checks the ownership invariants after every step
    assert finals[hostile].finish_reason in ("error", "length")
    if finals[hostile].finish_reason == "length":
        assert finals[hostile].completion.token_ids == NATIVE
    else:
        assert len(finals[hostile].error or "") < 2000
    assert finals[honest].completion.token_ids == NATIVE
    stats = batcher.stats()
    assert stats.lane_blocks == 0 and stats.staged_blocks == 0


@pytest.fixture(scope="module")
def router() -> Any:
    socket, endpoint = bound_router()
    yield socket, endpoint
    socket.close()


FRAME_KINDS = st.sampled_from([HEADER, LAYER, END, ERROR, b"Q", b"", b"H" * 100])
MESSAGES = st.lists(st.one_of(
    st.builds(lambda f: [HEADER, msgspec.msgpack.encode(f)], header_maps()),
    st.just([HEADER, encode_header(PAYLOAD.header)]),
    st.sampled_from([[LAYER, *layer_frames(x)] for x in PAYLOAD.layers]),
    st.builds(lambda n: [END, msgspec.msgpack.encode(n)], HUGE),
    st.builds(lambda kind, frames: [kind, *frames], FRAME_KINDS,
              st.lists(st.binary(max_size=300), max_size=4)),
), max_size=6)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(messages=MESSAGES)
def test_hostile_zeromq_frames_fail_the_source_with_a_transfer_error(router: Any,
                                                                     messages: list[Any]) -> None:
    socket, endpoint = router
    source = ZmqSource(endpoint, "fuzz", PROMPT, artifact=ART)
    try:
        assert socket.poll(5000)
        peer, _, _ = socket.recv_multipart()
        for message in messages:
            socket.send_multipart([peer, *message])
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline and not source.done():
            try:
                header, layers = source.poll()
            except KVTransferError as exc:
                assert len(str(exc)) < 5000
                break
            for layer in layers:
                assert isinstance(layer.k, np.ndarray)
    finally:
        source.close()
