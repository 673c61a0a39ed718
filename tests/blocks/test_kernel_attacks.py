"""Review of the decode-step kernel (issue 10): `StepKernel`, the scheduler / KV-manager split and
`Batcher.step_arrays()`, attacked where the lane-by-lane code it replaced could not go wrong.

- the kernel's bindings must follow the scheduler's requests exactly, after every step of random
  workloads (staging and rotation, preemption and recompute, prefix and host caches, buckets,
  hybrid sliding slots, n > 1, aborts, stop ids past the kernel's 16, min_tokens), and every
  request's tokens must equal the request run alone (B1);
- a runtime's logits in another dtype, of a wrong shape, or a request released between a step and
  the consumer reading its `StepResult`;
- the compiled kernel and its twin refuse the same arguments the same way, and nothing grows per
  step.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tracemalloc
from array import array
from typing import Any

import atombatch.kernel._blocks as c_impl
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kernel_review import artifact, check_kernel_bindings, drive, spec

import atombatch.kernel._blocks_py as py_impl
from atombatch import ArtifactConfig, Batcher, SamplingParams
from atombatch.engine.request import RequestState
from atombatch.errors import RequestError, StateError
from atombatch.runtime import NumpyRuntime

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def Q() -> array[int]:
    return array("q")


def D() -> array[float]:
    return array("d")

# -- the kernel follows the scheduler -------------------------------------------------------------


def draw_params(data: st.DataObject, vocab: int, room: int) -> SamplingParams:
    kind = data.draw(st.sampled_from(["greedy", "seeded", "stops", "many_stops", "min_tokens",
                                      "n2", "logprobs", "penalty"]), label="kind")
    fields: dict[str, Any] = dict(max_tokens=data.draw(st.integers(1, room), label="max_tokens"),
                                  ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
                                  temperature=0.0)
    if kind == "seeded":
        fields.update(temperature=0.9, seed=data.draw(st.integers(0, 99)))
    elif kind == "stops":
        fields.update(stop_token_ids=data.draw(st.lists(st.integers(0, vocab - 1), min_size=1,
                                                        max_size=3)))
    elif kind == "many_stops":  # more than the kernel's 16: the scheduler checks them
        fields.update(stop_token_ids=data.draw(st.lists(st.integers(0, vocab - 1), min_size=15,
                                                        max_size=20, unique=True)))
    elif kind == "min_tokens":
        fields.update(min_tokens=data.draw(st.integers(0, fields["max_tokens"])),
                      stop_token_ids=data.draw(st.lists(st.integers(0, vocab - 1), min_size=1,
                                                        max_size=2)))
    elif kind == "n2":
        fields.update(n=2, seed=data.draw(st.integers(0, 99)))
    elif kind == "logprobs":
        fields.update(logprobs=1)
    elif kind == "penalty":
        fields.update(repetition_penalty=1.3)
    return SamplingParams(**fields)


def piece_tokenizer(vocab: int) -> Any:
    """Token t >= 2 decodes to the piece "p<t>", glued to its neighbours (stop strings can span
    tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "<eos>"] + [f"p{i}" for i in range(2, vocab)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    return tok


def alone(model_art: ArtifactConfig, prompt: list[int], params: SamplingParams,
          seed: int, tokenizer: Any = None) -> dict[int, Any]:
    """The request run alone on a B1 engine of the same model (full pool)."""
    art = artifact(model_art.model, 1, max_seq_len=model_art.max_seq_len,
                   block_size=model_art.block_size)
    batcher = Batcher(NumpyRuntime.random(art, seed=seed), tokenizer=tokenizer)
    batcher.submit(prompt, params, request_id="solo")
    return {index: c for (_, index), c in drive(batcher).items()}


LAYOUTS = ["plain", "tight", "prefix", "host", "buckets", "hybrid", "text", "faults"]


class Poisoned(NumpyRuntime):
    """The reference runtime; decode call k poisons row `poison[k]` with a NaN."""

    poison: dict[int, int] = {}
    calls = 0

    def decode(self, inputs):  # type: ignore[no-untyped-def]
        logits = super().decode(inputs)
        self.calls += 1
        row = self.poison.get(self.calls)
        if row is not None and row < logits.shape[0]:
            logits = logits.copy()
            logits[row, 0] = np.nan
        return logits


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_workloads_bind_the_kernel_right_and_match_b1(layout: str,
                                                             data: st.DataObject) -> None:
    vocab = data.draw(st.sampled_from([24, 64]), label="vocab")
    model = spec(vocab, hybrid=layout == "hybrid")
    b = data.draw(st.integers(2, 5), label="B")
    num_blocks = None
    if layout == "tight":  # growth runs the free list dry: eviction and preemption
        num_blocks = data.draw(st.integers(9, b * 8), label="num_blocks")
    buckets = None
    if layout == "buckets":
        buckets = (*sorted(data.draw(st.sets(st.integers(1, b - 1), min_size=1))), b)
    art = artifact(model, b, num_blocks=num_blocks, buckets=buckets)
    kwargs: dict[str, Any] = {}
    if layout in ("prefix", "host"):
        kwargs["prefix_cache"] = True
    if layout == "host":
        kwargs["host_cache_bytes"] = 1 << 20
        art = artifact(model, b, num_blocks=b * 8 // 2 + 2)
    tokenizer = piece_tokenizer(vocab) if layout == "text" else None
    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    policy = data.draw(st.sampled_from(["prefill-first", "decode-first", "interleave:2"]))
    weights_seed = data.draw(st.integers(0, 3), label="weights")
    runtime = Poisoned.random(art, seed=weights_seed)
    if layout == "faults":  # NaN rows now and then: those requests fail, the others go on
        runtime.poison = data.draw(st.dictionaries(st.integers(1, 60), st.integers(0, b - 1),
                                                   max_size=4), label="poison")
    batcher = Batcher(runtime, policy=policy, **kwargs)
    stem = data.draw(st.lists(st.integers(0, vocab - 1), min_size=20, max_size=20))
    requests = []
    aborts: dict[int, list[str]] = {}
    for i in range(data.draw(st.integers(2, 9), label="requests")):
        plen = data.draw(st.integers(1, 30), label="plen")
        if data.draw(st.booleans()):
            prompt = stem[:plen]  # shared prefixes: the prefix cache hits
        else:
            prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=plen, max_size=plen))
        params = draw_params(data, vocab, art.max_seq_len - plen)
        if tokenizer is not None and data.draw(st.booleans(), label="stop string"):
            ids = data.draw(st.lists(st.integers(2, vocab - 1), min_size=1, max_size=2))
            stop = tokenizer.decode(ids)[1:]  # e.g. "3p1": ends inside a token, spans two
            params = SamplingParams(**{**{f: getattr(params, f)
                                          for f in params.__struct_fields__}, "stop": [stop]})
        rid = f"r{i}"
        batcher.submit(prompt, params, request_id=rid)
        requests.append((rid, prompt, params))
        if data.draw(st.integers(0, 5)) == 0:
            aborts.setdefault(data.draw(st.integers(0, 40)), []).append(rid)
    arrays = data.draw(st.booleans(), label="arrays")
    finals = drive(batcher, aborts, arrays=arrays)
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid, prompt, params in requests:
        for index in range(params.n):
            assert (rid, index) in finals, (rid, index)
        if rid in aborted:
            continue
        if any(finals[(rid, index)].finish_reason == "error" for index in range(params.n)):
            assert layout == "faults", finals[(rid, 0)].error
            assert all("non-finite" in (finals[(rid, index)].error or "non-finite")
                       for index in range(params.n))
            continue
        solo = alone(art, prompt, params, weights_seed, tokenizer)
        for index in range(params.n):
            got, want = finals[(rid, index)], solo[index]
            assert got.token_ids == want.token_ids, (rid, index, got, want)
            assert got.text == want.text, (rid, index)
            assert got.finish_reason == want.finish_reason, (rid, index)
            assert got.stop_reason == want.stop_reason, (rid, index)
    assert all(i is None for i in batcher.scheduler.kernel.ids)


