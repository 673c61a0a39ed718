"""Projected gain of speculative decoding on ATOM, from the simulator's cost model.

Theory of operation
-------------------
A speculating lane proposes `k` draft tokens (an n-gram proposer: host CPU only, no device time)
and verifies them in **one prefill-graph call** that feeds the lane's last token and the `k` drafts
at positions `p .. p + k`. The prefill graph is compiled at `prefill_chunk_size` tokens and
optimum-rbln 0.12's prefill forward pads every chunk to that size (`F.pad` of the inputs and the
cache positions up to `prefill_chunk_size`), so a verify call costs a **full chunk** at that
context whatever the real tokens: `CostModel.prefill_chunk_s(artifact, p, prefill_chunk_size)`
(never less than a decode step at that context, which reads the same weights and KV: this floor
binds only for the what-if of a short verify graph), plus the LM head for the `k + 1` positions
whose logits it must return (the artifact needs `logits_to_keep >= k + 1` or 0; the default 1
returns one position only).

Per-token acceptance `a` is taken as independent and identical at every draft position: the
standard analysis of speculative decoding (Leviathan, Kalman and Matias 2023, "Fast Inference from
Transformers via Speculative Decoding", section 3.1; Chen et al. 2023 make the same assumption).
A call then accepts `j` drafts with probability `a^j (1 - a)` (`j < k`) or `a^k` (all of them) and
yields `j + 1` tokens (the accepted drafts plus the model's own next token), so
`E[tokens per call] = (1 - a^(k+1)) / (1 - a)`.

`expected_decode_s` computes the expected device time of a request's decode phase exactly under
that assumption (a recursion over the tokens still to generate; the last call drafts no more than
what is left, and a call with nothing left to draft is a plain decode step). `serial_projection`
turns it into the origin's c16 figures on a B1/k1 artifact, which is strictly serial: request i
starts when request i - 1 finishes, so speculation moves every later first token earlier.
`crossover_batch` finds the batch size at which plain decoding (one decode step serves `B` lanes)
matches speculation (every lane needs its own prefill call: the prefill graph has batch 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from atombatch.artifact.config import ArtifactConfig
from atombatch.errors import ConfigError
from atombatch.runtime.sim.costs import CostModel


def tokens_per_call(acceptance: float, drafts: int) -> float:
    """E[tokens per verify call] = (1 - a^(k+1)) / (1 - a) at i.i.d. per-token acceptance `a`."""
    _check(acceptance, drafts)
    if acceptance == 1.0:
        return float(drafts + 1)
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


def equivalent_acceptance(mean_tokens: float, drafts: int) -> float:
    """The i.i.d. acceptance `a` whose `tokens_per_call(a, drafts)` is `mean_tokens` (bisection;
    `tokens_per_call` rises with `a`)."""
    if drafts < 1:
        raise ConfigError(f"drafts={drafts} must be >= 1")
    if not 1.0 <= mean_tokens <= drafts + 1:
        raise ConfigError(f"mean_tokens={mean_tokens} must lie in 1..{drafts + 1}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if tokens_per_call(mid, drafts) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _check(acceptance: float, drafts: int) -> None:
    if not 0.0 <= acceptance <= 1.0:
        raise ConfigError(f"acceptance={acceptance} must lie in [0, 1]")
    if drafts < 0:
        raise ConfigError(f"drafts={drafts} must be >= 0")


def verify_call_s(costs: CostModel, artifact: ArtifactConfig, start: int, drafts: int) -> float:
    """Device time of one verify call: the last token + `drafts` drafts from position `start`
    through the prefill graph (a full `prefill_chunk_size` chunk, whatever the real tokens) with
    logits returned for `drafts + 1` positions."""
    if drafts + 1 > artifact.prefill_chunk_size:
        raise ConfigError(f"drafts={drafts} + 1 exceeds prefill_chunk_size="
                          f"{artifact.prefill_chunk_size}: one call cannot verify them")
    spec = artifact.model
    # the chunk cost bills the LM head once; a verify returns logits for drafts + 1 positions
    head_flops = 2.0 * spec.vocab_size * spec.hidden_size / artifact.tensor_parallel * drafts
    # the call starts at the chunk boundary at or before `start` (optimum-rbln's prefill takes a
    # chunk past position 0 only at a multiple of the chunk size; the engine re-feeds from there)
    boundary = start - start % artifact.prefill_chunk_size
    chunk = costs.prefill_chunk_s(artifact, boundary, artifact.prefill_chunk_size)
    # the chunk formula leaves out reading the lane's KV (negligible beside a 128-token chunk's
    # FLOPs); a short verify graph still streams the weights and reads that KV, as a decode does
    floor = costs.decode_step_s(artifact, (start + drafts + 1,), rows=1)
    return max(chunk, floor) + head_flops / costs.prefill_flops


def _decode_s(costs: CostModel, artifact: ArtifactConfig, context: int) -> float:
    return costs.decode_step_s(artifact, (context,))


def plain_decode_s(costs: CostModel, artifact: ArtifactConfig, input_len: int,
                   output_len: int) -> float:
    """Device time of one lane's decode phase without speculation (the first token comes from
    prefill; step i attends input_len + 1 + i keys), alone in the decode graph."""
    return sum(_decode_s(costs, artifact, input_len + 1 + i) for i in range(output_len - 1))


def expected_decode_s(costs: CostModel, artifact: ArtifactConfig, input_len: int,
                      output_len: int, acceptance: float, drafts: int,
                      verify_artifact: ArtifactConfig | None = None) -> tuple[float, float]:
    """(expected device time, expected device calls) of one lane's decode phase with `drafts`
    drafts per verify call at i.i.d. acceptance `acceptance`.

    With `g` tokens out (the first from prefill) the lane's next position is `input_len + g - 1`;
    a call drafts `min(drafts, output_len - g - 1)` tokens (never past `max_tokens`), no more than
    the rest of the chunk its position is in holds (the call starts at that chunk's boundary, as
    the engine's verify does), and, with none to draft, is a plain decode step in `artifact`'s
    decode graph. `verify_artifact` (default `artifact`) is the artifact whose prefill graph
    verifies: pass one with a smaller `prefill_chunk_size` for the what-if of a dedicated verify
    graph.
    """
    _check(acceptance, drafts)
    verifier = verify_artifact or artifact
    remaining_time = np.zeros(output_len + 1)   # by tokens out: expected time to finish
    remaining_calls = np.zeros(output_len + 1)
    for out in range(output_len - 1, 0, -1):
        position = input_len + out - 1
        # never past max_tokens, nor past the chunk the call starts in (engine/speculative.py)
        k = min(drafts, output_len - out - 1, verifier.prefill_chunk_size - 1 -
                position % verifier.prefill_chunk_size)
        if k == 0:
            remaining_time[out] = _decode_s(costs, artifact, position + 1) + \
                remaining_time[out + 1]
            remaining_calls[out] = 1.0 + remaining_calls[out + 1]
            continue
        time = verify_call_s(costs, verifier, position, k)
        calls = 1.0
        for accepted in range(k + 1):
            p = acceptance ** accepted * ((1.0 - acceptance) if accepted < k else 1.0)
            time += p * remaining_time[out + accepted + 1]
            calls += p * remaining_calls[out + accepted + 1]
        remaining_time[out], remaining_calls[out] = time, calls
    return float(remaining_time[1]), float(remaining_calls[1])


class SerialProjection(msgspec.Struct, frozen=True):
    """One row of the projection: c-concurrent requests on a strictly serial B1 artifact."""

    acceptance: float | None      # i.i.d. per-token acceptance (None: plain decoding)
    drafts: int                   # k drafts per verify call (0: plain decoding)
    tokens_per_call: float        # output tokens / device calls of the decode phase
    decode_s: float               # expected decode phase of one request
    request_s: float              # prefill + decode phase
    throughput_tok_s: float       # concurrency x output_len / makespan
    max_first_token_s: float      # the last request's first token (s after all arrived)
    median_first_token_s: float   # median first token over all requests
    max_completion_s: float       # makespan


def serial_projection(costs: CostModel, artifact: ArtifactConfig, input_len: int,
                      output_len: int, concurrency: int, acceptance: float | None = None,
                      drafts: int = 0,
                      verify_artifact: ArtifactConfig | None = None) -> SerialProjection:
    """The c`concurrency` figures of a B1 artifact that serves requests one after another (all
    submitted together), plain (`acceptance=None`) or speculating.

    Raises:
        ConfigError: the artifact is not batch 1, or acceptance/drafts are out of range.
    """
    if artifact.batch_size != 1:
        raise ConfigError(f"batch_size={artifact.batch_size}: the serial projection is for B1")
    prefill = costs.request_prefill_s(artifact, input_len)
    if acceptance is None or drafts == 0:
        decode, calls = plain_decode_s(costs, artifact, input_len, output_len), output_len - 1.0
    else:
        decode, calls = expected_decode_s(costs, artifact, input_len, output_len, acceptance,
                                          drafts, verify_artifact)
    request = prefill + decode
    firsts = [i * request + prefill for i in range(concurrency)]
    return SerialProjection(
        acceptance=acceptance if drafts else None, drafts=drafts if acceptance is not None else 0,
        tokens_per_call=(output_len - 1) / calls if calls else 0.0, decode_s=decode,
        request_s=request, throughput_tok_s=output_len / request,
        max_first_token_s=firsts[-1], median_first_token_s=float(np.median(firsts)),
        max_completion_s=concurrency * request)


def best_drafts(costs: CostModel, artifact: ArtifactConfig, input_len: int, output_len: int,
                acceptance: float, drafts: Sequence[int],
                verify_artifact: ArtifactConfig | None = None) -> tuple[int, float]:
    """(k, expected decode phase) of the fastest `k` in `drafts` at this acceptance."""
    times = [(expected_decode_s(costs, artifact, input_len, output_len, acceptance, k,
                                verify_artifact)[0], k) for k in drafts]
    time, k = min(times)
    return k, time


def break_even_acceptance(costs: CostModel, artifact: ArtifactConfig, input_len: int,
                          output_len: int, drafts: Sequence[int],
                          verify_artifact: ArtifactConfig | None = None) -> float | None:
    """The i.i.d. acceptance above which speculation (best k of `drafts`) beats plain decoding
    for one lane alone (bisection: the best expected time falls as acceptance rises); None if it
    never does, 0.0 if it always does."""
    plain = plain_decode_s(costs, artifact, input_len, output_len)

    def pays(a: float) -> bool:
        return best_drafts(costs, artifact, input_len, output_len, a, drafts,
                           verify_artifact)[1] < plain

    if pays(0.0):
        return 0.0
    if not pays(1.0):
        return None
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pays(mid) else (mid, hi)
    return hi


def batched_artifact(artifact: ArtifactConfig, batch: int) -> ArtifactConfig:
    """`artifact` compiled at decode batch `batch` (one block per lane plus the spare)."""
    return msgspec.structs.replace(artifact, batch_size=batch, num_blocks=batch + 1,
                                   decoder_batch_sizes=())


def crossover_batch(costs: CostModel, artifact: ArtifactConfig, input_len: int, output_len: int,
                    acceptance: float, drafts: Sequence[int], max_batch: int = 64,
                    verify_artifact: ArtifactConfig | None = None) -> int | None:
    """The smallest decode batch B at which plain decoding is at least as fast as speculation
    (best k of `drafts`), with every lane in its decode phase: plain decodes the B lanes together,
    `sum_i step_B(contexts)`; speculation verifies each lane with its own batch-1 prefill call, so
    B lanes take B x one lane's expected decode phase. 1 means speculation never pays; None means
    it still pays at `max_batch`."""
    for batch in range(1, max_batch + 1):
        wide = batched_artifact(artifact, batch)
        plain = sum(costs.decode_step_s(wide, (input_len + 1 + i,) * batch)
                    for i in range(output_len - 1))
        _, lane = best_drafts(costs, wide, input_len, output_len, acceptance, drafts,
                              verify_artifact)
        if plain <= batch * lane:
            return batch
    return None


def verify_to_decode_ratio(costs: CostModel, artifact: ArtifactConfig, context: int,
                           drafts: int) -> float:
    """A verify call's time over a B1 decode step's at `context`: speculation pays at B1 only
    when tokens per call exceed it."""
    return verify_call_s(costs, artifact, context - 1, drafts) / \
        _decode_s(costs, artifact, context)


__all__ = ["SerialProjection", "batched_artifact", "best_drafts", "break_even_acceptance", "crossover_batch",
           "equivalent_acceptance", "expected_decode_s", "plain_decode_s", "serial_projection",
           "tokens_per_call", "verify_call_s", "verify_to_decode_ratio"]
