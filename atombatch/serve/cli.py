"""`python -m atombatch.serve`: one artifact behind an OpenAI-compatible HTTP/SSE server.

    python -m atombatch.serve                          # NumPy runtime, built-in random tiny spec
    python -m atombatch.serve --model /path/to/hf-checkpoint --batch-size 4 --max-seq-len 2048
    python -m atombatch.serve --runtime rebel --model koni-8b --batch-size 4 --max-seq-len 9216 \\
        --num-blocks 5 --compiled-dir /var/cache/atombatch

Without `--model` the NumPy runtime runs `DEFAULT_SPEC` (a 2-layer Llama-family model with random
weights, seeded by `--seed`, vocab 1024) so the server, the clients and the benchmark work without
a checkpoint. `--model` takes a Hugging Face checkpoint directory (config.json + safetensors; a
`tokenizer.json` next to it is used for text) or, with `--runtime rebel`, a preset name.

The artifact is built from the shape flags; `--block-size` defaults to the context (eager: one block
per sequence) and `--num-blocks` to lanes x blocks-per-sequence + 1 (DESIGN §3's general rule).
Configuration errors (a broken §3 rule, a missing SDK) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from atombatch.config import PRESETS, ArtifactConfig, ModelSpec
from atombatch.engine import Batcher
from atombatch.errors import ConfigError
from atombatch.serve.tokens import Codec, HFCodec

DEFAULT_SPEC = ModelSpec(
    name="atombatch-tiny", family="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, bos_token_id=1, eos_token_ids=(2,),
    dtype="float32")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atombatch.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face checkpoint dir (or a preset name with "
                   f"--runtime rebel: {', '.join(sorted(PRESETS))}); default: the built-in "
                   "random tiny spec on the NumPy runtime")
    p.add_argument("--runtime", choices=("numpy", "rebel"), default="numpy")
    p.add_argument("--tokenizer", help="dir with tokenizer.json (default: the --model dir if it "
                   "has one; none: token-id text)")
    p.add_argument("--served-model-name", help="id at /v1/models (default: the spec's name)")
    p.add_argument("--compiled-dir", help="RebelRuntime: root of the compiled-artifact cache")
    p.add_argument("--device", default="0",
                   help="RebelRuntime: ATOM device index, or a comma list for tensor parallel")
    p.add_argument("--batch-size", type=int, default=4, help="decode lanes B (default 4)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="context (default 1024)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: --max-seq-len)")
    p.add_argument("--num-blocks", type=int, help="KV blocks (default: B x blocks/seq + 1)")
    p.add_argument("--prefill-chunk-size", type=int, default=128)
    p.add_argument("--policy", default="prefill-first",
                   help="prefill-first | decode-first | interleave:N")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queue bound: requests without a lane past it answer 429 (default 256)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="keep finished sequences' KV for requests sharing a prefix")
    p.add_argument("--host-cache-bytes", type=int, default=0,
                   help="host memory for KV blocks evicted from the prefix cache (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random weights and engine sampling seed")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads for the NumPy runtime (default 1; 0 leaves the library's "
                   "default). OpenBLAS threads spin between calls and starve the event loop")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def build_engine(args: argparse.Namespace) -> tuple[Batcher, str, Codec | None]:
    """The `Batcher`, served model name and tokenizer that the flags describe.

    Raises:
        ConfigError: a rule of DESIGN §3 is broken, the checkpoint is unusable, or the rebel SDK
            (or `RebelRuntime`) is not available.
    """
    model_dir = Path(args.model) if args.model and Path(args.model).is_dir() else None
    if model_dir is not None:
        spec = ModelSpec.from_pretrained(model_dir)
    elif args.model:
        if args.runtime == "numpy" and args.model.lower() in PRESETS:
            raise ConfigError(f"--model {args.model}: the NumPy runtime needs weights; give a "
                              "checkpoint directory (presets are for --runtime rebel)")
        spec = ModelSpec.preset(args.model)
    else:
        spec = DEFAULT_SPEC
    block_size = args.block_size or args.max_seq_len
    bps = args.max_seq_len // block_size if block_size else 0
    num_blocks = args.num_blocks or args.batch_size * max(bps, 1) + 1
    artifact = ArtifactConfig(model=spec, batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                              block_size=block_size, num_blocks=num_blocks,
                              prefill_chunk_size=min(args.prefill_chunk_size, args.max_seq_len),
                              tensor_parallel=len(str(args.device).split(","))
                              if args.runtime == "rebel" else 1)
    runtime: Any
    if args.runtime == "rebel":
        runtime = _rebel_runtime(artifact, args)
    else:
        from atombatch.runtime.numpy_runtime import NumpyRuntime
        if model_dir is not None:
            runtime = NumpyRuntime.from_pretrained(model_dir, artifact=artifact)
        else:
            runtime = NumpyRuntime.random(artifact, seed=args.seed)
    batcher = Batcher(runtime, policy=args.policy, seed=args.seed, max_waiting=args.max_waiting,
                      prefix_cache=args.prefix_cache, host_cache_bytes=args.host_cache_bytes)
    tokenizer_dir = args.tokenizer or model_dir
    codec = HFCodec.from_dir(tokenizer_dir) if tokenizer_dir else None
    if args.tokenizer and codec is None:
        raise ConfigError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    return batcher, args.served_model_name or spec.name, codec


def _rebel_runtime(artifact: ArtifactConfig, args: argparse.Namespace) -> Any:
    """`RebelRuntime` on the artifact's own compiled-cache folder (imported lazily: rebel-sdk)."""
    try:
        from atombatch.runtime.rebel import RebelRuntime
    except ImportError:
        raise ConfigError("--runtime rebel: this build of atombatch has no RebelRuntime; "
                          "use --runtime numpy") from None
    if not args.compiled_dir:
        raise ConfigError("--runtime rebel needs --compiled-dir: the root of the compiled-artifact "
                          f"cache (graphs are read from {artifact.compiled_cache_dir('<root>')})")
    devices = [int(d) for d in str(args.device).split(",")]
    return RebelRuntime.from_cache_dir(artifact, args.compiled_dir,
                                       device=devices[0] if len(devices) == 1 else devices)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    try:
        batcher, name, codec = build_engine(args)
    except ConfigError as exc:
        print(f"atombatch.serve: {exc}", file=sys.stderr)
        return 2
    if args.runtime == "numpy" and args.blas_threads > 0:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=args.blas_threads, user_api="blas")
    import uvicorn

    from atombatch.serve.app import create_app
    app = create_app(batcher, name, codec)
    art = batcher.artifact
    print(f"atombatch.serve: {art.label} ({args.runtime}, policy {batcher.policy.label}, "
          f"tokenizer {'tokenizers' if codec else 'ids'}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    # timeout_graceful_shutdown=None: on SIGINT/SIGTERM uvicorn stops accepting and waits for
    # in-flight streams; then the lifespan drains the engine (AsyncBatcher.close(drain=True)).
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=None)
    return 0
