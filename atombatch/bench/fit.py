"""`python -m atombatch.bench fit`: the memory planner from the command line.

One artifact:
    python -m atombatch.bench fit --model koni-8b --batch-size 1 --max-seq-len 9216 \\
        --block-size 9216 --num-blocks 5 --observed-used-bytes 16357785600 --observed-num-blocks 1
prints its KV tensors, the projection and the verdict (exit status 0 fits, 1 does not fit,
2 configuration error), in the table's terms (KV/device, other/device, projected, headroom,
verdict, basis). Like the table, KONI on one device at the origin context is projected from the
origin issue's observation unless another observation is given (`--estimate` forces the
estimate).

The table (`--table`, and the default when no `--model` is given) covers the origin issue's four
models at B1/k1, B1/k3, B1/k5 and B4/k5 (eager: block_size == context), on one device and on two
(tensor parallel 2). KONI on one device is projected from the origin issue's observation (a
conditional estimate); every other cell uses weights + KV + the stated runtime overhead.

The quantization table (`--quant-table`, docs/planning.md) takes the four models at the origin
context on one device under each weight format (fp16, w8a16, w4a16, fp8) with bf16 and fp8 KV,
finds the largest B (k = B + 1, eager) that fits, and runs the simulator's c16 8192/128 at that B
(capped at the 16 clients) beside the origin's B1/k1 reference.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import msgspec

from atombatch.artifact import plan
from atombatch.artifact.config import (
    FP8_KV_DTYPE,
    PRESETS,
    QUANT_ACTIVATIONS,
    QUANT_KV_CACHES,
    QUANT_WEIGHTS,
    ArtifactConfig,
    ModelSpec,
    Quantization,
)
from atombatch.bench import provenance
from atombatch.errors import ConfigError

MODELS = ("qwen3-0.6b", "qwen3-4b", "koni-8b", "gemma3-1b")
TABLE_SHAPES = ((1, 1), (1, 3), (1, 5), (4, 5))  # (batch_size, num_blocks), eager
TABLE_TP = (1, 2)
ORIGIN_CONTEXT = 9216
# Origin issue: read-only monitoring of the assigned ATOM during KONI B1/ctx9216/k1 serving (TP1).
ORIGIN_OBSERVED_MODEL = "koni-8b"
ORIGIN_OBSERVED_USED_BYTES = 16_357_785_600


class FitCell(msgspec.Struct, frozen=True):
    """One model/shape/split of the planner output; `result` is None when the shape is rejected."""

    model: str                          # preset name
    batch_size: int                     # decode lanes
    num_blocks: int                     # KV blocks
    max_seq_len: int                    # context
    block_size: int                     # tokens per block
    tensor_parallel: int                # devices
    result: plan.FitResult | None       # the projection, or None when the config is illegal
    rejected: str | None = None         # the ConfigError message when the config is illegal
    max_lora_adapters: dict[int, int] | None = None  # rank -> adapters of that rank that fit
                                          #   (-1: the artifact alone does not fit); None: not asked


#: The weight formats of the quantization table: (label, quantization without the KV choice).
QUANT_FORMATS: tuple[tuple[str, Quantization | None], ...] = (
    ("fp16", None),
    ("w8a16", Quantization(weights="int8")),
    ("w4a16", Quantization(weights="int4")),
    ("fp8", Quantization(weights="fp8", activations="fp8")),
)
QUANT_KV = ("bf16", "fp8")
QUANT_MAX_BATCH = 1024  # the largest B the quantization table tries
# Origin issue: KONI native ATOM B1/k1, 8192 in / 128 out, c16 (PR #266 evidence f1d9117).
ORIGIN_B1_TOK_S = 7.7847
ORIGIN_B1_MAX_FIRST_S = 253.93


class QuantCell(msgspec.Struct, frozen=True):
    """One model x weight format x KV dtype of the quantization table."""

    model: str                          # preset name
    weights: str                        # "fp16" | "w8a16" | "w4a16" | "fp8"
    kv: str                             # "bf16" | "fp8"
    artifact: str | None                # `bench serve --artifacts` spec of the largest fit, or None
    batch_size: int                     # largest B that fits (0: none; QUANT_MAX_BATCH: at least)
    num_blocks: int                     # its k
    result: plan.FitResult | None       # the projection of that artifact
    serve_batch_size: int = 0           # B the projection ran at (min(B, concurrency))
    serve_artifact: str | None = None   # its `bench serve --artifacts` spec
    output_tok_s: float | None = None   # simulator, c16 8192/128, every generated token / makespan
    max_first_token_s: float | None = None  # latest first token over every request (origin style)
    timeouts: int | None = None         # requests over the 180 s timeout
    note: str = ""                      # e.g. a quantization optimum-rbln 0.12 does not accept


class FitReport(msgspec.Struct, frozen=True):
    """What `--json` writes: every parameter, the commit and machine, and each cell."""

    command: str
    params: dict[str, object]
    commit: str | None
    machine: str
    cells: list[FitCell]
    quant_cells: list[QuantCell] = msgspec.field(default_factory=list)


def origin_observed_artifact(max_seq_len: int = ORIGIN_CONTEXT) -> ArtifactConfig:
    """The KONI B1/k1 artifact the origin issue's device-use figure was measured on."""
    return ArtifactConfig(model=ModelSpec.preset(ORIGIN_OBSERVED_MODEL), batch_size=1,
                          max_seq_len=max_seq_len, block_size=max_seq_len, num_blocks=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m atombatch.bench fit",
        description="Exact KV-cache bytes and device-memory fit of a compiled ATOM artifact.")
    parser.add_argument("--model", choices=sorted(PRESETS), help="preset model; omit for the table")
    parser.add_argument("--table", action="store_true",
                        help="table of the four origin models at B1/k1, B1/k3, B1/k5 and "
                             "B4/k5, on one and two devices")
    parser.add_argument("--batch-size", type=int, default=1, help="decode lanes B (default 1)")
    parser.add_argument("--max-seq-len", type=int, default=ORIGIN_CONTEXT,
                        help=f"context length (default {ORIGIN_CONTEXT})")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size (default: max-seq-len, i.e. eager)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks (default: lanes + 1 rule, B * blocks_per_seq + 1)")
    parser.add_argument("--prefill-chunk-size", type=int, default=128)
    parser.add_argument("--tensor-parallel", type=int, default=1, help="devices (default 1)")
    parser.add_argument("--kv-dtype", default="bfloat16")
    quant = parser.add_argument_group(
        "quantization (optimum-rbln 0.12's `quantization` block; docs/planning.md)")
    quant.add_argument("--weights", choices=QUANT_WEIGHTS, default=None,
                       help="weight format of the projections (default fp16: not quantized)")
    quant.add_argument("--activations", choices=QUANT_ACTIVATIONS, default=None,
                       help="activation format (static int8/fp8 stores an input scale)")
    quant.add_argument("--kv-caches", choices=QUANT_KV_CACHES, default=None,
                       help="fp8: float8_e4m3fn KV caches, one byte per element")
    parser.add_argument("--device-bytes", type=int, default=plan.ATOM_DEVICE_BYTES,
                        help=f"capacity of one device (default {plan.ATOM_DEVICE_BYTES:,})")
    parser.add_argument("--runtime-overhead-bytes", type=int,
                        default=plan.DEFAULT_RUNTIME_OVERHEAD_BYTES,
                        help="allowance added to weights + KV when nothing was observed "
                             f"(default {plan.DEFAULT_RUNTIME_OVERHEAD_BYTES:,})")
    parser.add_argument("--observed-used-bytes", type=int, default=None,
                        help="device bytes in use measured while serving the observed artifact")
    parser.add_argument("--observed-batch-size", type=int, default=1)
    parser.add_argument("--observed-num-blocks", type=int, default=1)
    parser.add_argument("--observed-max-seq-len", type=int, default=None,
                        help="context of the observed artifact (default: --max-seq-len)")
    parser.add_argument("--observed-block-size", type=int, default=None,
                        help="block size of the observed artifact (default: its context)")
    parser.add_argument("--quant-table", action="store_true",
                        help="the four models at --max-seq-len on one device under each weight "
                             "format (fp16, w8a16, w4a16, fp8) and KV dtype (bf16, fp8): the "
                             "largest B that fits and the simulator's c16 --input-len/--output-len "
                             "throughput and max first token there (docs/planning.md)")
    parser.add_argument("--input-len", type=int, default=8192,
                        help="--quant-table: prompt tokens of the projection (default 8192)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="--quant-table: generated tokens of the projection (default 128)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="--quant-table: clients of the projection (default 16)")
    parser.add_argument("--no-project", action="store_true",
                        help="--quant-table: the fit only, no simulator run")
    parser.add_argument("--estimate", action="store_true",
                        help="single artifact: use the estimate even where the table uses the "
                             "origin observation (koni-8b, one device, context 9216)")
    lora = parser.add_argument_group(
        "LoRA adapters (compiled into the artifact, optimum-rbln 0.12: every adapter padded to "
        "--max-lora-rank, plus the reserved base adapter 0)")
    lora.add_argument("--lora-count", type=int, default=None,
                      help="user adapters to count beside the KV cache")
    lora.add_argument("--max-lora-rank", type=_ranks, default=None,
                      help="rank every adapter is padded to (optimum-rbln's max_lora_rank); "
                           "prints how many adapters of that rank fit (a comma-separated list: "
                           "of each rank; one rank with --lora-count)")
    lora.add_argument("--lora-target-modules", type=_modules, default=plan.LORA_TARGET_MODULES,
                      help="comma-separated projections the adapters target (default all: "
                           f"{','.join(plan.LORA_TARGET_MODULES)})")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the results as JSON")
    return parser


