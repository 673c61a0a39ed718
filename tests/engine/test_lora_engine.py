"""LoRA adapters through the engine (issue 41): a request carries its adapter from submit to the
device, and every engine path keeps it.

Requests under two PEFT adapters (made by peft in the test) and under the base model run mixed
in one batch, and each one's greedy tokens equal transformers + peft's with its adapter: with
paged and eager blocks, decode buckets, preemption from a small pool, n > 1 (forked with and
without a prefix cache), the overlap pipeline, and through the engine core process. The ids the
runtime receives are recorded by a thin wrapper over the real NumPy runtime: adapters really
share decode calls, padding rows run the base, and `max_loras=1` never lets two adapters into
one call while every request still finishes, a held-back adapter waiting a bounded time. Unknown
names, double loads and unloading an adapter in use are refused with typed errors.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import numpy as np
import pytest
from support.driving import run_to_end
from support.lora_engine import (
    ADAPTERS,
    LoraFamily,
    RecordingRuntime,
    core_batcher,
    greedy,
    make_family,
)

from atombatch import Batcher
from atombatch.api.structs import RequestOutput, SamplingParams
from atombatch.errors import ConfigError, RequestError, StateError

A, B = ADAPTERS
NEW = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> LoraFamily:
    return make_family("llama", tmp_path_factory.mktemp("lora-engine-llama"))


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(n)).tolist()
            for n in rng.integers(9, 40, size=count)]


def mixed(count: int, seed: int = 3) -> list[tuple[list[int], str | None]]:
    """`count` prompts, each under A, B or the base in turn."""
    return [(p, (A, B, None)[i % 3]) for i, p in enumerate(prompts(count, seed))]


def run(batcher: Batcher, work: list[tuple[list[int], str | None]], new: int = NEW,
        params: SamplingParams | None = None) -> dict[str, RequestOutput]:
    ids = [batcher.submit(p, params or greedy(new), lora=lora) for p, lora in work]
    finals = run_to_end(batcher)
    assert set(finals) == set(ids)
    return {rid: finals[rid] for rid in ids}


def assert_references(family: LoraFamily, work: list[tuple[list[int], str | None]],
                      finals: dict[str, RequestOutput], new: int = NEW) -> None:
    for (prompt, lora), out in zip(work, finals.values(), strict=True):
        assert out.completion is not None and out.completion.finish_reason == "length", out
        assert family.reference(lora, prompt, new) == list(out.completion.token_ids), \
            f"{out.request_id} under {lora}"


@pytest.mark.parametrize("layout", ["paged", "eager", "buckets"])
def test_mixed_adapters_in_one_batch_equal_peft(llama: LoraFamily, layout: str) -> None:
    kw = {"paged": {}, "eager": {"block_size": 128},
          "buckets": {"decoder_batch_sizes": (1, 2, 4)}}[layout]
    runtime = RecordingRuntime(llama.runtime(4, **kw))
    batcher = llama.engine(runtime)
    work = mixed(6)  # a second wave of two: a smaller bucket
    finals = run(batcher, work)
    assert_references(llama, work, finals)
    # the adapters really shared decode calls, and padding rows ran the base model
    decodes = [ids for kind, ids in runtime.calls if kind == "decode"]
    assert all(ids is not None for ids in decodes)
    assert any({1, 2} <= set(ids) for ids in decodes if ids is not None)
    if layout == "buckets":
        assert {len(ids) for ids in decodes if ids is not None} > {4}  # smaller buckets ran
    if layout == "paged":  # a request prefilled into the spare under its adapter, then rotated
        assert batcher.stats().staged_chunks > 0 and batcher.stats().rotations > 0


def test_no_adapter_no_ids(llama: LoraFamily) -> None:
    """A loadable runtime that never saw an adapter request is called as one without LoRA."""
    runtime = RecordingRuntime(llama.runtime(2))
    batcher = Batcher(runtime)
    work = [(p, None) for p in prompts(3)]
    assert_references(llama, work, run(batcher, work))
    assert runtime.calls and all(ids is None for _, ids in runtime.calls)
    with pytest.raises(RequestError, match="lora='x' is not a loaded LoRA adapter; loaded: none"):
        batcher.submit([5, 6], greedy(2), lora="x")


def test_preemption_recomputes_under_its_adapter(llama: LoraFamily) -> None:
    runtime = RecordingRuntime(llama.runtime(3, num_blocks=9))  # oversubscribed: 8 per sequence
    batcher = llama.engine(runtime)
    work = mixed(5, seed=11)
    finals = run(batcher, work, new=40)
    assert sum(out.completion.preemptions for out in finals.values()  # type: ignore[union-attr]
               ) > 0, "the pool was meant to run dry"
    assert_references(llama, work, finals, new=40)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_n_choices_keep_the_adapter(llama: LoraFamily, prefix_cache: bool) -> None:
    batcher = llama.engine(llama.runtime(4), prefix_cache=prefix_cache)
    prompt = prompts(1, seed=5)[0]
    rid = batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                                n=3), lora=B)
    done: dict[int, tuple[int, ...]] = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            assert out.request_id == rid
            if out.completion is not None:
                done[out.index] = out.completion.token_ids
    assert sorted(done) == [0, 1, 2]
    reference = llama.reference(B, prompt, NEW)
    assert all(reference == list(tokens) for tokens in done.values())


def test_overlap_pipeline_passes_the_ids(llama: LoraFamily) -> None:
    runtime = RecordingRuntime(llama.runtime(4))
    batcher = llama.engine(runtime, overlap=True)
    work = mixed(8, seed=7)
    finals = run(batcher, work)
    assert_references(llama, work, finals)
    assert batcher.stats().overlapped_steps > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_max_loras_one_never_mixes_adapters(llama: LoraFamily, overlap: bool) -> None:
    runtime = RecordingRuntime(llama.runtime(4))
    batcher = llama.engine(runtime, max_loras=1, overlap=overlap)
    work = mixed(9, seed=13)
    finals = run(batcher, work)
    assert_references(llama, work, finals)
    per_call = runtime.adapters_per_call()
    assert per_call and max(len(ids) for ids in per_call) == 1
    assert {1, 2} <= set().union(*per_call)  # both ran (in turn)


def test_max_loras_wait_is_bounded(llama: LoraFamily) -> None:
    """Under a cap of 1, a B request behind a stream of A requests is passed at most
    `lora_bypass_limit` times; then the A requests wait for it."""
    batcher = llama.engine(llama.runtime(2), max_loras=1)
    scheduler = batcher.scheduler
    scheduler.lora_bypass_limit = 2
    first = batcher.submit(prompts(1, 1)[0], greedy(30), lora=A)
    batcher.step()
    held = batcher.submit(prompts(1, 2)[0], greedy(4), lora=B)
    later = [batcher.submit(p, greedy(4), lora=A) for p in prompts(6, 4)]
    order: list[str] = []
    while batcher.has_unfinished():
        batcher.step()
        for request in scheduler.by_lane:
            if request is not None and request.request_id not in order:
                order.append(request.request_id)
    assert order[0] == first
    assert order.index(held) <= 1 + 2, order       # past it: at most the limit
    assert any(order.index(r) > order.index(held) for r in later)  # the rest waited for it


def test_adapter_errors_are_typed(llama: LoraFamily) -> None:
    batcher = llama.engine(llama.runtime(2), adapters=(A,))
    with pytest.raises(RequestError, match=r"lora='nope' is not a loaded LoRA adapter; loaded: "
                                           + A):
        batcher.submit([5, 6, 7], greedy(2), lora="nope")
    with pytest.raises(RequestError, match="is loaded already"):
        batcher.load_lora(A, str(llama.adapter_dirs[A]))
    with pytest.raises(ConfigError):
        batcher.load_lora("broken", str(llama.adapter_dirs[A].parent / "missing"))
    rid = batcher.submit([5, 6, 7], greedy(2), lora=A)
    with pytest.raises(StateError, match=rf"adapter '{A}' is in use by request '{rid}'"):
        batcher.unload_lora(A)
    run_to_end(batcher)
    batcher.unload_lora(A)
    assert dict(batcher.lora_adapters) == {}
    with pytest.raises(RequestError, match="loaded: none"):
        batcher.submit([5, 6, 7], greedy(2), lora=A)


def test_engine_core_process_runs_adapters(llama: LoraFamily) -> None:
    from atombatch.core import CoreClient

    factory = functools.partial(core_batcher, str(llama.checkpoint),
                                ((A, str(llama.adapter_dirs[A])),))
    work = mixed(4, seed=17)

    async def main() -> list[list[int]]:
        async with CoreClient(factory) as client:
            assert client.loras == [A]
            with pytest.raises(RequestError, match=f"lora='{B}' is not a loaded"):
                client.submit([5, 6], greedy(2), lora=B)
            assert await client.load_lora(B, str(llama.adapter_dirs[B])) == sorted(ADAPTERS)
            with pytest.raises(RequestError, match="is loaded already"):
                await client.load_lora(B, str(llama.adapter_dirs[B]))
            with pytest.raises(ConfigError):
                await client.load_lora("broken", str(Path(llama.adapter_dirs[A]) / "none"))
            outs = await asyncio.gather(*(client.generate(p, greedy(NEW), lora=lora)
                                          for p, lora in work))
            assert await client.unload_lora(A) == [B]
            return [list(o.token_ids) for o in outs]

    tokens = asyncio.run(main())
    for (prompt, lora), got in zip(work, tokens, strict=True):
        assert llama.reference(lora, prompt, NEW) == got


def test_row_ids_follow_the_packed_rows() -> None:
    """A decode's ids are its rows' lanes' (the bucket's packing), padding rows the base's, even
    when the padding row borrows a prefilling lane that runs an adapter."""
    from atombatch.engine.lora import LoraRows
    from atombatch.kernel.blocks import DecodeInputs, LaneTable

    lanes = LaneTable(4, 2, 16)
    inputs = DecodeInputs(4, 2, (1, 2, 4))
    rows = LoraRows(4)
    for block, lora in enumerate((5, 2, 6, 1)):  # lanes 0..3 bound, with these adapters
        lane = lanes.assign()
        lanes.push_block(lane, block)
        rows.by_lane[lane] = lora
    for lane in (1, 3):
        lanes.start_decode(lane, 3, 7)
    decoding = inputs.build(lanes, 4)
    rows.fill_decode(inputs, decoding)
    assert inputs.num_rows == 2 and rows.ids(inputs).tolist() == [2, 1]
    lanes.start_decode(0, 3, 7)
    decoding = inputs.build(lanes, 4)
    rows.fill_decode(inputs, decoding)
    assert inputs.row_lanes.tolist() == [0, 1, 3, 2]  # lane 2 (prefilling) lends the padding row
    assert rows.ids(inputs).tolist() == [5, 2, 1, 0]


def test_speculative_verify_runs_under_the_adapter(llama: LoraFamily,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft verified in one prefill-graph call (docs/speculative.md) runs under its request's
    adapter: with drafts taken from each adapter's own reference (most accepted), every request
    still equals transformers + peft; a verify under the base model would accept base tokens."""
    from support.speculative import OracleDrafts

    from atombatch.api.speculative import SpeculativeConfig
    from atombatch.sampling import ngram

    work = mixed(6, seed=11)
    refs = [llama.reference(lora, p, NEW) for p, lora in work]
    oracle = OracleDrafts([p for p, _ in work], refs, miss_rate=0.2, seed=5)
    monkeypatch.setattr(ngram, "propose", oracle.propose)
    batcher = llama.engine(llama.runtime(1), speculative=SpeculativeConfig(
        num_speculative_tokens=3, auto_off=False))
    finals = run(batcher, work)
    assert_references(llama, work, finals)
    assert batcher.stats().spec_decode_num_accepted_tokens > 0
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_n_choices_preempted_under_a_cap_with_the_overlap_pipeline(llama: LoraFamily,
                                                                   prefix_cache: bool) -> None:
    """Review: everything at once. n = 2 under each adapter and the base, an oversubscribed
    pool (preemption), `max_loras=1` and `overlap=True`: every choice equals transformers +
    peft's greedy tokens under its adapter, and no call mixes two adapters."""
    runtime = RecordingRuntime(llama.runtime(3, num_blocks=9))
    batcher = llama.engine(runtime, max_loras=1, overlap=True, prefix_cache=prefix_cache)
    work = [(p, (A, B, None, B, A)[i]) for i, p in enumerate(prompts(5, seed=17))]
    new = 30
    ids = [batcher.submit(p, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                                            n=2), lora=lora) for p, lora in work]
    done: dict[tuple[str, int], list[int]] = {}
    preempted = 0
    while batcher.has_unfinished():
        for out in batcher.step():
            if out.completion is not None:
                assert out.completion.finish_reason == "length", out
                done[(out.request_id, out.index)] = list(out.completion.token_ids)
                preempted += out.completion.preemptions
        batcher.check_invariants()
    assert preempted > 0, "the pool was meant to run dry"
    for rid, (prompt, lora) in zip(ids, work, strict=True):
        reference = llama.reference(lora, prompt, new)
        for index in (0, 1):
            assert done[(rid, index)] == reference, f"{rid}#{index} under {lora}"
    assert max(len(ids) for ids in runtime.adapters_per_call()) == 1


def test_two_loads_at_once_both_load(llama: LoraFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: `load_lora` chose the new adapter's id before reading its files, so two loads of
    different names at once (an embedder's threads) chose the same id and the second failed as
    "loaded meanwhile". The id is chosen when the adapter is handed to the runtime. The other
    load is run inside the first's file read (the window two threads would share)."""
    import atombatch.artifact.lora as lora_files

    batcher = llama.engine(llama.runtime(2), adapters=())
    real = lora_files.load_peft
    nested = {"done": False}

    def load_with_another_meanwhile(*args: object, **kwargs: object) -> object:
        if not nested["done"]:
            nested["done"] = True
            batcher.load_lora(B, str(llama.adapter_dirs[B]))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lora_files, "load_peft", load_with_another_meanwhile)
    batcher.load_lora(A, str(llama.adapter_dirs[A]))
    adapters = dict(batcher.lora_adapters)
    assert sorted(adapters) == sorted([A, B])
    assert len({a.lora_int_id for a in adapters.values()}) == 2
    work = mixed(6, seed=19)
    assert_references(llama, work, run(batcher, work))
