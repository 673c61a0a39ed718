"""Compiled optimum-rbln decoder-only directories: `rbln_config.json`, graph input lists, checks.

optimum-rbln (0.12) writes one directory per compiled causal LM: the Hugging Face `config.json`,
`rbln_config.json`, `prefill.rbln` and one `decoder_batch_{b}.rbln` per entry of
`decoder_batch_sizes`. `rbln_config.json` holds the compile options at its top level and, under
`_compile_cfgs`, one entry per graph (`compiled_model_name`, `input_info` as `[name, shape, dtype]`
triples, `npu`, `num_devices`). A graph's `input_info` lists the host inputs in positional order
followed by the device-resident KV caches (`past_key_values_{2l}` K, `{2l+1}` V), which the host
never passes.

`load(model_dir)` reads all of it, derives the `ArtifactConfig` (`load_artifact(model_dir)` when
only that is wanted), reads each graph's input list from the file (or derives it exactly as
optimum-rbln's `get_input_info` does when the file does not record it), checks every field against
the others, the model's `config.json` and atombatch's admission rules, and raises `ConfigError`
naming the field. The input table is in `docs/device.md`.

LoRA (`lora_config`): optimum-rbln compiles every adapter into the graphs, numbered 1..N
(`lora_int_id`; 0 is the base model, a zero adapter it injects and never writes to the file), and
every graph then takes one more input, `lora_int_ids` int32 `[batch]`, after the others: each row's
compiled adapter. `load` reads the adapters into `OptimumArtifact.lora` (`LoraCompileConfig`) and
checks each field (docs/lora.md, "Compiled adapters on ATOM").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.artifact.lora import MAX_LORA_RANK, TARGET_MODULES
from atombatch.errors import ConfigError
from atombatch.kernel.codes import check_buckets

CONFIG_FILE = "rbln_config.json"
PREFILL = "prefill"
HOST_INPUTS = ("input_ids", "cache_position", "block_tables", "local_block_tables",
               "query_position", "attention_mask", "position_ids", "lora_int_ids")
LORA_INPUT = "lora_int_ids"
# the projections optimum-rbln 0.12 swaps for its multi-adapter linear (attention and MLP, the
# same seven atombatch's LoRA math adapts); an adapter targeting anything else would be compiled
# without that part
LORA_TARGET_MODULES = TARGET_MODULES
LORA_ADAPTER_FIELDS = ("lora_int_id", "lora_name", "lora_path", "r", "lora_alpha",
                       "target_modules", "bias", "use_rslora", "scaling_factor")
MAX_COMPILED_ADAPTERS = 1024       # adapters one lora_config may list
MAX_COMPILED_LORA_RANK = MAX_LORA_RANK   # max_lora_rank / r (512, atombatch's LoRA bound)
MAX_LORA_NAME = 256                # characters of a lora_name
MAX_LORA_PATH = 4096               # characters of a lora_path
KV_PREFIX = "past_key_values_"
# optimum-rbln's per-NPU attention limits (modeling_attention_utils.AttentionLimits):
# (max eager max_seq_len, min and max flash partition length, max sliding window).
NPU_LIMITS = {"RBLN-CA": ("ATOM", 32_768, 1_024, 32_768, 32_768),
              "RBLN-CR": ("REBEL", 16_384, 1_024, 16_384, 32_767)}


class GraphInput(msgspec.Struct, frozen=True):
    """One positional input (or KV cache) of a compiled graph, as `input_info` records it."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class CompiledGraph(msgspec.Struct, frozen=True):
    """One compiled graph of the directory."""

    name: str                          # "prefill" or "decoder_batch_{b}"
    file: str                          # absolute path of its `.rbln` file
    batch: int                         # rows: 1 for prefill, b for decoder_batch_{b}
    query_length: int                  # prefill_chunk_size for prefill, 1 for decode
    inputs: tuple[GraphInput, ...]     # host inputs in positional order
    recorded: bool                     # True: read from rbln_config.json; False: derived

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)


