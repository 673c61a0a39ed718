"""Token sampling, vectorized over the rows of one step's logits.

Order of operations (vLLM's v1 sampler, so options mean what vLLM users expect):

0. structured output: a row with a grammar (`RequestSampler.grammar`) gets its token bitmask,
   every constrained row's filled in one pass (atombatch/sampling/grammar.py); as in vLLM, this is done
   to the logits before anything else, raw logprobs included;
1. logprobs in "raw" mode: log-softmax of the model's own logits (the default, as in vLLM);
2. `allowed_token_ids`: every other id is masked;
3. `bad_words`: the last token of a bad word is masked when the tokens before it were just
   generated (one-token words always);
4. `min_tokens`: EOS and `stop_token_ids` are masked until that many tokens were generated;
5. `logit_bias` is added;
6. penalties: repetition (a logit of an id seen in the prompt or the output is divided by the
   penalty when positive, multiplied when negative), then frequency (minus penalty x count of the
   id in the output) and presence (minus penalty once per id in the output);
7. greedy rows (temperature < 1e-5) take the argmax here, lowest id on a tie;
8. the others: divide by the temperature, drop tokens below `min_p` x the top probability,
   keep the `top_k` most likely, keep the smallest most-likely set whose mass reaches `top_p`,
   and draw from what is left with the request's own generator (one uniform number per token,
   inverse CDF), so a seeded request samples the same tokens whatever else shares the step;
9. logprobs in "processed" mode: log-softmax of what step 7 or 8 sampled from.

Per-request state (`RequestSampler`) is built once at submit: masks and bias as index arrays,
and the penalties' output-token counts, kept incrementally (each new token adds one) rather than
recounted every step. A request whose options are all off (`SamplingParams.plain_greedy`) gets no
state at all: the engine takes one argmax over the whole step for those rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.options import LogprobsMode
from atombatch.api.structs import GREEDY_EPS, SamplingParams, TokenLogprob, TokenLogprobs
from atombatch.api.structs import stop_ids as stop_id_tuple
from atombatch.sampling.grammar import RequestGrammar, apply_masks

LOGPROBS_MODES = ("raw", "processed")
_NEG_INF = np.float32(-np.inf)


class RequestSampler:
    """What the sampler keeps for one request between steps."""

    __slots__ = ("allowed", "bad_words", "bias_ids", "bias_values", "counted", "counts",
                 "grammar", "params", "penalized", "prompt", "prompt_seen", "rng", "stop_ids", "vocab")

    def __init__(self, params: SamplingParams, prompt: npt.NDArray[np.int64], vocab: int,
                 eos_token_ids: Sequence[int], rng: np.random.Generator,
                 bad_words: Sequence[Sequence[int]] = (),
                 stop_ids: Sequence[int] | None = None) -> None:
        self.params = params
        self.rng = rng
        self.vocab = vocab
        self.prompt = prompt
        self.allowed: npt.NDArray[np.intp] | None = None
        if params.allowed_token_ids is not None:
            self.allowed = np.unique(np.asarray(params.allowed_token_ids, dtype=np.intp))
        self.bias_ids: npt.NDArray[np.intp] | None = None
        self.bias_values: npt.NDArray[np.float32] | None = None
        if params.logit_bias:
            self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.intp)
            self.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32)
        # what min_tokens masks: the request's stop ids (given once resolved on its Request)
        stops = set(stop_ids if stop_ids is not None else stop_id_tuple(params, eos_token_ids))
        self.stop_ids = np.asarray(sorted(stops), dtype=np.intp)
        self.bad_words = [tuple(int(t) for t in word) for word in bad_words if len(word)]
        self.penalized = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or \
            params.repetition_penalty != 1.0
        # Built at the first sampling step (a queued request holds no vocabulary-sized arrays).
        self.counts: npt.NDArray[np.int32] | None = None  # generated tokens by id
        self.counted = 0                 # output tokens already added to `counts`
        self.prompt_seen: npt.NDArray[np.bool_] | None = None  # ids in the prompt
        self.grammar: RequestGrammar | None = None  # structured output, once its matcher compiled

    def observe(self, output: Sequence[int]) -> None:
        """Count the output tokens generated since the last call (usually one)."""
        if not self.penalized:
            return
        if self.counts is None:
            self.counts = np.zeros(self.vocab, dtype=np.int32)
            if self.params.repetition_penalty != 1.0:
                self.prompt_seen = np.zeros(self.vocab, dtype=np.bool_)
                self.prompt_seen[np.asarray(self.prompt, dtype=np.intp)] = True
        if self.counted >= len(output):
            return
        new = np.asarray(output[self.counted:], dtype=np.intp)
        np.add.at(self.counts, new, 1)
        self.counted = len(output)


class SampleResult(msgspec.Struct):
    tokens: npt.NDArray[np.int64]                      # one sampled id per row
    logprobs: list[TokenLogprobs | None]               # per row; None where not asked for
    masked_rows: list[int]                             # rows whose every token was masked
    failed: dict[int, str] = {}                        # rows whose output broke their grammar


def sample_rows(logits: npt.NDArray[np.floating], states: Sequence[RequestSampler],
                outputs: Sequence[Sequence[int]], mode: LogprobsMode = "raw") -> SampleResult:
    """Sample one token per row of `logits [rows, vocab]`; row i belongs to `states[i]`, whose
    generated tokens so far are `outputs[i]`. Rows must be finite (the engine checks)."""
    rows, vocab = logits.shape
    for state, output in zip(states, outputs, strict=True):
        state.observe(output)
    # A working copy only when something writes into the rows (masks, bias, penalties, a
    # grammar): at B64 and a 152k vocabulary the copy is 39 MB, ~5 ms of the step's host time.
    writes = any(s.grammar is not None or s.allowed is not None or s.bad_words or
                 s.bias_ids is not None or s.penalized or
                 (len(o) < s.params.min_tokens and s.stop_ids.size)
                 for s, o in zip(states, outputs, strict=True))
    x = np.array(logits, dtype=np.float32, copy=True) if writes else \
        np.asarray(logits, dtype=np.float32)
    failed: dict[int, str] = {}
    constrained = [i for i, s in enumerate(states) if s.grammar is not None]
    if constrained:
        failed = _constrain(x, constrained, states, outputs)
    want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw_lp = _log_softmax(x[want]) if want and mode == "raw" else None

    # Masks and bias (row by row: each is a short index list), then penalties (vectorized).
    for i, state in enumerate(states):
        params = state.params
        if state.allowed is not None:
            keep = np.full(vocab, _NEG_INF, dtype=np.float32)
            keep[state.allowed] = 0.0
            x[i] += keep
        if state.bad_words:
            banned = _banned(state.bad_words, outputs[i])
            if banned:
                x[i, banned] = _NEG_INF
        if len(outputs[i]) < params.min_tokens and state.stop_ids.size:
            x[i, state.stop_ids] = _NEG_INF
        if state.bias_ids is not None:
            x[i, state.bias_ids] += state.bias_values
    penalized = [i for i, s in enumerate(states) if s.penalized]
    if penalized:
        _apply_penalties(x, penalized, states)

    top = x.max(axis=1)
    masked_rows = [int(i) for i in np.flatnonzero(~np.isfinite(top))]
    if masked_rows:  # nothing left to sample: the engine fails these requests
        if not writes:
            x = np.array(x, copy=True)
        x[masked_rows] = 0.0
        top[masked_rows] = 0.0
    tokens = np.empty(rows, dtype=np.int64)
    greedy = np.fromiter((s.params.temperature < GREEDY_EPS for s in states), dtype=np.bool_,
                         count=rows)
    if greedy.any():
        tokens[greedy] = x[greedy].argmax(axis=1)
    sampled = np.flatnonzero(~greedy)
    z: npt.NDArray[np.float32] | None = None  # the sampled rows' final log-probabilities
    rest = sampled
    if sampled.size:
        uniform = np.fromiter((states[int(i)].rng.random() for i in sampled), dtype=np.float64,
                              count=sampled.size)
        if not (want and mode == "processed"):  # (processed logprobs read every row's z)
            # top-k / top-p rows whose kept ids are among a few candidates draw from those
            # alone: no pass over their rows but the one that finds the candidates
            drawn = _draw_candidates(x, top, sampled, [states[int(i)] for i in sampled],
                                     uniform, tokens)
            rest, uniform = sampled[~drawn], uniform[~drawn]
    if rest.size:
        # _filtered may overwrite what it is given when it is ours: x[rest] (a fresh copy),
        # or x itself when x is our working copy and every row samples (nothing reads x after)
        whole = rest.size == rows
        z = _filtered(x if whole else x[rest], top[rest],
                      [states[int(i)] for i in rest], own=writes or not whole)
        # the draw may overwrite z unless processed logprobs read it afterwards
        tokens[rest] = _draw(z, uniform, in_place=not (want and mode == "processed"))

    logprobs: list[TokenLogprobs | None] = [None] * rows
    if want:
        if raw_lp is not None:
            lp = raw_lp
        else:  # processed: what each row was drawn from (greedy rows: the processed logits)
            position = {int(i): j for j, i in enumerate(sampled)}
            lp = _log_softmax(np.stack([x[i] if i not in position else z[position[i]]  # type: ignore[index]
                                        for i in want]))
        for j, i in enumerate(want):
            k = states[i].params.logprobs
            assert k is not None
            logprobs[i] = _gather(lp[j], int(tokens[i]), k)
    return SampleResult(tokens=tokens, logprobs=logprobs, masked_rows=masked_rows, failed=failed)


def _constrain(x: npt.NDArray[np.float32], rows: list[int], states: Sequence[RequestSampler],
               outputs: Sequence[Sequence[int]]) -> dict[int, str]:
    """Advance each constrained row's matcher over its new output tokens, then mask all of them
    in one pass; returns the rows whose output broke the grammar (those are not masked, nor are
    rows still in a preamble before their constraint starts)."""
    failed: dict[int, str] = {}
    for i in rows:
        grammar = states[i].grammar
        assert grammar is not None
        error = grammar.advance(outputs[i])
        if error is not None:
            failed[i] = error
    live = [i for i in rows if states[i].grammar.active]  # type: ignore[union-attr]
    if live:
        grammars = [states[i].grammar for i in live]
        apply_masks(x, live, grammars)  # type: ignore[arg-type]
        for i, grammar in zip(live, grammars, strict=True):
            error = grammar.mask_error()  # type: ignore[union-attr]
            if error is not None:  # e.g. a grammar past llguidance's per-step limits
                failed[i] = error
    return failed


def _banned(words: list[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    banned = []
    n = len(output)
    for word in words:
        head = len(word) - 1
        if head == 0 or (n >= head and tuple(output[n - head:]) == word[:head]):
            banned.append(word[-1])
    return banned


_F32 = np.finfo(np.float32)


def _apply_penalties(x: npt.NDArray[np.float32], rows: list[int],
                     states: Sequence[RequestSampler]) -> None:
    counts = np.stack([states[i].counts for i in rows])  # type: ignore[misc]
    sub = x[rows]
    seen_out = counts > 0
    # float32 from any positive penalty: never 0 (a seen logit / 0 is inf) nor inf
    rep = np.clip(np.array([states[i].params.repetition_penalty for i in rows]),
                  _F32.tiny, _F32.max).astype(np.float32)
    if (rep != 1.0).any():
        seen = seen_out.copy()
        for j, i in enumerate(rows):
            prompt_seen = states[i].prompt_seen
            if prompt_seen is not None:
                seen[j] |= prompt_seen
        r = rep[:, None]
        with np.errstate(over="ignore"):
            sub = np.where(seen, np.where(sub > 0, sub / r, sub * r), sub)
        np.minimum(sub, _F32.max, out=sub)  # favoured without bound: the largest finite logit
    freq = np.array([states[i].params.frequency_penalty for i in rows], dtype=np.float32)
    pres = np.array([states[i].params.presence_penalty for i in rows], dtype=np.float32)
    sub = sub - freq[:, None] * counts - pres[:, None] * seen_out
    x[rows] = sub


def _draw_candidates(x: npt.NDArray[np.float32], top: npt.NDArray[np.float32],
                     sampled: npt.NDArray[np.intp], states: Sequence[RequestSampler],
                     uniform: npt.NDArray[np.float64],
                     tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Draw the top-k / top-p rows of `x[sampled]` whose kept ids are all among the
    `CANDIDATES` largest logits; returns which rows it drew (the others take the full path).

    The candidates of a row are every logit at least its `CANDIDATES`-th largest block maximum
    (blocks of `DRAW_BLOCK` ids): those include the row's `CANDIDATES` largest values, so the
    top-k set (k <= CANDIDATES) and a top-p set within them are exactly the kept ids of the
    full path, ties included. Temperature, min_p, top-k and top-p then apply to those values
    as `_filtered` and `_thresholds` apply them to the row, and the draw is the same inverse
    CDF over the kept ids in id order (`_draw`); only a top-p row without top-k reads its whole
    row once more, for the total mass p is a share of."""
    done = np.zeros(sampled.size, dtype=np.bool_)
    vocab = x.shape[1]
    m = CANDIDATES
    starts = np.arange(0, vocab, DRAW_BLOCK)
    if starts.size < m:  # a small vocabulary: the full path is as cheap
        return done
    pick = [j for j, st in enumerate(states)
            if (0 < st.params.top_k <= m and st.params.top_k < vocab) or
            (st.params.top_p < 1.0 and st.params.top_k <= 0)]
    if not pick:
        return done
    rows = sampled[pick]
    every = rows.size == x.shape[0]  # rows are sorted: then they are all of x, in order
    block_max = np.maximum.reduceat(x if every else x[rows], starts, axis=1)
    bound = np.partition(block_max, starts.size - m, axis=1)[:, starts.size - m]
    for j, i, b in zip(pick, rows.tolist(), bound.tolist(), strict=True):
        params = states[j].params
        row = x[i]
        ids = np.flatnonzero(row >= b)
        # as _filtered: shift by the row's max, then scale (float32, the same operations)
        t = np.float32(min(params.temperature, float(_F32.max)))
        z = np.subtract(row[ids], top[i]) / t
        if params.min_p > 0:
            z[np.exp(z) < np.float32(params.min_p)] = _NEG_INF
        order = np.argsort(-z, kind="stable")
        head = z[order[:m]]                       # the row's m largest, descending
        k = params.top_k if 0 < params.top_k < vocab else vocab
        kth = head[k - 1] if k < vocab else _NEG_INF
        p = params.top_p
        if p < 1.0:
            kept_head = np.where(np.arange(head.size) >= min(k, head.size), _NEG_INF, head)
            mass = np.cumsum(np.exp(kept_head.astype(np.float64)))
            if k < vocab:
                total = mass[-1]
            else:  # the row's whole mass (after min_p), one more pass over the row
                whole = np.subtract(row, top[i]) / t
                e = np.exp(whole)
                if params.min_p > 0:
                    e[e < np.float32(params.min_p)] = 0.0
                total = float(e.sum(dtype=np.float64))
            last = int((mass < p * total).sum())
            if last >= head.size:                 # p needs more than the candidates
                continue
            threshold = max(kth, head[last])
        else:
            threshold = kth
        kept = np.flatnonzero(z >= threshold)     # candidate positions, in id order
        weights = np.cumsum(np.exp(z[kept].astype(np.float64)))
        chosen = min(int(np.searchsorted(weights, uniform[j] * weights[-1], side="right")),
                     kept.size - 1)
        tokens[i] = ids[kept[chosen]]
        done[j] = True
    return done