def test_pd_import_staged_into_the_spare_takes_a_lane_bound_to_the_kernel() -> None:
    """Both lanes decode when a PD request arrives: it imports into the spare (STAGED, its first
    token from the producer), takes the first lane that finishes, and decodes there through the
    kernel: the same tokens as a native run."""
    import support.pd_models as pd

    from atombatch.pd import InProcessSource

    model = pd.SPECS["llama"]
    art = pd.artifact(model, 2, 7, block_size=32)
    natives = pd.prompts(2, seed=21)
    imported = pd.prompts(1, seed=22)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in Batcher(NumpyRuntime.random(art, pd.SEED)).generate(natives,
                                                                                     short)]
    want += pd.native(model, imported, art)
    batcher = Batcher(NumpyRuntime.random(art, pd.SEED))
    ids = [batcher.submit(p, short) for p in natives]
    decode_all(batcher, 2)
    ids.append(batcher.submit(imported[0], pd.PARAMS, kv=InProcessSource.from_producer(
        pd.producer_for(model), "pd-0", imported[0], pd.PARAMS, mode="whole")))
    finals = drive(batcher)
    assert [finals[(i, 0)].token_ids for i in ids] == want
    stats = batcher.stats()
    assert stats.imports >= 1 and stats.staged_chunks >= 1 and stats.rotations >= 1