class CompiledAdapter(msgspec.Struct, frozen=True):
    """One adapter optimum-rbln compiled into the graphs (a `lora_config.adapters` entry)."""

    lora_int_id: int                   # 1..N: the row id that selects it (0 is the base model)
    lora_name: str                     # the name it is served under
    lora_path: str                     # the PEFT directory it was compiled from (may be gone)
    r: int                             # rank (<= max_lora_rank)
    lora_alpha: float
    target_modules: tuple[str, ...]    # projections it adapts (LORA_TARGET_MODULES)
    use_rslora: bool = False
    scaling_factor: float = 1.0        # optimum-rbln's extra factor on the scaling


class LoraCompileConfig(msgspec.Struct, frozen=True):
    """`rbln_config.json`'s `lora_config`: the compiled adapters, by ascending `lora_int_id`."""

    adapters: tuple[CompiledAdapter, ...]
    max_lora_rank: int

    @property
    def ids(self) -> tuple[int, ...]:
        """Every id a row may carry: 0 (base) and the compiled adapters' 1..N."""
        return (0, *(a.lora_int_id for a in self.adapters))


class OptimumArtifact(msgspec.Struct, frozen=True):
    """What atombatch needs from one compiled optimum-rbln directory."""

    path: str                                  # the model directory
    artifact: ArtifactConfig                   # lanes, context, blocks, chunk, TP, KV dtype,
                                               # compiled decode batch sizes
    attn_impl: str                             # "eager" | "flash_attn"
    cache_impl: str                            # "static" | "hybrid"
    logits_to_keep: int                        # 1: prefill returns [1, 1, V]; 0: [1, Q, V]
    use_attention_mask: bool
    use_position_ids: bool
    dtype: str                                 # activations, masks and KV caches
    npu: str | None                            # the compile target, when recorded
    optimum_rbln_version: str | None
    prefill: CompiledGraph
    decoders: tuple[CompiledGraph, ...]        # ascending by batch
    kv_caches: tuple[GraphInput, ...]          # past_key_values_{i}, device-resident
    output_hidden_states: bool = False
    lora: LoraCompileConfig | None = None      # the compiled adapters (graphs take lora_int_ids)

    @property
    def decoder_batch_sizes(self) -> tuple[int, ...]:
        """The compiled decode batch sizes, ascending (kept once, on the artifact)."""
        return self.artifact.decoder_batch_sizes

    def decoder(self, rows: int) -> CompiledGraph:
        for graph in self.decoders:
            if graph.batch == rows:
                return graph
        raise ConfigError(f"no decode graph of batch {rows}: this directory has "
                          f"decoder_batch_sizes={list(self.decoder_batch_sizes)}")


# -- input lists ------------------------------------------------------------------------------------
def derive_inputs(*, batch: int, query_length: int, max_seq_len: int, block_size: int,
                  global_attention: bool, local_attention: bool, logits_to_keep: int,
                  use_attention_mask: bool, use_position_ids: bool, dtype: str,
                  lora: bool = False) -> tuple[GraphInput, ...]:
    """A graph's host inputs, in the order optimum-rbln's `get_input_info` builds them.

    `query_length > 1` is the prefill graph (batch 1), `query_length == 1` a decode graph;
    `lora` (a `lora_config`) appends `lora_int_ids` int32 `[batch]` after the others.
    """
    prefill = query_length > 1
    rows = [GraphInput("input_ids", (batch, query_length), "int64"),
            GraphInput("cache_position", (batch, query_length), "int32")]
    if global_attention:
        bps = max_seq_len // block_size
        rows.append(GraphInput("block_tables", (bps,) if prefill else (batch, bps), "int16"))
    if local_attention:
        rows.append(GraphInput("local_block_tables", (1,) if prefill else (batch, 1), "int16"))
    if prefill and (local_attention or logits_to_keep == 1):
        rows.append(GraphInput("query_position", (), "int16"))
    if use_attention_mask:
        shape = (batch, max_seq_len) if use_position_ids else \
            (batch, 1, query_length, max_seq_len)
        rows.append(GraphInput("attention_mask", shape, dtype))
    if use_position_ids:
        rows.append(GraphInput("position_ids", (batch, query_length), "int32"))
    if lora:
        rows.append(GraphInput(LORA_INPUT, (batch,), "int32"))
    return tuple(rows)


