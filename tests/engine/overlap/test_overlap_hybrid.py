"""A hybrid model's admissions inside the pipeline (`Batcher(overlap=True)`, atombatch/engine/pipeline.py):
a Gemma3-like model keeps its sliding-window layers' KV in a slot per lane, and a decode step's
padding rows write a slot at position 0. A request admitted while a decode is on the device has
its first chunk run right after it, and the decode of the other lanes after that chunk is built
ahead (`AheadScheduler.plan_after_prefill`); that decode's padding rows must leave the new lane's
fresh window alone (`StepKernel.build_ahead`), or the request's tokens change.

On the NumPy runtime (real decoder math, KV written for padding rows too), with buckets larger
than the rows that decode: every request's greedy tokens are those it gets alone on a fresh
synchronous engine, and those of the same arrivals stepped synchronously; the stats show the
admissions went ahead, and no device call right after a prefill chunk has a padding row in that
chunk's slot (recorded at the runtime's boundary).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.pd_models import SEED, SPECS

from atombatch import ArtifactConfig, Batcher, RequestOutput, SamplingParams
from atombatch.runtime import NumpyRuntime

pytestmark = pytest.mark.numerics

SPEC = SPECS["gemma3"]  # sliding window 8, sliding and global layers
assert SPEC.is_hybrid


def layout(batch_size: int, buckets: tuple[int, ...] | None = None) -> ArtifactConfig:
    return ArtifactConfig(model=SPEC, batch_size=batch_size, max_seq_len=96, block_size=8,
                          num_blocks=64, prefill_chunk_size=16, decoder_batch_sizes=buckets)


LAYOUTS = {
    "B4": layout(4),                        # one bucket: padding whenever a lane is not decoding
    "B4 buckets 1,3,4": layout(4, (1, 3, 4)),   # 2 lanes decode in 3 rows, 3 in 4
    "B5 buckets 2,5": layout(5, (2, 5)),    # 3 lanes decode in 5 rows: one idle slot, twice
}


class Recording:
    """The runtime, recording each call: a prefill's sliding slot, a decode's padding rows'
    slots (padding rows are the rows at position 0: a decoding lane is never there)."""

    def __init__(self, runtime: NumpyRuntime) -> None:
        self.runtime = runtime
        # ("prefill", its slot, (), ()) or ("decode", -1, real rows' slots, padding rows' slots)
        self.calls: list[tuple[str, int, tuple[int, ...], tuple[int, ...]]] = []

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        slot = int(np.asarray(inputs.local_block_tables).reshape(-1)[0])
        self.calls.append(("prefill", slot, (), ()))
        return self.runtime.prefill(inputs, **kw)

    def decode(self, inputs: Any) -> Any:
        positions = np.asarray(inputs.cache_position).reshape(-1)
        slots = np.asarray(inputs.local_block_tables).reshape(-1)
        self.calls.append(("decode", -1, tuple(slots[positions > 0].tolist()),
                           tuple(slots[positions == 0].tolist())))
        return self.runtime.decode(inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)

    def decodes_after_a_chunk(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(the chunk's slot, the real rows' slots, the padding rows' slots) of every decode
        right after a prefill chunk."""
        return [(slot, *self.calls[i + 1][2:]) for i, (kind, slot, _, _) in
                enumerate(self.calls[:-1])
                if kind == "prefill" and self.calls[i + 1][0] == "decode"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def sampled(max_tokens: int, seed: int) -> SamplingParams:
    """A request whose first token the engine draws when its chunk lands: it cannot join the
    decode right after its chunk (a greedy one does, with the chunk's argmax)."""
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True)


Arrivals = list[tuple[int, list[int], SamplingParams]]  # (the step it arrives before, prompt, params)


def run(batcher: Batcher, arrivals: Arrivals) -> list[tuple[tuple[int, ...], str | None]]:
    """Submit each request before the step it arrives at (the pipeline is in the air then, when
    it runs) and step to the end; each request's tokens and finish reason, in arrival order."""
    ids: list[str] = []
    finals: dict[str, RequestOutput] = {}
    queue = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    order: dict[int, str] = {}
    step = 0
    while queue or batcher.has_unfinished():
        while queue and arrivals[queue[0]][0] <= step:
            i = queue.pop(0)
            order[i] = batcher.submit(arrivals[i][1], arrivals[i][2])
        for out in batcher.step():
            assert out.request_id not in finals, f"{out.request_id} produced output after its end"
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        step += 1
        assert step < 5_000
    ids = [order[i] for i in range(len(arrivals))]
    return [(finals[i].completion.token_ids, finals[i].finish_reason) for i in ids]