# -- every release path drops the kernel's binding ------------------------------------------------


def small_batcher(batch_size: int = 2, num_blocks: int | None = None, **kwargs: Any) -> Batcher:
    return Batcher(NumpyRuntime.random(artifact(spec(), batch_size, num_blocks=num_blocks),
                                       seed=1), **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def decode_all(batcher: Batcher, lanes: int) -> None:
    drive(batcher, until=lambda: batcher.scheduler.lanes.num_decoding() >= lanes)


@pytest.mark.parametrize("path", ["finish", "abort", "fail", "preempt"])
def test_every_release_path_drops_the_request_from_the_kernel(path: str) -> None:
    """The kernel holds a request's output list only while its lane decodes: after a finish, an
    abort, a failure or a preemption nothing but the request refers to it."""
    batcher = small_batcher()
    params = SamplingParams(temperature=0.0, max_tokens=3 if path == "finish" else 30,
                            ignore_eos=True)
    batcher.submit([7, 8, 9], params, request_id="victim")
    batcher.submit([10, 11], GREEDY, request_id="other")
    decode_all(batcher, 2)
    scheduler = batcher.scheduler
    request = scheduler.requests["victim"]
    output = request.output
    lane = request.lane
    assert scheduler.kernel.ids[lane] == "victim"
    if path == "finish":
        drive(batcher, until=lambda: request.state is RequestState.FINISHED)
    elif path == "abort":
        batcher.abort("victim")
    elif path == "fail":
        sink: list[Any] = []
        batcher._fail(request, "injected", sink)  # the engine's path for a failed request
        assert sink[0].finish_reason == "error"
    else:
        scheduler.preempt(request)
    check_kernel_bindings(batcher)
    assert scheduler.kernel.ids[lane] is None and scheduler.kernel.flags(lane) == 0
    if path != "preempt":
        del request
        gc.collect()
        assert sys.getrefcount(output) == 2  # this test's name and getrefcount's argument
    drive(batcher)


def test_a_reused_lane_carries_none_of_its_previous_tenant() -> None:
    """A lane whose sampled, many-stop-id, own-output tenant finished decodes its next (plain
    greedy) tenant with no stale flag, stop id or limit: the same tokens as alone."""
    batcher = small_batcher(batch_size=1)
    first = SamplingParams(temperature=0.7, seed=3, max_tokens=4, ignore_eos=True, logprobs=1,
                           stop_token_ids=list(range(20, 40)))
    batcher.submit([1, 2, 3], first, request_id="first")
    batcher.submit([4, 5, 6], GREEDY, request_id="second")
    finals = drive(batcher)
    solo = alone(batcher.artifact, [4, 5, 6], GREEDY, 1)
    assert finals[("second", 0)].token_ids == solo[0].token_ids
    assert len(finals[("second", 0)].token_ids) == 30


# -- failures in the middle of a decode step ------------------------------------------------------


class Faulty(NumpyRuntime):
    """The reference runtime with one decode call's logits changed by `fault(step, logits)`."""

    fault: Any = None
    calls = 0

    def decode(self, inputs):  # type: ignore[no-untyped-def]
        logits = super().decode(inputs)
        self.calls += 1
        return self.fault(self.calls, logits) if self.fault is not None else logits


def faulty_batcher(fault: Any, batch_size: int = 3) -> Batcher:
    runtime = Faulty.random(artifact(spec(), batch_size), seed=1)
    runtime.fault = fault
    return Batcher(runtime)


def test_float64_logits_pick_the_same_greedy_token_in_prefill_and_decode() -> None:
    """A runtime returning float64 logits: greedy is the argmax of those logits, in decode as in
    prefill (a float32 copy ties entries that float64 tells apart)."""
    def widen(_: int, logits: np.ndarray) -> np.ndarray:
        wide = logits.astype(np.float64)
        top = wide.max(axis=1)
        wide[:, -1] = top + top * 1e-12  # equal to the top once rounded to float32
        return wide

    batcher = faulty_batcher(widen, batch_size=1)
    batcher.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                   request_id="r")
    finals = drive(batcher)
    last = batcher.spec.vocab_size - 1
    assert finals[("r", 0)].token_ids[1:] == (last, last, last)