def kv_cache_inputs(spec: ModelSpec, *, num_blocks: int, block_size: int, batch_size: int,
                    dtype: str) -> tuple[GraphInput, ...]:
    """`past_key_values_{2l}` (K) and `{2l+1}` (V) of every layer: global layers
    `[num_blocks, kv_heads, block_size, head_dim]`, sliding layers `[batch, kv_heads, window, d]`."""
    out = []
    for i in range(2 * spec.num_layers):
        sliding = spec.layer_kinds[i // 2] != "full_attention"
        shape = ((batch_size, spec.num_kv_heads, spec.sliding_window, spec.head_dim) if sliding
                 else (num_blocks, spec.num_kv_heads, block_size, spec.head_dim))
        out.append(GraphInput(f"{KV_PREFIX}{i}", shape, dtype))
    return tuple(out)


# -- reading ----------------------------------------------------------------------------------------
def _get(raw: dict[str, Any], field: str, kind: type | tuple[type, ...], default: Any = ...,
         ) -> Any:
    if field not in raw or raw[field] is None:
        if default is ...:
            raise ConfigError(f"{CONFIG_FILE}: field {field!r} is missing")
        return default
    value = raw[field]
    if (isinstance(value, bool) and kind is int) or not isinstance(value, kind):
        raise ConfigError(f"{CONFIG_FILE}: field {field!r}={value!r} has the wrong type")
    return value


def _positive(raw: dict[str, Any], field: str, default: Any = ...) -> int:
    value = _get(raw, field, int, default)
    if value <= 0:
        raise ConfigError(f"{CONFIG_FILE}: {field}={value} must be a positive integer")
    return int(value)


def _parse_input_info(graph: str, raw: Any) -> tuple[GraphInput, ...]:
    field = f"_compile_cfgs[{graph}].input_info"
    if not isinstance(raw, list):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be a list of [name, shape, dtype]")
    out = []
    for item in raw:
        if (not isinstance(item, (list, tuple)) or len(item) != 3 or not isinstance(item[0], str)
                or not isinstance(item[1], list) or not isinstance(item[2], str)
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in item[1])):
            raise ConfigError(f"{CONFIG_FILE}: {field} entry {item!r} is not [name, shape, dtype]")
        out.append(GraphInput(item[0], tuple(item[1]), item[2]))
    return tuple(out)


def _npu_limits(npu: str | None) -> tuple[str, int, int, int, int] | None:
    if not npu:
        return None
    for prefix, limits in NPU_LIMITS.items():
        if npu.upper().startswith(prefix):
            return limits
    return None


