"""Prefill/decode disaggregation end to end: PD output equals native output, faults stay local.

The producer is a NumpyRuntime with a different artifact (batch, block size, chunk) than the
decoder but the same weights; only tokens x heads x dim cross the wire.
"""

from __future__ import annotations

import multiprocessing
import re
import socket
import time

import numpy as np
import pytest
from support.driving import run_to_end
from support.pd_models import (  # noqa: F401
    PARAMS,
    SEED,
    SPECS,
    TINY,
    artifact,
    decoder_layouts,
    native,
    producer_for,
    prompts,
    run_pd,
)
from support.producers import run_producer_process

from atombatch import Batcher, SamplingParams
from atombatch.pd import (
    InProcessSource,
    KVHeader,
    LayerKV,
    ZmqSource,
)
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize("family", SPECS)
def test_in_process_pd_equals_native(family, mode):
    spec = SPECS[family]
    producer = producer_for(spec)
    work = prompts()
    for label, art in decoder_layouts(spec).items():
        want = native(spec, work, art)
        batcher = Batcher(NumpyRuntime.random(art, SEED))
        got, _ = run_pd(batcher, work, lambda rid, p: InProcessSource.from_producer(
            producer, rid, p, PARAMS, mode=mode))
        assert [o.completion.token_ids for o in got] == want, label
        assert batcher.runtime.prefill_calls == 0, label  # the decoder never prefilled
        assert batcher.stats().imports >= len(work)


