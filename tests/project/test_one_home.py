"""Issue 40, "one home per rule": each rule, default and shared struct is declared once, and the
names it was known by before still reach that one declaration (embedders import them)."""

from __future__ import annotations

import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, SamplingParams, engine, pd, pd_intake, reports
from atombatch.cluster import pd_pool, summary
from atombatch.core.shared import SharedCore
from atombatch.errors import CapacityError, StateError
from atombatch.request import Request, check_stop
from atombatch.runtime import NullRuntime
from atombatch.runtime.base import check_decode_rows
from atombatch.runtime.sim import SimRuntime
from atombatch.serve.cli import DEFAULT_SPEC
from atombatch.structs import stop_ids
from atombatch.validation import queue_limit


def test_the_reports_live_in_one_leaf_and_their_old_homes_reexport_them() -> None:
    import atombatch
    assert atombatch.EngineStats is engine.EngineStats is reports.EngineStats
    assert pd_pool.ProducerState is reports.ProducerState
    assert summary.CacheSummary is reports.CacheSummary
    assert summary.check_summary_size is reports.check_summary_size
    assert summary.DEFAULT_SUMMARY_BITS == reports.DEFAULT_SUMMARY_BITS


def test_one_kv_source_protocol() -> None:
    assert engine.KVSource is pd_intake.KVSource is pd.KVSource
    assert engine.KVSource.__module__ == "atombatch.pd.source"


class _Rows:
    """Decode inputs of `n` padding rows."""

    def __init__(self, n: int) -> None:
        self.input_ids = np.zeros((n, 1), np.int64)
        self.cache_position = np.zeros((n, 1), np.int32)
        self.block_tables = np.zeros((n, 1), np.int16)
        self.local_block_tables = np.zeros((n, 1), np.int16)


def test_the_decode_bucket_guard_is_the_runtime_bases() -> None:
    """The null and simulated runtimes refuse a row count that is no compiled decode batch with
    the base's one message (the NumPy and rebel runtimes: tests/runtime/)."""
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=4, max_seq_len=256, block_size=256,
                         num_blocks=5, prefill_chunk_size=16, decoder_batch_sizes=(1, 2, 4))
    with pytest.raises(StateError) as expected:
        check_decode_rows(3, art.decoder_batch_sizes)
    assert str(expected.value) == ("decode inputs have 3 rows; the compiled decode batches are "
                                   "(1, 2, 4)")
    check_decode_rows(2, art.decoder_batch_sizes)
    for runtime in (NullRuntime(art, step_ms=0.0), SimRuntime(art)):
        with pytest.raises(StateError) as refused:
            runtime.decode(_Rows(3))
        assert str(refused.value) == str(expected.value)
        assert runtime.decode(_Rows(2)).shape[0] == 2


def test_one_queue_bound() -> None:
    assert queue_limit(4, 2) == 6                    # a front: lanes + max_waiting in flight
    assert queue_limit(0, 2) == 2                    # the engine: waiting choices only
    assert queue_limit(4, 3, fronts=2) == 4          # each of two fronts: ceil(7 / 2)
    assert queue_limit(4, None) is None and queue_limit(0, None, fronts=3) is None
    shared = SharedCore(directory="/nonexistent", fronts=3, front=0, core_pid=1)
    assert shared.choice_limit(4, 3) == queue_limit(4, 3, 3) == 3


def test_the_core_leaves_the_queue_bound_to_its_fronts_without_forgetting_it() -> None:
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=1, max_seq_len=256, block_size=256,
                         num_blocks=2, prefill_chunk_size=16)
    batcher = Batcher(NullRuntime(art, step_ms=0.0), max_waiting=2)
    assert batcher.waiting_limit == 2
    params = SamplingParams(max_tokens=2)
    batcher.submit([1, 2], params)
    batcher.submit([1, 2], params)
    with pytest.raises(CapacityError, match="max_waiting=2"):
        batcher.submit([1, 2], params)
    batcher.leave_queue_bound_to_fronts()
    batcher.submit([1, 2], params)                   # the fronts bound it now
    assert batcher.max_waiting == 2 and batcher.waiting_limit is None and batcher.num_waiting == 3


def test_stop_ids_are_resolved_once_per_request_and_read_everywhere() -> None:
    params = SamplingParams(max_tokens=4, stop_token_ids=[9, 7], temperature=0.8, seed=1)
    assert stop_ids(params, (2, 3)) == (9, 7, 2, 3)              # the client's ids, then EOS
    ignoring = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    assert stop_ids(ignoring, (2, 3)) == (9,)
    request = Request("r", np.arange(1, 4, dtype=np.int64), params, 0.0, None, 64)
    assert request.stops is None
    assert request.resolve_stops((2,)) == (9, 7, 2)
    assert request.resolve_stops((5,)) == (9, 7, 2) == request.stop_ids   # once
    assert check_stop(request, 2, (5,)) == "stop" and check_stop(request, 5, (5,)) is None

    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=2, max_seq_len=256, block_size=256,
                         num_blocks=3, prefill_chunk_size=16)
    batcher = Batcher(NullRuntime(art, step_ms=0.0))
    rid = batcher.submit([1, 4, 5], params)
    (queued,) = batcher.scheduler.waiting
    assert queued.stop_ids == (9, 7, *DEFAULT_SPEC.eos_token_ids)
    sampler = next(iter(batcher._samplers.values()))           # what min_tokens masks
    assert sampler.stop_ids.tolist() == sorted(queued.stop_ids)
    assert batcher.abort(rid)
