"""`python -m atombatch.bench stalls`: how long decoding streams wait behind a burst of prompts.

    python -m atombatch.bench stalls --models qwen3-4b,qwen3-0.6b,gemma3-1b \
        --policies prefill-first,stall-free:2,stall-free:4,stall-free:8,interleave:4

On the calibrated simulator (virtual seconds: the cost model's figures, the same on any host),
B4/k5, context 9216, chunk 128: two streams decode 400 tokens; after 40 steps eight 2 000-token
prompts arrive. For each model and policy: the victims' longest pause between two tokens, the
burst's latest first token, and when all the work is done (docs/scheduling.md shows the table).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import msgspec

from atombatch.api.structs import Completion, SamplingParams
from atombatch.artifact.config import PRESETS, ArtifactConfig
from atombatch.engine.batcher import Batcher
from atombatch.runtime.sim import SimRuntime

VICTIMS, VICTIM_TOKENS = 2, 400
BURST, BURST_PROMPT, BURST_TOKENS = 8, 2000, 16
BURST_AFTER_STEPS = 40


class Burst(msgspec.Struct):
    """One run of the workload: the engine, its step trace and the requests' ids."""

    batcher: Batcher
    trace: list[object]
    victims: list[str]
    burst: list[str]


class StallRow(msgspec.Struct, frozen=True):
    model: str
    policy: str
    victim_gap_s: float                  # the victims' longest pause between two tokens
    burst_ttft_s: float                  # the burst's latest first token, from its arrival
    done_s: float                        # virtual time when every request had finished


def start_burst(model: str, policy: str) -> Burst:
    """The victims decoding, then the burst submitted (nothing of it has run yet)."""
    art = ArtifactConfig(model=PRESETS[model], batch_size=4, max_seq_len=9216, block_size=9216,
                         num_blocks=5, prefill_chunk_size=128)
    batcher = Batcher(SimRuntime(art), policy=policy, max_waiting=None)
    trace = batcher.record_trace()
    victims = [batcher.submit([5] * 64, SamplingParams(max_tokens=VICTIM_TOKENS,
                                                        ignore_eos=True))
               for _ in range(VICTIMS)]
    for _ in range(BURST_AFTER_STEPS):
        batcher.step()
    burst = [batcher.submit([7] * BURST_PROMPT, SamplingParams(max_tokens=BURST_TOKENS,
                                                                ignore_eos=True))
             for _ in range(BURST)]
    return Burst(batcher, trace, victims, burst)


def run_to_end(batcher: Batcher) -> dict[str, Completion]:
    finals: dict[str, Completion] = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            if out.finished and out.completion is not None:
                finals[out.request_id] = out.completion
    return finals


def measure(model: str, policy: str) -> StallRow:
    run = start_burst(model, policy)
    finals = run_to_end(run.batcher)

    def timings(rid: str) -> object:
        timing = finals[rid].timings
        assert timing is not None
        return timing

    gap = max(max(timings(v).inter_token) for v in run.victims)  # type: ignore[attr-defined]
    ttft = max(timings(r).ttft for r in run.burst)  # type: ignore[attr-defined]
    return StallRow(model, policy, gap, ttft, run.batcher.runtime.clock())  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atombatch.bench stalls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-4b,qwen3-0.6b,gemma3-1b")
    p.add_argument("--policies",
                   default="prefill-first,stall-free:2,stall-free:4,stall-free:8,interleave:4")
    args = p.parse_args(argv)
    print(f"{'model':<11} {'policy':<14} {'victim gap':>10} {'burst TTFT max':>14} "
          f"{'all done':>9}   (virtual seconds)")
    for model in args.models.split(","):
        for policy in args.policies.split(","):
            row = measure(model, policy)
            print(f"{row.model:<11} {row.policy:<14} {row.victim_gap_s:>9.3f}s "
                  f"{row.burst_ttft_s:>13.2f}s {row.done_s:>8.2f}s")
    return 0
