"""`python -m atombatch.bench spec`: speculative decoding on ATOM, projected and measured.

Two parts (docs/speculative.md, "Projected gain on ATOM"):

* **Projected** (simulator cost model, `atombatch/runtime/sim/speculative.py`): for each model,
  the origin's c16 case on a B1 artifact (8192 in / 128 out, requests served back to back) plain
  and speculating at each `--acceptance` (i.i.d. per-token acceptance) with the best `k` of
  `--drafts`: tokens per device call, throughput, max / median first token. Then the decode batch
  size B at which plain decoding catches up (one decode step serves B lanes; each speculating lane
  needs its own batch-1 prefill call).
* **Measured acceptance of n-gram drafts** on texts where copying is common, tokenizer-free
  (tokens: GPT-2's pre-tokenization pieces). A replay: the "model output" is a reference text, so
  a draft is accepted while it equals the reference; this is the acceptance of a model that
  reproduces the reference (an upper bound for a real model on the same task). Texts: an
  extractive summary that quotes its source, a code edit that repeats most of a file, and a
  control with the summary's words shuffled. One more row takes its tokens from the NumPy runtime
  (a small random-weight model, greedy): not a copy task, it shows what drafts do on what the
  runtime really emits. Each measured trace is also costed as KONI's decode phase.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Sequence

import msgspec
import numpy as np

from atombatch.api.speculative import DEFAULT_LOOKUP_WINDOW, DEFAULT_PROMPT_LOOKUP, MAX_LOOKUP_WINDOW
from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.bench.provenance import git_commit
from atombatch.errors import ConfigError
from atombatch.runtime.sim import CostModel
from atombatch.runtime.sim import speculative as spec
from atombatch.sampling.ngram import propose

MODELS = ("koni-8b", "qwen3-0.6b", "qwen3-4b", "gemma3-1b")
ACCEPTANCE = (0.2, 0.4, 0.6, 0.8)
DRAFTS = tuple(range(1, 9))
TEXTS = ("summary", "code-edit", "control", "numpy")


# -- texts ------------------------------------------------------------------------------------------
# GPT-2's pre-tokenizer without its contractions: a word or a run of punctuation with the space
# before it, or a run of whitespace. A BPE tokenizer splits rare pieces further.
_TOKEN = re.compile(r" ?\w+| ?[^\w\s]+|\s+(?!\S)|\s+")


class Vocabulary:
    """Tokenizer-free ids: every piece of GPT-2's pre-tokenization (a word with the space before
    it, a run of punctuation, a run of whitespace) is one token."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.ids.setdefault(piece, len(self.ids))
                         for piece in _TOKEN.findall(text)], dtype=np.int64)


def _source_text() -> str:
    """Prose that ships with the package: module docstrings of the simulator and the scheduler
    (the measured figures move a little when those docstrings change)."""
    import atombatch.engine.scheduler as scheduler
    import atombatch.runtime.sim as sim
    import atombatch.runtime.sim.costs as costs
    return "\n\n".join(inspect.getdoc(module) or "" for module in (costs, sim, scheduler))


def summary_case() -> tuple[str, str]:
    """(prompt, reference): an extractive summary quoting every third sentence of its source,
    each introduced by a short phrase of its own."""
    source = _source_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", source) if len(s.split()) > 4]
    lead = ("The text explains that", "It adds:", "In short,", "Next it says", "Finally,")
    quoted = [f"{lead[i % len(lead)]} {s}" for i, s in enumerate(sentences[::3])]
    return f"Summarize the following text, quoting it.\n\n{source}\n\nSummary:\n", " ".join(quoted)


def code_edit_case() -> tuple[str, str]:
    """(prompt, reference): a whole Python module, then the same module with one name renamed
    everywhere and a comment added before every function (the answer repeats most of the file)."""
    import atombatch.runtime.sim.costs as costs
    source = inspect.getsource(costs)
    edited = re.sub(r"\bartifact\b", "compiled", source)
    edited = re.sub(r"(?m)^(\s*)def (\w+)", r"\1# \2: see docs/simulator.md\n\1def \2", edited)
    return (f"Rename `artifact` to `compiled` in this file and add a comment before every "
            f"function. Answer with the whole file.\n\n{source}\n\nAnswer:\n", edited)


