"""The engine (`Batcher`) where merged features meet: PD × the sampler, AsyncBatcher × n > 1,
stop strings × max_tokens.

Each test drives real computation (the NumPy runtime, the engine's detokenizer on a real
`tokenizers` tokenizer) and compares against the same request run the plain way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from support.driving import run_to_end
from support.pd_models import SEED, SPECS, artifact, producer_for, prompts

from atombatch import AsyncBatcher, Batcher, SamplingParams
from atombatch.pd import InProcessSource
from atombatch.runtime import NumpyRuntime


def test_pd_seeded_sampling_matches_the_colocated_run() -> None:
    """A seeded request gives the same tokens whether its prefill ran on a PD producer or on the
    decoder: the producer drew the first token's uniform from `default_rng(seed)`, so the decoder
    must continue that stream, not draw the first uniform again for the second token."""
    spec = SPECS["llama"]
    producer = producer_for(spec)
    art = artifact(spec, 4, 5)
    work = prompts(3, seed=11)
    params = [SamplingParams(temperature=1.5, top_k=40, seed=100 + i, max_tokens=12,
                             ignore_eos=True) for i in range(len(work))]
    colocated = Batcher(NumpyRuntime.random(art, SEED)).generate(work, params)
    batcher = Batcher(NumpyRuntime.random(art, SEED))
    ids = [batcher.submit(p, sp, kv=InProcessSource.from_producer(producer, f"pd-{i}", p, sp))
           for i, (p, sp) in enumerate(zip(work, params, strict=True))]
    finals = run_to_end(batcher)
    assert batcher.runtime.prefill_calls == 0  # every first token came from the producer
    for rid, want in zip(ids, colocated, strict=True):
        got = finals[rid].completion
        assert got.token_ids[0] == want.token_ids[0]  # same first-token sampler and seed
        assert got.token_ids == want.token_ids


def test_an_unclaimed_n_request_keeps_every_choice() -> None:
    """AsyncBatcher compacts a finished request nobody iterated yet; with n > 1 that must keep
    each choice apart (tokens, logprobs, final output), not glue the choices into one."""
    art = artifact(SPECS["llama"], 4, 5)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, ignore_eos=True,
                            logprobs=1)
    prompt = prompts(1, seed=12)[0]
    want = Batcher(NumpyRuntime.random(art, SEED)).generate([prompt], params)

    async def late_reader() -> list[Any]:
        async with AsyncBatcher(Batcher(NumpyRuntime.random(art, SEED)), offload=False) as ab:
            rid = ab.submit(prompt, params)
            while ab.in_flight:  # finishes before anyone asks for its outputs
                await asyncio.sleep(0.001)
            return [out async for out in ab.outputs(rid)]

    outs = asyncio.run(late_reader())
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    for completion in want:
        mine = [o for o in outs if o.index == completion.index]
        tokens = tuple(t for o in mine for t in o.new_token_ids)
        assert tokens == completion.token_ids
        logprobs = [lp.token_id for o in mine for lp in o.logprobs or ()]
        assert logprobs == list(completion.token_ids)
        [final] = [o.completion for o in mine if o.completion is not None]
        assert final.token_ids == completion.token_ids


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop() -> None:
    """The token that reaches max_tokens also completes a stop string: the text ends before the
    stop string, so the request stopped on it (finish_reason "stop", stop_reason the string), as
    vLLM reports it; "length" with a cut text and no stop_reason contradicts itself."""
    from support.sampling_models import artifact as sampling_artifact
    from support.sampling_models import piece_tokenizer

    tok = piece_tokenizer()
    art = sampling_artifact()
    prompt = [3, 4, 5]
    base = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    text = base.text
    assert text == tok.decode(list(base.token_ids))
    # the shortest end of the text that occurs nowhere before: a stop string that the 4th (last
    # allowed) token completes
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    assert stop not in tok.decode(list(base.token_ids[:-1]))
    batcher = Batcher(NumpyRuntime.random(art, seed=3), tokenizer=tok)
    [done] = batcher.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True, stop=[stop]))
    assert done.token_ids == base.token_ids
    assert done.text == text[:len(text) - len(stop)]
    assert (done.finish_reason, done.stop_reason) == ("stop", stop)
    assert batcher.stats().finished == {"stop": 1}


def test_a_request_id_of_a_held_choice_is_refused_at_submit() -> None:
    """With a prefix cache, choices 1.. of an n > 1 request wait (held) for choice 0's prefill
    under the internal ids `<id>#<index>`. A caller's own request with such an id was accepted and
    the step that released the held choices raised StateError: the whole engine stopped."""
    from support.sampling_models import artifact as sampling_artifact

    from atombatch import RequestError

    art = sampling_artifact()
    batcher = Batcher(NumpyRuntime.random(art, seed=1), prefix_cache=True)
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
    batcher.submit(list(range(1, 20)), params, request_id="x")
    with pytest.raises(RequestError, match="'x#1'"):
        batcher.submit([1, 2, 3], SamplingParams(max_tokens=4), request_id="x#1")
    outs = []
    while batcher.has_unfinished():
        outs.extend(batcher.step())
        batcher.check_invariants()
    finals = {(o.request_id, o.index): o.completion for o in outs if o.completion is not None}
    want = Batcher(NumpyRuntime.random(art, seed=1)).generate([list(range(1, 20))], params)
    assert [finals["x", i].token_ids for i in range(2)] == [c.token_ids for c in want]


def test_max_waiting_counts_the_choices_held_for_choice_zero() -> None:
    """With a prefix cache an n > 1 request queues choice 0 and holds the others outside the
    scheduler; the queue bound must count them (docs/sampling.md: "max_waiting counts each
    choice"), or n=64 requests multiply it by 64."""
    from support.sampling_models import artifact as sampling_artifact

    from atombatch import CapacityError

    batcher = Batcher(NumpyRuntime.random(sampling_artifact(), seed=1), prefix_cache=True,
                      max_waiting=8)
    params = SamplingParams(n=4, max_tokens=2, temperature=1.0, ignore_eos=True)
    batcher.submit(list(range(1, 20)), params)
    batcher.submit(list(range(2, 21)), params)
    assert batcher.stats().queue_length == 8
    with pytest.raises(CapacityError, match="max_waiting=8"):
        batcher.submit(list(range(3, 22)), params)
    with pytest.raises(CapacityError, match="max_waiting=8"):
        batcher.submit([5, 6], SamplingParams(max_tokens=2))

    async def through_async() -> None:
        async with AsyncBatcher(Batcher(NumpyRuntime.random(sampling_artifact(), seed=1),
                                        prefix_cache=True, max_waiting=8), offload=False) as ab:
            ab.batcher.submit(list(range(1, 20)), params)
            ab.batcher.submit(list(range(2, 21)), params)
            with pytest.raises(CapacityError, match="max_waiting=8"):
                ab.submit([5, 6], SamplingParams(max_tokens=2))

    asyncio.run(through_async())
    # generate feeds within the bound, and the two requests already queued (whose outputs it
    # steps past) do not count among its own completions
    done = batcher.generate([list(range(4, 23))] * 3, params)
    assert len(done) == 3 * 4


class _SlowClosingSource:
    """A KV source that never delivers and whose close() waits for a gate (a transport whose
    teardown takes a while); the engine closes it inside `abort`, under its step lock."""

    def __init__(self) -> None:
        import threading

        self.closing = threading.Event()
        self.gate = threading.Event()

    def poll(self) -> tuple[Any, list[Any]]:
        return None, []

    def done(self) -> bool:
        return False

    def close(self) -> None:
        self.closing.set()
        self.gate.wait(10)


def test_step_waits_for_an_abort_from_another_thread_instead_of_raising() -> None:
    """Batcher's contract: `submit`/`abort` from another thread wait for a running step. The
    reverse held too little: a `step()` that arrived while another thread's abort held the lock
    raised StateError ("already running in another thread") though no step ran, crashing the
    consumer's loop."""
    import threading

    from support.sampling_models import artifact as sampling_artifact

    batcher = Batcher(NumpyRuntime.random(sampling_artifact(), seed=1))
    source = _SlowClosingSource()
    pd = batcher.submit([1, 2, 3], SamplingParams(max_tokens=2), kv=source)
    other = batcher.submit([4, 5, 6], SamplingParams(max_tokens=2))
    aborter = threading.Thread(target=batcher.abort, args=(pd,))
    aborter.start()
    assert source.closing.wait(10)  # the abort is inside the engine now
    errors: list[BaseException] = []
    outputs: list[Any] = []

    def consume() -> None:
        try:
            outputs.extend(batcher.step())
        except BaseException as exc:  # recorded for the assertion below
            errors.append(exc)

    stepper = threading.Thread(target=consume)
    stepper.start()
    stepper.join(0.5)  # a step that raises does so at once; a waiting one is still here
    source.gate.set()
    aborter.join(10)
    stepper.join(10)
    assert not errors, errors
    outputs.extend(run_to_end_outputs(batcher))
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals[pd].finish_reason == "abort" and finals[other].finish_reason == "length"


def run_to_end_outputs(batcher: Batcher) -> list[Any]:
    outs: list[Any] = []
    while batcher.has_unfinished():
        outs.extend(batcher.step())
    return outs


def test_a_pd_replica_prefills_n_and_logprobs_requests_itself() -> None:
    """A Ray Serve replica with PD producers (`_PooledAsyncBatcher`) opened a producer source for
    every request, and the engine refuses a KV source for n > 1 or logprobs (the engine must
    sample the first token): every such HTTP request failed, after costing a producer prefill
    whose source was never closed. Those requests are prefilled by the replica instead."""
    pytest.importorskip("ray")
    from atombatch.pd import Producer
    from atombatch.pd.pool import ProducerPool
    from atombatch.serve.ray import _PooledAsyncBatcher

    spec = SPECS["llama"]
    producer = producer_for(spec)
    opened: list[Any] = []

    def source(endpoint: str, request_id: str, prompt: list[int], params: Any,
               mode: str) -> Any:
        assert isinstance(producer, Producer)
        opened.append(InProcessSource.from_producer(producer, request_id, prompt, params,
                                                    mode=mode))
        return opened[-1]

    art = artifact(spec, 4, 5)
    prompt = prompts(1, seed=14)[0]
    cases = [SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=5, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=1.0, seed=9, max_tokens=5, ignore_eos=True)]
    want = [Batcher(NumpyRuntime.random(art, SEED)).generate([prompt], p) for p in cases]

    async def serve() -> list[list[Any]]:
        pool = ProducerPool([("p0", "inproc://p0")], source_factory=source)
        ab = _PooledAsyncBatcher(Batcher(NumpyRuntime.random(art, SEED)), pool)
        async with ab:
            got = []
            for params in cases:
                rid = ab.submit(prompt, params)
                got.append([o async for o in ab.outputs(rid)])
        return got

    got = asyncio.run(serve())
    for outs, completions in zip(got, want, strict=True):
        assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs]
        finals = sorted((o.completion for o in outs if o.completion is not None),
                        key=lambda c: c.index)
        assert [c.token_ids for c in finals] == [c.token_ids for c in completions]
    assert len(opened) == 1  # only the plain request went to the producer

    async def refused_source() -> tuple[list[Any], bool]:
        kv = InProcessSource.from_producer(producer, "kv-n2", prompt, cases[0])
        async with AsyncBatcher(Batcher(NumpyRuntime.random(art, SEED))) as ab:
            rid = ab.submit(prompt, cases[0], kv=kv)
            outs = [o async for o in ab.outputs(rid)]
        return outs, kv._closed

    outs, closed = asyncio.run(refused_source())
    assert [o.finish_reason for o in outs] == ["error"] and "n > 1" in (outs[0].error or "")
    assert closed  # a source the engine refused is closed, not left to its transport


