"""Decode buckets on the device path: a directory with several `decoder_batch_{b}.rbln` graphs
runs the smallest one >= the decoding lanes, rows packed, and still equals transformers."""

from __future__ import annotations

import pytest
from fakerebel.compiler import compile_dir
from support.device_cases import GREEDY, LAYOUTS, make_case

from atombatch import ArtifactConfig, Batcher, ModelSpec
from atombatch.artifact.rbln_config import load_artifact
from atombatch.runtime import RebelRuntime

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

FAMILIES = ("llama", "qwen3", "gemma3")


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    return make_case(request.param, tmp_path_factory)


def test_buckets_come_from_the_directory(fake_rebel, tmp_path, case):
    _, path, _, _ = case
    d = compile_dir(tmp_path / "c", path, batch_size=4, max_seq_len=128, prefill_chunk_size=16,
                    kvcache_num_blocks=5, decoder_batch_sizes=[4, 2, 1])
    spec = ModelSpec.from_pretrained(d)
    want = ArtifactConfig(model=spec, batch_size=4, max_seq_len=128, block_size=128,
                          num_blocks=5, prefill_chunk_size=16, kv_dtype="float32",
                          decoder_batch_sizes=(1, 2, 4))
    assert load_artifact(d) == want
    single = ArtifactConfig(model=spec, batch_size=4, max_seq_len=128, block_size=128,
                            num_blocks=5, prefill_chunk_size=16, kv_dtype="float32",
                            decoder_batch_sizes=(4,))
    assert want.identity != single.identity
    assert RebelRuntime.from_optimum(d).decoder_batch_sizes == (1, 2, 4)


def drive(batcher, prompts, arrivals):
    """Submit prompt i at step arrivals[i]; run to the end; tokens in prompt order."""
    ids: list[str | None] = [None] * len(prompts)
    finals = {}
    step = 0
    while any(i is None for i in ids) or batcher.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step and ids[i] is None:
                ids[i] = batcher.submit(prompts[i], GREEDY)
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        step += 1
    return [tuple(finals[i].completion.token_ids) for i in ids]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bucketed_decode_equals_transformers(fake_rebel, tmp_path, case, layout):
    family, path, prompts, references = case
    d = compile_dir(tmp_path / "c", path, batch_size=4, max_seq_len=128, prefill_chunk_size=16,
                    decoder_batch_sizes=[1, 2, 4], **LAYOUTS[layout])
    rt = RebelRuntime.from_optimum(d)
    # one request alone, then a second, then three more: 1, 2, 3 and 4 lanes decode
    got = drive(Batcher(rt), prompts, arrivals=[0, 4, 8, 8, 8])
    assert got == list(references)
    used = {rows for name, rows in fake_rebel.CALLS if name.startswith("decoder_batch_")}
    assert used == {1, 2, 4}
    assert all(rt.decode_calls_by_batch[b] > 0 for b in (1, 2, 4))
