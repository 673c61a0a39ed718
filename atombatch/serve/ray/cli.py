"""`python -m atombatch.serve.ray`: start an application (or resize a running one's PD pool).

    python -m atombatch.serve.ray --replicas 2                 # local Ray, NumPy runtime
    python -m atombatch.serve.ray --replicas 8 --atom-resource ATOM --runtime rebel \\
        --model /models/koni-8b-rbln --device 0,1 --address auto   # an existing Ray cluster

An ingress computes the prompt's prefix digests and a router sends each request to the decode
replica (one `AsyncBatcher` per device) that holds the longest prefix, within a bound on lane
imbalance; `--producers M` adds M PD producer actors the replicas prefill on. How it works:
docs/cluster.md ("What runs where", "The router", "PD pools").
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

import ray
from ray import serve

from atombatch import logs
from atombatch.cluster.routing import DEFAULT_ROUTE_BLOCK
from atombatch.errors import ConfigError
from atombatch.serve.ray.app import build_app
from atombatch.serve.ray.board import DEFAULT_APP
from atombatch.serve.ray.producers import scale_producers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m atombatch.serve.ray", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is passed to each replica's engine: see "
               "`python -m atombatch.serve --help`.")
    p.add_argument("--replicas", type=int, default=2, help="decode replicas (default 2)")
    p.add_argument("--atom-resource", help="custom Ray resource naming one device, e.g. ATOM "
                   "(start nodes with `ray start --resources '{\"ATOM\": 8}'`)")
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--producers", type=int, default=0, help="PD producer actors (default 0)")
    p.add_argument("--pd", action="store_true",
                   help="replicas use PD producers even if --producers is 0 (added later with "
                   "--scale-producers)")
    p.add_argument("--scale-producers", type=int, metavar="M",
                   help="do not start an application: make the running application --app-name "
                   "(on --address) have M PD producers, then exit; the engine flags describe "
                   "new producers")
    p.add_argument("--max-imbalance", type=int, default=4,
                   help="requests a replica may hold beyond the least loaded one and still win "
                   "on prefix affinity (default 4)")
    p.add_argument("--route-block", type=int, default=DEFAULT_ROUTE_BLOCK,
                   help=f"tokens per routing digest (default {DEFAULT_ROUTE_BLOCK})")
    p.add_argument("--router", choices=("prefix", "default"), default="prefix",
                   help="prefix: atombatch's router (default); default: Ray Serve's own")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument("--num-cpus", type=int, help="local Ray only: CPUs to give it")
    p.add_argument("--app-name", default=DEFAULT_APP)
    return p


def main(argv: list[str] | None = None) -> int:
    from atombatch.serve import lora, vllm_flags
    from atombatch.serve.cli import parser as engine_parser

    args, engine_args = _parser().parse_known_args(argv)
    engine = engine_parser().parse_args(engine_args)
    try:  # the plain server's LoRA checks, before Ray starts (each replica runs them again)
        lora.check_lora_flags(engine, engine.served_model_name)
    except ConfigError as exc:
        print(f"atombatch.serve.ray: {exc}", file=sys.stderr)
        return 2
    # resolved here (a terminal: console), and handed to every replica and producer, whose own
    # standard error is a file Ray forwards to this one
    engine.log_format = logs.setup(engine.log_level, engine.log_format)
    for flag, why in vllm_flags.warnings(engine).items():
        logs.log.warning("flag.ignored", flag=flag, reason=why)
    engine_args = [*engine_args, "--log-format", engine.log_format]
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus)
    try:
        return _run(args, engine, engine_args)
    finally:
        # A SIGTERM (see `_run`) unwinds to here like Ctrl-C: the local cluster this process
        # started stops with it (its dashboard and runtime-env agents too, not left at PPID 1).
        if not args.address:
            with contextlib.suppress(Exception):
                ray.shutdown()


def _run(args: argparse.Namespace, engine: argparse.Namespace, engine_args: list[str]) -> int:
    import signal

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    if args.scale_producers is not None:
        try:
            names = scale_producers(args.app_name, args.scale_producers, engine_args,
                                    replica_cpus=args.replica_cpus,
                                    atom_resource=args.atom_resource)
        except ConfigError as exc:
            print(f"atombatch.serve.ray: {exc}", file=sys.stderr)
            return 2
        print(f"atombatch.serve.ray: {args.app_name} has {len(names)} PD producers: "
              f"{', '.join(names) or '-'}", file=sys.stderr)
        return 0
    serve.start(http_options={"host": engine.host, "port": engine.port})
    try:
        app = build_app(engine_args, replicas=args.replicas, atom_resource=args.atom_resource,
                        replica_cpus=args.replica_cpus, producers=args.producers,
                        max_imbalance=args.max_imbalance, route_block=args.route_block,
                        app_name=args.app_name, router=args.router,
                        pd=args.pd or args.producers > 0)
    except ConfigError as exc:
        print(f"atombatch.serve.ray: {exc}", file=sys.stderr)
        return 2
    serve.run(app, name=args.app_name, route_prefix="/")
    print(f"atombatch.serve.ray: {args.replicas} replicas"
          f"{f', {args.producers} PD producers' if args.producers else ''} on "
          f"http://{engine.host}:{engine.port} (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(Exception):
            scale_producers(args.app_name, 0, drain_s=5.0, settle_s=0.0)
        serve.shutdown()
    return 0