def test_aborting_choice_zero_alone_releases_the_held_choices() -> None:
    """Choices 1.. of an n > 1 request wait for choice 0's prefill; choice 0 aborted by its own
    id (`<id>#0`, the id the engine's logs show) while prefilling left them held forever: the
    engine reported unfinished work and stepped idly without end."""
    from support.sampling_models import artifact as sampling_artifact

    art = sampling_artifact()
    prompt = list(range(1, 41))  # three prefill chunks
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=2, ignore_eos=True)
    batcher = Batcher(NumpyRuntime.random(art, seed=1), prefix_cache=True)
    batcher.submit(prompt, params, request_id="x")
    batcher.step()  # choice 0's first chunk
    assert batcher.abort("x#0")
    outs: list[Any] = []
    for _ in range(100):
        if not batcher.has_unfinished():
            break
        outs.extend(batcher.step())
    assert not batcher.has_unfinished()
    finals = {o.index: o for o in outs if o.finish_reason is not None}
    assert finals[0].finish_reason == "abort"
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    want = Batcher(NumpyRuntime.random(art, seed=1)).generate([prompt], params)
    assert [finals[i].completion.token_ids for i in (1, 2)] == [want[1].token_ids,
                                                                 want[2].token_ids]
    batcher.check_invariants()


