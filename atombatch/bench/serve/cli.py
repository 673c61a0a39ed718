"""`python -m atombatch.bench serve`: the matrix from the command line."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from atombatch.artifact import plan
from atombatch.bench.plot import require_matplotlib
from atombatch.bench.serve.matrix import (
    ARTIFACTS,
    CHUNK,
    CONCURRENCY,
    CONTEXT,
    INPUTS,
    MODELS,
    NUMPY_CHUNK,
    NUMPY_CONTEXT,
    NUMPY_INPUTS,
    NUMPY_OUTPUTS,
    OUTPUTS,
    POLICIES,
    TIMEOUT_S,
    Load,
    run,
)
from atombatch.bench.serve.report import format_table, write_plot
from atombatch.errors import ConfigError
from atombatch.runtime.sim import PD_HEADERS, ROUTES, CostModel


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    return parse


def _artifact_list(text: str) -> list[str]:
    """Comma-separated artifact specs; a comma inside `dbs1,2,4` stays with its artifact (a comma
    followed by a digit continues a bucket list; a new spec starts with a part name, in any
    order, like `parse_artifact` takes them)."""
    return [part.strip() for part in re.split(r",(?!\s*\d)", text) if part.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m atombatch.bench serve",
        description="Serving matrix (models x routes x inputs x outputs x artifacts x policies) on "
                    "the calibrated simulator, or on the NumPy runtime with small specs.")
    parser.add_argument("--models", type=_csv(str), default=None,
                        help=f"comma list (default {','.join(MODELS)})")
    parser.add_argument("--routes", type=_csv(str), default=None,
                        help=f"comma list of {','.join(ROUTES)} (default all; numpy: native)")
    parser.add_argument("--inputs", type=_csv(int), default=None,
                        help=f"prompt lengths (default {','.join(map(str, INPUTS))}; numpy "
                             f"{','.join(map(str, NUMPY_INPUTS))})")
    parser.add_argument("--outputs", type=_csv(int), default=None,
                        help=f"output lengths (default {','.join(map(str, OUTPUTS))}; numpy "
                             f"{','.join(map(str, NUMPY_OUTPUTS))})")
    parser.add_argument("--artifacts", type=_artifact_list, default=None,
                        help="Bn/kn[/ctxN][/bsN][/tpN][/dbsN,M,...] list, dbs = compiled decode "
                             f"batch sizes (default {','.join(ARTIFACTS)})")
    parser.add_argument("--policies", type=_csv(str), default=None,
                        help=f"scheduling policies (default {','.join(POLICIES)})")
    parser.add_argument("--context", type=int, default=None,
                        help=f"context of every artifact (default {CONTEXT}; numpy {NUMPY_CONTEXT})")
    parser.add_argument("--chunk", type=int, default=None,
                        help=f"prefill chunk size (default {CHUNK}; numpy {NUMPY_CHUNK})")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="clients (default 16)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in total (default: one per client)")
    parser.add_argument("--arrivals", choices=("together", "poisson"), default="together")
    parser.add_argument("--rate", type=float, default=None, help="poisson arrivals per second")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help="seconds after arrival; later completions are failures (default 180;"
                             " 0 = none)")
    parser.add_argument("--timeout-action", choices=("count", "abort"), default="count",
                        help="count: fail late requests after the fact (default); abort: the "
                             "client gives up and the request is aborted, freeing its lane")
    parser.add_argument("--ignore-fit", action="store_true",
                        help="also run artifacts that plan.fit says do not fit (marked *)")
    parser.add_argument("--device-bytes", type=int, default=plan.ATOM_DEVICE_BYTES)
    parser.add_argument("--runtime", choices=("sim", "numpy"), default="sim")
    parser.add_argument("--costs", type=Path, default=None, metavar="PATH",
                        help="cost model JSON (CostModel.save); default: the origin calibration")
    parser.add_argument("--save-costs", type=Path, default=None, metavar="PATH",
                        help="write the cost model used as JSON")
    parser.add_argument("--per-lane-fraction", type=float, default=None,
                        help="decode cost of each lane past the first, x weight streaming "
                             "(default 0.05; recalibrates)")
    parser.add_argument("--idle-lane-fraction", type=float, default=None,
                        help="cost of a padded idle lane relative to a decoding lane's share "
                             "(default 1.0)")
    parser.add_argument("--producer-speed", type=float, default=None,
                        help="PD producer prefill speed relative to the ATOM (default 1.0)")
    parser.add_argument("--transfer-bandwidth", type=float, default=None,
                        help="PD KV transfer bytes/s (default 12e9)")
    parser.add_argument("--import-bandwidth", type=float, default=None,
                        help="PD decoder-side KV write bytes/s per device (default 32e9)")
    parser.add_argument("--import-call-s", type=float, default=None,
                        help="PD decoder-side seconds per imported layer (default 2e-4)")
    parser.add_argument("--pd-header", choices=PD_HEADERS, default=None,
                        help="layer-stream: the header (first token) arrives when the producer's "
                             "prefill ends (first-token, default) or when it starts "
                             "(producer-start, a what-if)")
    parser.add_argument("--pd-timeout", type=float, default=0.0,
                        help="the Batcher's pd_timeout in seconds (default 0 = none: a simulated "
                             "producer never stalls)")
    parser.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                        help="a mix of LoRA adapters (simulator): --lora-share of the requests "
                        "run under N adapters in turn, the rest the base model; each distinct "
                        "adapter of a step costs its matrices once (docs/lora.md, \"Measuring "
                        "adapters\"; default 0: the base model only)")
    parser.add_argument("--lora-rank", type=int, default=16, metavar="R",
                        help="the adapters' rank, on every linear layer (default 16)")
    parser.add_argument("--lora-share", type=float, default=1.0, metavar="S",
                        help="the share of requests under an adapter, in (0, 1] (default 1)")
    parser.add_argument("--max-loras", type=int, default=None, metavar="M",
                        help="distinct adapters one step may hold (vLLM's --max-loras; default: "
                        "no cap)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="PNG of the headline comparisons, one file per policy: TTFT p99, "
                             "completion max and tok/s of every model and artifact at the "
                             "longest prompt and output, and the first model across prompt "
                             "lengths and routes (needs the plot extra: matplotlib, checked "
                             "before the run)")
    parser.add_argument("--plot-grid", type=Path, default=None, metavar="PATH",
                        help="PNG of every request's TTFT and completion time: every model, "
                             "route, input, output and artifact as box plots, one file per "
                             "policy")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (default: a bar on a terminal, else one "
                             "line per finished cell with elapsed and remaining time)")
    return parser


def _check_writable(path: Path) -> None:
    """Fail before the run when an output file cannot be written."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create its folder ({exc.strerror})") from None
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{path}: not writable (checked before the run)")


