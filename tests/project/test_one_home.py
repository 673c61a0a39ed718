"""Issue 40, "one home per rule": each rule, default and shared struct is declared once, and the
names it was known by before still reach that one declaration (embedders import them)."""

from __future__ import annotations

import inspect
import pickle

import msgspec
import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, SamplingParams, pd
from atombatch.api import reports
from atombatch.api.options import EngineOptions
from atombatch.api.reports import EngineCounters, EngineStats
from atombatch.api.structs import stop_ids
from atombatch.api.validation import queue_limit
from atombatch.cluster import summary
from atombatch.core import messages
from atombatch.core.shared import SharedCore
from atombatch.engine import batcher as engine
from atombatch.engine import pd_intake
from atombatch.engine.request import Counters, Request, check_stop
from atombatch.errors import CapacityError, StateError
from atombatch.pd import pool as pd_pool
from atombatch.runtime import NullRuntime
from atombatch.runtime.base import check_decode_rows
from atombatch.runtime.sim import SimRuntime
from atombatch.serve import metrics
from atombatch.serve.cli import DEFAULT_SPEC, SERVER_OPTIONS, engine_options, parser


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
                                   "(1, 2, 4) (decoder_batch_sizes=[1, 2, 4])")
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


def test_one_engine_options_struct_holds_every_default() -> None:
    """`Batcher(...)`'s keywords default to `EngineOptions`' fields; the server's flags default to
    its `SERVER_OPTIONS` (the library's but for max_waiting, overlap and request logs); the struct
    pickles and round-trips through msgpack (it crosses into the engine core process)."""
    defaults = EngineOptions()
    signature = inspect.signature(Batcher.__init__).parameters
    for field in EngineOptions.__struct_fields__:
        assert signature[field].default == getattr(defaults, field), field
    assert defaults.max_waiting == engine.DEFAULT_MAX_WAITING
    changed = {f for f in EngineOptions.__struct_fields__
               if getattr(SERVER_OPTIONS, f) != getattr(defaults, f)}
    assert changed == {"max_waiting", "overlap", "log_requests"}
    args = parser().parse_args([])
    assert (args.max_waiting, args.overlap, args.pd_timeout, args.seed, args.policy,
            args.host_cache_bytes, args.argmax_threads, args.enable_log_requests) == (
        SERVER_OPTIONS.max_waiting, SERVER_OPTIONS.overlap, SERVER_OPTIONS.pd_timeout,
        SERVER_OPTIONS.seed, SERVER_OPTIONS.policy, SERVER_OPTIONS.host_cache_bytes,
        SERVER_OPTIONS.argmax_threads, SERVER_OPTIONS.log_requests)
    built = engine_options(args, prefix_cache=False)
    assert built == SERVER_OPTIONS
    logged = engine_options(parser().parse_args(["--enable-log-requests"]), prefix_cache=False)
    assert logged.log_requests and Batcher.from_options(
        NullRuntime(ArtifactConfig(model=DEFAULT_SPEC, batch_size=2, max_seq_len=256,
                                   block_size=256, num_blocks=3, prefill_chunk_size=16),
                    step_ms=0.0), logged).log_requests
    assert pickle.loads(pickle.dumps(built)) == built
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(built), type=EngineOptions) == built


def test_a_batcher_built_from_options_runs_with_them() -> None:
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=2, max_seq_len=256, block_size=256,
                         num_blocks=3, prefill_chunk_size=16)
    options = EngineOptions(max_waiting=7, pd_timeout=12.5, policy="prefill-first", seed=3,
                            logprobs_mode="processed", detokenize=False)
    batcher = Batcher.from_options(NullRuntime(art, step_ms=0.0), options)
    assert batcher.options == options
    assert (batcher.max_waiting, batcher.pd_timeout, batcher.policy.label,
            batcher.logprobs_mode, batcher.detokenize) == (7, 12.5, "prefill-first",
                                                           "processed", False)
    plain = Batcher(NullRuntime(art, step_ms=0.0), max_waiting=7)   # the keywords still work
    assert plain.options == EngineOptions(max_waiting=7)
    plain.pd_timeout = 9.0
    plain.use_tokenizer(None, detokenize=False)
    assert plain.options == EngineOptions(max_waiting=7, pd_timeout=9.0, detokenize=False)


def test_the_counters_are_listed_once_and_stats_carries_them_all() -> None:
    art = ArtifactConfig(model=DEFAULT_SPEC, batch_size=2, max_seq_len=256, block_size=256,
                         num_blocks=3, prefill_chunk_size=16)
    batcher = Batcher(NullRuntime(art, step_ms=0.0))
    batcher.generate([[1, 4, 5], [6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    stats = batcher.stats()
    counters = batcher.scheduler.counters
    for name in Counters.__struct_fields__:
        value = getattr(counters, name)
        want = tuple(value) if isinstance(value, list) else value
        assert getattr(stats, name) == want, name
    assert stats.generated_tokens == 6 and stats.finished == {"length": 2}
    # one list: the scheduler's Counters and EngineStats extend EngineCounters, and /metrics
    # exports every scalar counter of it (a counter added there is exported without a new line)
    assert issubclass(Counters, EngineCounters) and issubclass(EngineStats, EngineCounters)
    scalars = [name for name in EngineCounters.__struct_fields__
               if isinstance(getattr(counters, name), int)]
    assert list(metrics._ENGINE_COUNTERS) == scalars and "slot_saves" in scalars


def test_the_per_step_message_is_array_like_and_untracked() -> None:
    import gc

    step = messages.Step(ids=["a", "b"], tokens=np.array([5, 6], np.int64).tobytes(), outputs=[])
    data = messages.core_encoder.encode(step)
    assert b"ids" not in data and b"tokens" not in data     # fields by position, no names
    assert msgspec.msgpack.decode(data)[0] == "Step"        # led by its tag
    assert messages.core_decoder.decode(data) == step
    assert not gc.is_tracked(step)