def _filtered(x: npt.NDArray[np.float32], top: npt.NDArray[np.float32],
              states: Sequence[RequestSampler], own: bool = False) -> npt.NDArray[np.float32]:
    """Temperature, min_p, top_k and top_p for sampled rows; masked entries become -inf. With
    `own` the result overwrites `x` (the caller's copy), else it is a new array."""
    vocab = x.shape[1]
    # a temperature past float32's range is the largest float32 (inf would turn -inf into NaN)
    temperature = np.minimum(np.array([s.params.temperature for s in states]),
                             _F32.max).astype(np.float32)
    # Shift before scaling: (x - max) <= 0, so a tiny temperature gives -inf, never inf - inf.
    z = np.subtract(x, top[:, None], out=x if own else None)
    z /= temperature[:, None]
    min_p = np.array([s.params.min_p for s in states], dtype=np.float32)
    if (min_p > 0).any():  # relative to the top probability: exp(z) is 1 at the top
        z[np.exp(z) < min_p[:, None]] = _NEG_INF
    top_k = np.array([s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states])
    top_p = np.array([s.params.top_p for s in states], dtype=np.float64)
    need = np.flatnonzero((top_k < vocab) | (top_p < 1.0))
    if need.size == z.shape[0]:  # every row: in place
        threshold = _thresholds(z, top_k, top_p)
        z[z < threshold[:, None]] = _NEG_INF
    elif need.size:
        sub = z[need]
        threshold = _thresholds(sub, top_k[need], top_p[need])
        sub[sub < threshold[:, None]] = _NEG_INF
        z[need] = sub
    return z