def load(model_dir: str | os.PathLike[str], model: ModelSpec | None = None) -> OptimumArtifact:
    """Read and check a compiled optimum-rbln causal-LM directory.

    Args:
        model_dir: the directory optimum-rbln's `save_pretrained` wrote (or `rbln_config.json`
            itself).
        model: the model's spec; None reads the directory's `config.json`. When both exist they
            must agree.
    Raises:
        ConfigError: a missing file, a missing, ill-typed or contradicting field, an option
            atombatch does not support (inputs_embeds, fp8 KV caches, batch sorting), a
            `lora_config` field out of its bounds (`read_lora_config`), or an
            artifact that breaks atombatch's admission rules; the message names the field.
    """
    path = Path(model_dir)
    if path.name == CONFIG_FILE:
        path = path.parent
    config_path = path / CONFIG_FILE
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path} does not exist: not a compiled optimum-rbln "
                          "directory (see docs/device.md)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path} must hold a JSON object")
    spec = _model_spec(path, model)

    _refuse_unsupported(raw)
    lora = read_lora_config(raw.get("lora_config"))

    # -- shapes ------------------------------------------------------------------------------------
    batch_size = _positive(raw, "batch_size", 1)
    max_seq_len = _positive(raw, "max_seq_len")
    chunk = _positive(raw, "prefill_chunk_size")
    attn_impl = _get(raw, "attn_impl", str, "eager")
    block_size = _positive(raw, "kvcache_block_size")
    num_blocks = _get(raw, "kvcache_num_blocks", int)
    if num_blocks <= 0:
        raise ConfigError(f"{CONFIG_FILE}: kvcache_num_blocks={num_blocks}: the block count was "
                          "never resolved; compile with an explicit kvcache_num_blocks "
                          "(docs/device.md)")
    npu = _get(raw, "npu", str, None)
    cfgs_raw = _get(raw, "_compile_cfgs", list, [])
    for cfg in cfgs_raw:
        if isinstance(cfg, dict) and isinstance(cfg.get("npu"), str):
            npu = npu or cfg["npu"]
    limits = _npu_limits(npu)
    if attn_impl == "eager":
        if block_size != max_seq_len:
            raise ConfigError(f"{CONFIG_FILE}: kvcache_block_size={block_size} contradicts "
                              f"attn_impl='eager', which needs it equal to max_seq_len="
                              f"{max_seq_len}")
        if limits and max_seq_len > limits[1]:
            raise ConfigError(f"{CONFIG_FILE}: max_seq_len={max_seq_len} exceeds {limits[0]}'s "
                              f"eager limit {limits[1]}")
    elif attn_impl == "flash_attn":
        partition = _positive(raw, "kvcache_partition_len")
        if partition != block_size:
            raise ConfigError(f"{CONFIG_FILE}: kvcache_partition_len={partition} contradicts "
                              f"kvcache_block_size={block_size}: flash_attn needs them equal")
        if max_seq_len % partition or max_seq_len // partition < 2:
            raise ConfigError(f"{CONFIG_FILE}: max_seq_len={max_seq_len} must be a multiple of "
                              f"kvcache_partition_len={partition} and at least twice it")
        if limits and not limits[2] <= partition <= limits[3]:
            raise ConfigError(f"{CONFIG_FILE}: kvcache_partition_len={partition} is outside "
                              f"{limits[0]}'s flash_attn range {limits[2]}..{limits[3]}")
    else:
        raise ConfigError(f"{CONFIG_FILE}: attn_impl={attn_impl!r} is not 'eager' or "
                          "'flash_attn'")

    # -- attention kinds vs the model ----------------------------------------------------------------
    cache_impl = _get(raw, "cache_impl", str, "static")
    window = _get(raw, "sliding_window", int, None)
    sliding_layers = tuple(_get(raw, "sliding_window_layers", list, []))
    if cache_impl == "static":
        if spec.is_hybrid:
            raise ConfigError(f"{CONFIG_FILE}: cache_impl='static' contradicts the model "
                              f"{spec.name}, which has sliding-window layers {spec.sliding_layers}")
    elif cache_impl == "hybrid":
        if not spec.is_hybrid:
            raise ConfigError(f"{CONFIG_FILE}: cache_impl='hybrid' contradicts the model "
                              f"{spec.name}, which has no sliding-window layers")
        if window != spec.sliding_window:
            raise ConfigError(f"{CONFIG_FILE}: sliding_window={window} contradicts the model's "
                              f"sliding_window={spec.sliding_window}")
        if sliding_layers != spec.sliding_layers:
            raise ConfigError(f"{CONFIG_FILE}: sliding_window_layers={list(sliding_layers)} "
                              f"contradicts the model's {list(spec.sliding_layers)}")
        if limits and window > limits[4] - chunk:
            raise ConfigError(f"{CONFIG_FILE}: sliding_window={window} exceeds {limits[0]}'s "
                              f"limit {limits[4]} - prefill_chunk_size {chunk}")
    elif cache_impl == "sliding_window":
        raise ConfigError(f"{CONFIG_FILE}: cache_impl='sliding_window' (every layer sliding) is "
                          "not supported: atombatch serves static and hybrid caches")
    else:
        raise ConfigError(f"{CONFIG_FILE}: cache_impl={cache_impl!r} is not one of 'static', "
                          "'hybrid', 'sliding_window'")
    global_attention = True   # static and hybrid both have global layers
    local_attention = cache_impl == "hybrid"

    use_mask = _get(raw, "use_attention_mask", bool, False)
    use_pos = _get(raw, "use_position_ids", bool, False)
    if use_pos and not use_mask:
        raise ConfigError(f"{CONFIG_FILE}: use_position_ids=true contradicts "
                          "use_attention_mask=false (position ids come with a mask)")
    logits_to_keep = _get(raw, "logits_to_keep", int, 1)
    if logits_to_keep not in (0, 1):
        raise ConfigError(f"{CONFIG_FILE}: logits_to_keep={logits_to_keep} is not 0 or 1")
    dtype = _get(raw, "dtype", str, "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{CONFIG_FILE}: dtype={dtype!r} is not float32, bfloat16 or float16")

    # optimum-rbln records the sizes in any order; the one rule for them is `check_buckets`
    buckets_raw = _get(raw, "decoder_batch_sizes", list, [batch_size])
    ints = all(isinstance(b, int) and not isinstance(b, bool) for b in buckets_raw)
    try:
        buckets = check_buckets(batch_size, sorted(buckets_raw) if ints else buckets_raw)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_FILE}: {exc}") from None

    tp = _tensor_parallel(raw, cfgs_raw)

    try:
        artifact = _artifact(spec, batch_size=batch_size, max_seq_len=max_seq_len,
                             block_size=block_size, num_blocks=num_blocks,
                             prefill_chunk_size=chunk, tensor_parallel=tp, kv_dtype=dtype,
                             buckets=buckets)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_FILE} (batch_size={batch_size}, max_seq_len={max_seq_len}, "
                          f"kvcache_block_size={block_size}, kvcache_num_blocks={num_blocks}, "
                          f"prefill_chunk_size={chunk}): {exc} (docs/device.md)") from None

    # -- graphs: names, files, input lists -----------------------------------------------------------
    recorded = _recorded_inputs(cfgs_raw)
    wanted = [PREFILL] + [f"decoder_batch_{b}" for b in buckets]
    if recorded and set(recorded) != set(wanted):
        raise ConfigError(f"{CONFIG_FILE}: _compile_cfgs names {sorted(recorded)} contradict "
                          f"phases and decoder_batch_sizes, which need {wanted}")
    kv = kv_cache_inputs(spec, num_blocks=num_blocks, block_size=block_size,
                         batch_size=batch_size, dtype=dtype)
    common = dict(max_seq_len=max_seq_len, block_size=block_size,
                  global_attention=global_attention, local_attention=local_attention,
                  logits_to_keep=logits_to_keep, use_attention_mask=use_mask,
                  use_position_ids=use_pos, dtype=dtype, lora=lora is not None)
    graphs = []
    for name in wanted:
        batch = 1 if name == PREFILL else int(name.rsplit("_", 1)[1])
        query = chunk if name == PREFILL else 1
        derived = derive_inputs(batch=batch, query_length=query, **common)  # type: ignore[arg-type]
        file = path / f"{name}.rbln"
        if not file.exists():
            raise ConfigError(f"{file} does not exist: {CONFIG_FILE} lists graph {name!r} "
                              "(phases / decoder_batch_sizes)")
        info = recorded.get(name, ())
        inputs = _check_recorded(name, info, derived, kv) if info else derived
        graphs.append(CompiledGraph(name=name, file=str(file), batch=batch, query_length=query,
                                    inputs=inputs, recorded=bool(info)))
    return OptimumArtifact(
        path=str(path), artifact=artifact, attn_impl=attn_impl,
        cache_impl=cache_impl, logits_to_keep=logits_to_keep, use_attention_mask=use_mask,
        use_position_ids=use_pos, dtype=dtype, npu=npu,
        optimum_rbln_version=_get(raw, "optimum_rbln_version", str, None),
        prefill=graphs[0], decoders=tuple(graphs[1:]), kv_caches=kv,
        output_hidden_states=_get(raw, "output_hidden_states", bool, False), lora=lora)