def _modules(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks"
                                         ) from None
    if not ranks or len(ranks) > 16:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 to 16 ranks")
    if min(ranks) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a rank must be a positive integer")
    return ranks


def cli_quantization(args: argparse.Namespace) -> tuple[Quantization | None, str]:
    """(quantization, kv_dtype) that `--weights` / `--activations` / `--kv-caches` name."""
    fields = {name: value for name, value in (("weights", args.weights),
                                              ("activations", args.activations),
                                              ("kv_caches", args.kv_caches)) if value}
    if not fields:
        return None, args.kv_dtype
    quant = Quantization(**fields)
    return quant, quant.kv_dtype or args.kv_dtype


def lora_plan(args: argparse.Namespace) -> plan.LoraPlan | None:
    """The adapters `--lora-count` / `--max-lora-rank` / `--lora-target-modules` describe."""
    if args.lora_count is None:
        return None
    if args.max_lora_rank is None or len(args.max_lora_rank) != 1:
        raise ConfigError(f"--lora-count={args.lora_count} needs one --max-lora-rank: every "
                          "adapter is padded to it")
    return plan.LoraPlan(count=args.lora_count, max_rank=args.max_lora_rank[0],
                         target_modules=args.lora_target_modules)


def _cell(model: str, batch_size: int, num_blocks: int, max_seq_len: int, block_size: int,
          tensor_parallel: int, args: argparse.Namespace,
          observed: tuple[int, ArtifactConfig] | None) -> FitCell:
    shape = dict(model=model, batch_size=batch_size, num_blocks=num_blocks,
                 max_seq_len=max_seq_len, block_size=block_size, tensor_parallel=tensor_parallel)
    try:
        quant, kv_dtype = cli_quantization(args)
        artifact = ArtifactConfig(model=ModelSpec.preset(model), batch_size=batch_size,
                                  max_seq_len=max_seq_len, block_size=block_size,
                                  num_blocks=num_blocks, prefill_chunk_size=args.prefill_chunk_size,
                                  tensor_parallel=tensor_parallel, kv_dtype=kv_dtype,
                                  quantization=quant)
    except ConfigError as exc:
        return FitCell(**shape, result=None, rejected=str(exc))  # type: ignore[arg-type]
    used, observed_artifact = observed if observed else (None, None)
    result = plan.fit(artifact, device_bytes=args.device_bytes, observed_used_bytes=used,
                      observed_artifact=observed_artifact,
                      runtime_overhead_bytes=args.runtime_overhead_bytes, lora=lora_plan(args))
    adapters = None
    if args.max_lora_rank is not None:
        adapters = {rank: plan.max_lora_adapters(
            artifact, rank, args.lora_target_modules, args.device_bytes, used, observed_artifact,
            runtime_overhead_bytes=args.runtime_overhead_bytes) for rank in args.max_lora_rank}
    return FitCell(**shape, result=result, max_lora_adapters=adapters)  # type: ignore[arg-type]


