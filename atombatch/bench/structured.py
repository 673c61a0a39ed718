"""Per-step cost of structured-output masks next to the unconstrained step.

`python -m atombatch.bench structured [--batch 4,16,64,256] [--vocab 151936] [--steps 16]
[--threads N] [--json PATH]`

`python -m atombatch.bench structured --storm [--clients 9] [--seconds 20] [--step-ms 10]
[--repeats 3]` instead measures what clients' grammars cost: compile time per grammar kind and
size, and a victim stream's worst gap while clients send distinct worst-case grammars
(atombatch/bench/grammar_storm.py).

For every batch size B, B rows of random logits of a Qwen3-sized vocabulary are sampled step
after step through the engine's sampler (`sample_rows`), each row with its own llguidance matcher
for a JSON schema (strings, integers, enums, an array: the masks of string content allow most of
the vocabulary, those between fields a handful of ids). A row that completes its document starts
a fresh one, so every step masks B live rows in mixed states. Reported per step (median over
`--steps`):

- `unconstrained_greedy_ms`: the argmax over `[B, vocab]` the engine takes for plain greedy rows;
- `unconstrained_sampled_ms`: `sample_rows` for B sampled rows (temperature 1, no top-k/top-p);
- `constrained_sampled_ms`: the same with every row constrained: advance each matcher by its
  last token, fill the masks, apply them, sample (`fill_ms` included: the engine starts the fill
  before the device call, so on a device most of it is hidden behind the step);
- `fill_ms`: of that, the one `LLExecutor` call filling B bitmask rows;
- `apply_ms`: of that, unpacking the bits and setting the disallowed logits to -inf;
- `sim_decode_ms`: the simulator's device time of one qwen3-4b decode step at B, for scale.

The tokenizer is a byte-level BPE built here with `--vocab` ids (256 bytes, then synthetic word
pieces, as a 152k Qwen3 vocabulary has): mask cost follows the token trie's size, not the merges.
Results are printed as a table and, with `--json`, written with the commit and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import msgspec
import numpy as np

from atombatch.api.structs import SamplingParams
from atombatch.api.structured import StructuredOutput
from atombatch.bench import provenance
from atombatch.sampling.grammar import Grammars, RequestGrammar, apply_bitmask
from atombatch.sampling.sampler import RequestSampler, sample_rows

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "city": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "maxItems": 3},
                         "kind": {"enum": ["person", "robot", "other"]}}}
EOS_ID = 151645                       # Qwen3's <|im_end|> (smaller vocabularies: their last id)


class StructuredRecord(msgspec.Struct, frozen=True):
    """One batch size: milliseconds per step."""

    batch: int
    vocab: int
    unconstrained_greedy_ms: float
    unconstrained_sampled_ms: float
    constrained_sampled_ms: float
    fill_ms: float
    apply_ms: float
    sim_decode_ms: float
    allowed_fraction: float           # mean share of the vocabulary a row's mask allowed


def synthetic_tokenizer(vocab: int, seed: int = 0) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with `vocab` ids: the 256 byte symbols, then
    distinct pieces of 2..12 letters (a third with the leading-space mark), then EOS (at Qwen3's
    id when the vocabulary is that large)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    pieces: dict[str, int] = {}
    for symbol in sorted(alphabet):
        pieces[symbol] = len(pieces)
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz_0123456789"))
    weights = np.linspace(2.0, 0.2, letters.size)
    weights /= weights.sum()
    target = min(vocab - 1, EOS_ID)
    while len(pieces) < target:
        n = int(rng.integers(2, 13))
        word = "".join(rng.choice(letters, size=n, p=weights))
        if rng.random() < 0.33:
            word = "\u0120" + word  # ByteLevel's space
        pieces.setdefault(word, len(pieces))
    tok = Tokenizer(models.BPE(pieces, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>"])
    return tok


def _sim_decode_ms(batch: int) -> float:
    try:
        from atombatch.artifact.config import ArtifactConfig, ModelSpec
        from atombatch.runtime.sim import CostModel
        spec = ModelSpec.preset("qwen3-4b")
        art = ArtifactConfig(model=spec, batch_size=batch, max_seq_len=4096, block_size=4096,
                             num_blocks=batch + 1, prefill_chunk_size=128)
        return float(CostModel.default().decode_step_s(art, [1024] * batch)) * 1e3
    except Exception:
        return float("nan")


def run(batches: list[int], vocab: int, steps: int, threads: int | None,
        progress: bool = False) -> list[StructuredRecord]:
    tokenizer = synthetic_tokenizer(vocab)
    eos = int(tokenizer.token_to_id("<|im_end|>"))
    grammars = Grammars(tokenizer, vocab, (eos,), threads=threads)
    structured = StructuredOutput.json_schema(SCHEMA)
    template = grammars.matcher_now(structured)
    rng = np.random.default_rng(1)
    records = []
    for batch in batches:
        params = SamplingParams(temperature=1.0, max_tokens=None)
        prompt = np.zeros(1, dtype=np.int64)
        plain = [RequestSampler(params, prompt, vocab, (eos,), np.random.default_rng(i))
                 for i in range(batch)]
        constrained = [RequestSampler(params, prompt, vocab, (eos,), np.random.default_rng(i))
                       for i in range(batch)]
        for state in constrained:
            state.grammar = RequestGrammar(template.deep_copy(), structured, grammars)
        # the sampler state of the constrained rows, without their grammar (applied by hand)
        masked = [RequestSampler(params, prompt, vocab, (eos,), np.random.default_rng(i))
                  for i in range(batch)]
        outputs: list[list[int]] = [[] for _ in range(batch)]
        plain_outputs: list[list[int]] = [[] for _ in range(batch)]
        greedy_ms, plain_ms, cons_ms, fill_ms, apply_ms, allowed = [], [], [], [], [], []
        logits = rng.standard_normal((batch, vocab), dtype=np.float32)
        rows = list(range(batch))
        for _ in range(steps + 2):  # the first two steps warm up
            logits += rng.standard_normal((batch, vocab), dtype=np.float32) * 0.1
            out = np.empty(batch, dtype=np.int64)
            t0 = time.perf_counter()
            np.argmax(logits, axis=1, out=out)
            t1 = time.perf_counter()
            sample_rows(logits, plain, plain_outputs)
            t2 = time.perf_counter()
            # the constrained step, part by part, as `sample_rows` runs it for constrained rows
            live = []
            for state, output in zip(constrained, outputs, strict=True):
                assert state.grammar is not None
                state.grammar.advance(output)
                live.append(state.grammar)
            f0 = time.perf_counter()
            mask = grammars.fill(live)
            f1 = time.perf_counter()
            x = np.array(logits, copy=True)
            a0 = time.perf_counter()
            apply_bitmask(x, rows, mask)
            a1 = time.perf_counter()
            result = sample_rows(x, masked, outputs)
            t3 = time.perf_counter()
            bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little", count=vocab)
            allowed.append(float(bits.mean()))
            greedy_ms.append((t1 - t0) * 1e3)
            plain_ms.append((t2 - t1) * 1e3)
            cons_ms.append((t3 - t2 - (a0 - f1)) * 1e3)  # the copy of x is sample_rows' own
            fill_ms.append((f1 - f0) * 1e3)
            apply_ms.append((a1 - a0) * 1e3)
            for i, token in enumerate(result.tokens.tolist()):
                outputs[i].append(token)
                grammar = constrained[i].grammar
                if token == eos or i in result.masked_rows:
                    assert grammar is not None
                    grammar.matcher.reset()      # the document is complete: start another
                    grammar.consumed = 0
                    outputs[i] = []
        keep = slice(2, None)
        records.append(StructuredRecord(
            batch=batch, vocab=vocab,
            unconstrained_greedy_ms=statistics.median(greedy_ms[keep]),
            unconstrained_sampled_ms=statistics.median(plain_ms[keep]),
            constrained_sampled_ms=statistics.median(cons_ms[keep]),
            fill_ms=statistics.median(fill_ms[keep]),
            apply_ms=statistics.median(apply_ms[keep]),
            sim_decode_ms=_sim_decode_ms(batch),
            allowed_fraction=statistics.mean(allowed[keep])))
        if progress:
            print(f"  B={batch}: {records[-1].constrained_sampled_ms:.1f} ms constrained, "
                  f"{records[-1].unconstrained_sampled_ms:.1f} ms unconstrained", file=sys.stderr,
                  flush=True)
    grammars.close()
    return records


def format_table(records: list[StructuredRecord]) -> str:
    lines = [f"{'B':>4} {'vocab':>7} {'greedy':>8} {'sampled':>8} {'constr.':>8} {'fill':>7} "
             f"{'apply':>7} {'sim dev':>8} {'allowed':>8}   (ms per step)"]
    for r in records:
        lines.append(f"{r.batch:>4} {r.vocab:>7} {r.unconstrained_greedy_ms:>8.2f} "
                     f"{r.unconstrained_sampled_ms:>8.2f} {r.constrained_sampled_ms:>8.2f} "
                     f"{r.fill_ms:>7.2f} {r.apply_ms:>7.2f} {r.sim_decode_ms:>8.2f} "
                     f"{r.allowed_fraction:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atombatch.bench structured",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--batch", default="4,16,64,256", help="batch sizes (comma list)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen3: 151936)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per batch size")
    p.add_argument("--threads", type=int, default=None,
                   help="LLExecutor threads (default: llguidance's, 80%% of the CPUs)")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--storm", action="store_true",
                   help="measure grammar compile times and a victim stream under a storm of "
                   "distinct worst-case grammars instead (atombatch/bench/grammar_storm.py)")
    p.add_argument("--clients", type=int, default=9, help="--storm: clients sending grammars")
    p.add_argument("--seconds", type=float, default=20.0, help="--storm: the storm's length")
    p.add_argument("--step-ms", type=float, default=10.0,
                   help="--storm: the null device's milliseconds per step")
    p.add_argument("--repeats", type=int, default=3,
                   help="--storm: distinct grammars timed per kind and size")
    args = p.parse_args(argv)
    if args.storm:
        return _storm_main(args)
    batches = [int(b) for b in args.batch.split(",") if b]
    if not batches or min(batches) < 1 or args.vocab < 512 or args.steps < 1:
        print("error: --batch needs positive ints, --vocab >= 512, --steps >= 1", file=sys.stderr)
        return 2
    records = run(batches, args.vocab, args.steps, args.threads, progress=True)
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": provenance.git_commit(), "machine": provenance.machine(),
                       "params": vars(args),
                       "records": msgspec.to_builtins(records)}, f, indent=2)
    return 0


def _storm_main(args: argparse.Namespace) -> int:
    from atombatch.bench import grammar_storm

    if args.clients < 1 or args.seconds <= 0 or args.step_ms <= 0 or args.repeats < 1:
        print("error: --clients, --seconds, --step-ms and --repeats must be positive",
              file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    tokenizer = synthetic_tokenizer(args.vocab)
    eos = min(args.vocab - 1, EOS_ID)
    compiles = grammar_storm.compile_times(tokenizer, args.vocab, eos, args.repeats,
                                           progress=True)
    print(grammar_storm.format_compile_table(compiles))
    record = grammar_storm.storm(tokenizer, args.clients, args.seconds, args.step_ms)
    print(grammar_storm.format_storm(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": provenance.git_commit(), "machine": provenance.machine(),
                       "load_before": load_before, "load_after": os.getloadavg(),
                       "params": vars(args), "compiles": msgspec.to_builtins(compiles),
                       "storm": msgspec.to_builtins(record)}, f, indent=2)
    return 0 if record.server_alive else 1
