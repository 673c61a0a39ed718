"""`python -m atombatch.serve`: one artifact behind an OpenAI-compatible HTTP/SSE server.

    python -m atombatch.serve                          # NumPy runtime, built-in random tiny spec
    python -m atombatch.serve --model /path/to/hf-checkpoint --batch-size 4 --max-seq-len 2048
    python -m atombatch.serve --runtime rebel --model /path/to/optimum-rbln-compiled-dir

Without `--model` the NumPy runtime runs `DEFAULT_SPEC` (a 2-layer Llama-family model with random
weights, seeded by `--seed`, vocab 1024) so the server, the clients and the benchmark work without
a checkpoint. `--model` takes a Hugging Face checkpoint directory (config.json + safetensors; a
`tokenizer.json` next to it is used for text) or, with `--runtime rebel`, a directory compiled by
optimum-rbln, whose `rbln_config.json` gives every shape (the shape flags are not used; see
docs/device.md).

The artifact is built from the shape flags; `--block-size` defaults to the context (eager: one block
per sequence) and `--num-blocks` to lanes x blocks-per-sequence + 1 (the general admission rule of
docs/rules.md). Configuration errors (a broken rule of docs/rules.md, a missing SDK, a missing
checkpoint, a chat template that does not compile, an address already in use) print one line and
exit with status 2. The line `atombatch.serve: ... listening on http://HOST:PORT` is printed once
the port is bound and the engine runs (with `--port 0` it names the port the system picked).

The server bounds what one client can cost (body size and time, header time, open connections;
docs/security.md). `--api-key` requires a shared bearer key on /v1/* (not per user), and
`--ssl-keyfile`/`--ssl-certfile` serve HTTPS (`--ssl-ca-certs` with `--ssl-cert-reqs 2` asks for
client certificates); without them it speaks plain HTTP to anyone who can connect. Beyond a
trusted network, put a proxy with per-user authentication in front of it.

Every flag of `vllm serve` (vLLM 0.30 and 0.34, vllm-rbln's `--rbln-*`) parses: honoured, accepted
with one warning line when it has no meaning on ATOM, or refused naming why
(docs/from-vllm.md#flags). Request logs and access lines are off unless --enable-log-requests.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from atombatch import logs
from atombatch.api.options import (
    DEFAULT_CORE_HANG_TIMEOUT,
    DEFAULT_FRONT_STALL_TIMEOUT,
    EngineOptions,
    LogprobsMode,
)
from atombatch.api.speculative import parse_speculative_config
from atombatch.artifact.config import PRESETS, ArtifactConfig, ModelSpec
from atombatch.engine.batcher import Batcher, prefix_cache_refusal
from atombatch.engine.scheduler import POLICY_KINDS, Policy
from atombatch.errors import ConfigError, RequestError
from atombatch.serve import lora, schema, vllm_flags
from atombatch.serve.chat_template import template_from_argument
from atombatch.serve.limits import DEFAULT_MAX_RESPONSE_BYTES, ServerLimits
from atombatch.serve.reasoning import REASONING_PARSER_NAMES
from atombatch.serve.structured import DEFAULT_MAX_STRUCTURED_CHARS
from atombatch.serve.tokens import Codec, HFCodec
from atombatch.serve.tools import TOOL_PARSER_NAMES

log = logs.logger("atombatch.serve")

POLICY_HELP = {
    "stall-free:K": "prefill-first, but a decode step at least every K prefill chunks while "
                    "lanes decode (default stall-free:8)",
    "prefill-first": "a pending prefill chunk runs before the next decode step",
    "decode-first": "prefill only when no lane decodes",
    "interleave:N": "at most one prefill chunk per N decode steps while lanes decode",
    "fill-first:N": "a lane's own prefill at once; chunks into the spare one per N decode steps",
}

DEFAULT_SPEC = ModelSpec(
    name="atombatch-tiny", family="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, bos_token_id=1, eos_token_ids=(2,),
    dtype="float32")


# vLLM's --logprobs-mode values and the Batcher's
LOGPROBS_MODES: dict[str, LogprobsMode] = {"raw_logprobs": "raw",
                                           "processed_logprobs": "processed"}

# The server's engine options: the library's (`EngineOptions`, where every default lives) but for
# three deliberate choices, written here once and read by the flags' defaults: a shorter queue (a
# server answers 429 early rather than hold thousands of prompts), the overlapped decode pipeline
# on (docs/overlap.md) and requests' info events off unless --enable-log-requests (vLLM's default).
SERVER_OPTIONS = EngineOptions(max_waiting=256, overlap=True, log_requests=False)

# The default context of the host-memory runtimes: a checkpoint's own context (often 32k-128k)
# would size eager KV blocks of that many tokens per lane on the CPU.
DEFAULT_CONTEXT_CAP = 1024


class _Parser(argparse.ArgumentParser):
    """Parses, then folds vLLM's spellings in (`resolve_vllm_aliases`; a conflict exits 2)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        try:
            resolve_vllm_aliases(parsed)
        except ConfigError as exc:
            self.error(str(exc))
        return parsed, rest


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m atombatch.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the same as --model (vLLM's `vllm serve MODEL`)")
    p.add_argument("--model", help="Hugging Face checkpoint dir (with --runtime rebel: a "
                   "directory compiled by optimum-rbln); default: the built-in random tiny spec "
                   "on the NumPy runtime")
    p.add_argument("--runtime", choices=("numpy", "rebel", "sim", "null"), default="numpy",
                   help="numpy: real math on the CPU; rebel: ATOM devices; sim: no math, the "
                   "calibrated device-time model of `bench serve` (docs/results.md), its time "
                   "slept in wall time (--sim-pace), pseudo-logits: for load tests of a server "
                   "or a cluster without devices (--model names a preset, default qwen3-4b); "
                   "null: no math, every decode step sleeps --null-step-ms (the ideal device of "
                   "`bench overlap`, docs/overlap.md; --model names a preset, default the "
                   "built-in tiny spec)")
    p.add_argument("--sim-pace", type=float, default=1.0,
                   help="--runtime sim: wall seconds per simulated device second (default 1.0: "
                   "real time; 0: no sleeping)")
    p.add_argument("--sim-costs", help="--runtime sim: a cost model JSON (default: the fitted "
                   "one)")
    p.add_argument("--null-step-ms", type=float, default=20.0,
                   help="--runtime null: milliseconds per decode step (default 20)")
    p.add_argument("--null-prefill-ms", type=float,
                   help="--runtime null: milliseconds per prefill chunk (default: --null-step-ms)")
    p.add_argument("--tokenizer", help="dir with tokenizer.json (default: the --model dir if it "
                   "has one; none: token-id text)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="id at /v1/models (default: the spec's name); vLLM's flag, one name")
    p.add_argument("--device", default=None,
                   help="RebelRuntime: ATOM device index, or a comma list for tensor parallel "
                   "(default 0, or 0..N-1 with --tensor-parallel-size N)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="vLLM's flag: --runtime rebel on devices 0..N-1 (N must match the "
                   "compiled tensor_parallel_size); the host runtimes take only 1")
    p.add_argument("--batch-size", "--max-num-seqs", type=int, default=4, action=_Typed,
                   help="decode lanes B (default 4); --max-num-seqs is vLLM's name")
    p.add_argument("--max-seq-len", "--max-model-len", type=int, action=_Typed,
                   help="context (default: the model's max_position_embeddings, capped at "
                   f"{DEFAULT_CONTEXT_CAP} on the NumPy and sim runtimes, whose KV lives in "
                   "host memory; with --runtime rebel the compiled shapes decide)")
    p.add_argument("--block-size", type=int, action=_Typed,
                   help="tokens per KV block (default: --max-seq-len)")
    p.add_argument("--num-blocks", "--num-gpu-blocks-override", type=int, action=_Typed,
                   help="KV blocks (default: B x blocks/seq + 1); --num-gpu-blocks-override is "
                   "vLLM's name")
    p.add_argument("--prefill-chunk-size", "--max-num-batched-tokens", type=int, default=128,
                   action=_Typed,
                   help="tokens per prefill chunk (default 128); --max-num-batched-tokens is "
                   "vLLM's name, which vllm-rbln uses for the compiled prefill chunk")
    p.add_argument("--decoder-batch-sizes", type=_batch_sizes, default=(),
                   help="compiled decode batches, e.g. 1,2,4 (default: --batch-size only); each "
                        "decode step runs the smallest that holds the decoding lanes")
    p.add_argument("--policy", default=SERVER_OPTIONS.policy, type=_policy,
                   metavar="{" + ",".join(POLICY_HELP) + "}",
                   help="scheduling policy: " + "; ".join(f"{k}: {v}"
                                                          for k, v in POLICY_HELP.items()))
    p.add_argument("--max-waiting", type=int, default=SERVER_OPTIONS.max_waiting,
                   help="queue bound: requests without a lane past it answer 429 (default "
                   f"{SERVER_OPTIONS.max_waiting})")
    p.add_argument("--enable-prefix-caching", "--prefix-cache", dest="prefix_cache",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="keep finished sequences' KV for requests sharing a prefix (default: on "
                   "wherever the artifact and runtime support it, as vLLM; "
                   "--no-enable-prefix-caching turns it off)")
    p.add_argument("--host-cache-bytes", type=int, default=SERVER_OPTIONS.host_cache_bytes,
                   help="host memory for KV blocks evicted from the prefix cache (default 0)")
    p.add_argument("--seed", type=int, default=SERVER_OPTIONS.seed,
                   help="random weights and engine sampling seed")
    p.add_argument("--argmax-threads", type=int, default=SERVER_OPTIONS.argmax_threads, metavar="N",
                   help="threads the greedy argmax of a large decode step splits its rows over "
                   "(default: half the cores, at most 4; 1 on four cores or fewer)")
    p.add_argument("--overlap", "--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=SERVER_OPTIONS.overlap,
                   help="run steady decodes as a pipeline: the next step's inputs are "
                   "built while the device runs this one, and the device is called again as soon "
                   "as its argmax is known (default on; --no-overlap: one synchronous step at a "
                   "time; docs/overlap.md)")
    p.add_argument("--speculative-config", "-sc", default=None, metavar="JSON",
                   help="speculative decoding as vLLM spells it, n-gram drafts only: "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                   "\"prompt_lookup_max\": 4}'; needs an artifact compiled with "
                   "logits_to_keep=0 and runs synchronous steps (overlap off; "
                   "docs/speculative.md)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads for the NumPy runtime (default 1; 0 leaves the library's "
                   "default). OpenBLAS threads spin between calls and starve the event loop")
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="chat template to use instead of the tokenizer's (a file, or the jinja "
                   "text itself)")
    p.add_argument("--api-key", action="extend", nargs="+", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise; several "
                   "keys: --api-key K1 K2, or the flag repeated; default: $VLLM_API_KEY when "
                   "set, else no authentication)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES,
                   help="parse the model's tool calls into message.tool_calls (hermes: Qwen3's "
                   "<tool_call>{...}</tool_call>; llama3_json: Llama 3.1 / KONI JSON); without "
                   "it, requests with tools and tool_choice other than none answer 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: tool_choice auto (needs --tool-call-parser; auto is on "
                   "whenever a parser is named)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="vLLM's flag: GET /tokenizer_info is always served here")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES,
                   help="split the model's <think>...</think> into message.reasoning_content "
                   "(qwen3)")
    p.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="vLLM's flag: a response's usage carries prompt_tokens_details."
                   "cached_tokens (prompt tokens the prefix cache saved)")
    p.add_argument("--strict-protocol", action="store_true",
                   help="reject request fields the server does not read (400 unknown_parameter) "
                   "instead of ignoring them (default: ignored, logged once, listed in the "
                   "X-Ignored-Fields response header)")
    limits = ServerLimits()
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                   help="larger request bodies answer 413, checked as they stream in "
                   f"(default {limits.max_body_bytes})")
    p.add_argument("--max-structured-chars", type=int, default=DEFAULT_MAX_STRUCTURED_CHARS,
                   help="characters of one structured-output constraint (JSON schema, regex, "
                   f"grammar or choices) at most; longer answers 400 "
                   f"(default {DEFAULT_MAX_STRUCTURED_CHARS})")
    p.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                   help=f"seconds a request body may take (default {limits.body_timeout:g})")
    p.add_argument("--header-timeout", type=float, default=limits.header_timeout,
                   help="seconds a connection has to deliver a complete request head "
                   f"(default {limits.header_timeout:g})")
    p.add_argument("--keep-alive-timeout", type=int, default=limits.keep_alive_timeout,
                   help=f"idle seconds between requests (default {limits.keep_alive_timeout})")
    p.add_argument("--max-connections", type=int,
                   help="open connections; past it the longest-idle one is closed (default: "
                   "from the descriptor limit, `ulimit -n`)")
    bounds, response = schema.Bounds(), DEFAULT_MAX_RESPONSE_BYTES
    p.add_argument("--max-json-depth", type=int, default=bounds.max_depth,
                   help="nesting of a request body; deeper answers 400 nesting_too_deep "
                   f"(default {bounds.max_depth})")
    p.add_argument("--max-json-objects", type=int, default=bounds.max_objects,
                   help="JSON objects and arrays a body may hold outside token-id lists; more "
                   f"answer 400 too_many_objects (default {bounds.max_objects})")
    p.add_argument("--max-response-bytes", type=int, default=response,
                   help="a request whose response is estimated larger (n x logprobs x tokens, "
                   f"prompt logprobs) answers 400 response_too_large (default {response})")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per SSE event at most once a stream has started: a stream's "
                   "consumer is woken and written to once per this many tokens (its first token "
                   "and its end go at once); larger trades smoothness for front CPU, as SGLang's "
                   "--stream-interval (default 1: every token)")
    p.add_argument("--engine-core", choices=("process", "inline"), default="process",
                   help="process: the engine steps in its own process and this one serves HTTP, "
                   "tokenizes and streams (default; docs/architecture.md); inline: both share "
                   "one interpreter (an AsyncBatcher)")
    p.add_argument("--core-hang-timeout", type=float, default=DEFAULT_CORE_HANG_TIMEOUT,
                   metavar="SECONDS",
                   help="--engine-core process: a core that sends nothing for this long while "
                   "requests are in flight (between device calls it sends a message at least "
                   "every quarter second: keep this above the longest device call) is hung: it "
                   "is killed, its requests end with an error and the server exits non-zero, as "
                   "when the core dies; a shutdown waits no longer for "
                   f"it either (default {DEFAULT_CORE_HANG_TIMEOUT:g})")
    p.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="front processes (HTTP, tokenization, streaming) sharing one engine core "
                   "and the listening socket; a front that dies is started again, its requests "
                   "aborted in the core (default 1; N > 1 needs --engine-core process; "
                   "docs/architecture.md)")
    p.add_argument("--front-stall-timeout", type=float, default=DEFAULT_FRONT_STALL_TIMEOUT,
                   metavar="SECONDS",
                   help="--api-server-count N > 1: a front that reads none of the engine core's "
                   "messages for this long while more than a window of them wait (a stopped "
                   "process, a hung event loop) has its requests aborted, so the other fronts' "
                   "requests get their lanes; they end with an error naming the stall, and the "
                   "front serves on when it reads again. A slow front is never stalled: any read "
                   f"moves its count (default {DEFAULT_FRONT_STALL_TIMEOUT:g})")
    p.add_argument("--pd-producer", action="append", metavar="ENDPOINT",
                   help="prefill/decode disaggregation: take prompts' KV from the "
                   "ZmqProducerServer at this ZeroMQ endpoint (tcp://HOST:PORT or ipc:///PATH; "
                   "repeat for several, chosen by load); the engine core connects to them "
                   "(needs --engine-core process; docs/pd.md)")
    p.add_argument("--pd-mode", choices=("layer-stream", "whole"), default="layer-stream",
                   help="--pd-producer: write layers as they arrive, or all at once")
    p.add_argument("--pd-timeout", type=float, default=SERVER_OPTIONS.pd_timeout,
                   help="--pd-producer: seconds a request may wait for its producer's next "
                   f"message before it fails (default {SERVER_OPTIONS.pd_timeout:g})")
    p.add_argument("--pd-probe-s", type=float, default=1.0,
                   help="--pd-producer: seconds between the core's handshakes with each "
                   "producer (one that does not answer gets no requests until it does; "
                   "default 1)")
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                   help="HTTP parser: httptools (C, the cheapest per streamed event; auto picks "
                   "it when installed) or h11 (pure Python); both keep the connection guards of "
                   "docs/security.md")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (named at startup)")
    p.add_argument("--root-path", default="",
                   help="the path prefix a proxy serves this server under (uvicorn's root_path)")
    p.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key "
                   "(PEM; with --ssl-certfile)")
    p.add_argument("--ssl-certfile", metavar="FILE", help="the certificate chain of "
                   "--ssl-keyfile (PEM)")
    p.add_argument("--ssl-ca-certs", metavar="FILE",
                   help="CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked for (default), 1 optional, 2 required "
                   "(the ssl module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)")
    p.add_argument("--ssl-ciphers", metavar="CIPHERS",
                   help="OpenSSL cipher list for TLS 1.2 and below (default: uvicorn's)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                   default=SERVER_OPTIONS.log_requests,
                   help="log each request's finish (request.finished, with its timings) and an "
                   "access line per HTTP request; off by default, as in vLLM")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="the default (vLLM's earlier spelling, accepted for old launch scripts)")
    p.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                   default=False, help="no access lines even with --enable-log-requests")
    p.add_argument("--uvicorn-log-level", choices=(*logs.LEVELS, "trace"), default=None,
                   help="level of uvicorn's own records (default: --log-level)")
    p.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"),
                   default="raw_logprobs",
                   help="raw_logprobs: log-softmax of the model's logits (default, as vLLM); "
                   "processed_logprobs: of the distribution sampled from (docs/sampling.md)")
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                   help="vLLM's flag: serve LoRA adapters on the numpy runtime (PEFT directories: "
                   "--lora-modules, and /v1/load_lora_adapter with "
                   f"{lora.ENV_RUNTIME_UPDATES}=1); --runtime rebel serves the adapters "
                   "compiled into the artifact without it (docs/lora.md)")
    p.add_argument("--lora-modules", nargs="+", action=lora.LoraModulesAction, default=None,
                   metavar="NAME=PATH",
                   help="vLLM's flag: adapters served under their names from the start, as "
                   "name=path or the JSON object {\"name\": ..., \"path\": ..., "
                   "\"base_model_name\": ...}; with --runtime rebel each name must be one the "
                   "artifact holds")
    p.add_argument("--max-lora-rank", type=int, choices=lora.MAX_LORA_RANKS,
                   default=lora.DEFAULT_MAX_LORA_RANK, metavar="R",
                   help=f"vLLM's flag: the largest adapter rank loaded (default "
                   f"{lora.DEFAULT_MAX_LORA_RANK}; one of "
                   f"{', '.join(map(str, lora.MAX_LORA_RANKS))})")
    p.add_argument("--max-loras", type=int, default=lora.DEFAULT_MAX_LORAS, metavar="N",
                   help="vLLM's flag: distinct adapters in one step at most (default "
                   f"{lora.DEFAULT_MAX_LORAS}, as vLLM; the base model does not count)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="vLLM's flag: adapters loaded at once at most (each keeps its matrices "
                   "in host memory); a load past it answers 400 (default: "
                   f"{lora.DEFAULT_MAX_CPU_LORAS}, or the --lora-modules count if larger)")
    logs.add_arguments(p)
    vllm_flags.add_arguments(p)
    return p