def table_cells(args: argparse.Namespace) -> list[FitCell]:
    """The table's cells, model by model, TP1 then TP2, in TABLE_SHAPES order."""
    models = (args.model,) if args.model else MODELS
    context = args.max_seq_len
    cells = []
    for model in models:
        for tp in TABLE_TP:
            observed = None
            if model == ORIGIN_OBSERVED_MODEL and tp == 1 and context == ORIGIN_CONTEXT:
                observed = (ORIGIN_OBSERVED_USED_BYTES, origin_observed_artifact())
            for batch_size, num_blocks in TABLE_SHAPES:
                cells.append(_cell(model, batch_size, num_blocks, context, context, tp, args,
                                   observed))
    return cells


def _short_rejection(message: str) -> str:
    if "single-block mode, which a hybrid model" in message:
        return "rejected: hybrid single-block"
    if "lanes+1 rule" in message:
        return "rejected: lanes+1 rule"
    return "rejected"


def format_table(cells: list[FitCell], device_bytes: int, overhead: int) -> str:
    """Fixed-width table, one row per cell, exact bytes per device."""
    header = (f"{'model':<11} {'TP':>2} {'shape':<6} {'KV/device':>15} {'other/device':>15} "
              f"{'projected':>15} {'headroom':>15}  {'verdict':<29} basis")
    lines = [f"Device capacity {device_bytes:,} bytes; context {cells[0].max_seq_len} eager "
             f"(block_size = context); bytes per device.", header, "-" * len(header)]
    previous = None
    for cell in cells:
        if previous is not None and cell.model != previous:
            lines.append("")
        previous = cell.model
        shape = f"B{cell.batch_size}/k{cell.num_blocks}"
        result = cell.result
        if result is None:
            lines.append(f"{cell.model:<11} {cell.tensor_parallel:>2} {shape:<6} {'-':>15} "
                         f"{'-':>15} {'-':>15} {'-':>15}  "
                         f"{_short_rejection(cell.rejected or ''):<29} docs/rules.md")
            continue
        verdict = "fits" if result.fits else "DOES NOT FIT"
        basis = "observed (conditional)" if result.method == "observed" else "estimate"
        lines.append(f"{cell.model:<11} {cell.tensor_parallel:>2} {shape:<6} "
                     f"{result.kv_bytes:>15,} {result.other_bytes:>15,} "
                     f"{result.projected_bytes:>15,} {result.headroom_bytes:>15,}  "
                     f"{verdict:<29} {basis}{_adapters_text(cell)}")
    lines += [
        "",
        "observed (conditional): origin issue, 16,357,785,600 bytes in use at koni-8b "
        "B1/ctx9216/k1 TP1; projected = observed - its KV + this KV, if other allocations stay "
        "unchanged (not a compiler result).",
        f"estimate: weights from the spec (embeddings and norms on every device) + KV + "
        f"{overhead:,} bytes runtime overhead (a stated allowance, not measured).",
        "Eager KV is num_blocks x [kv_heads, context, head_dim] per global layer, so B1/k5 and "
        "B4/k5 differ only in Gemma3's per-lane sliding slots.",
    ]
    cross_check = _estimate_cross_check(device_bytes, overhead)
    if cross_check:
        lines.append(cross_check)
    return "\n".join(lines)