def alone(art: ArtifactConfig, arrivals: Arrivals) -> list[tuple[tuple[int, ...], str | None]]:
    return [run(Batcher(NumpyRuntime.random(art, SEED)), [(0, prompt, params)])[0]
            for _, prompt, params in arrivals]


def staggered_arrivals(count: int, seed: int) -> Arrivals:
    """Two requests at once, then one every few steps: short prompts (one chunk; some shorter
    than the window, some longer) and some of two or three chunks, output limits that end
    lanes at different steps."""
    rng = np.random.default_rng(seed)
    out: Arrivals = []
    step = 0
    for i in range(count):
        length = int(rng.choice([3, 7, 12, 16, 24, 40])) if i % 4 else 5
        prompt = rng.integers(1, 256, size=length).tolist()
        limit = 4 + (7 * i) % 11
        out.append((step, prompt, sampled(limit, i) if i % 3 == 2 else greedy(limit)))
        if i:
            step += int(rng.integers(1, 5))
    return out


def check_ahead(art: ArtifactConfig, arrivals: Arrivals) -> tuple[int, int, int, int]:
    """Overlapped, synchronous and alone agree; no decode right after a chunk pads into its
    slot. Returns (chunks that went ahead, decodes of other lanes right after a chunk, without
    its lane, with padding rows, those of them whose padding rows share a slot, decodes right
    after a chunk that its lane joined)."""
    want = alone(art, arrivals)
    sync = Batcher(NumpyRuntime.random(art, SEED))
    assert run(sync, arrivals) == want
    recording = Recording(NumpyRuntime.random(art, SEED))
    over = Batcher(recording, overlap=True)  # type: ignore[arg-type]
    assert run(over, arrivals) == want
    after = recording.decodes_after_a_chunk()
    for slot, _, padding in after:
        assert slot not in padding, f"a padding row wrote slot {slot} right after its chunk"
    stats = over.stats()
    assert stats.lane_blocks == 0
    # the case at stake: other lanes decode right after the chunk, its lane not yet, padding too
    at_stake = [padding for slot, real, padding in after if real and padding and slot not in real]
    reused = sum(1 for padding in at_stake if len(set(padding)) < len(padding))
    joined = sum(1 for slot, real, _ in after if slot in real)
    return stats.overlapped_prefills, len(at_stake), reused, joined


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_admissions_go_ahead_and_keep_their_tokens(name: str, core: str) -> None:
    art = LAYOUTS[name]
    ahead, padded, reused, joined = check_ahead(art, staggered_arrivals(12, seed=5))
    assert ahead >= 4  # of the 10 requests that arrive while the pipeline runs
    assert padded >= 1  # decodes built after a sampled request's chunk, with padding rows
    assert joined >= 2  # greedy requests decode right after their chunk
    if name != "B4 buckets 1,3,4":  # one free slot for two padding rows, some of the time
        assert reused >= 1


def test_with_no_slot_for_padding_the_decode_after_the_chunk_waits() -> None:
    """B2, one bucket: one lane decodes, the other is admitted ahead. The decode after its
    chunk has one padding row and no slot it may write (the only other lane is the new one), so
    for a sampled request it is not built ahead: the chunk goes ahead, the decode after it is
    scheduled by the host. A greedy request joins that decode (no padding row at all)."""
    art = layout(2)
    rng = np.random.default_rng(11)
    arrivals: Arrivals = [(0, rng.integers(1, 256, size=9).tolist(), greedy(30))]
    arrivals += [(3 + 6 * i, rng.integers(1, 256, size=6 + i).tolist(),
                  sampled(4, i) if i % 2 else greedy(4)) for i in range(3)]
    ahead, padded, _, joined = check_ahead(art, arrivals)
    assert ahead >= 2 and padded == 0 and joined >= 1


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_into_a_hybrid_pipeline(seed: int) -> None:
    """Random arrival steps, prompt lengths (1 to 3 chunks) and limits, random layout."""
    rng = np.random.default_rng(100 + seed)
    art = list(LAYOUTS.values())[seed % len(LAYOUTS)]
    arrivals: Arrivals = []
    for _ in range(int(rng.integers(5, 10))):
        prompt = rng.integers(1, 256, size=int(rng.integers(1, 45))).tolist()
        limit = int(rng.integers(2, 14))
        arrivals.append((int(rng.integers(0, 25)), prompt,
                         sampled(limit, len(arrivals)) if rng.random() < 0.3 else greedy(limit)))
    check_ahead(art, arrivals)