def control_case() -> tuple[str, str]:
    """(prompt, reference): the summary case with the reference's words shuffled (same vocabulary,
    no copied order)."""
    prompt, reference = summary_case()
    words = reference.split()
    np.random.default_rng(0).shuffle(words)
    return prompt, " ".join(words)


# -- replay -----------------------------------------------------------------------------------------
class Measured(msgspec.Struct, frozen=True):
    """Drafts replayed against one reference output."""

    text: str                      # which text
    drafts: int                    # k: drafts asked of the proposer per call
    output_tokens: int             # reference tokens generated
    calls: int                     # device calls (verify with drafts, or plain decode)
    verify_calls: int              # calls that carried at least one draft
    proposed: int                  # draft tokens proposed
    accepted: int                  # draft tokens accepted
    tokens_per_call: float         # output_tokens / calls (the first token from prefill excluded)
    acceptance_rate: float         # accepted / proposed (vLLM's draft acceptance rate)
    iid_acceptance: float          # the i.i.d. rate with the same tokens per verify call
    koni_decode_ratio: float       # the trace's device time on KONI / plain decoding's
    koni_tok_s: float              # KONI B1 c16 throughput at that decode time
    koni_max_first_token_s: float  # KONI B1 c16 latest first token


def replay(prompt: np.ndarray, reference: np.ndarray, k: int, max_n: int, min_n: int,
           window: int = DEFAULT_LOOKUP_WINDOW) -> list[tuple[int, int]]:
    """(drafts proposed, drafts accepted) per device call that generates `reference[1:]` (the
    first token comes from prefill) with the engine's proposer (`atombatch/sampling/ngram.py`,
    searching the last `window` tokens); a call with no draft is a plain decode step."""
    context = np.concatenate([prompt, reference])
    done = len(prompt) + 1
    end = len(context)
    trace = []
    while done < end:
        drafts = propose(context[:done], min(k, end - done - 1), min_n, max_n, window) \
            if end - done > 1 else context[:0]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == context[done + accepted]:
            accepted += 1
        trace.append((len(drafts), accepted))
        done += accepted + 1
    return trace


def cost_trace_on_koni(trace: Sequence[tuple[int, int]], costs: CostModel, input_len: int,
                       output_len: int, concurrency: int) -> tuple[float, float, float]:
    """(decode time / plain decode time, c16 tok/s, max first token) of a trace replayed as
    KONI's decode phase: each call is costed at the position it would have in an
    `input_len`-token request (verify calls through the prefill graph, draftless calls through the
    decode graph), per output token of the trace, scaled to `output_len`."""
    artifact = _artifact("koni-8b", 1)
    span = output_len - 1
    out, spent = 1, 0.0
    for proposed, accepted in trace:
        position = input_len + (out - 1) % span   # wrap long traces into the origin's window
        spent += spec.verify_call_s(costs, artifact, position, proposed) if proposed else \
            costs.decode_step_s(artifact, (position + 1,))
        out += accepted + 1
    per_token = spent / (out - 1)
    plain = spec.plain_decode_s(costs, artifact, input_len, output_len)
    decode = per_token * span
    prefill = costs.request_prefill_s(artifact, input_len)
    request = prefill + decode
    return decode / plain, output_len / request, (concurrency - 1) * request + prefill


def numpy_case(seed: int = 0, output: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, greedy output) of a small random-weight KONI-family model on the NumPy runtime;
    the prompt holds one random segment twice (copying would pay), and the output is the model's."""
    from atombatch.api.structs import SamplingParams
    from atombatch.bench.serve.matrix import small_spec
    from atombatch.engine.batcher import Batcher
    from atombatch.runtime.numpy_runtime import NumpyRuntime

    small = small_spec("koni-8b")
    artifact = ArtifactConfig(model=small, batch_size=1, max_seq_len=256, block_size=256,
                              num_blocks=2, prefill_chunk_size=32, kv_dtype="float32")
    rng = np.random.default_rng(seed)
    segment = rng.integers(3, small.vocab_size, 40, dtype=np.int64)
    prompt = np.concatenate([segment, rng.integers(3, small.vocab_size, 8), segment[:20]])
    batcher = Batcher(NumpyRuntime.random(artifact, seed=seed))
    (done,) = batcher.generate([prompt], SamplingParams(temperature=0.0, max_tokens=output,
                                                        ignore_eos=True))
    return prompt, np.asarray(done.token_ids, dtype=np.int64)