def _adapters_text(cell: FitCell) -> str:
    """`; adapters r16 49, r64 12` when --max-lora-rank was given (-1: none, it does not fit)."""
    if not cell.max_lora_adapters:
        return ""
    return "; adapters " + ", ".join(f"r{rank} {count}" for rank, count in
                                     cell.max_lora_adapters.items())


def format_single(result: plan.FitResult, max_lora_adapters: dict[int, int] | None = None,
                  batch_size: int | None = None) -> str:
    """One artifact in the table's words: KV/device, other/device, projected, headroom, verdict,
    basis (and the adapters, when asked)."""
    lines = [f"{result.label}  identity {result.identity}"]
    for group in result.kv_groups:
        shape = ",".join(str(dim) for dim in group.shape)
        lines.append(f"  {group.count} {plan.DTYPE_LABELS.get(group.dtype, group.dtype)} "
                     f"{group.kind} KV tensors of [{shape}] = {group.total_bytes:,} bytes")
    basis = "observed (conditional)" if result.method == "observed" else "estimate"
    width = max(len(f"{v:,}") for v in (result.kv_bytes, result.other_bytes,
                                         result.projected_bytes, result.headroom_bytes))
    lines += [f"  {'KV/device':<13} {result.kv_bytes:>{width},} bytes",
              f"  {'other/device':<13} {result.other_bytes:>{width},} bytes",
              f"  {'projected':<13} {result.projected_bytes:>{width},} bytes of "
              f"{result.device_bytes:,}",
              f"  {'headroom':<13} {result.headroom_bytes:>{width},} bytes",
              f"  {'verdict':<13} {'fits' if result.fits else 'DOES NOT FIT'}",
              f"  {'basis':<13} {basis}",
              f"  {'how':<13} {result.basis}"]
    if result.lora is not None:
        lines.insert(3, f"  {'LoRA':<13} {result.lora_bytes:>{width},} bytes, inside other "
                        f"({result.lora.count} adapters + the reserved base, padded to rank "
                        f"{result.lora.max_rank}, {','.join(result.lora.target_modules)})")
    for rank, count in (max_lora_adapters or {}).items():
        fits_text = "none: the artifact alone does not fit" if count < 0 else f"{count}"
        lines.append(f"  {'adapters':<13} rank {rank} adapters that fit beside "
                     f"{batch_size} lanes: {fits_text}")
    return "\n".join(lines)


