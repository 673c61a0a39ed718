"""Speculative decoding through the prefill graph (n-gram drafts; docs/speculative.md).

A step that would decode one lone lane (the decode plan has one row, the engine steps
synchronously) may instead verify a draft: one prefill-graph call of
[chunk boundary .. last token, d1..dk] at the lane's own positions, every position's logits back
(an artifact compiled with `logits_to_keep=0`). The call starts at the chunk boundary at or before
the lane's last position (optimum-rbln's prefill takes a chunk that starts past position 0 only
at a multiple of `prefill_chunk_size`, and a flash-attention chunk must not straddle a KV
partition): positions before the last token are written again with the same tokens. Greedy: the
longest run of drafts equal to the model's own picks is accepted, plus the model's next token.
The tokens go through the decode-step kernel one by one (`StepKernel.complete`), so the lane's
length, its output, stop ids and the output limit advance exactly as decode steps would, and no
token past a stop is emitted. Rejected positions hold stale KV past the lane's length: a later
position's attention reads only keys at positions <= its own, each written again first.

Sampled requests follow vLLM's rejection rule (`reject_sample`) on the distribution
`sample_rows` would draw from (`processed_probs`); requests with logprobs, penalties, bad words,
a grammar or a pending `min_tokens` decode as before (`speculation_ready`; docs/speculative.md).
Auto-off: per request, an EWMA of the tokens each verify call yielded
against the cost of a verify call in decode steps (measured); below it the request decodes
plainly and probes again every `PROBE_EVERY` eligible steps.
"""

from __future__ import annotations

import bisect
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from atombatch.api.speculative import SpeculativeConfig
from atombatch.engine.request import ITERATION_TOKEN_BUCKETS, RequestState
from atombatch.errors import ConfigError, RequestError
from atombatch.kernel import blocks as core
from atombatch.sampling import ngram
from atombatch.sampling.sampler import processed_probs, speculation_ready

if TYPE_CHECKING:
    from atombatch.api.structs import RequestOutput
    from atombatch.engine.request import Request, StepPlan

# A verify call's cost in decode steps before both were measured: the figure for ATOM
# (a prefill chunk costs about 1.6 decode steps at B1 in the calibrated model). A runtime may
# state its own as `verify_cost_ratio`.
DEFAULT_COST_RATIO = 1.6
# Speculate while the expected tokens per verify call beat the call's cost by this factor.
MARGIN = 1.05
# A request whose speculation is off probes once every this many eligible steps.
PROBE_EVERY = 32
EWMA = 0.3  # weight of the newest verify call in a request's tokens-per-call estimate


class _State:
    __slots__ = ("declined", "tokens_per_call")

    def __init__(self) -> None:
        self.tokens_per_call: float | None = None  # EWMA; None: not probed yet
        self.declined = 0                          # eligible steps decoded since the last probe


def check_supported(config: SpeculativeConfig, artifact: Any, every_position_logits: bool,
                    overlap: bool) -> None:
    """The rules a speculative engine needs, each a ConfigError naming it."""
    if not every_position_logits:
        raise ConfigError("speculative decoding verifies a draft with every position's logits "
                          "from the prefill graph: this runtime returns only the last one "
                          "(compile the artifact with logits_to_keep=0)")
    if artifact.model.is_hybrid:
        raise ConfigError("speculative decoding is refused on hybrid models (sliding-window "
                          "layers): a sliding slot is a shift buffer, and rejected draft "
                          "positions would shift out keys the window still needs")
    if overlap:
        raise ConfigError("speculative decoding runs on synchronous steps: turn overlap off "
                          "(--no-overlap) to use --speculative-config")
    if config.num_speculative_tokens >= artifact.prefill_chunk_size:
        raise ConfigError(f"speculative_config.num_speculative_tokens="
                          f"{config.num_speculative_tokens} must be below prefill_chunk_size="
                          f"{artifact.prefill_chunk_size} (the draft and the last token are "
                          f"verified in one chunk)")


def reject_sample(probs: np.ndarray, draft: np.ndarray, rng: np.random.Generator) -> list[int]:
    """vLLM's rejection rule for a draft without draft probabilities (a point mass on each
    draft token): draft token x at position i is accepted with probability p_i(x); at the
    first rejection the token is drawn from p_i with x removed (renormalized) and the run
    ends; with every draft accepted, a bonus token is drawn from p_k. The tokens emitted then
    follow the target distribution exactly, position by position. `probs [k + 1, vocab]`."""
    out: list[int] = []
    for i, token in enumerate(draft.tolist()):
        p = probs[i]
        if rng.random() < p[token]:
            out.append(int(token))
            continue
        rest = p.copy()
        rest[token] = 0.0
        out.append(_draw_one(rest, rng))
        return out
    out.append(_draw_one(probs[len(draft)], rng))
    return out