def load_artifact(model_dir: str | os.PathLike[str], model: ModelSpec | None = None) -> ArtifactConfig:
    """The artifact of a compiled optimum-rbln directory (or its `rbln_config.json`).

    Lanes, context, block size, block count, chunk, tensor parallel, KV dtype and the compiled
    decode batch sizes come from `rbln_config.json`; the model from `model` or the directory's
    `config.json`. Every field is checked as `load` checks it (docs/device.md).

    Raises:
        ConfigError: a missing, contradicting or unsupported field, named in the message.
    """
    return load(model_dir, model).artifact


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """Compile options atombatch refuses rather than mis-drive (each names the option)."""
    cls_name = _get(raw, "cls_name", str, "")
    if cls_name and not cls_name.endswith("ForCausalLMConfig"):
        raise ConfigError(f"{CONFIG_FILE}: cls_name={cls_name!r} is not a causal LM "
                          "(…ForCausalLMConfig); atombatch drives decoder-only causal LMs")
    if _get(raw, "use_inputs_embeds", bool, False):
        raise ConfigError(f"{CONFIG_FILE}: use_inputs_embeds=true is not supported: atombatch "
                          "feeds input_ids; recompile without it")
    quant = _get(raw, "quantization", dict, {})
    if quant.get("kv_caches") == "fp8":
        raise ConfigError(f"{CONFIG_FILE}: quantization.kv_caches='fp8' is not supported: "
                          "atombatch moves KV as bfloat16/float16/float32")
    if _get(raw, "_requires_batch_sort", bool, False):
        raise ConfigError(f"{CONFIG_FILE}: _requires_batch_sort=true: this graph needs decode "
                          "rows sorted by length, but atombatch packs rows in lane order")
    phases = _get(raw, "phases", list, ["prefill", "decode"])
    if "decode" not in phases:
        raise ConfigError(f"{CONFIG_FILE}: phases={phases} has no 'decode': the directory has "
                          "no decode graph")
    if "image_prefill" in phases:
        raise ConfigError(f"{CONFIG_FILE}: phases={phases}: image_prefill is not supported")


