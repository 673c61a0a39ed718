"""`python -m atombatch.bench lora`: what LoRA adapters add to a step, on the simulator.

For a model preset and a decode batch, it runs `SimRuntime` decode steps (every lane at the same
context) with the rows spread over 0, 1, 2, ... distinct adapters of each `--ranks` rank on the
`--targets` modules, and one prefill chunk under an adapter, and prints each step's simulated
device time and its increase over the base step. Each distinct adapter of a step streams its A and
B matrices once; each row under one adds its FLOPs (docs/lora.md, "Adapters on the host
runtimes"). The figures are the cost model's (its calibration is printed with them), not a
measurement.
"""

from __future__ import annotations

import argparse
import sys

import msgspec
import numpy as np

from atombatch.artifact.config import PRESETS, ArtifactConfig, ModelSpec
from atombatch.artifact.lora import ATTENTION_MODULES, TARGET_MODULES, LoraAdapter
from atombatch.bench.provenance import git_commit
from atombatch.errors import ConfigError
from atombatch.kernel.blocks import DecodeInputs, LaneTable, PrefillInputs
from atombatch.runtime.sim import SimRuntime

TARGETS = {"all": TARGET_MODULES, "attention": ATTENTION_MODULES}


class LoraRow(msgspec.Struct, frozen=True):
    """One line of the table."""

    rank: int                  # the adapters' rank
    adapters: int              # distinct adapters in the step (0: the base step)
    adapted_rows: int          # rows under an adapter (of batch_size)
    step_ms: float             # simulated device time of the step
    increase: float            # step_ms / the base step's - 1


def _artifact(model: str, batch: int, context: int) -> ArtifactConfig:
    spec = ModelSpec.preset(model)
    return ArtifactConfig(model=spec, batch_size=batch, max_seq_len=context, block_size=context,
                          num_blocks=batch + 1, prefill_chunk_size=128)


def _adapters(rank: int, targets: tuple[str, ...], count: int) -> list[LoraAdapter]:
    return [LoraAdapter(name=f"r{rank}-{i}", lora_int_id=i, path="-", r=rank,
                        lora_alpha=float(rank), target_modules=targets)
            for i in range(1, count + 1)]


def run(model: str, batch: int, context: int, ranks: list[int], targets: str
        ) -> tuple[list[LoraRow], list[tuple[int, float, float]], str]:
    """The table's rows, (rank, base chunk ms, adapted chunk ms) per rank, and the cost model's
    description."""
    art = _artifact(model, batch, context)
    lanes = LaneTable(batch, 1, context)
    for lane in range(batch):
        lanes.assign()
        lanes.push_block(lane, lane)
        lanes.start_decode(lane, context - 1, 7)
    inputs = DecodeInputs(batch, 1)
    inputs.build(lanes, batch)
    prefill = PrefillInputs(128, 1)
    prefill.build(list(range(3, 131)), 0, [0], 1, sliding_slot=0)
    rows: list[LoraRow] = []
    chunks = []
    description = ""
    for rank in ranks:
        runtime = SimRuntime(art, lora_adapters=_adapters(rank, TARGETS[targets], batch))
        description = runtime.costs.describe()

        def step(ids: list[int], runtime: SimRuntime = runtime) -> float:
            before = runtime.device.decode_s
            runtime.decode(inputs, lora_int_ids=np.array(ids, dtype=np.int32))
            return (runtime.device.decode_s - before) * 1e3

        base = step([0] * batch)
        rows.append(LoraRow(rank, 0, 0, base, 0.0))
        mixes = [[1] + [0] * (batch - 1), [1] * batch]
        count = 2
        while count <= batch:
            mixes.append([1 + i % count for i in range(batch)])
            count *= 2
        for ids in mixes:
            ms = step(ids)
            rows.append(LoraRow(rank, len({i for i in ids if i}), sum(1 for i in ids if i), ms,
                                ms / base - 1))
        before = runtime.device.prefill_s
        runtime.prefill(prefill)
        plain = runtime.device.prefill_s - before
        runtime.prefill(prefill, lora_int_ids=np.array([1], dtype=np.int32))
        chunks.append((rank, plain * 1e3, (runtime.device.prefill_s - before - plain) * 1e3))
    return rows, chunks, description


def format_table(rows: list[LoraRow], batch: int) -> str:
    lines = [f"{'rank':>4}  {'adapters':>8}  {'rows':>7}  {'step ms':>9}  {'vs base':>8}"]
    for row in rows:
        lines.append(f"{row.rank:>4}  {row.adapters:>8}  {row.adapted_rows:>3} of {batch:<2} "
                     f"{row.step_ms:>9.3f}  {100 * row.increase:>+7.2f}%")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m atombatch.bench lora",
        description="What LoRA adapters add to a decode step and a prefill chunk on the "
                    "simulator: rows spread over 0, 1, 2, ... distinct adapters of each rank.")
    p.add_argument("--model", default="koni-8b", choices=sorted(PRESETS),
                   help="model preset (default koni-8b)")
    p.add_argument("--batch-size", type=int, default=4, help="decode lanes (default 4)")
    p.add_argument("--context", type=int, default=9216,
                   help="context of the artifact; every lane decodes at its end (default 9216)")
    p.add_argument("--ranks", default="16,64",
                   help="comma-separated adapter ranks (default 16,64)")
    p.add_argument("--targets", choices=sorted(TARGETS), default="all",
                   help="adapted modules: every linear layer or the attention projections")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
        if not ranks or any(not 1 <= r <= 512 for r in ranks) or not 1 <= args.batch_size <= 256:
            raise ValueError
    except ValueError:
        print(f"error: --ranks {args.ranks!r} must be integers in 1..512 and --batch-size "
              "1..256", file=sys.stderr)
        return 2
    try:
        rows, chunks, description = run(args.model, args.batch_size, args.context, ranks,
                                        args.targets)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"LoRA on the simulator: {args.model} B{args.batch_size}, every lane at context "
          f"{args.context}, adapters on {args.targets} linear layers (commit {git_commit()})")
    print(format_table(rows, args.batch_size))
    for rank, plain, adapted in chunks:
        print(f"prefill chunk of 128 at position 0: {plain:.3f} ms base, {adapted:.3f} ms under "
              f"an r={rank} adapter ({100 * (adapted / plain - 1):+.2f}%)")
    print(description)
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.encode({"rows": rows, "chunks": chunks,
                                         "params": vars(args), "commit": git_commit()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