@pytest.mark.parametrize("width", [0, 1, 48 + 8, "extra row", "missing row"])
def test_logits_of_the_wrong_vocabulary_fail_the_step_not_the_engine(width: Any) -> None:
    """Decode logits with no entries, or not `vocab_size` of them, or not one row per row of the
    bucket, fail that step's requests with a clear error (no token outside the vocabulary reaches
    a client or the next step), and the engine serves the next request."""
    def reshape(call: int, logits: np.ndarray) -> np.ndarray:
        if call != 2:
            return logits
        if width == "extra row":
            return np.vstack([logits, logits[:1]])
        if width == "missing row":
            return logits[:-1]
        out = np.full((logits.shape[0], width), -1.0, dtype=np.float32)
        out[:, :min(width, logits.shape[1])] = logits[:, :width]
        if width > logits.shape[1]:
            out[:, -1] = 1e3
        return out

    batcher = faulty_batcher(reshape, batch_size=2)
    batcher.submit([1, 2], GREEDY, request_id="a")
    batcher.submit([3, 4], GREEDY, request_id="b")
    finals = drive(batcher)
    vocab = batcher.spec.vocab_size
    for rid in ("a", "b"):
        completion = finals[(rid, 0)]
        assert completion.finish_reason == "error"
        assert "vocab" in (completion.error or "") and "rows" in (completion.error or "")
        assert all(0 <= t < vocab for t in completion.token_ids)
    batcher.submit([5, 6], GREEDY, request_id="c")
    assert drive(batcher)[("c", 0)].token_ids == alone(batcher.artifact, [5, 6], GREEDY,
                                                       1)[0].token_ids