CANDIDATES = 256  # top-k/top-p look at this many most likely ids first (a partial sort)


def _thresholds(z: npt.NDArray[np.float32], k: npt.NDArray[np.int_],
                p: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
    """Per row, the smallest value kept by top-k and then top-p (ties at it are kept too).

    Most rows are decided by the `CANDIDATES` largest values (a partial sort, O(vocab)): top-k
    with k <= CANDIDATES, and top-p when those candidates already hold mass p. The other rows
    sort their whole row."""
    n, vocab = z.shape
    m = min(vocab, CANDIDATES)
    largest = np.partition(-z, m - 1, axis=1)[:, :m] if m < vocab else -z  # negated, unordered
    head = -np.sort(largest, axis=1)                                       # descending
    rows = np.arange(n)
    with_k = k < vocab
    exact = k <= m
    kth = np.where(with_k & exact, head[rows, np.minimum(k, m) - 1], _NEG_INF)
    head_k = np.where(np.arange(m)[None, :] >= np.minimum(k, m)[:, None], _NEG_INF, head)
    mass = np.cumsum(np.exp(head_k.astype(np.float64)), axis=1)
    total = mass[:, -1].copy()  # the mass top-k keeps; rows without top-k: the whole row's
    whole = np.flatnonzero(~(with_k & exact) & (p < 1.0))
    if whole.size:
        total[whole] = np.exp(z[whole]).sum(axis=1, dtype=np.float64)
    # The smallest most-likely set reaching p: entries whose preceding mass is below p.
    last = (mass < p[:, None] * total[:, None]).sum(axis=1)
    with_p = p < 1.0
    pth = np.where(with_p, head[rows, np.minimum(last, m - 1)], _NEG_INF)
    threshold = np.maximum(kth, pth).astype(np.float32)
    slow = np.flatnonzero(~exact | (with_p & (last >= m)))
    for i in slow:
        threshold[i] = _threshold_full(z[i], int(k[i]), float(p[i]))
    return threshold


def _threshold_full(row: npt.NDArray[np.float32], k: int, p: float) -> np.float32:
    vocab = row.size
    ordered = -np.sort(-row)
    kth = ordered[k - 1] if k < vocab else _NEG_INF
    kept = np.where(np.arange(vocab) >= k, _NEG_INF, ordered)
    mass = np.cumsum(np.exp(kept.astype(np.float64)))
    if p >= 1.0:
        return np.float32(kth)
    last = min(int((mass < p * mass[-1]).sum()), vocab - 1)
    return np.float32(max(kth, ordered[last]))


DRAW_BLOCK = 256  # ids per block of the two-level inverse CDF in `_draw`


def _draw(z: npt.NDArray[np.float32], uniform: npt.NDArray[np.float64],
          in_place: bool = False) -> npt.NDArray[np.int64]:
    """Inverse-CDF draw per row from unnormalized log-probabilities (max 0): the first id whose
    cumulative mass exceeds uniform x the row's total; a masked id has no mass and is never drawn.

    Two levels, so no cumulative sum over the whole vocabulary: block masses first (one pass),
    then the cumulative sum inside the one block the target falls in. With `in_place` the
    masses overwrite `z` (no second array of the step's size)."""
    n, vocab = z.shape
    mass = np.exp(z, out=z) if in_place else np.exp(z)
    starts = np.arange(0, vocab, DRAW_BLOCK)
    blocks = np.cumsum(np.add.reduceat(mass, starts, axis=1).astype(np.float64), axis=1)
    tokens = np.empty(n, dtype=np.int64)
    for i in range(n):
        cdf = blocks[i]
        target = uniform[i] * cdf[-1]
        b = min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)
        lo = int(starts[b])
        inside = np.cumsum(mass[i, lo:lo + DRAW_BLOCK].astype(np.float64))
        rest = target - (cdf[b - 1] if b else 0.0)
        j = min(int(np.searchsorted(inside, rest, side="right")), inside.size - 1)
        token = lo + j
        if mass[i, token] == 0.0:  # rounding at a block edge: the nearest id with mass
            alive = np.flatnonzero(mass[i])
            token = int(alive[min(int(np.searchsorted(alive, token)), alive.size - 1)])
        tokens[i] = token
    return tokens


