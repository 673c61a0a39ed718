"""vLLM's `vllm serve` flags on atombatch's command line: each honoured, accepted with a warning,
or refused at startup naming why.

`TABLE` holds every flag of `vllm serve` in vLLM 0.34.0 and 0.30.0 (the version vllm-rbln 0.12
pins) and vllm-rbln 0.12.0's `--rbln-*` flags, as listed from the wheels by tools/vllm_flags.py
(docs/vllm-flags/), plus `--disable-log-requests` (the spelling of earlier vLLMs) and `-O`
(`-O3`, vLLM's shorthand for --optimization-level). Each line is
`FLAG ARITY FATE [DETAIL]`:

- `honoured`: the flag means here what it means in vLLM. Without DETAIL, atombatch's own parser
  has it (cli.py); with DETAIL (a key of `REASONS`), it asks for what atombatch does anyway (a
  feature that is off, prefill that is always chunked) and is accepted silently;
- `warn`: it has no meaning on ATOM (a GPU or cluster knob): accepted with one warning line
  naming the flag and `REASONS[DETAIL]`;
- `refused`: it would change the results and cannot be honoured: the server exits with status 2
  naming the flag and `REASONS[DETAIL]`;
- `values`: DETAIL is `V1,V2:KEY`: those values are honoured (they name what atombatch does),
  any other is refused with `REASONS[KEY]`.

ARITY (`switch`, `value`, `values`, `optional`) is vLLM's, so a launch line parses as in vLLM.
docs/from-vllm.md#flags is this table as prose (`python tools/vllm_flags.py --table`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REASONS = {
    # honoured: what atombatch does anyway
    "off": "the feature it turns off is not in atombatch",
    "chunked": "prefill always runs in chunks of the compiled prefill_chunk_size",
    "stats": "atombatch logs no periodic statistics (they are at /metrics)",
    "docs": "the server has no /docs or /redoc pages",
    "remotecode": "atombatch never runs a checkpoint's own code: the model families are built in",
    # warn: no meaning on ATOM
    "gpu": "a GPU kernel, graph or backend knob: an ATOM runs the compiled graphs as compiled",
    "eager": "CUDA graphs and torch.compile do not exist here: an ATOM runs its compiled graphs",
    "memory": "device memory is fixed by the artifact: KV blocks are --num-blocks "
              "(docs/device.md)",
    "parallel": "a multi-GPU or multi-node launch knob: atombatch runs one engine per device "
                "(replicas: python -m atombatch.serve.ray, docs/cluster.md)",
    "mm": "a multimodal knob: atombatch serves text models",
    "hub": "a download or checkpoint-loading knob: atombatch loads a local directory "
           "(config.json and safetensors, or an optimum-rbln compiled directory)",
    "obs": "a vLLM tracing, metrics or log knob: atombatch's /metrics and logs are fixed "
           "(docs/server.md)",
    "cors": "the server sends no CORS headers (browsers' cross-origin calls are refused)",
    "sched": "a vLLM scheduler knob: atombatch schedules by --policy (docs/scheduling.md)",
    "rbln": "a vllm-rbln compile knob: the compiled directory's rbln_config.json decides "
            "(docs/device.md)",
    "autotool": "tool_choice auto is on whenever --tool-call-parser is named",
    "tokinfo": "GET /tokenizer_info is always served",
    "sslrefresh": "certificates are read once at startup",
    "maxlogprobs": "logprobs are bounded at 20 per token, as vLLM's default, and by "
                   "--max-response-bytes",
    "structured": "structured output has one backend here (docs/server.md#structured-output)",
    "shutdown": "a shutdown waits for the requests in flight (docs/server.md)",
    "http": "HTTP limits are the server's own flags (--max-body-bytes, --header-timeout; "
            "docs/security.md)",
    # refused: would change results and cannot be honoured
    "dtype": "the weights run in the dtype they were saved or compiled in (auto)",
    "kvdtype": "the KV cache has the model's dtype (auto)",
    "loadformat": "weights load from safetensors",
    "tokmode": "the tokenizer is the checkpoint's tokenizer.json (hf)",
    "runner": "atombatch serves generative decoders only",
    "priority": "requests are served first come, first served (fcfs)",
    "genconfig": "sampling defaults are vLLM's own; generation_config.json is not read "
                 "(vLLM's --generation-config vllm)",
    "contentformat": "message content is rendered as the chat template expects it (auto)",
    "role": "the response role is assistant",
    "quant": "quantization is decided when the model is compiled for the ATOM, not at serve time",
    "overrides": "a model or config override would change the model; atombatch serves the "
                 "checkpoint or compiled directory as it is",
    "spec": "only --speculative-config with n-gram drafts is implemented (docs/speculative.md)",
    "lora": "LoRA adapters are compiled into the optimum-rbln artifact; none load at serve time",
    "code": "it loads code (plugins, middleware, worker or scheduler classes) into the server",
    "window": "the sliding-window layers are part of the model and of its compiled graphs",
    "tokens_out": "it changes what a response carries, and atombatch answers as vLLM's defaults",
    "embeds": "prompt and multimodal embeddings as input are not implemented",
    "watermark": "watermarking is not implemented",
    "tools": "this tool or reasoning option is not implemented",
    "listen": "the server listens on --host/--port over HTTP(S) only",
    "sleep": "sleep mode and weight transfer are not implemented",
    "expert": "expert parallelism is not implemented",
    "kvconnector": "KV transfer between engines goes through --pd-producer (docs/pd.md)",
    "convertmodel": "atombatch serves text generation from decoder-only models only",
    "logging_code": "logging is configured by --log-level and --log-format",
}

FATES = ("honoured", "warn", "refused", "values")
ARITIES = {"switch": 0, "value": None, "values": "+", "optional": "?"}

TABLE = """\
--additional-config value refused overrides
--aggregate-engine-logging switch warn obs
--all2all-backend value warn gpu
--allow-credentials switch warn cors
--allow-deprecated-quantization switch refused quant
--allowed-headers value warn cors
--allowed-local-media-path value warn mm
--allowed-media-domains values warn mm
--allowed-methods value warn cors
--allowed-origins value warn cors
--anthropic-disabled-thinking-effort value refused tools
--api-key values honoured
--api-server-count value honoured
--async-scheduling switch honoured
--attention-backend value warn gpu
--attention-config value warn gpu
--aux-output-config value refused convertmodel
--block-size value honoured
--cache-aware-admission-threshold value warn sched
--cache-aware-admission-window value warn sched
--chat-template value honoured
--chat-template-content-format value values auto:contentformat
--checkpoint-prepare-on-startup switch warn memory
--code-revision value warn hub
--cohere-format value refused tools
--cohere-is-reasoning-model switch refused tools
--collect-detailed-traces values warn obs
--compilation-config value warn eager
--config value refused listen
--config-format value warn hub
--convert value values auto,none:runner
--cp-kv-cache-interleave-size value warn parallel
--cpu-distributed-timeout-seconds value warn parallel
--cpu-offload-gb value warn memory
--cpu-offload-params values warn memory
--cudagraph-capture-sizes values warn gpu
--cudagraph-metrics switch warn gpu
--custom-histogram-buckets value warn obs
--data-parallel-address value warn parallel
--data-parallel-backend value warn gpu
--data-parallel-external-lb switch warn parallel
--data-parallel-hybrid-lb switch warn parallel
--data-parallel-multi-port-external-lb switch warn parallel
--data-parallel-rank value values 0:parallel
--data-parallel-rpc-port value warn parallel
--data-parallel-size value values 1:parallel
--data-parallel-size-local value values 1:parallel
--data-parallel-start-rank value values 0:parallel
--data-parallel-supervisor-port value warn parallel
--dbo-decode-token-threshold value warn gpu
--dbo-prefill-token-threshold value warn gpu
--dcp-comm-backend value warn gpu
--dcp-kv-cache-interleave-size value warn parallel
--dcp-q-replicate switch warn parallel
--decode-context-parallel-size value values 1:parallel
--default-chat-template-kwargs value refused tools
--default-mm-loras value refused lora
--device-ids value warn parallel
--device-memory-utilization value warn memory
--diffusion-config value refused convertmodel
--disable-access-log-for-endpoints value warn obs
--disable-cascade-attn switch warn gpu
--disable-chunked-mm-input switch warn mm
--disable-custom-all-reduce switch warn gpu
--disable-fastapi-docs switch honoured docs
--disable-hybrid-kv-cache-manager switch warn gpu
--disable-log-requests switch honoured
-O optional warn eager
--disable-log-stats switch honoured stats
--disable-nccl-for-dp-synchronization switch warn gpu
--disable-sliding-window switch refused window
--disable-uvicorn-access-log switch honoured
--distributed-executor-backend value warn gpu
--distributed-timeout-seconds value warn parallel
--download-dir value warn hub
--dp-supervisor-probe-failure-threshold value warn parallel
--dp-supervisor-probe-interval-s value warn parallel
--dp-supervisor-probe-timeout-s value warn parallel
--dp-sync-interval value warn parallel
--dtype value values auto:dtype
--ec-manager-config value refused kvconnector
--ec-transfer-config value refused kvconnector
--elastic-ep-max-dp-size value refused expert
--enable-auto-tool-choice switch honoured
--enable-batch-sharded-sampling switch warn gpu
--enable-chunked-prefill switch honoured chunked
--enable-cumem-allocator switch warn gpu
--enable-dbo switch warn gpu
--enable-elastic-ep switch refused expert
--enable-ep-weight-filter switch warn gpu
--enable-eplb switch refused expert
--enable-expert-parallel switch refused expert
--enable-extensible-kv-cache switch warn gpu
--enable-fault-tolerance switch warn parallel
--enable-flash-late-interaction switch refused convertmodel
--enable-flashinfer-autotune switch warn gpu
--enable-force-include-usage switch refused tokens_out
--enable-hc-sp switch warn gpu
--enable-layerwise-nvtx-tracing switch warn gpu
--enable-log-deltas switch warn obs
--enable-log-outputs switch warn obs
--enable-log-requests switch honoured
--enable-logging-iteration-details switch warn obs
--enable-lora switch refused lora
--enable-mamba-cache-stochastic-rounding switch warn gpu
--enable-mamba-fine-grained-prefix-cache switch warn gpu
--enable-mamba-shared-prefix-checkpoint switch warn gpu
--enable-mfu-metrics switch warn obs
--enable-mixed-moe-lora-format switch refused lora
--enable-mm-embeds switch refused embeds
--enable-moe-shared-loras switch refused lora
--enable-nccl-comm-suspend switch warn gpu
--enable-offline-docs switch warn gpu
--enable-per-request-metrics switch warn obs
--enable-prefix-caching switch honoured
--enable-prompt-embeds switch refused embeds
--enable-prompt-tokens-details switch honoured
--enable-request-id-headers switch warn obs
--enable-return-routed-experts switch refused convertmodel
--enable-scale-out switch refused kvconnector
--enable-server-load-tracking switch warn obs
--enable-shm-tensor-arena switch warn gpu
--enable-sleep-mode switch refused sleep
--enable-ssl-refresh switch warn sslrefresh
--enable-tokenizer-info-endpoint switch honoured
--enable-tower-connector-lora switch refused lora
--enable-trace-replay switch warn obs
--enforce-eager switch warn eager
--engram-config value refused convertmodel
--eplb-config value refused expert
--exclude-tools-when-tool-choice-none switch refused tools
--expert-placement-strategy value refused expert
--fail-on-environ-validation switch warn hub
--fault-tolerance-config value warn parallel
--fingerprint-mode value warn parallel
--fingerprint-value value warn parallel
--fully-sharded-loras switch refused lora
--gdn-prefill-backend value warn gpu
--generation-config value values vllm:genconfig
--gpu-memory-utilization value warn memory
--grpc switch refused listen
--grpc-port value refused listen
--h11-max-header-count value warn http
--h11-max-incomplete-event-size value warn http
--headless switch refused listen
--headless-client-handshake-address value refused listen
--hf-config-path value refused overrides
--hf-overrides value refused overrides
--hf-token optional warn hub
--host value honoured
--ignore-patterns values warn hub
--interleave-mm-strings switch warn mm
--io-processor-plugin value refused code
--ir-op-priority value warn gpu
--jit-monitor-mode value warn gpu
--jit-monitor-verbose switch warn gpu
--kda-decode-backend value warn gpu
--kda-prefill-backend value warn gpu
--kernel-config value warn gpu
--kv-cache-dtype value values auto:kvdtype
--kv-cache-dtype-skip-layers values refused quant
--kv-cache-memory-bytes value warn memory
--kv-cache-metrics switch warn obs
--kv-cache-metrics-sample value warn obs
--kv-events-config value refused kvconnector
--kv-offloading-backend value refused kvconnector
--kv-offloading-size value refused kvconnector
--kv-sharing-fast-prefill switch warn memory
--kv-transfer-config value refused kvconnector
--language-model-only switch refused convertmodel
--limit-mm-per-prompt value warn mm
--linear-backend value warn gpu
--load-format value values auto,safetensors:loadformat
--log-config-file value refused logging_code
--log-error-stack switch warn obs
--log-level value honoured
--logging-config value refused logging_code
--logits-processors values refused code
--logprobs-mode value honoured
--long-prefill-token-threshold value warn sched
--long-prefill-token-threshold-adaptive switch warn sched
--lora-dtype value refused lora
--lora-modules values refused lora
--lora-target-modules values refused lora
--mamba-backend value warn gpu
--mamba-block-size value warn gpu
--mamba-cache-dtype value warn gpu
--mamba-cache-mode value warn gpu
--mamba-cache-philox-rounds value warn gpu
--mamba-ssm-cache-dtype value warn gpu
--mamba-ssu-algorithm value warn gpu
--master-addr value warn parallel
--master-port value warn parallel
--max-cpu-loras value refused lora
--max-cudagraph-capture-size value warn gpu
--max-log-len value warn obs
--max-logprobs value warn maxlogprobs
--max-lora-cls-labels value refused lora
--max-lora-rank value refused lora
--max-loras value refused lora
--max-model-len value honoured
--max-num-active-seqs value warn gpu
--max-num-batched-tokens value honoured
--max-num-inflight-kv-loads value warn memory
--max-num-queued-reqs value warn sched
--max-num-queued-tokens value warn sched
--max-num-scheduled-tokens value warn sched
--max-num-seqs value honoured
--max-parallel-loading-workers value warn parallel
--media-io-kwargs value warn mm
--middleware value refused code
--mm-device-do-normalize switch warn mm
--mm-encoder-attn-backend value warn gpu
--mm-encoder-attn-dtype value warn gpu
--mm-encoder-fp8-scale-path value warn mm
--mm-encoder-fp8-scale-save-margin value warn mm
--mm-encoder-fp8-scale-save-path value warn mm
--mm-encoder-only switch refused convertmodel
--mm-encoder-tp-mode value warn mm
--mm-hasher-algorithm value warn mm
--mm-ipc-gpu-memory-gb value warn memory
--mm-processor-cache-gb value warn mm
--mm-processor-cache-type value warn mm
--mm-processor-device value warn mm
--mm-processor-kwargs value warn mm
--mm-shm-cache-max-object-size-mb value warn mm
--mm-tensor-ipc value warn mm
--model value honoured
--model-class-overrides value refused overrides
--model-impl value warn hub
--model-loader-extra-config value warn hub
--moe-backend value warn gpu
--monokernel switch warn gpu
--nnodes value values 1:parallel
--no-allow-credentials switch warn cors
--no-allow-deprecated-quantization switch honoured off
--no-async-scheduling switch honoured
--no-checkpoint-prepare-on-startup switch warn memory
--no-cohere-is-reasoning-model switch honoured off
--no-cudagraph-metrics switch warn gpu
--no-data-parallel-external-lb switch warn parallel
--no-data-parallel-hybrid-lb switch warn parallel
--no-dcp-q-replicate switch warn parallel
--no-disable-cascade-attn switch warn gpu
--no-disable-chunked-mm-input switch warn mm
--no-disable-custom-all-reduce switch warn gpu
--no-disable-fastapi-docs switch warn docs
--no-disable-hybrid-kv-cache-manager switch warn gpu
--no-disable-nccl-for-dp-synchronization switch warn gpu
--no-disable-sliding-window switch honoured off
--no-disable-uvicorn-access-log switch honoured
--no-enable-auto-tool-choice switch warn autotool
--no-enable-batch-sharded-sampling switch warn gpu
--no-enable-chunked-prefill switch warn chunked
--no-enable-cumem-allocator switch warn gpu
--no-enable-dbo switch warn gpu
--no-enable-elastic-ep switch honoured off
--no-enable-ep-weight-filter switch warn gpu
--no-enable-eplb switch honoured off
--no-enable-expert-parallel switch honoured off
--no-enable-extensible-kv-cache switch warn gpu
--no-enable-fault-tolerance switch warn parallel
--no-enable-flash-late-interaction switch honoured off
--no-enable-flashinfer-autotune switch warn gpu
--no-enable-force-include-usage switch honoured off
--no-enable-hc-sp switch warn gpu
--no-enable-layerwise-nvtx-tracing switch warn gpu
--no-enable-log-deltas switch honoured off
--no-enable-log-outputs switch honoured off
--no-enable-log-requests switch honoured
--no-enable-logging-iteration-details switch warn obs
--no-enable-lora switch honoured off
--no-enable-mamba-cache-stochastic-rounding switch warn gpu
--no-enable-mamba-fine-grained-prefix-cache switch warn gpu
--no-enable-mamba-shared-prefix-checkpoint switch warn gpu
--no-enable-mfu-metrics switch warn obs
--no-enable-mixed-moe-lora-format switch honoured off
--no-enable-mm-embeds switch honoured off
--no-enable-moe-shared-loras switch honoured off
--no-enable-nccl-comm-suspend switch warn gpu
--no-enable-offline-docs switch warn gpu
--no-enable-per-request-metrics switch warn obs
--no-enable-prefix-caching switch honoured
--no-enable-prompt-embeds switch honoured off
--no-enable-prompt-tokens-details switch honoured
--no-enable-request-id-headers switch warn obs
--no-enable-return-routed-experts switch honoured off
--no-enable-scale-out switch honoured off
--no-enable-server-load-tracking switch warn obs
--no-enable-shm-tensor-arena switch warn gpu
--no-enable-sleep-mode switch honoured off
--no-enable-ssl-refresh switch warn sslrefresh
--no-enable-tokenizer-info-endpoint switch warn tokinfo
--no-enable-tower-connector-lora switch honoured off
--no-enable-trace-replay switch warn obs
--no-enforce-eager switch warn eager
--no-exclude-tools-when-tool-choice-none switch honoured off
--no-fail-on-environ-validation switch warn hub
--no-fully-sharded-loras switch honoured off
--no-interleave-mm-strings switch warn mm
--no-jit-monitor-verbose switch warn gpu
--no-kv-cache-metrics switch warn obs
--no-kv-sharing-fast-prefill switch warn memory
--no-language-model-only switch honoured off
--no-log-error-stack switch warn obs
--no-long-prefill-token-threshold-adaptive switch warn sched
--no-mm-device-do-normalize switch warn mm
--no-mm-encoder-only switch honoured off
--no-monokernel switch warn gpu
--no-numa-bind switch warn gpu
--no-ray-workers-use-nsight switch warn parallel
--no-rbln-enable-sub-block-cache switch warn rbln
--no-rbln-enforce-model-fp32 switch honoured off
--no-rbln-specialize-moe-decode switch warn rbln
--no-rbln-use-all2all-combine switch warn rbln
--no-rbln-use-all2all-dispatch switch warn rbln
--no-rbln-use-batch-attn-opt switch warn rbln
--no-rbln-use-custom-kernel switch warn rbln
--no-rbln-use-custom-sampler switch warn rbln
--no-rbln-use-dynamic-kv-cache switch warn rbln
--no-rbln-use-moe-tokens-mask switch warn rbln
--no-rbln-use-w8a8 switch honoured off
--no-return-sampling-mask switch honoured off
--no-return-tokens-as-token-ids switch honoured off
--no-scheduler-reserve-full-isl switch warn memory
--no-shuffle-safetensors-files switch warn hub
--no-skip-mm-profiling switch warn mm
--no-skip-tokenizer-init switch honoured off
--no-sleep-mode-offload-cudagraph switch honoured off
--no-specialize-active-lora switch honoured off
--no-swa-bounded-replay switch warn gpu
--no-tokens-only switch honoured off
--no-trust-remote-code switch honoured remotecode
--no-trust-request-chat-template switch honoured off
--no-trust-request-mm-kwargs switch warn mm
--no-use-fp64-gumbel switch warn gpu
--no-use-replayssm switch warn gpu
--no-use-tqdm-on-load switch warn hub
--node-rank value values 0:parallel
--num-gpu-blocks-override value honoured
--numa-bind switch warn gpu
--numa-bind-cpus values warn gpu
--numa-bind-nodes values warn gpu
--offload-backend value warn gpu
--offload-group-size value warn memory
--offload-num-in-group value warn memory
--offload-params values warn memory
--offload-prefetch-step value warn memory
--optimization-level value warn eager
--otlp-traces-endpoint value warn obs
--override-generation-config value refused overrides
--per-request-spec-decode-metrics value warn obs
--performance-mode value warn gpu
--pipeline-parallel-size value values 1:parallel
--pooler-config value refused convertmodel
--port value honoured
--prefill-context-parallel-size value values 1:parallel
--prefill-schedule-interval value warn sched
--prefix-cache-retention-interval value warn memory
--prefix-caching-hash-algo value warn memory
--prefix-match-unit value warn memory
--profiler-config value warn obs
--pt-load-map-location value warn hub
--quantization value refused quant
--quantization-config value refused quant
--ray-workers-use-nsight switch warn parallel
--rbln-compile-dtype value refused quant
--rbln-decode-batch-bucket-limit value warn rbln
--rbln-decode-batch-bucket-manual-buckets values warn rbln
--rbln-decode-batch-bucket-min value warn rbln
--rbln-decode-batch-bucket-step value warn rbln
--rbln-decode-batch-bucket-strategy value warn rbln
--rbln-enable-sub-block-cache switch warn rbln
--rbln-enforce-model-fp32 switch refused quant
--rbln-num-devices-per-local-rank value warn rbln
--rbln-optimum-overrides value refused overrides
--rbln-specialize-moe-decode switch warn rbln
--rbln-sub-block-size value warn rbln
--rbln-use-all2all-combine switch warn rbln
--rbln-use-all2all-dispatch switch warn rbln
--rbln-use-batch-attn-opt switch warn rbln
--rbln-use-custom-kernel switch warn rbln
--rbln-use-custom-sampler switch warn rbln
--rbln-use-dynamic-kv-cache switch warn rbln
--rbln-use-moe-tokens-mask switch warn rbln
--rbln-use-w8a8 switch refused quant
--reasoning-config value refused tools
--reasoning-effort-map value refused tools
--reasoning-parser value honoured
--reasoning-parser-plugin value refused code
--renderer-num-workers value warn parallel
--replayssm-buffer-len value warn gpu
--response-role value values assistant:role
--return-sampling-mask switch refused tokens_out
--return-tokens-as-token-ids switch refused tokens_out
--revision value warn hub
--root-path value honoured
--runner value values auto,generate:runner
--safetensors-load-strategy value warn hub
--safetensors-prefetch-block-size value warn hub
--safetensors-prefetch-num-threads value warn hub
--scheduler-cls value refused code
--scheduler-reserve-full-isl switch warn memory
--scheduling-policy value values fcfs:priority
--seed value honoured
--served-model-name values honoured
--show-hidden-metrics-for-version value warn obs
--shuffle-safetensors-files switch warn hub
--shutdown-timeout value warn shutdown
--skip-mm-profiling switch warn mm
--skip-tokenizer-init switch refused tokens_out
--sleep-mode-backend value refused sleep
--sleep-mode-offload-cudagraph switch refused sleep
--sleep-preserve-parameter-names values refused sleep
--sparse-indexer-topk-backend value warn gpu
--spec-method value refused spec
--spec-model value refused spec
--spec-tokens value refused spec
--specialize-active-lora switch refused lora
--speculative-config value honoured
--sse-keep-alive-interval value warn http
--ssl-ca-certs value honoured
--ssl-cert-reqs value honoured
--ssl-certfile value honoured
--ssl-ciphers value honoured
--ssl-keyfile value honoured
--stream-interval value honoured
--structured-outputs-config value warn structured
--swa-bounded-replay switch warn gpu
--tensor-parallel-size value honoured
--tokenizer value honoured
--tokenizer-mode value values auto,hf:tokmode
--tokenizer-revision value warn hub
--tokens-only switch refused tokens_out
--tool-call-parser value honoured
--tool-parser-plugin value refused code
--tool-server value refused tools
--tool-strict-level value refused tools
--trust-remote-code switch warn remotecode
--trust-request-chat-template switch refused code
--trust-request-mm-kwargs switch warn mm
--ubatch-size value warn gpu
--uds value refused listen
--use-fp64-gumbel switch warn gpu
--use-replayssm switch warn gpu
--use-tqdm-on-load switch warn hub
--uvicorn-log-level value honoured
--video-pruning-method value warn mm
--video-pruning-rate value warn mm
--watchdog-config value warn obs
--watermark value refused watermark
--watermark-config value refused watermark
--weight-transfer-config value refused sleep
--worker-cls value refused code
--worker-extension-cls value refused code
-ac value warn gpu
-asc value honoured
-cc value warn eager
-dc value refused convertmodel
-dcp value values 1:parallel
-dp value values 1:parallel
-dpa value warn parallel
-dpb value warn parallel
-dpe switch warn parallel
-dph switch warn parallel
-dpl value values 1:parallel
-dpm switch warn parallel
-dpn value values 0:parallel
-dpp value warn parallel
-dpr value values 0:parallel
-ep switch refused expert
-n value values 1:parallel
-pcp value values 1:parallel
-pp value values 1:parallel
-q value refused quant
-r value values 0:parallel
-sc value honoured
-tp value honoured
"""


@dataclass(frozen=True)
class VllmFlag:
    """One row of `TABLE`."""

    flag: str                    # the option string, as vLLM spells it
    arity: str                   # switch | value | values | optional (vLLM's)
    fate: str                    # honoured | warn | refused | values
    allowed: tuple[str, ...]     # fate values: the values honoured
    reason: str                  # REASONS key ("" for a flag of atombatch's own parser)


def _rows() -> dict[str, VllmFlag]:
    rows = {}
    for line in TABLE.splitlines():
        flag, arity, fate, *rest = line.split()
        detail = rest[0] if rest else ""
        allowed: tuple[str, ...] = ()
        if fate == "values":
            values, detail = detail.split(":")
            allowed = tuple(values.split(","))
        rows[flag] = VllmFlag(flag, arity, fate, allowed, detail)
    return rows


FLAGS: dict[str, VllmFlag] = _rows()


class _Accepted(argparse.Action):
    """A flag with no meaning here: its value is recorded for one warning (`warnings`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen = getattr(namespace, "vllm_ignored", None) or {}
        seen.setdefault(option_string, REASONS[FLAGS[str(option_string)].reason])
        namespace.vllm_ignored = seen


class _Honoured(argparse.Action):
    """A flag asking for what atombatch does anyway: nothing to do."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        pass


class _Checked(argparse.Action):
    """Refused, or honoured for its `allowed` values only: anything else exits 2 naming why."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        row = FLAGS[str(option_string)]
        if row.fate == "values" and values in row.allowed:
            return
        shown = f"{option_string} {values}" if isinstance(values, str) else \
            " ".join([str(option_string), *values]) if values else str(option_string)
        rule = REASONS[row.reason]
        if row.fate == "values":
            rule = f"{rule}; accepted: {', '.join(row.allowed)}"
        parser.error(f"{shown}: vLLM's flag is refused here: {rule} (docs/from-vllm.md#flags)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every flag of `TABLE` that `parser` does not have (hidden from --help).

    Raises:
        AssertionError: an honoured flag without DETAIL is missing from `parser`.
    """
    have = set(parser._option_string_actions)
    for row in FLAGS.values():
        if row.flag in have:
            continue
        assert not (row.fate == "honoured" and not row.reason), f"{row.flag} is not in the parser"
        action: type[argparse.Action] = {"honoured": _Honoured, "warn": _Accepted}.get(
            row.fate, _Checked)
        parser.add_argument(row.flag, action=action, nargs=ARITIES[row.arity],
                            dest="vllm_flag_" + row.flag.lstrip("-").replace("-", "_"),
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


RBLN_ENV_REASON = ("vllm-rbln's environment knobs are not read: the compiled directory's "
                   "rbln_config.json decides (docs/from-vllm.md)")


def ignored_environment(environ: Mapping[str, str]) -> list[str]:
    """The vllm-rbln environment variables set (`VLLM_RBLN_*`): each is warned about once."""
    return sorted(name for name in environ if name.startswith("VLLM_RBLN_"))


def warnings(args: argparse.Namespace) -> dict[str, str]:
    """The accepted flags with no meaning here that `args` holds: flag -> why (one each)."""
    return dict(getattr(args, "vllm_ignored", None) or {})