def _estimate_cross_check(device_bytes: int, overhead: int) -> str:
    """How the estimate compares with the one observation (KONI B1/k1 TP1)."""
    observed = origin_observed_artifact()
    estimate = plan.fit(observed, device_bytes=device_bytes, runtime_overhead_bytes=overhead)
    over = estimate.projected_bytes - ORIGIN_OBSERVED_USED_BYTES
    return (f"cross-check: the estimate for {observed.label} is {estimate.projected_bytes:,} "
            f"bytes, {over:,} {'above' if over >= 0 else 'below'} the observed "
            f"{ORIGIN_OBSERVED_USED_BYTES:,} (verdict "
            f"{'fits' if estimate.fits else 'DOES NOT FIT'}, yet it runs): the device holds less "
            "than the full BF16 weights, so estimate verdicts err towards 'does not fit'.")


def _quantization(base: Quantization | None, kv: str) -> tuple[Quantization | None, str]:
    """(quantization, kv_dtype) of a table cell: the weight format with bf16 or fp8 KV."""
    if kv == "bf16":
        return base, "bfloat16"
    if base is None:
        return Quantization(kv_caches="fp8"), FP8_KV_DTYPE
    return msgspec.structs.replace(base, kv_caches="fp8"), FP8_KV_DTYPE


def _fit_at(model: str, batch_size: int, num_blocks: int, quant: Quantization | None,
            kv_dtype: str, args: argparse.Namespace) -> plan.FitResult | None:
    context = args.max_seq_len
    try:
        artifact = ArtifactConfig(model=ModelSpec.preset(model), batch_size=batch_size,
                                  max_seq_len=context, block_size=context,
                                  num_blocks=num_blocks,
                                  prefill_chunk_size=args.prefill_chunk_size,
                                  quantization=quant, kv_dtype=kv_dtype)
    except ConfigError:
        return None  # e.g. single-block mode on a hybrid model
    used, observed = None, None
    if model == ORIGIN_OBSERVED_MODEL and context == ORIGIN_CONTEXT:
        used, observed = ORIGIN_OBSERVED_USED_BYTES, origin_observed_artifact()
    return plan.fit(artifact, device_bytes=args.device_bytes, observed_used_bytes=used,
                    observed_artifact=observed,
                    runtime_overhead_bytes=args.runtime_overhead_bytes)