class _Typed(argparse.Action):
    """Stores the value and which of the option's spellings the user typed (`typed_flag`), so
    that a message about the value names the flag the user wrote (--max-model-len, not
    --max-seq-len or max_seq_len)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        typed = dict(getattr(namespace, "typed_flags", None) or {})
        typed[self.dest] = option_string
        namespace.typed_flags = typed


# artifact fields, as ArtifactConfig's messages name them, that an option of the same dest sets
_FIELDS = ("max_seq_len", "batch_size", "block_size", "num_blocks", "prefill_chunk_size")


def typed_flag(args: argparse.Namespace, dest: str, default: str) -> str:
    """The spelling of option `dest` the user typed, else `default`."""
    return str((getattr(args, "typed_flags", None) or {}).get(dest, default))


def in_users_words(args: argparse.Namespace, message: str) -> str:
    """`message` with the artifact fields the user set through a flag named as typed:
    `max_seq_len=256` becomes `--max-model-len 256` for a user who passed --max-model-len."""
    import re

    typed = getattr(args, "typed_flags", None) or {}
    for field_name in _FIELDS:
        flag = typed.get(field_name)
        if flag:
            message = re.sub(rf"(?<![\w-]){field_name}=", f"{flag} ", message)
            message = re.sub(rf"(?<![\w-]){field_name}(?![\w=])", flag, message)
    return message


def resolve_vllm_aliases(args: argparse.Namespace) -> argparse.Namespace:
    """Fold vLLM's spellings into atombatch's options (in place; returns `args`).

    Raises:
        ConfigError: two spellings disagree, or a vLLM option has no meaning here.
    """
    tag = getattr(args, "model_tag", None)
    args.model_tag = None  # folded once (parse_args may be followed by a second call)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ConfigError(f"the positional model {tag!r} and --model {args.model!r} differ: "
                              "give one")
        args.model = tag
    names = args.served_model_name
    if isinstance(names, list):
        if len(names) > 1:
            raise ConfigError(f"--served-model-name {' '.join(names)}: this server serves one "
                              "name")
        args.served_model_name = names[0]
    tp = args.tensor_parallel_size
    if tp is not None:
        if tp < 1:
            raise ConfigError(f"--tensor-parallel-size {tp} must be >= 1")
        if args.runtime != "rebel" and tp != 1:
            raise ConfigError(f"--tensor-parallel-size {tp}: the {args.runtime} runtime runs on "
                              "one host process (tensor parallel needs --runtime rebel)")
        if args.device is None:
            args.device = ",".join(str(d) for d in range(tp))
        elif len(str(args.device).split(",")) != tp:
            raise ConfigError(f"--tensor-parallel-size {tp} and --device {args.device} name "
                              "different device counts")
    if args.device is None:
        args.device = "0"
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes or "
                          "llama3_json)")
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        args.api_key = [os.environ["VLLM_API_KEY"]]
    return args


def build_engine(args: argparse.Namespace) -> tuple[Batcher, str, Codec | None]:
    """The `Batcher`, served model name and tokenizer that the flags describe.

    Raises:
        ConfigError: a rule of docs/rules.md is broken, the checkpoint is unusable, or the rebel SDK
            (or `RebelRuntime`) is not available.
    """
    model_dir = _model_dir(args)
    runtime: Any
    if args.runtime == "rebel":
        runtime = _rebel_runtime(args)
        return _serving(runtime, args, model_dir, runtime.spec)
    if args.runtime == "sim":
        return _sim_engine(args)
    if args.runtime == "null":
        return _null_engine(args)
    if model_dir is not None:
        spec = ModelSpec.from_pretrained(model_dir)
    elif args.model and args.model.lower() not in PRESETS:
        if os.sep in args.model or args.model.startswith((".", "~")) or Path(args.model).exists():
            what = "is not a directory" if Path(args.model).exists() else "does not exist"
            raise ConfigError(f"--model {args.model}: the path {what} (give a Hugging Face "
                              "checkpoint directory with config.json)")
        raise ConfigError(f"--model {args.model}: neither a checkpoint directory nor a preset "
                          f"({', '.join(sorted(PRESETS))})")
    elif args.model:
        if args.model.lower() in PRESETS:
            raise ConfigError(f"--model {args.model}: the NumPy runtime needs weights; give a "
                              "checkpoint directory")
        spec = ModelSpec.preset(args.model)
    else:
        spec = DEFAULT_SPEC
    if _context(args, spec) > spec.max_position_embeddings:
        raise ConfigError(f"{typed_flag(args, 'max_seq_len', '--max-seq-len')} "
                          f"{args.max_seq_len} exceeds the model's "
                          f"max_position_embeddings={spec.max_position_embeddings}: positions "
                          "past it were never trained")
    artifact = _artifact(args, spec)
    from atombatch.runtime.numpy_runtime import NumpyRuntime
    if model_dir is not None:
        runtime = NumpyRuntime.from_pretrained(model_dir, artifact=artifact)
    else:
        runtime = NumpyRuntime.random(artifact, seed=args.seed)
    return _serving(runtime, args, model_dir, spec)


def _context(args: argparse.Namespace, spec: ModelSpec) -> int:
    """--max-seq-len, or the model's context capped for the host-memory runtimes (vLLM's
    `max_model_len` default, minus the cap)."""
    if args.max_seq_len is not None:
        return int(args.max_seq_len)
    return min(spec.max_position_embeddings, DEFAULT_CONTEXT_CAP)


def _artifact(args: argparse.Namespace, spec: ModelSpec) -> ArtifactConfig:
    """The artifact the shape flags describe (one block per sequence unless --block-size)."""
    context = _context(args, spec)
    block_size = args.block_size or context
    bps = context // block_size if block_size else 0
    num_blocks = args.num_blocks or args.batch_size * max(bps, 1) + 1
    return ArtifactConfig(model=spec, batch_size=args.batch_size, max_seq_len=context,
                          block_size=block_size, num_blocks=num_blocks,
                          prefill_chunk_size=min(args.prefill_chunk_size, context),
                          decoder_batch_sizes=args.decoder_batch_sizes)


def _sim_engine(args: argparse.Namespace) -> tuple[Batcher, str, Codec | None]:
    """A `SimRuntime` engine: the preset's shapes, the cost model's device time (paced)."""
    from atombatch.runtime.sim import CostModel, SimRuntime

    name = (args.model or "qwen3-4b").lower()
    if name not in PRESETS:
        raise ConfigError(f"--model {args.model}: --runtime sim needs a preset "
                          f"({', '.join(sorted(PRESETS))})")
    spec = ModelSpec.preset(name)
    artifact = _artifact(args, spec)
    costs = CostModel.load(args.sim_costs) if args.sim_costs else None
    runtime = SimRuntime(artifact, costs, seed=args.seed, pace=args.sim_pace)
    return _serving(runtime, args, None, spec)


def _null_engine(args: argparse.Namespace) -> tuple[Batcher, str, Codec | None]:
    """A `NullRuntime` engine: the preset's (or the tiny spec's) shapes, fixed sleeps, no math."""
    from atombatch.runtime.null import NullRuntime

    if args.model and args.model.lower() not in PRESETS:
        raise ConfigError(f"--model {args.model}: --runtime null needs a preset "
                          f"({', '.join(sorted(PRESETS))}) or no --model (the tiny spec)")
    spec = ModelSpec.preset(args.model.lower()) if args.model else DEFAULT_SPEC
    runtime = NullRuntime(_artifact(args, spec), step_ms=args.null_step_ms,
                          prefill_ms=args.null_prefill_ms, seed=args.seed)
    return _serving(runtime, args, None, spec)


def _serving(runtime: Any, args: argparse.Namespace, model_dir: Path | None,
             spec: ModelSpec) -> tuple[Batcher, str, Codec | None]:
    prefix_cache = args.prefix_cache
    if prefix_cache is None:  # the default: on wherever it can be (vLLM's), quietly off elsewhere
        reason = prefix_cache_refusal(runtime, host_cache_bytes=args.host_cache_bytes)
        prefix_cache = reason is None
        if reason is not None:
            log.info("prefix_cache.default_off", reason=reason)
    batcher = Batcher.from_options(runtime, engine_options(args, prefix_cache=prefix_cache))
    serve_adapters(batcher, args)
    return batcher, args.served_model_name or spec.name, codec_from_args(args, model_dir)


def serve_adapters(batcher: Batcher, args: argparse.Namespace) -> None:
    """The adapters of `--lora-modules` (docs/lora.md#serving-adapters): a compiled artifact
    must hold each name (it serves all it holds, flag or not); a loadable runtime loads each
    PEFT directory now, so a bad one stops the server before it listens.

    Raises:
        ConfigError: a name the artifact does not hold (listing those it holds), a runtime
            that cannot load adapters, a directory that is not a usable PEFT adapter.
    """
    modules = getattr(args, "lora_modules", None) or ()
    if args.runtime == "rebel":
        lora.check_compiled(modules, getattr(batcher, "lora_adapters", None) or {}, args.model)
        return
    if not getattr(args, "enable_lora", False):
        return
    if not batcher.capabilities.lora_loadable:
        raise ConfigError(f"--enable-lora: the {args.runtime} runtime cannot load adapters")
    served = args.served_model_name or batcher.spec.name  # (the flag's is checked before)
    for module in modules:
        if module.name == served:  # requests naming it would get the base model
            raise ConfigError(f"--lora-modules {module.name}: the name is the served model's "
                              f"({served!r}, the model directory's name without "
                              "--served-model-name); an adapter needs its own")
        try:
            batcher.load_lora(module.name, module.path)
        except (ConfigError, RequestError) as exc:
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc}") from None


def engine_options(args: argparse.Namespace, *, prefix_cache: bool) -> EngineOptions:
    """The engine's options from the server's flags, built once (`prefix_cache`: the flag, or
    its default resolved against the runtime)."""
    lora_on = getattr(args, "enable_lora", False) or args.runtime == "rebel"
    text = getattr(args, "speculative_config", None)
    speculative = parse_speculative_config(text) if text else None
    return EngineOptions(
        prefix_cache=prefix_cache, host_cache_bytes=args.host_cache_bytes, policy=args.policy,
        seed=args.seed, max_waiting=args.max_waiting, pd_timeout=args.pd_timeout,
        argmax_threads=args.argmax_threads,
        # speculation runs on synchronous steps (atombatch/engine/speculative.py)
        overlap=args.overlap and speculative is None, speculative=speculative,
        logprobs_mode=LOGPROBS_MODES[args.logprobs_mode],
        log_requests=getattr(args, "enable_log_requests", SERVER_OPTIONS.log_requests),
        # vLLM's LoRA flags, while LoRA is on (the server's defaults otherwise)
        max_loras=args.max_loras if lora_on else None,
        max_lora_rank=args.max_lora_rank if lora_on else None)


def _model_dir(args: argparse.Namespace) -> Path | None:
    if args.runtime == "sim":
        return None
    return Path(args.model) if args.model and Path(args.model).is_dir() else None


def core_batcher(args: argparse.Namespace) -> Batcher:
    """The engine of `--engine-core process`, built in the core process from the same flags.

    It keeps the tokenizer for stop strings and bad words only (`detokenize=False`): every other
    request's text is decoded by the front."""
    logs.setup(args.log_level, args.log_format)
    batcher, _, codec = build_engine(args)
    if args.runtime == "numpy" and args.blas_threads > 0:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=args.blas_threads, user_api="blas")
    if isinstance(codec, HFCodec):
        batcher.use_tokenizer(codec.tokenizer, detokenize=False)
    return batcher


