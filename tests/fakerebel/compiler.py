"""Writes a compiled directory as optimum-rbln 0.12 lays it out, for the emulated `rebel`.

`compile_dir` takes a Hugging Face checkpoint directory and the compile options optimum-rbln takes
(`batch_size`, `max_seq_len`, `kvcache_block_size`, `kvcache_num_blocks`, `attn_impl`,
`prefill_chunk_size`, `decoder_batch_sizes`, `logits_to_keep`, masks, dtype) and writes:
  - `rbln_config.json` with optimum-rbln's field names, `_compile_cfgs` (one per graph, with its
    `input_info` unless `record_input_info=False`) and `cache_metas`;
  - `config.json` and the safetensors weights (the emulator computes with them);
  - `prefill.rbln` and one `decoder_batch_{b}.rbln` per decode batch, each holding the graph's
    input list as it was "compiled": what the emulated device checks every call against.

The input lists are built here on their own, following optimum-rbln's `get_input_info`, so that
atombatch's reading and derivation are tested against an independent statement of the contract.

LoRA: `lora_config(adapters)` writes the `lora_config` entry as optimum-rbln 0.12's
`RBLNLoRAConfig` serializes it (each adapter's unset fields read from its PEFT directory's
`adapter_config.json`; `optimum_lora.json` beside this file records what optimum-rbln's own
classes wrote for the same input, and a test holds the two equal); `compile_dir(...,
lora_config=...)` then gives every graph the `lora_int_ids` input, and the emulated device
computes each row with its adapter's weights, read from the adapter's `lora_path`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def input_info(*, batch: int, query: int, cfg: dict[str, Any], layers: list[str],
               kv_heads: int, head_dim: int) -> list[list[Any]]:
    prefill = query > 1
    local = cfg["cache_impl"] in ("hybrid", "sliding_window")
    bps = cfg["max_seq_len"] // cfg["kvcache_block_size"]
    info: list[list[Any]] = [["input_ids", [batch, query], "int64"],
                             ["cache_position", [batch, query], "int32"],
                             ["block_tables", [bps] if prefill else [batch, bps], "int16"]]
    if local:
        info.append(["local_block_tables", [1] if prefill else [batch, 1], "int16"])
    if prefill and (local or cfg["logits_to_keep"] == 1):
        info.append(["query_position", [], "int16"])
    if cfg["use_attention_mask"]:
        if cfg["use_position_ids"]:
            info.append(["attention_mask", [batch, cfg["max_seq_len"]], cfg["dtype"]])
        else:
            info.append(["attention_mask", [batch, 1, query, cfg["max_seq_len"]], cfg["dtype"]])
    if cfg["use_position_ids"]:
        info.append(["position_ids", [batch, query], "int32"])
    if cfg["lora_config"] is not None:
        info.append(["lora_int_ids", [batch], "int32"])
    for meta in cache_metas(cfg, layers, kv_heads, head_dim):
        info.append([meta["name"], meta["shape"], meta["dtype"]])
    return info


def cache_metas(cfg: dict[str, Any], layers: list[str], kv_heads: int, head_dim: int
                ) -> list[dict[str, Any]]:
    metas = []
    for i in range(2 * len(layers)):
        sliding = layers[i // 2] == "sliding_attention"
        shape = ([cfg["batch_size"], kv_heads, cfg["sliding_window"], head_dim] if sliding else
                 [cfg["kvcache_num_blocks"], kv_heads, cfg["kvcache_block_size"], head_dim])
        metas.append({"name": f"past_key_values_{i}", "layer_index": i // 2, "shape": shape,
                      "layer_type": "sliding_attention" if sliding else "full_attention",
                      "is_auto": False, "dtype": cfg["dtype"]})
    return metas


def lora_adapter(lora_int_id: int, lora_name: str, lora_path: str | Path, **fields: Any
                 ) -> dict[str, Any]:
    """One `lora_config.adapters` entry as `RBLNLoRAAdapterConfig` serializes it: the fields
    given, the rest from `lora_path/adapter_config.json` (optimum-rbln's defaults when absent)."""
    config_file = Path(lora_path) / "adapter_config.json"
    peft = json.loads(config_file.read_text()) if config_file.exists() else {}

    def pick(name: str, default: Any) -> Any:
        if fields.get(name) is not None:
            return fields[name]
        return peft.get(name, default)

    return {"lora_int_id": lora_int_id, "lora_name": lora_name, "lora_path": str(lora_path),
            "r": pick("r", 8), "lora_alpha": pick("lora_alpha", 8.0),
            "target_modules": pick("target_modules", None), "bias": pick("bias", "none"),
            "use_rslora": pick("use_rslora", False),
            "scaling_factor": fields.get("scaling_factor") or 1.0}


def lora_config(adapters: list[dict[str, Any]], max_lora_rank: int | None = None
                ) -> dict[str, Any]:
    """`lora_config` as `RBLNLoRAConfig` serializes it: the user adapters (the base adapter it
    injects at id 0, rank 1, is never written), by ascending id, and `max_lora_rank` (default:
    the largest rank, the base's 1 included)."""
    largest = max([1] + [a["r"] for a in adapters])
    return {"adapters": sorted(adapters, key=lambda a: a["lora_int_id"]),
            "max_lora_rank": largest if max_lora_rank is None else max_lora_rank}


def compile_dir(directory: Path, checkpoint: Path, *, batch_size: int, max_seq_len: int,
                kvcache_num_blocks: int, prefill_chunk_size: int = 16,
                kvcache_block_size: int | None = None, attn_impl: str | None = None,
                decoder_batch_sizes: list[int] | None = None, logits_to_keep: int = 1,
                use_attention_mask: bool | None = None, use_position_ids: bool | None = None,
                dtype: str = "float32", record_input_info: bool = True,
                npu: str | None = None, lora_config: dict[str, Any] | None = None,
                overrides: dict[str, Any] | None = None) -> Path:
    """Write a compiled directory for `checkpoint`; `overrides` replace rbln_config.json fields
    after the input lists are fixed (to write contradicting or unsupported files)."""
    hf = json.loads((checkpoint / "config.json").read_text())
    text = hf.get("text_config", hf)
    gemma = str(text.get("model_type", "")).startswith("gemma3")
    layers = list(text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"])
    if not gemma:
        layers = ["full_attention"] * len(layers)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    block = kvcache_block_size or max_seq_len
    attn = attn_impl or ("eager" if block == max_seq_len else "flash_attn")
    sliding = [i for i, kind in enumerate(layers) if kind == "sliding_attention"]
    cfg: dict[str, Any] = {
        "cls_name": ("RBLNGemma3ForCausalLMConfig" if gemma else
                     f"RBLN{text.get('model_type', 'llama').capitalize()}ForCausalLMConfig"),
        "optimum_rbln_version": "0.12.0",
        "dtype": dtype,
        "batch_size": batch_size,
        "max_seq_len": max_seq_len,
        "use_inputs_embeds": False,
        "use_position_ids": gemma if use_position_ids is None else use_position_ids,
        "use_attention_mask": gemma if use_attention_mask is None else use_attention_mask,
        "quantization": {},
        "lora_config": lora_config,
        "attn_impl": attn,
        "kvcache_partition_len": block if attn == "flash_attn" else None,
        "kvcache_block_size": block,
        "prefill_chunk_size": prefill_chunk_size,
        "kvcache_num_blocks": kvcache_num_blocks,
        "cache_impl": "hybrid" if sliding else "static",
        "sliding_window": text.get("sliding_window") if sliding else None,
        "sliding_window_layers": sliding,
        "phases": ["prefill", "decode"],
        "logits_to_keep": logits_to_keep,
        "output_hidden_states": False,
        "_requires_batch_sort": False,
        "decoder_batch_sizes": sorted(decoder_batch_sizes or [batch_size], reverse=True),
    }
    graphs = [("prefill", 1, prefill_chunk_size)] + [
        (f"decoder_batch_{b}", b, 1) for b in cfg["decoder_batch_sizes"]]
    infos = {name: input_info(batch=b, query=q, cfg=cfg, layers=layers, kv_heads=kv_heads,
                              head_dim=head_dim) for name, b, q in graphs}
    cfg["cache_metas"] = cache_metas(cfg, layers, kv_heads, head_dim)
    cfg["_compile_cfgs"] = [
        {"compiled_model_name": name, "input_info": infos[name] if record_input_info else None,
         "npu": npu, "num_devices": None} for name, _, _ in graphs]
    cfg.update(overrides or {})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rbln_config.json").write_text(json.dumps(cfg, indent=2))
    for item in checkpoint.iterdir():
        if item.name == "config.json" or item.suffix == ".safetensors":
            shutil.copy(item, directory / item.name)
    for name, _, _ in graphs:
        (directory / f"{name}.rbln").write_text(json.dumps({"graph": name,
                                                            "input_info": infos[name]}))
    return directory
