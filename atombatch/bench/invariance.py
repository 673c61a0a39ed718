"""Batch invariance on real compute: a lane's logits at B4 (other lanes busy) vs alone at B1.

`python -m atombatch.bench invariance [--steps N] [--json PATH]`

For each model family (small random specs on the NumPy reference runtime), a probe request runs
alone on a B1 artifact and again on a B4 artifact beside three other requests that arrive with it.
Every decode step's logits row of the probe is recorded in both runs and compared: the report is
max |Δlogit| and whether the greedy tokens agree. The NumPy runtime computes each lane with the
matmul shapes of B1, so the expected answer is exactly 0; a device kernel that batches lanes
differently would show up here as a nonzero bound.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec
import numpy as np

from atombatch.api.structs import SamplingParams
from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.engine.batcher import Batcher
from atombatch.runtime.numpy_runtime import NumpyRuntime

TINY: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                            num_kv_heads=2, head_dim=16)
FAMILIES = {
    "llama": ModelSpec(name="tiny-llama", family="llama", num_layers=2, **TINY),
    "qwen3": ModelSpec(name="tiny-qwen3", family="qwen3", num_layers=2, tie_word_embeddings=True,
                       **TINY),
    "gemma3": ModelSpec(name="tiny-gemma3", family="gemma3", num_layers=4, sliding_window=16,
                        layer_types=("sliding_attention", "full_attention") * 2,
                        query_pre_attn_scalar=16.0, tie_word_embeddings=True, **TINY),
}


class InvarianceRecord(msgspec.Struct, frozen=True):
    """B1 vs B4 logits of one probe request."""

    family: str                 # model family of the small spec
    steps: int                  # decode steps compared
    max_abs_diff: float         # max |logit(B4) - logit(B1)| over every step and vocab entry
    tokens_equal: bool          # greedy tokens identical


class _Recording:
    """Wraps a runtime and keeps the probe lane's decode logits."""

    def __init__(self, runtime: NumpyRuntime) -> None:
        self.runtime = runtime
        self.artifact = runtime.artifact
        self.probe_lane = -1
        self.rows: list[np.ndarray] = []

    def prefill(self, inputs: Any) -> np.ndarray:
        return self.runtime.prefill(inputs)

    def decode(self, inputs: Any) -> np.ndarray:
        logits = self.runtime.decode(inputs)
        rows = np.flatnonzero(inputs.row_lanes == self.probe_lane)
        if self.probe_lane >= 0 and len(rows) and int(inputs.cache_position[rows[0], 0]) > 0:
            self.rows.append(logits[rows[0]].copy())
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


def _probe_rows(spec: ModelSpec, batch_size: int, prompts: list[list[int]],
                steps: int) -> tuple[list[np.ndarray], tuple[int, ...]]:
    art = ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=256, block_size=256,
                         num_blocks=batch_size + 1, prefill_chunk_size=32)
    recording = _Recording(NumpyRuntime.random(art, seed=0))
    batcher = Batcher(recording)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    probe = batcher.submit(prompts[0], params)
    for prompt in prompts[1:batch_size]:
        batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    tokens: tuple[int, ...] = ()
    while batcher.has_unfinished():
        request = batcher.scheduler.requests.get(probe)
        recording.probe_lane = request.lane if request is not None else -1
        for out in batcher.step():
            if out.request_id == probe and out.finished and out.completion is not None:
                tokens = out.completion.token_ids
    return recording.rows, tokens


def run(steps: int = 16) -> list[InvarianceRecord]:
    rng = np.random.default_rng(1)
    records = []
    for family, spec in FAMILIES.items():
        prompts = [rng.integers(1, spec.vocab_size, size=int(n)).tolist()
                   for n in rng.integers(20, 60, size=4)]
        alone, alone_tokens = _probe_rows(spec, 1, prompts, steps)
        batched, batched_tokens = _probe_rows(spec, 4, prompts, steps)
        if len(alone) != len(batched):
            raise RuntimeError(f"{family}: {len(alone)} B1 steps vs {len(batched)} B4 steps")
        diff = max(float(np.abs(a - b).max()) for a, b in zip(alone, batched, strict=True))
        records.append(InvarianceRecord(family=family, steps=len(alone), max_abs_diff=diff,
                                        tokens_equal=alone_tokens == batched_tokens))
    return records


def format_table(records: list[InvarianceRecord]) -> str:
    lines = [f"{'family':8} {'steps':>5} {'max |Δlogit| B4 vs B1':>24} {'tokens equal':>13}"]
    for r in records:
        lines.append(f"{r.family:8} {r.steps:5d} {r.max_abs_diff:24.3g} {r.tokens_equal!s:>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atombatch.bench invariance",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="decode steps compared per family")
    parser.add_argument("--json", help="write the records as JSON to this path")
    args = parser.parse_args(argv)
    records = run(args.steps)
    print(format_table(records))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(records)))
    return 0 if all(r.tokens_equal for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