def measure(texts: Sequence[str], drafts: Sequence[int], max_n: int, min_n: int,
            costs: CostModel, input_len: int, output_len: int, concurrency: int,
            window: int = DEFAULT_LOOKUP_WINDOW) -> list[Measured]:
    rows = []
    for text in texts:
        if text == "numpy":
            prompt, reference = numpy_case()
        else:
            vocabulary = Vocabulary()
            make = {"summary": summary_case, "code-edit": code_edit_case,
                    "control": control_case}[text]
            prompt_text, reference_text = make()
            prompt, reference = vocabulary.encode(prompt_text), vocabulary.encode(reference_text)
        for k in drafts:
            trace = replay(prompt, reference, k, max_n, min_n, window)
            proposed = sum(p for p, _ in trace)
            accepted = sum(a for _, a in trace)
            verify_calls = sum(1 for p, _ in trace if p)
            per_verify = (accepted + verify_calls) / verify_calls if verify_calls else 1.0
            ratio, tok_s, first = cost_trace_on_koni(trace, costs, input_len, output_len,
                                                     concurrency)
            rows.append(Measured(
                text=text, drafts=k, output_tokens=len(reference) - 1, calls=len(trace),
                verify_calls=verify_calls, proposed=proposed, accepted=accepted,
                tokens_per_call=(len(reference) - 1) / len(trace),
                acceptance_rate=accepted / proposed if proposed else 0.0,
                iid_acceptance=spec.equivalent_acceptance(min(per_verify, k + 1.0), k),
                koni_decode_ratio=ratio, koni_tok_s=tok_s, koni_max_first_token_s=first))
    return rows


# -- projection -------------------------------------------------------------------------------------
class Projected(msgspec.Struct, frozen=True):
    """One row of the projection table."""

    model: str
    acceptance: float | None       # None: plain decoding
    drafts: int                    # best k (0: plain)
    row: spec.SerialProjection
    gain: float                    # throughput / plain's


class Crossover(msgspec.Struct, frozen=True):
    model: str
    acceptance: float
    batch: int | None              # B where plain catches up (1: never pays; None: > max_batch)


class BreakEven(msgspec.Struct, frozen=True):
    model: str
    acceptance: float | None       # i.i.d. acceptance above which speculation pays at B1
    verify_to_decode: float        # a verify call (4 drafts) / a B1 decode step, mid-output


def _artifact(model: str, batch: int, context: int = 9216, chunk: int = 128) -> ArtifactConfig:
    preset = ModelSpec.preset(model)
    # a hybrid model may not use a single block; the block count does not change a call's cost
    blocks = batch + 1 if preset.is_hybrid or batch > 1 else 1
    return ArtifactConfig(model=preset, batch_size=batch, max_seq_len=context, block_size=context,
                          num_blocks=blocks, prefill_chunk_size=chunk)


def project(models: Sequence[str], acceptance: Sequence[float], drafts: Sequence[int],
            costs: CostModel, input_len: int, output_len: int, concurrency: int,
            context: int, chunk: int, max_batch: int, verify_chunk: int | None
            ) -> tuple[list[Projected], list[Crossover], list[BreakEven]]:
    rows: list[Projected] = []
    crossings: list[Crossover] = []
    evens: list[BreakEven] = []
    for model in models:
        artifact = _artifact(model, 1, context, chunk)
        verifier = None if verify_chunk is None else _artifact(model, 1, context, verify_chunk)
        middle = input_len + output_len // 2
        evens.append(BreakEven(model, spec.break_even_acceptance(
            costs, artifact, input_len, output_len, drafts, verifier),
            spec.verify_call_s(costs, verifier or artifact, middle - 1, 4) /
            costs.decode_step_s(artifact, (middle,))))
        plain = spec.serial_projection(costs, artifact, input_len, output_len, concurrency)
        rows.append(Projected(model, None, 0, plain, 1.0))
        for a in acceptance:
            k, _ = spec.best_drafts(costs, artifact, input_len, output_len, a, drafts, verifier)
            row = spec.serial_projection(costs, artifact, input_len, output_len, concurrency,
                                         a, k, verifier)
            rows.append(Projected(model, a, k, row,
                                  row.throughput_tok_s / plain.throughput_tok_s))
            crossings.append(Crossover(model, a, spec.crossover_batch(
                costs, artifact, input_len, output_len, a, drafts, max_batch, verifier)))
    return rows, crossings, evens


