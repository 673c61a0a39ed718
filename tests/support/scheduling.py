"""The scheduler tests' artifact and random workloads, driven and checked against a cache-free
reference (the `core` fixture, both block cores, is in conftest.py)."""

from __future__ import annotations

from hypothesis import strategies as st

from atombatch import (
    ArtifactConfig,
    Batcher,
    SamplingParams,
)
from support.ledger import ledger_spec, reference


def artifact(batch_size=4, max_seq_len=64, block_size=64, num_blocks=None, chunk=8,
             hybrid=False, window=5, eos=(), buckets=()):
    bps = max_seq_len // block_size
    if num_blocks is None:
        num_blocks = batch_size * bps + 1
    return ArtifactConfig(model=ledger_spec(hybrid=hybrid, window=window, eos=eos),
                          batch_size=batch_size, max_seq_len=max_seq_len, block_size=block_size,
                          num_blocks=num_blocks, prefill_chunk_size=chunk,
                          decoder_batch_sizes=buckets)


def drive(batcher: Batcher, arrivals: dict[int, list], aborts: dict[int, list[str]] | None = None,
          max_steps: int = 100_000):
    """Step until done, submitting `arrivals[step]` and aborting `aborts[step]`; invariants each
    step. Returns {request_id: final RequestOutput} and the per-request streamed tokens."""
    aborts = aborts or {}
    finals: dict[str, object] = {}
    streamed: dict[str, list[int]] = {}
    step = 0
    pending = dict(arrivals)
    while batcher.has_unfinished() or pending:
        for prompt, params, rid in pending.pop(step, []):
            batcher.submit(prompt, params, request_id=rid)
        for rid in aborts.get(step, []):
            batcher.abort(rid)
        for out in batcher.step():
            assert out.request_id not in finals, f"{out.request_id} produced output after finishing"
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        batcher.check_invariants()
        step += 1
        assert step < max_steps, "the engine did not make progress"
    return finals, streamed


def expected(prompt, params, art):
    spec = art.model
    stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else
                                                frozenset(spec.eos_token_ids))
    return reference(list(prompt), params.max_tokens, spec.vocab_size,
                     spec.sliding_window if spec.is_hybrid else 0, stop)


# -- random workloads: invariants every step, tokens always right -----------------------------------
def draw_workload(data: st.DataObject) -> tuple[dict[int, list], dict[int, list[str]]]:
    """Up to 8 greedy requests (arrival step -> [(prompt, params, id)]) and some aborts
    (step -> ids); a tiny alphabet makes prompts share prefixes (and partial blocks) all the time."""
    arrivals: dict[int, list] = {}
    aborts: dict[int, list[str]] = {}
    alphabet = data.draw(st.sampled_from([3, 96]))
    stem = data.draw(st.lists(st.integers(1, alphabet), min_size=0, max_size=30))
    for i in range(data.draw(st.integers(1, 8))):
        plen = data.draw(st.integers(1, 40))
        prompt = data.draw(st.lists(st.integers(1, alphabet), min_size=plen, max_size=plen))
        if data.draw(st.booleans()):  # shared prefixes make the prefix cache hit
            prompt = (stem + prompt)[:plen]
        params = SamplingParams(temperature=0.0, max_tokens=data.draw(st.integers(1, 64 - plen)),
                                ignore_eos=True)
        arrivals.setdefault(data.draw(st.integers(0, 30)), []).append((prompt, params, f"r{i}"))
        if data.draw(st.booleans()) and data.draw(st.booleans()):
            aborts.setdefault(data.draw(st.integers(0, 60)), []).append(f"r{i}")
    return arrivals, aborts


def check_workload(arrivals: dict[int, list], finals: dict, streamed: dict, art) -> None:
    """Finished requests produced the reference tokens; aborted ones streamed a prefix of them."""
    for batch in arrivals.values():
        for prompt, params, rid in batch:
            out = finals[rid]
            want = expected(prompt, params, art)
            if out.finish_reason == "abort":
                assert want[: len(streamed.get(rid, []))] == streamed.get(rid, [])
            else:
                assert out.finish_reason == "length" and streamed[rid] == want