def test_async_generate_refuses_n_choices_instead_of_returning_one_at_random() -> None:
    """`AsyncBatcher.generate` returned the completion of whichever choice ended last; with
    n > 1 it now says so, and `stream()` gives every choice."""
    from support.sampling_models import artifact as sampling_artifact

    from atombatch import RequestError

    art = sampling_artifact()
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=4, ignore_eos=True)
    want = Batcher(NumpyRuntime.random(art, seed=1)).generate([[1, 2, 3]], params)

    async def run() -> list[Any]:
        async with AsyncBatcher(Batcher(NumpyRuntime.random(art, seed=1)), offload=False) as ab:
            with pytest.raises(RequestError, match="n=2: generate returns one completion"):
                await ab.generate([1, 2, 3], params)
            return [o.completion async for o in ab.stream([1, 2, 3], params)
                    if o.completion is not None]

    got = sorted(asyncio.run(run()), key=lambda c: c.index)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_bad_words_with_a_kv_source_are_refused_not_ignored_for_the_first_token() -> None:
    """A producer has no tokenizer, so it cannot ban `bad_words` from the first token it samples:
    a PD request with bad words got a banned first token a colocated run never gives. The engine
    refuses such a source (like n > 1 and logprobs); a PD replica prefills the request itself."""
    from support.sampling_models import PIECES, piece_tokenizer
    from support.sampling_models import artifact as sampling_artifact

    from atombatch import RequestError
    from atombatch.pd import Producer

    tok = piece_tokenizer()
    art = sampling_artifact()
    prompt = [9, 8, 7]
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [base] = Batcher(NumpyRuntime.random(art, seed=4), tokenizer=tok).generate([prompt], plain)
    banned = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                            bad_words=[PIECES[base.token_ids[0]]])
    [colocated] = Batcher(NumpyRuntime.random(art, seed=4), tokenizer=tok).generate([prompt],
                                                                                     banned)
    assert colocated.token_ids[0] != base.token_ids[0]
    producer = Producer(NumpyRuntime.random(art, seed=4))
    batcher = Batcher(NumpyRuntime.random(art, seed=4), tokenizer=tok)
    source = InProcessSource.from_producer(producer, "bw", prompt, banned)
    with pytest.raises(RequestError, match="bad_words"):
        batcher.submit(prompt, banned, kv=source)