def test_a_non_finite_row_and_a_sampler_failure_fail_only_their_requests() -> None:
    """One step: lane 0's logits turn NaN, lane 1's request samples and its sampler raises; lane
    2 (plain greedy) goes on with the tokens it has alone, and the kernel is unbound from the
    failed lanes."""
    def poison(call: int, logits: np.ndarray) -> np.ndarray:
        if call == 3:
            logits = logits.copy()
            logits[0, 5] = np.nan
        return logits

    batcher = faulty_batcher(poison)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True)
    batcher.submit([1, 2], GREEDY, request_id="nan")
    batcher.submit([3, 4], sampled, request_id="sampled")
    batcher.submit([5, 6], GREEDY, request_id="plain")
    decode_all(batcher, 3)
    import atombatch.engine.step as engine_module  # the step samples

    real = engine_module.sample_rows
    calls = [0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("sampler bug")
        return real(*args, **kwargs)

    engine_module.sample_rows = broken  # type: ignore[assignment]
    try:
        finals = drive(batcher, arrays=True)
    finally:
        engine_module.sample_rows = real  # type: ignore[assignment]
    assert finals[("nan", 0)].finish_reason == "error"
    assert "non-finite" in (finals[("nan", 0)].error or "")
    assert finals[("sampled", 0)].finish_reason == "error"
    assert "sampler bug" in (finals[("sampled", 0)].error or "")
    assert finals[("plain", 0)].token_ids == alone(batcher.artifact, [5, 6], GREEDY,
                                                   1)[0].token_ids


def test_a_block_op_failure_before_the_decode_skips_that_row() -> None:
    """A host restore fails for a request in the step that decodes the others: the request fails
    before the device call, its row is skipped by the kernel, the others' tokens are unchanged."""
    art = artifact(spec(), 2, num_blocks=2 * 8 // 2 + 2)
    batcher = Batcher(NumpyRuntime.random(art, seed=1), prefix_cache=True,
                      host_cache_bytes=1 << 20, policy="decode-first")
    stem = list(range(6, 30))
    batcher.submit(stem, SamplingParams(temperature=0.0, max_tokens=2), request_id="seed")
    drive(batcher)
    filler = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    batcher.submit([40, 41, 42], filler, request_id="f1")
    batcher.submit([43, 44], filler, request_id="f2")
    drive(batcher)  # evicts the stem's blocks to the host

    def refuse(block: int, data: Any) -> None:
        raise OSError("restore refused")

    batcher.runtime.write_block = refuse  # type: ignore[method-assign]
    batcher.submit([45, 46], GREEDY, request_id="plain")
    decode_all(batcher, 1)
    batcher.submit(stem + [1], GREEDY, request_id="restored")
    trace = batcher.record_trace()
    finals = drive(batcher, until=lambda: "restored" not in batcher.scheduler.requests)
    assert trace[0].kind == "decode"  # the restore rode on a decode step (decode-first)
    finals.update(drive(batcher))
    assert finals[("restored", 0)].finish_reason == "error"
    assert finals[("plain", 0)].token_ids == alone(art, [45, 46], GREEDY, 1)[0].token_ids
    assert batcher.stats().host_restores >= 1


# -- step_arrays ----------------------------------------------------------------------------------


def test_step_result_names_its_rows_requests_after_an_abort_between_steps() -> None:
    """An abort from another thread can land between `step_arrays()` and the consumer reading its
    result: the plain rows must still say whose tokens they are."""
    batcher = small_batcher()
    batcher.submit([1, 2], GREEDY, request_id="a")
    batcher.submit([5, 6], GREEDY, request_id="b")
    decode_all(batcher, 2)
    result = batcher.step_arrays()
    rows = result.lanes.tolist()
    assert result.plain.tolist() == [True, True]
    before = [result.request_ids[lane] for lane in rows]
    assert sorted(before) == ["a", "b"]
    batcher.abort("a")
    assert [result.request_ids[lane] for lane in rows] == before


def test_step_arrays_after_prefill_and_failed_decode_steps_are_empty() -> None:
    """A step that ran a prefill, or a decode whose device call failed, has no decode rows: the
    arrays are empty (not the last decode's stale rows)."""
    def explode(call: int, logits: np.ndarray) -> np.ndarray:
        if call == 3:
            raise RuntimeError("device lost")
        return logits

    batcher = faulty_batcher(explode, batch_size=1)
    batcher.submit([1, 2], GREEDY, request_id="a")
    kinds = []
    while batcher.has_unfinished():
        trace = batcher.record_trace()
        result = batcher.step_arrays()
        kind = trace[0].kind if trace else None
        kinds.append(kind)
        if kind != "decode" or any(o.finish_reason == "error" for o in result.outputs):
            assert len(result.lanes) == len(result.tokens) == len(result.plain) == 0
        check_kernel_bindings(batcher)
    assert "prefill" in kinds and "decode" in kinds


def test_step_and_step_arrays_mixed_report_every_token_once() -> None:
    batcher = small_batcher(batch_size=3)
    for i in range(5):
        batcher.submit([i + 1, i + 2], SamplingParams(temperature=0.0, max_tokens=10 + i,
                                                     ignore_eos=True), request_id=f"r{i}")
    streamed: dict[str, list[int]] = {}
    finals = {}
    n = 0
    while batcher.has_unfinished():
        n += 1
        if n % 2:
            result = batcher.step_arrays()
            outputs = result.outputs
            for lane, token, plain in zip(result.lanes.tolist(), result.tokens.tolist(),
                                          result.plain.tolist(), strict=True):
                if plain:
                    streamed.setdefault(result.request_ids[lane], []).append(token)
        else:
            outputs = batcher.step()
        for out in outputs:
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.completion is not None:
                finals[out.request_id] = out.completion.token_ids
    assert {k: tuple(v) for k, v in streamed.items()} == finals
    assert all(len(v) == 10 + int(k[1:]) for k, v in finals.items())


# -- the kernel's own contract --------------------------------------------------------------------


def kernels(b: int = 2, bps: int = 2, block_size: int = 4) -> list[Any]:
    out = []
    for impl in (c_impl, py_impl):
        pool = impl.BlockPool(b * bps + 1)
        lanes = impl.LaneTable(b, bps, block_size)
        inputs = impl.DecodeInputs(b, bps, (b,))
        out.append((impl, pool, lanes, impl.StepKernel(pool, lanes, inputs)))
    return out


@pytest.mark.parametrize(("field", "value"), [
    ("max_output", 2**31), ("max_output", 2**63), ("max_output", -1),
    ("stops", [2**63]), ("stops", [-(2**63) - 1]), ("stops", [1, 2**64]),
    ("flags", 8), ("flags", 2**40), ("flags", -1),
])
def test_bind_refuses_the_same_arguments_in_both_implementations(field: str, value: Any) -> None:
    """Out-of-range limits, stop ids and flags get the same typed error from the compiled kernel
    and its twin, and a refused bind leaves the lane's previous binding as it was."""
    for impl, pool, lanes, kernel in kernels():
        lanes.assign()
        lanes.push_block(0, pool.allocate(impl.LANE, 0))
        lanes.start_decode(0, 1, 1)
        kernel.bind(0, "old", Q(), D(), 5, [7, 8], py_impl.LANE_OWN_OUTPUT)
        args = dict(max_output=5, stops=[1], flags=0)
        args[field] = value
        with pytest.raises((RequestError, StateError)) as info:
            kernel.bind(0, "new", Q(), D(), args["max_output"], args["stops"], args["flags"])
        expected = StateError if field == "flags" else RequestError
        assert type(info.value) is expected, (impl.IMPLEMENTATION, info.value)
        assert kernel.ids[0] == "old" and kernel.flags(0) == py_impl.LANE_OWN_OUTPUT


def run_kernel_step(impl: Any, pool: Any, lanes: Any, kernel: Any, logits: np.ndarray,
                    sample: dict[int, int]) -> tuple[int, list[int], list[int]]:
    assert kernel.grow() == 0
    n = kernel.build(pool.reserve_spare() if pool.num_spare == 0 else -1)
    k = kernel.pick(np.ascontiguousarray(logits[:n], dtype=np.float32),
                    logits[:n].argmax(axis=1))
    for row in kernel.attention[:k].tolist():
        if kernel.status[row] == impl.ROW_SAMPLE:
            kernel.tokens[row] = sample[row]
    k = kernel.complete(1.0)
    return n, kernel.status[:n].tolist(), kernel.tokens[:n].tolist()


@pytest.mark.parametrize("token", [2**31 - 1, 2**31, 2**31 + 7, 2**62 + 1, 2**63 - 1])
def test_large_sampled_token_ids_stop_only_on_their_own_id(token: int) -> None:
    """Token ids past int32 (a caller's sampler writes them) match a stop id exactly: no
    truncation makes 2**31 + 7 stop on 7, and the token reaches the output list intact."""
    for impl, pool, lanes, kernel in kernels():
        outputs = (Q(), Q())
        for lane in (0, 1):
            lanes.assign()
            lanes.push_block(lane, pool.allocate(impl.LANE, lane))
            lanes.start_decode(lane, 1, 1)
            stops = [token] if lane == 0 else [token & 0xFFFFFFFF, token & 0x7FFFFFFF, 7]
            kernel.bind(lane, f"r{lane}", outputs[lane], D(), 100, stops, impl.LANE_SAMPLE)
        logits = np.zeros((2, 3), dtype=np.float32)
        n, status, tokens = run_kernel_step(impl, pool, lanes, kernel, logits,
                                            {0: token, 1: token})
        assert n == 2 and tokens == [token, token]
        assert (list(outputs[0]), list(outputs[1])) == ([token], [token])
        lane1 = impl.ROW_STOP if token in (token & 0xFFFFFFFF, token & 0x7FFFFFFF) else impl.ROW_OK
        assert status == [impl.ROW_STOP, lane1], impl.IMPLEMENTATION


def test_a_vocabulary_of_one_token() -> None:
    """vocab = 1: every greedy pick is token 0, which is the stop id of one lane only."""
    for impl, pool, lanes, kernel in kernels():
        outputs = (Q(), Q())
        for lane in (0, 1):
            lanes.assign()
            lanes.push_block(lane, pool.allocate(impl.LANE, lane))
            lanes.start_decode(lane, 0, 0)
            kernel.bind(lane, f"r{lane}", outputs[lane], D(), 3, [0] if lane == 0 else [], 0)
        logits = np.zeros((2, 1), dtype=np.float32)
        assert run_kernel_step(impl, pool, lanes, kernel, logits, {})[1] == [impl.ROW_STOP,
                                                                             impl.ROW_OK]
        assert (list(outputs[0]), list(outputs[1])) == ([0], [0])
        assert kernel.plain[:2].tolist() == [False, True]
        out: list[Any] = []
        assert kernel.emit(out, lambda *args: args) == 1 and out == [("r1", (0,), False)]


# -- memory and the two implementations ------------------------------------------------------------


def test_a_long_step_arrays_soak_allocates_nothing_per_step() -> None:
    """Cycles of identical requests decoded through `step_arrays()`: after warming up, a cycle
    leaves no memory behind (kernel lists, counters, events, per-request records)."""
    batcher = small_batcher(batch_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def cycle(tag: int) -> None:
        for lane in range(4):
            batcher.submit([lane + 1, lane + 2], params, request_id=f"c{tag}-{lane}")
        while batcher.has_unfinished():
            batcher.step_arrays()

    for tag in range(3):
        cycle(tag)
    gc.collect()
    tracemalloc.start()
    try:
        cycle(3)
        gc.collect()
        first = tracemalloc.get_traced_memory()[0]
        for tag in range(4, 14):
            cycle(tag)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - first
    finally:
        tracemalloc.stop()
    # ten cycles of 160 tokens: anything kept per token or per step would be > 10 kB
    assert grown < 8_000, grown
    assert all(i is None for i in batcher.scheduler.kernel.ids)


SUBPROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from support.kernel_review import mixed_workload
print(json.dumps(mixed_workload()))
"""


def test_twin_and_compiled_engines_produce_the_same_outputs() -> None:
    runs = []
    for no_ext in (None, "1"):
        env = {k: v for k, v in os.environ.items() if k != "ATOMBATCH_NO_EXTENSIONS"}
        if no_ext:
            env["ATOMBATCH_NO_EXTENSIONS"] = no_ext
        code = SUBPROCESS.format(tests=os.path.join(REPO, "tests"))
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True, cwd=REPO).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["impl"] for r in runs] == ["c", "py"]
    assert runs[0]["out"] == runs[1]["out"]
    assert runs[0]["preemptions"] == runs[1]["preemptions"] > 0


def test_an_abort_from_another_thread_waits_for_the_running_decode_step() -> None:
    """`abort` called while `step_arrays()` is inside the device call waits for the step: the
    step's rows are appended and reported for the request's lane, then the abort ends it with
    every one of those tokens in its completion."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def hold(call: int, logits: np.ndarray) -> np.ndarray:
        if call == 3:
            entered.set()
            assert release.wait(30)
        return logits

    batcher = faulty_batcher(hold, batch_size=2)
    batcher.submit([1, 2], GREEDY, request_id="a")
    batcher.submit([3, 4], GREEDY, request_id="b")
    decode_all(batcher, 2)
    drive(batcher, until=lambda: batcher.runtime.calls >= 2)  # type: ignore[attr-defined]
    streamed: dict[tuple[str, int], list[int]] = batcher.__dict__["_review_stream"]
    done: list[bool] = []
    result: list[Any] = []
    stepper = threading.Thread(target=lambda: result.append(batcher.step_arrays()))
    stepper.start()
    assert entered.wait(30)
    aborter = threading.Thread(target=lambda: done.append(batcher.abort("a")))
    aborter.start()
    aborter.join(0.2)
    assert aborter.is_alive() and not done  # waits for the step's lock
    release.set()
    stepper.join(30)
    aborter.join(30)
    assert done == [True]
    step = result[0]
    rows = dict(zip(step.lanes.tolist(), step.tokens.tolist(), strict=True))
    for lane, token in rows.items():
        streamed.setdefault((step.request_ids[lane], 0), []).append(token)
    assert sorted(step.request_ids[lane] for lane in rows) == ["a", "b"]
    finals = drive(batcher)
    assert finals[("a", 0)].finish_reason == "abort"
    assert finals[("b", 0)].token_ids == alone(batcher.artifact, [3, 4], GREEDY, 1)[0].token_ids


@pytest.mark.parametrize("form", ["fortran", "strided", "list", "float16"])
def test_decode_logits_in_any_layout_give_the_float32_tokens(form: str) -> None:
    """Fortran-ordered, strided or list decode logits: the same greedy tokens as the runtime's own
    C-contiguous float32; float16 ones: the tokens of the same rounded logits as float32."""
    def change(_: int, logits: np.ndarray) -> Any:
        if form == "fortran":
            return np.asfortranarray(logits)
        if form == "strided":
            wide = np.repeat(logits, 2, axis=1)
            return wide[:, ::2]
        if form == "list":
            return logits.tolist()
        return logits.astype(np.float16)

    batcher = faulty_batcher(change, batch_size=2)
    batcher.submit([1, 2], GREEDY, request_id="a")
    batcher.submit([3, 4, 5], GREEDY, request_id="b")
    finals = drive(batcher, arrays=True)
    if form == "float16":  # the reference: the same rounding, handed over as float32
        reference = faulty_batcher(lambda _, x: x.astype(np.float16).astype(np.float32),
                                   batch_size=2)
        reference.submit([1, 2], GREEDY, request_id="a")
        reference.submit([3, 4, 5], GREEDY, request_id="b")
        want = drive(reference)
        assert {k: c.token_ids for k, c in finals.items()} == \
            {k: c.token_ids for k, c in want.items()}
        return
    for rid, prompt in (("a", [1, 2]), ("b", [3, 4, 5])):
        assert finals[(rid, 0)].token_ids == alone(batcher.artifact, prompt, GREEDY,
                                                   1)[0].token_ids


@pytest.mark.parametrize(("prompt_len", "many_stops"), [(5, False), (5, True), (31, False)])
def test_the_scheduler_alone_stops_a_request_without_max_tokens_at_the_context_end(
        prompt_len: int, many_stops: bool) -> None:
    """`max_tokens=None` means "up to the context" (SamplingParams): a request the sans-I/O
    scheduler runs without the engine's default finishes "length" when prompt + output fill
    max_seq_len, on the kernel's path and on the scheduler's own stop check (more than 16 stop
    ids, or the first token), instead of the step kernel raising CapacityError for a block past
    the row."""
    from atombatch.engine.scheduler import Request, Scheduler

    art = artifact(spec(), 2, max_seq_len=32)
    scheduler = Scheduler(art)
    stops = list(range(30, 47)) if many_stops else []
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None,
                            stop_token_ids=stops)
    scheduler.add(Request("a", np.arange(1, prompt_len + 1, dtype=np.int64), params, 0.0,
                          np.random.default_rng(0)))
    finished = []
    for step in range(100):
        plan = scheduler.schedule(float(step))
        if plan is None:
            break
        if plan.kind == "prefill":
            done = scheduler.complete_prefill(plan, 7 if plan.last_chunk else None, float(step))
        else:
            scheduler.kernel.tokens[:plan.rows] = 7
            done = scheduler.complete_decode(plan, float(step))
        finished += [r for r in done if r.state is RequestState.FINISHED]
        scheduler.check_invariants()
    [request] = finished
    assert request.finish_reason == "length"
    assert len(request.prompt) + len(request.output) == art.max_seq_len


def test_bind_refuses_a_lane_that_is_not_decoding() -> None:
    """A binding lives while its lane decodes: an idle or prefilling lane cannot be bound (its
    request's lists would stay referenced by a lane `complete` never serves)."""
    for impl, pool, lanes, kernel in kernels():
        with pytest.raises(StateError, match="not decoding"):
            kernel.bind(0, "idle", Q(), D(), 3, [], 0)
        lane = lanes.assign()
        lanes.push_block(lane, pool.allocate(impl.LANE, lane))
        with pytest.raises(StateError, match="not decoding"):
            kernel.bind(lane, "prefilling", Q(), D(), 3, [], 0)
        assert kernel.ids[lane] is None and kernel.flags(lane) == 0
        lanes.start_decode(lane, 1, 1)
        kernel.bind(lane, "decoding", Q(), D(), 3, [], 0)
        assert kernel.ids[lane] == "decoding", impl.IMPLEMENTATION