def pd_options(args: argparse.Namespace) -> Any:
    """The engine core's PD options from `--pd-producer` (None without it).

    Raises:
        ConfigError: an endpoint is malformed or named twice, or a PD flag is out of range.
    """
    if not getattr(args, "pd_producer", None):
        return None
    from atombatch.core.pd import PDOptions, static_producers

    if args.pd_timeout <= 0:
        raise ConfigError(f"--pd-timeout {args.pd_timeout} must be > 0")
    if args.pd_probe_s <= 0:
        raise ConfigError(f"--pd-probe-s {args.pd_probe_s} must be > 0")
    return PDOptions(producers=static_producers(args.pd_producer), mode=args.pd_mode,
                     probe_s=args.pd_probe_s)


def codec_from_args(args: argparse.Namespace, model_dir: Path | None) -> Codec | None:
    """The tokenizer (and chat template) the flags name: None serves token-id text."""
    tokenizer_dir = args.tokenizer or model_dir
    codec = HFCodec.from_dir(tokenizer_dir) if tokenizer_dir else None
    if args.tokenizer and codec is None:
        raise ConfigError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    if getattr(args, "chat_template", None):
        if codec is None:
            raise ConfigError("--chat-template needs a tokenizer (--tokenizer DIR, or a --model "
                              "checkpoint with tokenizer.json)")
        codec.chat_template = template_from_argument(args.chat_template, codec.special)
    return codec