def read_lora_config(raw: Any) -> LoraCompileConfig | None:
    """`rbln_config.json`'s `lora_config` as optimum-rbln 0.12 writes it (None: no LoRA).

    The rules are optimum-rbln's own (`RBLNLoRAConfig`): a non-empty `adapters` list whose
    `lora_int_id`s are 1..N, each once (0 is the base model and never listed); names unique;
    every rank positive and at most `max_lora_rank`; `bias="none"`. atombatch adds bounds on
    every size and refuses a target module optimum-rbln does not adapt (the compiled adapter
    would not be the trained one).

    Raises:
        ConfigError: naming the field (`lora_config.adapters[i].field`), its value and the rule.
    """
    if raw is None:
        return None
    where = "lora_config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{CONFIG_FILE}: {where}={raw!r} must be an object with adapters and "
                          "max_lora_rank")
    unknown = sorted(set(raw) - {"adapters", "max_lora_rank"})
    if unknown:
        raise ConfigError(f"{CONFIG_FILE}: {where} has unknown fields {unknown} (optimum-rbln "
                          "0.12 writes adapters and max_lora_rank)")
    entries = raw.get("adapters")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{CONFIG_FILE}: {where}.adapters={entries!r} must be a non-empty list "
                          "of compiled adapters")
    if len(entries) > MAX_COMPILED_ADAPTERS:
        raise ConfigError(f"{CONFIG_FILE}: {where}.adapters lists {len(entries)} adapters, more "
                          f"than atombatch's bound {MAX_COMPILED_ADAPTERS}")
    adapters = [_lora_adapter(f"{where}.adapters[{i}]", entry) for i, entry in enumerate(entries)]
    ids = sorted(a.lora_int_id for a in adapters)
    if ids != list(range(1, len(adapters) + 1)):
        raise ConfigError(f"{CONFIG_FILE}: {where}.adapters have lora_int_id {ids}: they must be "
                          f"1..{len(adapters)}, each once (0 is the base model)")
    names: dict[str, int] = {}
    for adapter in adapters:
        if adapter.lora_name in names:
            raise ConfigError(f"{CONFIG_FILE}: {where}.adapters name {adapter.lora_name!r} twice "
                              f"(lora_int_id {names[adapter.lora_name]} and "
                              f"{adapter.lora_int_id}): names must be unique")
        names[adapter.lora_name] = adapter.lora_int_id
    largest = max(a.r for a in adapters)
    max_rank = raw.get("max_lora_rank")
    if max_rank is None:
        max_rank = largest                      # optimum-rbln's default: the largest rank
    if not isinstance(max_rank, int) or isinstance(max_rank, bool) or \
            not 1 <= max_rank <= MAX_COMPILED_LORA_RANK:
        raise ConfigError(f"{CONFIG_FILE}: {where}.max_lora_rank={max_rank!r} must be an "
                          f"integer in 1..{MAX_COMPILED_LORA_RANK}")
    for adapter in adapters:
        if adapter.r > max_rank:
            raise ConfigError(f"{CONFIG_FILE}: {where} adapter {adapter.lora_name!r} has r="
                              f"{adapter.r}, above max_lora_rank={max_rank}")
    adapters.sort(key=lambda a: a.lora_int_id)
    return LoraCompileConfig(adapters=tuple(adapters), max_lora_rank=max_rank)