def _spec_text(batch_size: int, num_blocks: int, quant: Quantization | None) -> str:
    parts = [f"B{batch_size}", f"k{num_blocks}"]
    if quant is not None:
        if quant.weights != "fp16":
            parts.append(f"w{quant.weights}")
        if quant.activations != "fp16":
            parts.append(f"a{quant.activations}")
        if quant.kv_caches == "fp8":
            parts.append("kvfp8")
    return "/".join(parts)


def quant_cells(args: argparse.Namespace) -> list[QuantCell]:
    """The quantization table: per model, weight format and KV dtype, the largest B that fits
    (k = B + 1, eager; B1/k1 single-block when only that fits) and, unless `--no-project`, the
    simulator's projection at min(B, concurrency)."""
    from atombatch.bench.serve.matrix import POLICIES, Load, run_cell

    models = (args.model,) if args.model else MODELS
    cells = []
    for model in models:
        for label, base in QUANT_FORMATS:
            for kv in QUANT_KV:
                quant, kv_dtype = _quantization(base, kv)
                note = ("optimum-rbln 0.12 refuses weights=fp16 with activations=fp16, so fp8 KV "
                        "needs int8/fp8 activations" if base is None and kv == "fp8" else "")
                best: tuple[int, int, plan.FitResult] | None = None
                for batch_size in range(1, QUANT_MAX_BATCH + 1):
                    result = _fit_at(model, batch_size, batch_size + 1, quant, kv_dtype, args)
                    if result is None or not result.fits:
                        break
                    best = (batch_size, batch_size + 1, result)
                if best is None:
                    single = _fit_at(model, 1, 1, quant, kv_dtype, args)
                    if single is not None and single.fits:
                        best = (1, 1, single)
                if best is None:
                    cells.append(QuantCell(model=model, weights=label, kv=kv, artifact=None,
                                           batch_size=0, num_blocks=0, result=None, note=note))
                    continue
                batch_size, num_blocks, result = best
                spec = _spec_text(batch_size, num_blocks, quant)
                cell = QuantCell(model=model, weights=label, kv=kv, artifact=spec,
                                 batch_size=batch_size, num_blocks=num_blocks, result=result,
                                 note=note)
                if not args.no_project:
                    serve_b = min(batch_size, args.concurrency)
                    serve_k = num_blocks if serve_b == batch_size else serve_b + 1
                    serve_spec = _spec_text(serve_b, serve_k, quant)
                    ran = run_cell(model, "native", args.input_len, args.output_len, serve_spec,
                                   POLICIES[0], load=Load(concurrency=args.concurrency),
                                   context=args.max_seq_len, chunk=args.prefill_chunk_size,
                                   ignore_fit=True, device_bytes=args.device_bytes)
                    cell = msgspec.structs.replace(
                        cell, serve_batch_size=serve_b, serve_artifact=serve_spec,
                        output_tok_s=ran.output_tok_s if ran.status == "ok" else None,
                        max_first_token_s=ran.max_first_token_all, timeouts=ran.timeouts)
                cells.append(cell)
    return cells