def test_one_held_choice_aborted_by_its_id_ends_alone() -> None:
    """`abort("<id>#<index>")` ended a choice already in the scheduler, but returned False for a
    choice still held for choice 0's prefill: the same id, a different answer by timing."""
    from support.sampling_models import artifact as sampling_artifact

    art = sampling_artifact()
    prompt = list(range(1, 41))
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=2, ignore_eos=True)
    batcher = Batcher(NumpyRuntime.random(art, seed=1), prefix_cache=True)
    batcher.submit(prompt, params, request_id="x")
    batcher.step()
    assert batcher.abort("x#2")
    assert not batcher.abort("x#2")  # once
    outs: list[Any] = []
    while batcher.has_unfinished():
        outs.extend(batcher.step())
    finals = {o.index: o for o in outs if o.finish_reason is not None}
    assert finals[2].finish_reason == "abort" and not finals[2].new_token_ids
    want = Batcher(NumpyRuntime.random(art, seed=1)).generate([prompt], params)
    assert [finals[i].completion.token_ids for i in (0, 1)] == [want[0].token_ids,
                                                                 want[1].token_ids]
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    batcher.check_invariants()
    assert not batcher._groups and not batcher._extras


def test_temperatures_and_penalties_past_float32_keep_masks_and_filters() -> None:
    """SamplingParams accepts any temperature >= 0 and any repetition_penalty > 0 (as vLLM does);
    the sampler computes in float32, where temperature=1e39 became inf (a masked -inf logit
    divided by inf is NaN: tokens outside allowed_token_ids and top_k were drawn) and
    repetition_penalty=1e-300 became 0 (a seen token's logit +inf: the request failed as if
    every token were masked)."""
    from support.sampling_models import artifact as sampling_artifact

    art = sampling_artifact()
    prompt = [1, 2, 3]

    def run(**fields: Any) -> Any:
        batcher = Batcher(NumpyRuntime.random(art, seed=1))
        [done] = batcher.generate([prompt], SamplingParams(max_tokens=8, seed=1,
                                                           ignore_eos=True, **fields))
        return done

    for temperature in (1e39, 1e308):
        done = run(temperature=temperature, allowed_token_ids=[5, 6])
        assert done.finish_reason == "length" and set(done.token_ids) <= {5, 6}
        greedy = run(temperature=0.0)
        assert run(temperature=temperature, top_k=1).token_ids == greedy.token_ids
    done = run(temperature=1.0, repetition_penalty=1e-300)
    assert done.finish_reason == "length" and len(done.token_ids) == 8, done.error