def format_break_even(evens: list[BreakEven]) -> str:
    lines = [f"{'model':<11} {'verify/decode':>13} {'break-even acceptance':>21}"]
    for e in evens:
        even = "never" if e.acceptance is None else f"{e.acceptance:.3f}"
        lines.append(f"{e.model:<11} {e.verify_to_decode:>12.3f}x {even:>21}")
    return "\n".join(lines)


def format_projection(rows: list[Projected]) -> str:
    lines = [f"{'model':<11} {'accept':>6} {'k':>2} {'tok/call':>8} {'tok/s':>8} {'gain':>6} "
             f"{'max first s':>11} {'p50 first s':>11} {'makespan s':>10}"]
    for r in rows:
        p = r.row
        accept = "plain" if r.acceptance is None else f"{r.acceptance:.2f}"
        lines.append(f"{r.model:<11} {accept:>6} {r.drafts or '-':>2} {p.tokens_per_call:>8.3f} "
                     f"{p.throughput_tok_s:>8.4f} {r.gain:>5.2f}x {p.max_first_token_s:>11.2f} "
                     f"{p.median_first_token_s:>11.2f} {p.max_completion_s:>10.2f}")
    return "\n".join(lines)


def format_crossover(crossings: list[Crossover], acceptance: Sequence[float],
                     max_batch: int) -> str:
    models = list(dict.fromkeys(c.model for c in crossings))
    lines = [f"{'model':<11} " + " ".join(f"{'a=' + format(a, '.2f'):>7}" for a in acceptance)]
    for model in models:
        cells = []
        for a in acceptance:
            (c,) = [c for c in crossings if c.model == model and c.acceptance == a]
            cells.append(f"{'>' + str(max_batch) if c.batch is None else c.batch:>7}")
        lines.append(f"{model:<11} " + " ".join(cells))
    return "\n".join(lines)


def format_measured(rows: list[Measured]) -> str:
    lines = [f"{'text':<10} {'k':>2} {'tokens':>6} {'calls':>5} {'verify':>6} {'proposed':>8} "
             f"{'accepted':>8} {'accept%':>7} {'iid a':>5} {'tok/call':>8} {'KONI decode':>11} "
             f"{'KONI tok/s':>10} {'max first s':>11}"]
    for r in rows:
        lines.append(f"{r.text:<10} {r.drafts:>2} {r.output_tokens:>6} {r.calls:>5} "
                     f"{r.verify_calls:>6} {r.proposed:>8} {r.accepted:>8} "
                     f"{100 * r.acceptance_rate:>6.1f}% {r.iid_acceptance:>5.2f} "
                     f"{r.tokens_per_call:>8.3f} "
                     f"{r.koni_decode_ratio:>10.3f}x {r.koni_tok_s:>10.4f} "
                     f"{r.koni_max_first_token_s:>11.2f}")
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",")]