def format_quant_table(cells: list[QuantCell], args: argparse.Namespace) -> str:
    """One row per model x weight format x KV dtype."""
    header = (f"{'model':<11} {'weights':<7} {'KV':<4} {'largest fit':<12} {'weights/device':>15} "
              f"{'KV/device':>15} {'headroom':>15}  {'c16 run at':<22} {'tok/s':>7} "
              f"{'max 1st s':>9} {'t/o':>3}")
    lines = [f"Largest B (k = B + 1, eager; B1/k1 single-block when only it fits) on one device of "
             f"{args.device_bytes:,} bytes at context {args.max_seq_len}; simulator projection: "
             f"c{args.concurrency} {args.input_len}/{args.output_len}, native, stall-free:8, "
             "at min(B, clients) lanes.", header, "-" * len(header)]
    previous = None
    for cell in cells:
        if previous is not None and cell.model != previous:
            lines.append("")
        previous = cell.model
        result = cell.result
        if result is None:
            lines.append(f"{cell.model:<11} {cell.weights:<7} {cell.kv:<4} {'none':<12}")
            continue
        shape = f"B{cell.batch_size}/k{cell.num_blocks}"
        if cell.batch_size == QUANT_MAX_BATCH:
            shape = ">=" + shape
        run = (f"{cell.serve_artifact:<22} {cell.output_tok_s or 0.0:>7.2f} "
               f"{cell.max_first_token_s or 0.0:>9.2f} {cell.timeouts:>3}"
               if cell.serve_artifact else "")
        mark = " *" if cell.note else ""
        lines.append(f"{cell.model:<11} {cell.weights:<7} {cell.kv + mark:<4} {shape:<12} "
                     f"{result.weight_bytes:>15,} {result.kv_bytes:>15,} "
                     f"{result.headroom_bytes:>15,}  {run}")
    lines += ["",
              f"origin reference: koni-8b B1/k1 bf16, native ATOM, c16 8192/128: "
              f"{ORIGIN_B1_TOK_S} tok/s, max first SSE {ORIGIN_B1_MAX_FIRST_S} s (the simulator "
              "is calibrated to it).",
              "koni-8b is projected from the origin observation (16,357,785,600 bytes in use at "
              "B1/k1 bf16: its KV and weights swapped for the cell's); the others by weights + KV "
              f"+ {args.runtime_overhead_bytes:,} bytes overhead.",
              "* fp16 weights with fp8 KV: optimum-rbln 0.12 refuses weights=fp16 with "
              "activations=fp16; compile it with int8/fp8 activations (same bytes)."]
    return "\n".join(lines)


def _params(args: argparse.Namespace) -> dict[str, object]:
    return {key: (str(value) if isinstance(value, Path) else value)
            for key, value in sorted(vars(args).items())}


def main(argv: list[str] | None = None) -> int:
    """Run the planner; exit status 0 fits (or table printed), 1 does not fit, 2 config error."""
    parser = _parser()
    args = parser.parse_args(argv)
    table = args.table or args.model is None
    try:
        lora_plan(args)
        cli_quantization(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    quant: list[QuantCell] = []
    if args.quant_table:
        quant = quant_cells(args)
        print(format_quant_table(quant, args))
        cells: list[FitCell] = []
        status = 0
    elif table:
        cells = table_cells(args)
        print(format_table(cells, args.device_bytes, args.runtime_overhead_bytes))
        status = 0
    else:
        context = args.max_seq_len
        block_size = args.block_size or context
        num_blocks = args.num_blocks
        if num_blocks is None and block_size > 0:
            num_blocks = args.batch_size * (context // block_size) + 1
        observed = None
        try:
            if args.observed_used_bytes is None and not args.estimate and \
                    args.model == ORIGIN_OBSERVED_MODEL and args.tensor_parallel == 1 and \
                    context == ORIGIN_CONTEXT:
                observed = (ORIGIN_OBSERVED_USED_BYTES, origin_observed_artifact())
            elif args.observed_used_bytes is not None:
                observed_context = args.observed_max_seq_len or context
                observed_artifact = ArtifactConfig(
                    model=ModelSpec.preset(args.model), batch_size=args.observed_batch_size,
                    max_seq_len=observed_context,
                    block_size=args.observed_block_size or observed_context,
                    num_blocks=args.observed_num_blocks,
                    prefill_chunk_size=args.prefill_chunk_size,
                    tensor_parallel=args.tensor_parallel, kv_dtype=args.kv_dtype)
                observed = (args.observed_used_bytes, observed_artifact)
            cell = _cell(args.model, args.batch_size, num_blocks, context, block_size,
                         args.tensor_parallel, args, observed)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if cell.result is None:
            print(f"error: {cell.rejected}", file=sys.stderr)
            return 2
        print(format_single(cell.result, cell.max_lora_adapters, cell.batch_size))
        cells = [cell]
        status = 0 if cell.result.fits else 1

    if args.json is not None:
        report = FitReport(command="fit", params=_params(args), commit=provenance.git_commit(),
                           machine=f"{platform.node()} {platform.platform()}", cells=cells,
                           quant_cells=quant)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