def test_rebel_runtime_sampling_n_choices_and_caches_with_buckets(fake_rebel: Any,
                                                                  tmp_path: Any) -> None:
    """RebelRuntime (emulated rebel) with decode buckets 1/2/4, an oversubscribed flash layout,
    prefix and host caches, seeded sampling, top-p, logprobs and n > 1 sharing the prompt: each
    choice samples exactly what it samples alone on a one-lane directory (seed + index)."""
    import msgspec
    from fakerebel.compiler import compile_dir
    from support.hf_models import save_checkpoint

    from atombatch.runtime import RebelRuntime

    path = save_checkpoint("llama", tmp_path / "ckpt")
    many = compile_dir(tmp_path / "b4", path, batch_size=4, max_seq_len=128, prefill_chunk_size=16,
                       kvcache_block_size=16, kvcache_num_blocks=14,
                       decoder_batch_sizes=[1, 2, 4])
    one = compile_dir(tmp_path / "b1", path, batch_size=1, max_seq_len=128, prefill_chunk_size=16,
                      kvcache_block_size=16, kvcache_num_blocks=9)
    rng = np.random.default_rng(0)
    system = rng.integers(3, 512, size=40).tolist()
    work, params = [], []
    for i in range(5):
        tail = rng.integers(3, 512, size=int(rng.integers(2, 20))).tolist()
        work.append(system + tail if i % 2 else rng.integers(3, 512, size=int(rng.integers(5, 50)))
                    .tolist())
        params.append(SamplingParams(temperature=(0.0, 1.0, 0.7)[i % 3], seed=10 + i,
                                     n=(1, 2, 3)[i % 3], max_tokens=int(rng.integers(5, 30)),
                                     ignore_eos=True, logprobs=1 if i % 2 else None, top_p=0.9))
    batcher = Batcher(RebelRuntime.from_optimum(many), prefix_cache=True, host_cache_bytes=1 << 20)
    done = iter(batcher.generate(work, params))
    batcher.check_invariants()
    stats = batcher.stats()
    assert stats.prefix_hits > 0 and len(stats.bucket_steps) > 1
    for prompt, sp in zip(work, params, strict=True):
        for index in range(sp.n):
            got = next(done)
            alone = msgspec.structs.replace(sp, n=1, seed=sp.seed + index)
            [want] = Batcher(RebelRuntime.from_optimum(one)).generate([prompt], alone)
            assert (got.index, got.token_ids) == (index, want.token_ids)
            if sp.logprobs is not None:
                assert [lp.token_id for lp in got.logprobs] == list(got.token_ids)