def _ints(text: str) -> list[int]:
    values: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        values.extend(range(int(lo), int(hi or lo) + 1))
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m atombatch.bench spec",
        description="Speculative decoding on ATOM: the projected c16 gain per acceptance on "
                    "the simulator, the batch size where it stops paying, and measured "
                    "acceptance of n-gram drafts on copy-heavy texts.")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated presets (default {','.join(MODELS)})")
    p.add_argument("--acceptance", default=",".join(map(str, ACCEPTANCE)),
                   help="i.i.d. per-token acceptance rates (default 0.2,0.4,0.6,0.8)")
    p.add_argument("--drafts", default="1-8",
                   help="k values tried, best kept: list or range (default 1-8)")
    p.add_argument("--input", type=int, default=8192, help="prompt tokens (default 8192)")
    p.add_argument("--output", type=int, default=128, help="output tokens (default 128)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests submitted together (default 16)")
    p.add_argument("--context", type=int, default=9216, help="max_seq_len (default 9216)")
    p.add_argument("--chunk", type=int, default=128,
                   help="prefill_chunk_size of the artifact (default 128)")
    p.add_argument("--verify-chunk", type=int, default=None, metavar="N",
                   help="what-if: verify with a prefill graph compiled at N tokens instead of "
                        "the artifact's chunk")
    p.add_argument("--max-batch", type=int, default=64,
                   help="largest decode batch searched for the crossover (default 64)")
    p.add_argument("--texts", default=",".join(TEXTS),
                   help=f"measured texts, or 'none' (default {','.join(TEXTS)})")
    p.add_argument("--measure-drafts", default="2,4,8",
                   help="k values of the measured replay (default 2,4,8)")
    p.add_argument("--prompt-lookup-max", type=int, default=DEFAULT_PROMPT_LOOKUP,
                   help="longest n-gram matched (vLLM's prompt_lookup_max; default "
                        f"{DEFAULT_PROMPT_LOOKUP}, vLLM's)")
    p.add_argument("--prompt-lookup-min", type=int, default=DEFAULT_PROMPT_LOOKUP,
                   help="shortest n-gram matched (vLLM's prompt_lookup_min; default "
                        f"{DEFAULT_PROMPT_LOOKUP}, vLLM's)")
    p.add_argument("--lookup-window", type=int, default=DEFAULT_LOOKUP_WINDOW,
                   help="the proposer searches the last N tokens (the engine's "
                        f"speculative_config.lookup_window; default {DEFAULT_LOOKUP_WINDOW})")
    p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        models = [m for m in args.models.split(",") if m]
        for model in models:
            ModelSpec.preset(model)
        acceptance = _floats(args.acceptance)
        drafts, measure_drafts = _ints(args.drafts), _ints(args.measure_drafts)
        texts = [] if args.texts == "none" else args.texts.split(",")
        unknown = [t for t in texts if t not in TEXTS]
        if unknown:
            raise ConfigError(f"--texts {','.join(unknown)!r}: not one of {', '.join(TEXTS)}")
        if not acceptance or any(not 0 <= a <= 1 for a in acceptance):
            raise ConfigError(f"--acceptance {args.acceptance!r}: rates must lie in [0, 1]")
        if not drafts or any(not 1 <= k < args.chunk for k in drafts + measure_drafts):
            raise ConfigError(f"--drafts/--measure-drafts: k must lie in 1..{args.chunk - 1}")
        if not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
            raise ConfigError("--prompt-lookup-min must lie in 1..--prompt-lookup-max")
        if not 1 <= args.lookup_window <= MAX_LOOKUP_WINDOW:
            raise ConfigError(f"--lookup-window {args.lookup_window} must lie in "
                              f"1..{MAX_LOOKUP_WINDOW}")
        if not 1 <= args.max_batch <= 1024:
            raise ConfigError(f"--max-batch {args.max_batch} must lie in 1..1024")
        if args.output < 2 or args.input < 1 or args.concurrency < 1:
            raise ConfigError("--output must be >= 2, --input and --concurrency >= 1")
    except (ValueError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    costs = CostModel.default()
    try:
        rows, crossings, evens = project(models, acceptance, drafts, costs, args.input, args.output,
                                  args.concurrency, args.context, args.chunk, args.max_batch,
                                  args.verify_chunk)
        measured = measure(texts, measure_drafts, args.prompt_lookup_max,
                           args.prompt_lookup_min, costs, args.input, args.output,
                           args.concurrency, args.lookup_window)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verify = f"a prefill graph of {args.verify_chunk} tokens (what-if)" \
        if args.verify_chunk else f"the artifact's prefill graph ({args.chunk} tokens)"
    print(f"speculative decoding, projected on the simulator (commit {git_commit()}): "
          f"B1, {args.input} in / {args.output} out, c{args.concurrency}, requests back to back; "
          f"one verify call = {verify}; best k of {args.drafts} per acceptance")
    print(format_projection(rows))
    print("\ndecode batch B at which plain decoding catches up (1: speculation never pays; "
          "each speculating lane needs its own batch-1 prefill call)")
    print(format_crossover(crossings, acceptance, args.max_batch))
    print("\nbreak-even at B1: a verify call (4 drafts) over a decode step, mid-output, and the "
          "i.i.d. acceptance above which speculation pays")
    print(format_break_even(evens))
    if measured:
        print(f"\nmeasured: n-gram drafts (atombatch/sampling/ngram.py, prompt_lookup "
              f"{args.prompt_lookup_min}..{args.prompt_lookup_max}, window "
              f"{args.lookup_window}) replayed against reference outputs; KONI columns cost "
              "each trace as KONI's decode phase")
        print(format_measured(measured))
    print(costs.describe())
    if args.json:
        with open(args.json, "wb") as handle:
            handle.write(msgspec.json.encode({"projected": rows, "crossover": crossings,
                                              "break_even": evens,
                                              "measured": measured}))
    return 0