def _draw_one(p: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(p)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    index = min(index, len(p) - 1)
    while p[index] == 0.0 and index > 0:  # rounding at the top end: the last id with mass
        index -= 1
    return index


class Speculator:
    """The engine's speculative decoding: `verify` runs in place of a lone lane's decode."""

    def __init__(self, config: SpeculativeConfig, runtime: Any, artifact: Any,
                 counters: Any) -> None:
        self.config = config
        # vLLM exports every draft position's counter from the start (at 0)
        counters.spec_decode_num_accepted_tokens_per_pos[:] = [0] * config.num_speculative_tokens
        self.artifact = artifact
        self.vocab = artifact.model.vocab_size
        self._states: dict[str, _State] = {}
        stated = getattr(runtime, "verify_cost_ratio", None)
        self._stated_ratio = float(stated) if stated else DEFAULT_COST_RATIO
        self._verify_s: float | None = None    # EWMA of a verify call's device time
        self._decode_s: float | None = None    # EWMA of a lone lane's decode call's time
        # (steps, clock) when a lone lane's step was left to decode plainly: the engine's clock
        # at the next call times that step (the runtime's clock: virtual time on the simulator)
        self._mark: tuple[int, float] | None = None
        self.verify_calls = 0

    def cost_ratio(self) -> float:
        """A verify call's cost in decode steps: measured once both were timed, else stated;
        never below 1 (a verify call does a decode step's work and more: a timing that says
        otherwise is noise, and a call that yields one token must not count as a gain)."""
        if self._verify_s is not None and self._decode_s:
            return max(self._verify_s / self._decode_s, 1.0)
        return max(self._stated_ratio, 1.0)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _timing(self, runner: Any) -> None:
        """The plain decode the last call declined for (and nothing else since) timed it."""
        mark, self._mark = self._mark, None
        if mark is not None and runner.scheduler.counters.steps == mark[0] + 1:
            took = runner.clock() - mark[1]
            if took > 0:
                self._decode_s = took if self._decode_s is None else \
                    (1 - EWMA) * self._decode_s + EWMA * took

    def _decline(self, runner: Any) -> bool:
        self._mark = (runner.scheduler.counters.steps, runner.clock())
        return False

    def verify(self, runner: Any, plan: StepPlan, outputs: list[RequestOutput]) -> bool:
        """Verify a draft for the plan's lone decoding lane instead of decoding it; False (and
        nothing done) when the step should decode as planned."""
        self._timing(runner)
        if plan.rows != 1:
            return False
        lane = int(plan.inputs.row_lanes[0])
        scheduler = runner.scheduler
        request: Request | None = scheduler.by_lane[lane]
        if request is None:
            return self._decline(runner)
        sampler = runner._samplers.get(request.request_id) if runner._samplers else None
        if sampler is not None and not speculation_ready(sampler, len(request.output)):
            return self._decline(runner)
        extras = runner._outputs.extras.get(request.request_id) if runner._outputs.extras \
            else None
        if extras is not None and extras.logprobs is not None:
            return self._decline(runner)
        artifact = self.artifact
        q = artifact.prefill_chunk_size
        lanes = scheduler.kv.lanes
        last = lanes.seq_len(lane)                 # the position the last token is written at
        start = last - last % q                    # the chunk boundary the call starts from
        room = min(self.config.num_speculative_tokens,
                   start + q - 1 - last,            # the chunk's positions
                   request.max_tokens - len(request.output) - 1,  # tokens it may still emit
                   artifact.max_seq_len - 1 - last)
        if room <= 0 or len(request.output) == 0:
            return self._decline(runner)
        cfg = self.config
        state = self._states.get(request.request_id)
        if cfg.auto_off and state is not None and state.tokens_per_call is not None and \
                state.tokens_per_call < self.cost_ratio() * MARGIN:
            state.declined += 1                    # off: no lookup until the next probe
            if state.declined < PROBE_EVERY:
                return self._decline(runner)
        output = request.output
        if len(request.prompt) + len(output) != last + 1:  # not a lane this rule knows
            return self._decline(runner)
        window = cfg.lookup_window                 # only the tail the proposer searches
        if len(output) >= window:
            sequence = np.asarray(output[len(output) - window:], dtype=np.int64)
        else:
            sequence = np.concatenate([request.prompt[-(window - len(output)):],
                                       np.asarray(output, dtype=np.int64)])
        draft = ngram.propose(sequence, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                              window)
        if not len(draft):
            return self._decline(runner)
        if state is None:
            if len(self._states) >= 4 * self.artifact.batch_size:  # ended without a verify
                live = scheduler.requests
                self._states = {rid: s for rid, s in self._states.items() if rid in live}
            state = self._states[request.request_id] = _State()
        state.declined = 0
        kv = scheduler.kv
        extent = min(start + q, artifact.max_seq_len)   # the chunk writes every one of its rows
        need = lanes.blocks_for(extent) - lanes.num_held(lane)
        if need > 0 and need > kv.pool.num_free - kv.committed(scheduler.by_lane):
            return self._decline(runner)               # blocks others were promised
        if need > 0 and not kv.grow_lane(request, extent):
            return self._decline(runner)
        # the chunk reads the sequence by absolute position (built only for a verify call)
        tokens = np.concatenate([request.prompt, np.asarray(output, dtype=np.int64), draft])
        inputs = kv.prefill_inputs
        inputs.build(tokens, start, lanes.rows()[lane], lanes.num_held(lane), lane)
        if scheduler.lora is not None:  # the verify runs under the request's adapter
            scheduler.lora.fill_prefill(inputs, request.lora_id)
        k = len(draft)
        try:
            began = runner.clock()
            raw = runner._device_call(functools.partial(runner._rows_of_call(
                runner.runtime.prefill), every_position=True), inputs)
            took = runner.clock() - began
            logits = np.asarray(raw)
            if logits.size != q * self.vocab:
                raise RequestError(f"prefill(every_position=True) returned logits of shape "
                                   f"{logits.shape}; the chunk has {q} positions of "
                                   f"{self.vocab} ids")
            rows = logits.reshape(q, self.vocab)[last - start:last - start + k + 1]
            if not np.isfinite(rows.max(axis=1)).all():
                raise RequestError(f"verify returned non-finite logits for "
                                   f"{request.request_id} in positions {last}..{last + k}")
        except Exception as exc:
            runner._fail(request, f"speculative verify failed: {exc}", outputs)
            return True
        self._verify_s = took if self._verify_s is None else \
            (1 - EWMA) * self._verify_s + EWMA * took
        if sampler is None:  # greedy: the drafts equal to the model's picks, then its own
            picks = rows.argmax(axis=1)
            accepted = 0
            while accepted < k and picks[accepted] == draft[accepted]:
                accepted += 1
            emitted = [int(t) for t in draft[:accepted]] + [int(picks[accepted])]
        else:
            emitted = reject_sample(processed_probs(rows, sampler), draft, sampler.rng)
            accepted = len(emitted) - 1
        self.verify_calls += 1
        self._commit(runner, plan, request, emitted, outputs)
        counters = scheduler.counters
        counters.steps += 1
        # vLLM's iteration tokens of a speculative step: the last token and the draft
        counters.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, k + 1)] += 1
        counters.iteration_tokens_sum += k + 1
        counters.spec_decode_num_drafts += 1
        counters.spec_decode_num_draft_tokens += k
        counters.spec_decode_num_accepted_tokens += accepted
        per_pos = counters.spec_decode_num_accepted_tokens_per_pos
        for i in range(accepted):
            per_pos[i] += 1
        got = float(len(emitted))
        state.tokens_per_call = got if state.tokens_per_call is None else \
            (1 - EWMA) * state.tokens_per_call + EWMA * got
        if request.state is RequestState.FINISHED:
            self.forget(request.request_id)
        return True

    def _commit(self, runner: Any, plan: StepPlan, request: Request, emitted: list[int],
                outputs: list[RequestOutput]) -> None:
        """Feed the accepted tokens through the decode-step kernel one by one, as that many
        decode steps would (stop ids, the output limit and stop strings end the request at the
        right token; nothing past it is emitted)."""
        scheduler = runner.scheduler
        kernel = runner._kernel
        now = runner.clock()
        counters = scheduler.counters
        for token in emitted:
            kernel.tokens[0] = token
            kernel.status[0] = core.ROW_OK
            attention = kernel.complete(now)
            counters.generated_tokens += kernel.completed
            if attention:
                scheduler.apply_row_status(request, kernel.status[0])
            outputs.append(runner._output(request))
            if request.state is RequestState.FINISHED:
                break
