"""What the tests of the decode pipeline (`Batcher(overlap=True)`, atombatch/engine/pipeline.py, in
tests/engine/overlap/) share: greedy limits, short prompts, closed-loop clients (plain, raising,
n > 1), each request run alone on a fresh synchronous engine, and runtimes that fail a prefill
call or record every device call."""

from __future__ import annotations

from typing import Any

import numpy as np

from atombatch import ArtifactConfig, Batcher, RequestOutput, SamplingParams
from atombatch.runtime import NumpyRuntime
from support.pd_models import SEED, prompts


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def short_prompts(count: int, seed: int, longest: int = 16) -> list[list[int]]:
    """Prompts of one 16-token chunk (the decode after the chunk follows it on the device)."""
    return [p[:longest - i % 5] for i, p in enumerate(prompts(count, seed=seed))]


def closed_loop(batcher: Batcher, work: list[list[int]], params: list[SamplingParams],
                concurrency: int, between: Any = None) -> list[RequestOutput]:
    """Keep `concurrency` requests in flight: each final output submits the next request before
    the next step (the pipeline is in the air then). `between(batcher, ids, step)` runs after
    each step. Returns the final outputs in request order."""
    pending = list(range(len(work)))
    ids: dict[int, str] = {}

    def submit_next() -> None:
        i = pending.pop(0)
        ids[i] = batcher.submit(work[i], params[i])

    for _ in range(min(concurrency, len(work))):
        submit_next()
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while batcher.has_unfinished() or pending:
        for out in batcher.step():
            assert out.request_id not in finals, f"{out.request_id} produced output after its end"
            if out.finished:
                finals[out.request_id] = out
                if pending:
                    submit_next()
        batcher.check_invariants()
        steps += 1
        if between is not None:
            between(batcher, ids, steps)
        assert steps < 10_000
    return [finals[ids[i]] for i in range(len(work))]


def loop_through(over: Batcher, work: list[list[int]], params: list[SamplingParams],
                 first: int, error: type[BaseException],
                 on_raise: Any = None) -> tuple[list[Any], int]:
    """A closed loop (`first` requests at once, a new one per finished one) whose steps may
    raise `error` (then `on_raise(over, ids)`, the ids submitted so far, if given): the final
    outputs in request order, and how many steps raised."""
    ids = [over.submit(p, sp) for p, sp in zip(work[:first], params[:first], strict=True)]
    queue = list(range(first, len(work)))
    finals: dict[str, Any] = {}
    raised = 0
    for _ in range(3000):
        try:
            outs = over.step()
        except error:
            raised += 1
            outs = []
            if on_raise is not None:
                on_raise(over, ids)
        for out in outs:
            assert out.request_id not in finals, out.request_id
            if out.finished:
                finals[out.request_id] = out
                if queue:
                    i = queue.pop(0)
                    ids.append(over.submit(work[i], params[i]))
        over.check_invariants()
        if not over.has_unfinished() and not queue:
            break
    return [finals[i] for i in ids], raised


def choices_loop(batcher: Batcher, work: list[list[int]], params: list[SamplingParams],
                  concurrency: int) -> list[Any]:
    """A closed loop where a request ends once all its `n` choices have: per request, each
    choice's (tokens, finish reason) in index order and its prompt logprobs."""
    pending = list(range(len(work)))
    ids: dict[str, int] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    ends: dict[tuple[str, int], Any] = {}
    prompt: dict[str, Any] = {}

    def submit() -> None:
        i = pending.pop(0)
        ids[batcher.submit(work[i], params[i])] = i

    for _ in range(min(concurrency, len(work))):
        submit()
    for _ in range(10_000):
        for out in batcher.step():
            key = (out.request_id, out.index)
            assert key not in ends, f"{key} produced output after its end"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                prompt[out.request_id] = [None if lp is None else (lp.token_id, lp.logprob)
                                          for lp in out.prompt_logprobs]
            if out.finish_reason is not None:  # a choice's last output
                ends[key] = out.finish_reason
            if out.finished and pending:  # the request's last choice ended
                submit()
        batcher.check_invariants()
        if not batcher.has_unfinished() and not pending:
            break
    out = []
    for request_id, i in sorted(ids.items(), key=lambda item: item[1]):
        out.append(([(tuple(tokens[(request_id, c)]), ends[(request_id, c)])
                     for c in range(params[i].n)], prompt.get(request_id)))
    return out


def tokens_of(finals: list[RequestOutput]) -> list[tuple[tuple[int, ...], str | None]]:
    return [(f.completion.token_ids, f.finish_reason) for f in finals]


def run_alone(art: ArtifactConfig, work: list[list[int]], params: list[SamplingParams]
              ) -> list[tuple[tuple[int, ...], str | None]]:
    out = []
    for p, sp in zip(work, params, strict=True):
        solo = Batcher(NumpyRuntime.random(art, SEED))
        out += tokens_of(closed_loop(solo, [p], [sp], 1))
    return out


def assert_only_aborted_differs(finals: list[RequestOutput],
                                want: list[tuple[tuple[int, ...], str | None]],
                                aborted: list[str]) -> None:
    """One request was aborted and ended so; every other one got the tokens it gets alone."""
    assert len(aborted) == 1
    got = tokens_of(finals)
    for i, final in enumerate(finals):
        if final.request_id == aborted[0]:
            assert final.finish_reason == "abort"
        else:
            assert got[i] == want[i]


class FaultyPrefill(NumpyRuntime):
    """Prefill call `at` (counting from 1) raises `error`, or (error None) returns NaN logits."""

    at = 0
    error: Exception | None = None
    calls = 0

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == self.at and self.error is not None:
            raise self.error
        logits = super().prefill(inputs, **kw)
        if self.calls == self.at:
            logits = np.full_like(np.asarray(logits), np.nan)
        return logits


class CallLog(NumpyRuntime):
    """Records every device call: ("prefill", lane, end) with `end` the chunk's last real
    position + 1, ("decode", {lane: position}) for a decode's rows (a padding row: its slot's
    lane at position 0)."""

    log: list[Any]

    def prefill(self, inputs: Any, **kw: Any) -> Any:
        start = int(inputs.cache_position[0, 0])
        self.log.append(("prefill", int(inputs.local_block_tables[0]),
                         start + int(inputs.query_position) + 1))
        return super().prefill(inputs, **kw)

    def decode(self, inputs: Any) -> Any:
        rows = inputs.input_ids.shape[0]
        self.log.append(("decode", dict(zip(inputs.local_block_tables[:rows, 0].tolist(),
                                            inputs.cache_position[:rows, 0].tolist(),
                                            strict=True))))
        return super().decode(inputs)