@pytest.mark.parametrize("family", SPECS)
def test_import_is_staged_in_the_spare_while_all_lanes_decode(family):
    spec = SPECS[family]
    art = artifact(spec, 4, 5)
    long_runs = prompts(4, seed=1)
    pd_prompt = prompts(1, seed=2)
    want_native = native(spec, long_runs + pd_prompt, art)
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    for p in long_runs:
        batcher.submit(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    while batcher.stats().decoding_lanes < 4:
        batcher.step()
    producer = producer_for(spec)
    got, _ = run_pd(batcher, pd_prompt, lambda rid, p: InProcessSource.from_producer(
        producer, rid, p, PARAMS, mode="layer-stream"))
    assert got[0].completion.token_ids == want_native[-1]
    stats = batcher.stats()
    if spec.is_hybrid:
        assert stats.staged_chunks == 0 and stats.rotations == 0  # slots cannot rotate
    else:
        assert stats.staged_chunks >= 1 and stats.rotations == 1


def test_partial_prefix_resumes_natively_outside_single_block():
    spec = SPECS["llama"]
    art = artifact(spec, 4, 5)
    producer = producer_for(spec)
    work = prompts(3, seed=4)
    want = native(spec, work, art)
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    got, _ = run_pd(batcher, work, lambda rid, p: InProcessSource.from_producer(
        producer, rid, p, PARAMS, mode="whole", covered_len=len(p) - 9))
    assert [o.completion.token_ids for o in got] == want
    assert batcher.runtime.prefill_calls >= len(work)  # the uncovered tail was prefilled here


# -- faults: each fails its request alone -----------------------------------------------------------
def payload_items(spec, prompt, **kw):
    return list(producer_for(spec).produce("x", prompt, PARAMS, **kw).items())


def drop_layer(items):
    return items[:2] + items[3:]


def duplicate_layer(items):
    return items[:2] + [items[1]] + items[2:]


def wrong_identity(items):
    header = items[0]
    fields = {f: getattr(header, f) for f in header.__struct_fields__}
    return [KVHeader(**{**fields, "model_identity": "0" * 16})] + items[1:]


def wrong_dtype(items):
    bad = items[1]
    return [items[0], LayerKV(layer=bad.layer, k=bad.k.astype(np.float64),
                              v=bad.v.astype(np.float64))] + items[2:]


def wrong_shape(items):
    bad = items[1]
    return [items[0], LayerKV(layer=bad.layer, k=bad.k[:, :-1], v=bad.v[:, :-1])] + items[2:]


def producer_exception(items):
    return items[:2] + [RuntimeError("producer device lost")]


FAULTS = {
    "missing layer": (drop_layer, "of 2 layers|missing|layers"),
    "extra layer": (duplicate_layer, "extra|twice"),
    "wrong identity": (wrong_identity, "identity"),
    "wrong dtype": (wrong_dtype, "dtype"),
    "wrong shape": (wrong_shape, "shape"),
    "producer exception": (producer_exception, "producer device lost"),
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
def test_faults_fail_only_their_request(fault, mode):
    spec = SPECS["llama"]
    art = artifact(spec, 2, 3)
    work = prompts(3, seed=5)
    want = native(spec, work, art)
    mangle, message = FAULTS[fault]
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    bad = batcher.submit(work[0], PARAMS, kv=InProcessSource(mangle(payload_items(spec, work[0])),
                                                            mode))
    good = [batcher.submit(p, PARAMS) for p in work[1:]]
    finals = run_to_end(batcher)
    assert finals[bad].finish_reason == "error"
    assert "KV import failed" in finals[bad].error

    assert re.search(message, finals[bad].error), finals[bad].error
    assert [finals[g].completion.token_ids for g in good] == want[1:]
    stats = batcher.stats()
    assert stats.occupied_lanes == 0 and stats.lane_blocks == 0 and stats.staged_blocks == 0


def test_single_block_rejects_a_truncated_prefix_and_keeps_serving():
    spec = SPECS["qwen3"]
    art = artifact(spec, 1, 1)
    work = prompts(2, seed=6)
    want = native(spec, work, art)
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    partial = InProcessSource(payload_items(spec, work[0], covered_len=len(work[0]) - 3), "whole")
    bad = batcher.submit(work[0], PARAMS, kv=partial)
    good = batcher.submit(work[1], PARAMS)
    finals = run_to_end(batcher)
    assert finals[bad].finish_reason == "error" and "full prefix" in finals[bad].error
    assert finals[good].completion.token_ids == want[1]
    assert batcher.scheduler.pool.num_free == 1


def test_hybrid_rejects_a_partial_prefix():
    spec = SPECS["gemma3"]
    art = artifact(spec, 2, 3)
    [prompt] = prompts(1, seed=8)
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    [out] = [o for o in _run_all(batcher, [(prompt, InProcessSource(
        payload_items(spec, prompt, covered_len=len(prompt) - 4), "whole"))])]
    assert out.finish_reason == "error" and "full prefix" in out.error


def _run_all(batcher, items):
    ids = [batcher.submit(p, PARAMS, kv=src) for p, src in items]
    finals = run_to_end(batcher)
    return [finals[i] for i in ids]


class Silent:
    """A producer that never answers."""

    def poll(self):
        return None, []

    def done(self):
        return False

    def close(self):
        self.closed = True


def test_a_silent_producer_times_out_and_its_source_is_closed():
    spec = SPECS["llama"]
    art = artifact(spec, 2, 3)
    now = [0.0]
    batcher = Batcher(NumpyRuntime.random(art, SEED), clock=lambda: now[0], pd_timeout=5.0)
    silent = Silent()
    rid = batcher.submit(prompts(1)[0], PARAMS, kv=silent)
    other = batcher.submit(prompts(1, seed=3)[0], PARAMS)
    finals = {}
    while batcher.has_unfinished():
        now[0] += 1.0
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[rid].finish_reason == "error" and "pd_timeout=5.0" in finals[rid].error
    assert finals[other].finish_reason == "length" and silent.closed


# -- across processes over ZeroMQ -------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def zmq_producer(request):
    family, kwargs = request.param
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    art_kwargs = dict(batch_size=2, max_seq_len=96, block_size=32, num_blocks=7,
                      prefill_chunk_size=32)
    proc = ctx.Process(target=run_producer_process,
                       args=(SPECS[family], art_kwargs, SEED, endpoint), kwargs=kwargs, daemon=True)
    proc.start()
    yield family, endpoint, proc
    proc.kill()
    proc.join(10)


@pytest.mark.parametrize("zmq_producer", [(f, {}) for f in SPECS], indirect=True, ids=list(SPECS))
@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
def test_pd_across_processes_equals_native(zmq_producer, mode):
    family, endpoint, _ = zmq_producer
    spec = SPECS[family]
    work = prompts(3, seed=9)
    for label, art in decoder_layouts(spec).items():
        want = native(spec, work, art)
        batcher = Batcher(NumpyRuntime.random(art, SEED), pd_timeout=60.0)
        got, _ = run_pd(batcher, work, lambda rid, p: ZmqSource(endpoint, rid, p, PARAMS,
                                                                mode=mode))
        assert [o.completion.token_ids for o in got] == want, (label, [o.error for o in got])
        assert batcher.runtime.prefill_calls == 0


@pytest.mark.parametrize("zmq_producer", [("llama", {"layer_delay": 0.5})], indirect=True,
                         ids=["slow-llama"])
def test_producer_killed_mid_stream_fails_only_its_request(zmq_producer):
    _, endpoint, proc = zmq_producer
    spec = SPECS["llama"]
    art = artifact(spec, 2, 3)
    work = prompts(2, seed=10)
    want = native(spec, work, art)
    batcher = Batcher(NumpyRuntime.random(art, SEED), pd_timeout=20.0)
    pd_id = batcher.submit(work[0], PARAMS, kv=ZmqSource(endpoint, "victim", work[0], PARAMS,
                                                         mode="layer-stream"))
    good = batcher.submit(work[1], PARAMS)
    finals = {}
    deadline = time.monotonic() + 60
    killed = False
    while batcher.has_unfinished():
        assert time.monotonic() < deadline, "the killed producer was never noticed"
        if not killed and batcher.scheduler.requests.get(pd_id) is not None and \
                batcher.scheduler.requests[pd_id].pd is not None and \
                batcher.scheduler.requests[pd_id].pd.header_ok:
            proc.kill()
            killed = True
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        time.sleep(0.01)
    assert killed
    assert finals[pd_id].finish_reason == "error", finals[pd_id]
    assert finals[good].completion.token_ids == want[1]
    batcher.check_invariants()


def test_a_producer_whose_prefill_returns_nan_fails_that_request_alone():
    """A NaN in the producer's last prefill row would have become a first token (its argmax);
    the producer refuses to send one, the decoder fails that request, the other decodes on."""
    from atombatch.errors import RequestError

    spec = SPECS[next(iter(SPECS))]
    producer = producer_for(spec)
    real = producer.runtime.prefill
    poison = {"on": False}

    def prefill(inputs, **kwargs):
        out = real(inputs, **kwargs)
        if poison["on"]:
            out = np.array(out, dtype=np.float32, copy=True)
            out.reshape(-1)[5] = np.nan
        return out

    producer.runtime.prefill = prefill
    work = prompts(2)
    poison["on"] = True
    with pytest.raises(RequestError, match="non-finite logits"):
        producer.produce("direct", work[0], PARAMS)
    art = next(iter(decoder_layouts(spec).values()))
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    bad = batcher.submit(work[0], PARAMS, kv=InProcessSource.from_producer(
        producer, "bad", work[0], PARAMS))
    outs = []
    while batcher.has_unfinished() and len(outs) < 1:  # the bad request's source runs first
        outs += [o for o in batcher.step() if o.finished]
    poison["on"] = False
    good = batcher.submit(work[1], PARAMS, kv=InProcessSource.from_producer(
        producer, "good", work[1], PARAMS))
    while batcher.has_unfinished():
        outs += [o for o in batcher.step() if o.finished]
    finals = {o.request_id: o for o in outs}
    assert finals[bad].finish_reason == "error" and "non-finite" in finals[bad].error
    assert finals[good].completion.token_ids == tuple(native(spec, [work[1]], art)[0])
    assert batcher.stats().free_blocks + batcher.stats().spare_blocks + \
        batcher.stats().cached_blocks == art.num_blocks