def _lora_adapter(where: str, raw: Any) -> CompiledAdapter:
    """One `lora_config.adapters` entry, every field checked."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{CONFIG_FILE}: {where}={raw!r} must be an object")
    unknown = sorted(set(raw) - set(LORA_ADAPTER_FIELDS))
    if unknown:
        raise ConfigError(f"{CONFIG_FILE}: {where} has unknown fields {unknown} (optimum-rbln "
                          f"0.12 writes {', '.join(LORA_ADAPTER_FIELDS)})")

    def integer(field: str, low: int, high: int) -> int:
        value = raw.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{CONFIG_FILE}: {where}.{field}={value!r} must be an integer in "
                              f"{low}..{high}")
        return value

    def positive(field: str, default: float | None = None) -> float:
        value = raw.get(field)
        if value is None and default is not None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                not 0 < value < float("inf"):
            raise ConfigError(f"{CONFIG_FILE}: {where}.{field}={value!r} must be a positive, "
                              "finite number")
        return float(value)

    def text(field: str, limit: int) -> str:
        value = raw.get(field)
        if not isinstance(value, str) or not 0 < len(value) <= limit:
            raise ConfigError(f"{CONFIG_FILE}: {where}.{field}={value!r:.80} must be a string "
                              f"of 1..{limit} characters")
        return value

    lora_int_id = integer("lora_int_id", 0, MAX_COMPILED_ADAPTERS)
    if lora_int_id == 0:
        raise ConfigError(f"{CONFIG_FILE}: {where}.lora_int_id=0 is reserved for the base model; "
                          "compiled adapters are numbered from 1")
    name = text("lora_name", MAX_LORA_NAME)
    path = text("lora_path", MAX_LORA_PATH)
    r = integer("r", 1, MAX_COMPILED_LORA_RANK)
    alpha = positive("lora_alpha")
    modules = raw.get("target_modules")
    if not isinstance(modules, list) or len(modules) > len(LORA_TARGET_MODULES) or \
            not all(isinstance(m, str) for m in modules) or len(set(modules)) != len(modules):
        raise ConfigError(f"{CONFIG_FILE}: {where}.target_modules={modules!r:.120} must be a list "
                          f"of distinct module names from {list(LORA_TARGET_MODULES)}")
    for module in modules:
        if module not in LORA_TARGET_MODULES:
            raise ConfigError(f"{CONFIG_FILE}: {where}.target_modules has {module!r}, which "
                              "optimum-rbln does not adapt (it adapts "
                              f"{', '.join(LORA_TARGET_MODULES)}): the compiled adapter would "
                              "not be the trained one")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise ConfigError(f"{CONFIG_FILE}: {where}.bias={bias!r}: only 'none' is supported "
                          "(optimum-rbln compiles no LoRA bias)")
    rslora = raw.get("use_rslora", False)
    if rslora is None:
        rslora = False
    if not isinstance(rslora, bool):
        raise ConfigError(f"{CONFIG_FILE}: {where}.use_rslora={rslora!r} must be true or false")
    return CompiledAdapter(lora_int_id=lora_int_id, lora_name=name, lora_path=path, r=r,
                           lora_alpha=alpha, target_modules=tuple(modules), use_rslora=rslora,
                           scaling_factor=positive("scaling_factor", 1.0))


def _tensor_parallel(raw: dict[str, Any], cfgs_raw: list[Any]) -> int:
    """The tensor parallel size, the same wherever the file records it (1 when it does not)."""
    recorded_tp = [raw.get("tensor_parallel_size"), raw.get("num_devices")]
    recorded_tp += [cfg.get("num_devices") for cfg in cfgs_raw if isinstance(cfg, dict)]
    for value in recorded_tp:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ConfigError(f"{CONFIG_FILE}: num_devices={value!r} must be a positive integer")
    tp_values = {v for v in recorded_tp if v is not None}
    if len(tp_values) > 1:
        raise ConfigError(f"{CONFIG_FILE}: num_devices / tensor_parallel_size disagree across "
                          f"the file: {sorted(tp_values)}")
    return tp_values.pop() if tp_values else 1


def _recorded_inputs(cfgs_raw: list[Any]) -> dict[str, tuple[GraphInput, ...]]:
    """Each compiled graph's recorded input list (`_compile_cfgs`), by graph name."""
    recorded: dict[str, tuple[GraphInput, ...]] = {}
    for cfg in cfgs_raw:
        if not isinstance(cfg, dict) or not isinstance(cfg.get("compiled_model_name"), str):
            raise ConfigError(f"{CONFIG_FILE}: _compile_cfgs entry {cfg!r} has no "
                              "compiled_model_name")
        name = cfg["compiled_model_name"]
        if name in recorded:
            raise ConfigError(f"{CONFIG_FILE}: _compile_cfgs names {name!r} twice")
        recorded[name] = (_parse_input_info(name, cfg["input_info"])
                          if cfg.get("input_info") is not None else ())
    return recorded