def _log_softmax(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    x64 = x.astype(np.float64)
    shifted = x64 - x64.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        out = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return out.astype(np.float32)


def _gather(lp: npt.NDArray[np.float32], token: int, k: int) -> TokenLogprobs:
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top: tuple[TokenLogprob, ...] = ()
    if k:
        k = min(k, lp.size)
        ids = np.argpartition(-lp, k - 1)[:k]
        ids = ids[np.lexsort((ids, -lp[ids]))]  # most likely first, then lowest id
        top = tuple(TokenLogprob(token_id=int(t), logprob=float(lp[t]), rank=r + 1)
                    for r, t in enumerate(ids))
    return TokenLogprobs(token_id=token, logprob=chosen, rank=rank, top=top)


def sample(logits: npt.NDArray[np.floating], params: SamplingParams,
           rng: np.random.Generator, eos_token_ids: Sequence[int] = (),
           prompt: Sequence[int] | npt.NDArray[np.integer] = ()) -> int:
    """One token from one row of logits (the first token of a request: nothing generated yet).

    Greedy when temperature < 1e-5 (ties: lowest id). Used by PD producers and the simulator;
    the engine samples whole steps with `sample_rows`.
    """
    row = np.asarray(logits).reshape(1, -1)
    if params.plain_greedy:
        return int(np.argmax(row[0]))
    state = RequestSampler(params, np.asarray(prompt, dtype=np.int64), row.shape[1],
                           eos_token_ids, rng)
    result = sample_rows(row, [state], [()])
    return int(result.tokens[0])


class PromptLogprobs:
    """A request's prompt logprobs (vLLM's `prompt_logprobs`), filled chunk by chunk.

    The logits at prompt position p predict token p + 1, so a prefill chunk covering positions
    `start..start+length-1` gives the logprobs of prompt tokens `start+1..start+length`; the
    first prompt token has none. They are the log-softmax of the model's raw logits (as in vLLM:
    no penalty, bias, mask or temperature), kept as arrays of `len(prompt) x (k + 1)` values
    (`k <= MAX_LOGPROBS`) until `result()` builds the public structs once. A chunk computed again
    (a request preempted during its prefill) overwrites its positions with the same values.
    """

    __slots__ = ("filled", "k", "logprob", "prompt", "rank", "top_ids", "top_logprobs")

    # rows of logits turned into logprobs at once: bounds the float64 scratch to about 32 MiB
    ROW_BUDGET = 1 << 22

    def __init__(self, prompt: npt.NDArray[np.int64], k: int) -> None:
        n = len(prompt)
        self.prompt = prompt
        self.k = k
        self.logprob = np.zeros(n, dtype=np.float32)     # of the prompt token at each position
        self.rank = np.zeros(n, dtype=np.int64)          # its rank among all ids (1 = best)
        self.top_ids = np.zeros((n, k), dtype=np.int64)  # the k most likely ids, best first
        self.top_logprobs = np.zeros((n, k), dtype=np.float32)
        self.filled = np.zeros(n, dtype=np.bool_)
        self.filled[0] = True                            # the first token has no logprob

    def add_chunk(self, rows: npt.NDArray[np.floating], start: int) -> None:
        """`rows[i]`: the raw logits at prompt position `start + i` (real tokens only)."""
        n = len(self.prompt)
        count = min(len(rows), n - 1 - start)  # the last prompt position predicts no prompt token
        if count <= 0:
            return
        step = max(1, self.ROW_BUDGET // max(rows.shape[1], 1))
        for lo in range(0, count, step):
            hi = min(lo + step, count)
            lp = _log_softmax(np.asarray(rows[lo:hi]))
            at = slice(start + 1 + lo, start + 1 + hi)
            targets = self.prompt[at]
            chosen = lp[np.arange(hi - lo), targets]
            self.logprob[at] = chosen
            self.rank[at] = (lp > chosen[:, None]).sum(axis=1) + 1
            k = min(self.k, lp.shape[1])
            if k:
                ids = np.argpartition(-lp, k - 1, axis=1)[:, :k]
                values = np.take_along_axis(lp, ids, axis=1)
                order = np.lexsort((ids, -values), axis=-1)  # most likely first, then lowest id
                self.top_ids[at, :k] = np.take_along_axis(ids, order, axis=1)
                self.top_logprobs[at, :k] = np.take_along_axis(values, order, axis=1)
            self.filled[at] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def result(self) -> tuple[TokenLogprobs | None, ...]:
        """One entry per prompt token: None for the first, then its logprob, rank and top k."""
        k = min(self.k, self.top_ids.shape[1])
        out: list[TokenLogprobs | None] = [None]
        prompt, logprob, rank = self.prompt.tolist(), self.logprob.tolist(), self.rank.tolist()
        top_ids, top_lp = self.top_ids.tolist(), self.top_logprobs.tolist()
        for i in range(1, len(prompt)):
            top = tuple(TokenLogprob(token_id=top_ids[i][r], logprob=top_lp[i][r], rank=r + 1)
                        for r in range(k))
            out.append(TokenLogprobs(token_id=prompt[i], logprob=logprob[i], rank=rank[i],
                                     top=top))
        return tuple(out)


def speculation_ready(state: RequestSampler, output_len: int) -> bool:
    """A sampled request whose next positions' distributions do not depend on the tokens drawn
    before them in a draft (no penalties, bad words, grammar, pending min_tokens or logprobs):
    speculative decoding may verify its drafts with `processed_probs` (docs/speculative.md)."""
    params = state.params
    return params.temperature >= GREEDY_EPS and not state.penalized and not state.bad_words \
        and state.grammar is None and params.structured is None and params.logprobs is None \
        and output_len >= params.min_tokens


def processed_probs(logits: npt.NDArray[np.floating],
                    state: RequestSampler) -> npt.NDArray[np.float64]:
    """The distribution `sample_rows` draws each row of `logits [rows, vocab]` from, for a
    `speculation_ready` request: allowed ids, logit bias, temperature, min_p, top_k, top_p."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if state.allowed is not None:
        keep = np.full(x.shape[1], _NEG_INF, dtype=np.float32)
        keep[state.allowed] = 0.0
        x += keep
    if state.bias_ids is not None and state.bias_values is not None:
        x[:, state.bias_ids] += state.bias_values
    z = _filtered(x, x.max(axis=1), [state] * x.shape[0], own=True)
    mass = np.exp(z.astype(np.float64))
    return mass / mass.sum(axis=1, keepdims=True)