def _costs_from_args(args: argparse.Namespace) -> CostModel:
    from atombatch.runtime.sim import calibrate
    costs = CostModel.load(args.costs) if args.costs is not None else CostModel.default()
    priors = {name: value for name, value in (
        ("per_lane_fraction", args.per_lane_fraction),
        ("idle_lane_fraction", args.idle_lane_fraction)) if value is not None}
    if priors:  # lane priors do not change the B1 fit, but recalibrate to record them
        kept = {f: getattr(costs, f) for f in ("decode_call_s", "prefill_call_s",
                                               "bill_padded_chunk", "tp_sync_s_per_layer")}
        figures = costs.calibration.figures if costs.calibration else None
        costs = calibrate(figures, **kept, **priors) if figures else \
            msgspec.structs.replace(costs, **priors)
    pd = {name: value for name, value in (
        ("producer_speed", args.producer_speed), ("transfer_bandwidth", args.transfer_bandwidth),
        ("import_bandwidth", args.import_bandwidth), ("import_call_s", args.import_call_s),
        ("pd_header", args.pd_header)) if value is not None}
    return msgspec.structs.replace(costs, **pd) if pd else costs


def main(argv: list[str] | None = None) -> int:
    """Run the matrix from the command line; returns 0, or 2 on a configuration error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    numpy_runtime = args.runtime == "numpy"
    try:
        if args.plot is not None or args.plot_grid is not None:
            require_matplotlib()
        for path in (args.json, args.plot, args.plot_grid):
            if path is not None:
                _check_writable(path)
        costs = None if numpy_runtime else _costs_from_args(args)
        if costs is not None and args.save_costs is not None:
            costs.save(args.save_costs)
        load = Load(concurrency=args.concurrency, requests=args.requests, arrivals=args.arrivals,
                    rate=args.rate, timeout_s=args.timeout or None,
                    timeout_action=args.timeout_action, seed=args.seed,
                    pd_timeout_s=args.pd_timeout or None, lora_adapters=args.lora_adapters,
                    lora_rank=args.lora_rank, lora_share=args.lora_share,
                    max_loras=args.max_loras)
        report = run(
            models=args.models or MODELS,
            routes=args.routes or (("native",) if numpy_runtime else ROUTES),
            inputs=args.inputs or (NUMPY_INPUTS if numpy_runtime else INPUTS),
            outputs=args.outputs or (NUMPY_OUTPUTS if numpy_runtime else OUTPUTS),
            artifacts=args.artifacts or ARTIFACTS, policies=args.policies or POLICIES,
            runtime=args.runtime, costs=costs, load=load,
            context=args.context or (NUMPY_CONTEXT if numpy_runtime else CONTEXT),
            chunk=args.chunk or (NUMPY_CHUNK if numpy_runtime else CHUNK),
            ignore_fit=args.ignore_fit, device_bytes=args.device_bytes,
            progress=not args.no_progress, argv=argv)
    except (ConfigError, OSError, msgspec.DecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    try:
        for target, grid in ((args.plot, False), (args.plot_grid, True)):
            for path in write_plot(report, target, grid=grid) if target is not None else ():
                print(f"plot: {path}", file=sys.stderr)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