def _rebel_runtime(args: argparse.Namespace) -> Any:
    """`RebelRuntime` on an optimum-rbln compiled directory (imported lazily: rebel-sdk)."""
    from atombatch.runtime.rebel import RebelRuntime

    if not args.model or not (Path(args.model) / "rbln_config.json").is_file():
        raise ConfigError(f"--runtime rebel needs --model DIR, a directory compiled by "
                          f"optimum-rbln (with rbln_config.json); got {args.model!r} "
                          "(docs/device.md)")
    devices = [int(d) for d in str(args.device).split(",")]
    return RebelRuntime.from_optimum(args.model,
                                     device=devices[0] if len(devices) == 1 else devices)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type of --decoder-batch-sizes: a comma list of positive ints."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of batch sizes, e.g. 1,2,4"
                                         ) from None


def _policy(text: str) -> str:
    """argparse type of --policy: a valid policy, else an error listing the values."""
    try:
        Policy.parse(text)
    except (ConfigError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a policy: use one of {', '.join(POLICY_HELP)} "
            f"(kinds: {', '.join(POLICY_KINDS)})") from None
    return text


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to host:port (port 0: any free port).

    Raises:
        OSError: the address is in use, not local, or not resolvable.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # resolved once here, so the engine core process logs in the front's format
    args.log_format = logs.setup(args.log_level, args.log_format)
    if not args.front_stall_timeout > 0:  # (NaN too)
        print(f"atombatch.serve: --front-stall-timeout {args.front_stall_timeout:g} must be a "
              "positive number of seconds", file=sys.stderr)
        return 2
    try:
        lora.check_lora_flags(args, args.served_model_name)
    except ConfigError as exc:
        print(f"atombatch.serve: {exc}", file=sys.stderr)
        return 2
    for flag, why in vllm_flags.warnings(args).items():
        logs.log.warning("flag.ignored", flag=flag, reason=why)
    for name in vllm_flags.ignored_environment(os.environ):
        logs.log.warning("env.ignored", name=name, reason=vllm_flags.RBLN_ENV_REASON)
    try:
        tls_options(args)
    except ConfigError as exc:
        print(f"atombatch.serve: {exc}", file=sys.stderr)
        return 2
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(f"atombatch.serve: cannot listen on {args.host}:{args.port}: {reason.lower()}",
              file=sys.stderr)
        return 2
    try:
        if args.api_server_count != 1:
            import functools

            from atombatch.serve.launcher import launch
            return launch(args, sock, serve=_serve,
                          factory=functools.partial(core_batcher, args),
                          pd=functools.partial(pd_options, args),
                          check=lambda: codec_from_args(args, _model_dir(args)))
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket, shared: Any = None,
           started: Any = None) -> int:
    """Serve on `sock` until stopped. With `shared` (a `SharedCore`) this process is one front
    of a shared engine core (atombatch/serve/launcher.py): it connects to it instead of
    spawning one, and sets the `started` event once it listens."""
    engine: Any
    try:
        if args.engine_core == "process":
            import functools

            from atombatch.core import CoreClient
            codec = codec_from_args(args, _model_dir(args))
            factory = None if shared is not None else functools.partial(core_batcher, args)
            if not args.core_hang_timeout > 0:  # (NaN too)
                raise ConfigError(f"--core-hang-timeout {args.core_hang_timeout} must be a "
                                  "positive number of seconds")
            engine = CoreClient(factory, stream_interval=args.stream_interval,
                                hang_timeout=args.core_hang_timeout, pd=pd_options(args),
                                shared=shared)
            ready = engine.start_process()
            name = args.served_model_name or ready.rules.artifact.model.name
            art, policy = ready.rules.artifact, ready.policy
        else:
            from atombatch.engine.aio import AsyncBatcher

            if args.pd_producer:
                raise ConfigError("--pd-producer needs --engine-core process (the engine core "
                                  "connects to the producers; docs/pd.md)")
            batcher, name, codec = build_engine(args)
            art, policy = batcher.artifact, batcher.policy.label
            engine = AsyncBatcher(batcher, offload=True, stream_interval=args.stream_interval)
            if args.runtime == "numpy" and args.blas_threads > 0:
                from threadpoolctl import threadpool_limits
                threadpool_limits(limits=args.blas_threads, user_api="blas")
    except ConfigError as exc:
        print(f"atombatch.serve: {in_users_words(args, str(exc))}", file=sys.stderr)
        return 2
    import uvicorn

    from atombatch.serve.app import create_app
    from atombatch.serve.limits import uvicorn_config
    from atombatch.serve.tokens import IdCodec
    try:
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                              header_timeout=args.header_timeout,
                              keep_alive_timeout=args.keep_alive_timeout,
                              max_connections=args.max_connections).resolved()
    except ConfigError as exc:
        print(f"atombatch.serve: {in_users_words(args, str(exc))}", file=sys.stderr)
        _stop_engine(engine)
        return 2
    try:
        bounds = schema.Bounds(max_depth=args.max_json_depth, max_objects=args.max_json_objects)
        if args.max_response_bytes < 1:
            raise ConfigError(f"--max-response-bytes {args.max_response_bytes} must be >= 1")
        app = create_app(engine, name, codec, max_body_bytes=limits.max_body_bytes,
                         body_timeout=limits.body_timeout, strict_protocol=args.strict_protocol,
                         bounds=bounds, max_response_bytes=args.max_response_bytes,
                         max_structured_chars=args.max_structured_chars,
                         api_keys=args.api_key or (), tool_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                         **lora.app_options(args))
    except ConfigError as exc:
        print(f"atombatch.serve: {in_users_words(args, str(exc))}", file=sys.stderr)
        _stop_engine(engine)
        return 2
    if args.engine_core == "process" and engine.pd_options is not None:
        from atombatch.serve.pd_metrics import add_pd_metrics
        add_pd_metrics(app, lambda: engine.pd_stats)
    host, port = sock.getsockname()[:2]
    template = (codec or IdCodec()).chat_template_name
    banner = (f"atombatch.serve: {art.label} ({args.runtime}, policy {policy}, "
              f"tokenizer {'tokenizers' if codec else 'ids'}, chat template {template}, "
              f"engine core {args.engine_core}"
              f"{f', front {shared.front + 1}/{shared.fronts}' if shared is not None else ''}"
              f"{f', PD producers {len(args.pd_producer)}' if args.pd_producer else ''}"
              f"{', strict protocol' if args.strict_protocol else ''}"
              f"{', api key' if args.api_key else ''}"
              f"{f', tool parser {args.tool_call_parser}' if args.tool_call_parser else ''}"
              f"{f', reasoning parser {args.reasoning_parser}' if args.reasoning_parser else ''}"
              ") listening on "
              f"{'https' if args.ssl_certfile else 'http'}://"
              f"{host if ':' not in host else f'[{host}]'}:{port}")

    stopped_by: list[int] = []   # the signals uvicorn caught (it re-raises them at the end)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            stopped_by.append(sig)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # bound, listening, and the engine's loop runs
                from atombatch.core.process import freeze_heap
                freeze_heap()  # what startup built is out of the collector's scans
                print(banner, file=sys.stderr, flush=True)
                if started is not None:
                    started.set()

    # timeout_graceful_shutdown=None: on SIGINT/SIGTERM uvicorn stops accepting and waits for
    # in-flight streams; then the lifespan drains the engine (close(drain=True)).
    # log_config=None: uvicorn's records go through logs.setup's handler, in the chosen format
    config = uvicorn_config(app, limits, http=args.http,
                            log_level=args.uvicorn_log_level or args.log_level,
                            log_config=None, timeout_graceful_shutdown=None,
                            access_log=args.enable_log_requests
                            and not args.disable_uvicorn_access_log,
                            root_path=args.root_path, **tls_options(args))
    server = Server(config)
    died: list[int | None] = []

    def core_exited(code: int | None) -> None:  # answer 503 meanwhile, then exit non-zero
        died.append(code)
        print(f"atombatch.serve: the engine core exited (code {code}); stopping",
              file=sys.stderr, flush=True)
        server.should_exit = True

    if args.engine_core == "process":
        engine.on_core_exit = core_exited
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        return 130
    finally:
        _stop_engine(engine)
    if signal.SIGINT in stopped_by:  # re-raised into an inherited SIG_IGN (a background job
        return 130                   # of a script): Ctrl-C's status all the same
    return 1 if died else 0


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from the --ssl-* flags ({} without --ssl-certfile), checked by
    loading them once, so a missing or mismatched file is a one-line error at startup.

    Raises:
        ConfigError: a key without a certificate (or the reverse), or files TLS cannot load.
    """
    if not (args.ssl_keyfile or args.ssl_certfile):
        for flag, value in (("--ssl-ca-certs", args.ssl_ca_certs),
                            ("--ssl-cert-reqs", args.ssl_cert_reqs or None),
                            ("--ssl-ciphers", args.ssl_ciphers)):
            if value is not None:
                raise ConfigError(f"{flag} needs --ssl-keyfile and --ssl-certfile (HTTPS)")
        return {}
    if not (args.ssl_keyfile and args.ssl_certfile):
        given, missing = (("--ssl-keyfile", "--ssl-certfile") if args.ssl_keyfile else
                          ("--ssl-certfile", "--ssl-keyfile"))
        raise ConfigError(f"{given} needs {missing}: HTTPS takes a key and its certificate")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ConfigError(f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs (the CAs "
                          "client certificates are checked against)")
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile "
                          f"{args.ssl_keyfile}: {_why(exc)}"
                          ) from None
    if args.ssl_ca_certs:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--ssl-ca-certs {args.ssl_ca_certs}: "
                              f"{_why(exc)}") from None
    if args.ssl_ciphers:
        try:
            context.set_ciphers(args.ssl_ciphers)
        except ssl.SSLError:
            raise ConfigError(f"--ssl-ciphers {args.ssl_ciphers}: no cipher matches") from None
    options: dict[str, Any] = {"ssl_keyfile": args.ssl_keyfile,
                               "ssl_certfile": args.ssl_certfile,
                               "ssl_cert_reqs": args.ssl_cert_reqs}
    if args.ssl_ca_certs:
        options["ssl_ca_certs"] = args.ssl_ca_certs
    if args.ssl_ciphers:
        options["ssl_ciphers"] = args.ssl_ciphers
    return options


def _why(exc: Exception) -> str:
    """An OSError's reason as the other startup errors say it (lower case), else the error."""
    reason = getattr(exc, "strerror", None)
    return reason.lower() if isinstance(reason, str) else str(exc)


def _stop_engine(engine: Any) -> None:
    """Make sure a core process does not outlive the server (a no-op once it stopped)."""
    kill = getattr(engine, "_kill", None)
    if kill is not None:
        kill()