def _check_recorded(graph: str, info: tuple[GraphInput, ...], derived: tuple[GraphInput, ...],
                    kv: tuple[GraphInput, ...]) -> tuple[GraphInput, ...]:
    """The recorded host inputs (their order rules), checked against the config-derived list."""
    field = f"_compile_cfgs[{graph}].input_info"
    host = tuple(i for i in info if not i.name.startswith(KV_PREFIX))
    caches = {i.name: i for i in info if i.name.startswith(KV_PREFIX)}
    first_kv = next((n for n, i in enumerate(info) if i.name.startswith(KV_PREFIX)), len(info))
    if any(not i.name.startswith(KV_PREFIX) for i in info[first_kv:]):
        raise ConfigError(f"{CONFIG_FILE}: {field} has host inputs after the KV caches")
    for item in host:
        if item.name not in HOST_INPUTS:
            raise ConfigError(f"{CONFIG_FILE}: {field} has input {item.name!r}, which atombatch "
                              f"cannot supply (it supplies {', '.join(HOST_INPUTS)})")
    expected = {i.name: i for i in derived}
    got = {i.name: i for i in host}
    if len(got) != len(host) or set(got) != set(expected):
        raise ConfigError(f"{CONFIG_FILE}: {field} lists inputs {[i.name for i in host]}, but "
                          f"the config's options give {[i.name for i in derived]}")
    for name, item in got.items():
        want = expected[name]
        if item.shape != want.shape or item.dtype != want.dtype:
            raise ConfigError(f"{CONFIG_FILE}: {field} {name} is {list(item.shape)} {item.dtype}, "
                              f"the config's shape fields give {list(want.shape)} {want.dtype}")
    if caches:
        if set(caches) != {c.name for c in kv}:
            raise ConfigError(f"{CONFIG_FILE}: {field} has KV caches {sorted(caches)}, the model "
                              f"has {2 * (len(kv) // 2)} (past_key_values_0..{len(kv) - 1})")
        for cache in kv:
            item = caches[cache.name]
            # an auto-sized cache is recorded at its compile shape (one block)
            if item.shape[1:] != cache.shape[1:] or item.dtype != cache.dtype or \
                    item.shape[0] not in (cache.shape[0], 1):
                raise ConfigError(f"{CONFIG_FILE}: {field} {cache.name} is {list(item.shape)} "
                                  f"{item.dtype}, the config and model give "
                                  f"{list(cache.shape)} {cache.dtype}")
    return host


def _model_spec(path: Path, model: ModelSpec | None) -> ModelSpec:
    has_config = (path / "config.json").exists()
    if model is None:
        if not has_config:
            raise ConfigError(f"{path / 'config.json'} does not exist: pass the model's "
                              "ModelSpec or keep the config.json optimum-rbln saved")
        return ModelSpec.from_pretrained(path)
    if has_config:
        theirs = ModelSpec.from_pretrained(path)
        skip = {"name", "bos_token_id", "eos_token_ids", "dtype"}
        mine = {k: v for k, v in model.shape_fields.items() if k not in skip}
        other = {k: v for k, v in theirs.shape_fields.items() if k not in skip}
        diff = sorted(k for k in mine if mine[k] != other.get(k))
        if diff:
            raise ConfigError(f"the model spec {model.name} contradicts {path / 'config.json'} "
                              f"in {diff}")
    return model


def _artifact(spec: ModelSpec, *, buckets: tuple[int, ...], **fields: Any) -> ArtifactConfig:
    return ArtifactConfig(model=spec, decoder_batch_sizes=buckets, **fields)
