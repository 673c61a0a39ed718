"""An emulated rebel-sdk for tests: `rebel.Runtime` over a compiled directory, no ATOM needed.

A compiled directory (written by `fakerebel.compiler.compile_dir`) holds a real `rbln_config.json`,
the model's `config.json` + safetensors (the emulator's weights) and one `<graph>.rbln` per graph,
each recording that graph's `input_info` as the compiler fixed it. `Runtime(path, tensor_type,
device)` loads one graph; every graph of one directory on one device shares one device model: a
`NumpyRuntime` whose KV arrays are the device-resident caches.

A call is checked the way a device checks it: the number of positional inputs, then each input's
dtype, shape and layout against the graph's list, raising `RBLNRuntimeError` on a mismatch. The
attention mask and position ids must agree with `cache_position` (the emulator computes with the
positions, so a disagreeing mask would change a device's output silently). The KV methods check
bounds and 4 KiB host alignment.

LoRA (a `lora_config` in `rbln_config.json`): every graph takes `lora_int_ids` int32 `[rows]`
last, and each row runs with the adapter its id names, computed as optimum-rbln 0.12 compiles it
(the weights read from the adapter's `lora_path`; scaling `lora_alpha / r`, with `use_rslora` a
further `1 / sqrt(r)`, times `scaling_factor`; only the compiled `target_modules`). An id outside
0..N (N adapters; 0 is the base) raises `RBLNRuntimeError`, as the device refuses it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.artifact.lora import MAX_LORA_RANK, LoraAdapter, LoraWeights, load_peft
from atombatch.runtime.numpy_runtime import NumpyRuntime

__version__ = "0.12.0-emulated"
ALIGNMENT = 4096
KV_PREFIX = "past_key_values_"

CALLS: list[tuple[str, int]] = []      # (graph name, rows) of every graph call, in order
KV_CALLS: Counter[str] = Counter()      # KV method name -> calls
_DEVICES: dict[tuple[str, str], _DeviceModel] = {}


class RBLNRuntimeError(RuntimeError):
    """What the emulated device raises for a call it cannot run."""


def reset() -> None:
    """Forget every loaded model (their KV caches) and the call log."""
    _DEVICES.clear()
    CALLS.clear()
    KV_CALLS.clear()


def _dtype_name(array: np.ndarray) -> str:
    return "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.name


class _DeviceModel:
    """One compiled directory on one device: the decoder and its KV caches, shared by graphs."""

    def __init__(self, directory: Path) -> None:
        cfg = json.loads((directory / "rbln_config.json").read_text())
        spec = ModelSpec.from_pretrained(directory)
        fields: dict[str, Any] = dict(
            model=spec, batch_size=cfg["batch_size"], max_seq_len=cfg["max_seq_len"],
            block_size=cfg["kvcache_block_size"], num_blocks=cfg["kvcache_num_blocks"],
            prefill_chunk_size=cfg["prefill_chunk_size"], kv_dtype="float32")
        self.buckets = tuple(sorted(cfg.get("decoder_batch_sizes") or [cfg["batch_size"]]))
        fields["decoder_batch_sizes"] = self.buckets
        self.rt = NumpyRuntime.from_pretrained(directory, artifact=ArtifactConfig(**fields))
        self.dtype = cfg.get("dtype", "float32")
        self.logits_to_keep = cfg.get("logits_to_keep", 1)
        self.batch_size = cfg["batch_size"]
        self.block_size = cfg["kvcache_block_size"]
        self.caches: dict[str, np.ndarray] = {}
        ordinal = {False: 0, True: 0}
        for layer, kind in enumerate(spec.layer_kinds):
            sliding = kind != "full_attention"
            store = self.rt.sliding_kv if sliding else self.rt.kv
            for value in (0, 1):
                self.caches[f"{KV_PREFIX}{2 * layer + value}"] = store[ordinal[sliding], value]
            ordinal[sliding] += 1
        self.lora_ids = 0            # the largest compiled adapter id (0: no LoRA)
        for entry in (cfg.get("lora_config") or {}).get("adapters", []):
            self._compile_adapter(entry, spec)
        self.global_names = [name for name, arr in self.caches.items()
                             if arr.shape[0] == self.rt.artifact.num_blocks
                             and spec.layer_kinds[int(name[len(KV_PREFIX):]) // 2]
                             == "full_attention"]

    def _compile_adapter(self, entry: dict[str, Any], spec: ModelSpec) -> None:
        """One compiled adapter as optimum-rbln builds it: the directory's A/B matrices of the
        compiled target modules, B scaled by the compiled fields' scaling."""
        read, weights = load_peft(entry["lora_path"], name=entry["lora_name"],
                                  lora_int_id=entry["lora_int_id"], spec=spec,
                                  max_lora_rank=MAX_LORA_RANK)
        r = entry["r"]
        scaling = entry["lora_alpha"] / r
        if entry.get("use_rslora"):
            scaling /= r ** 0.5
        scaling *= entry.get("scaling_factor") or 1.0
        targets = tuple(m for m in read.target_modules if m in entry["target_modules"])
        pairs = {key: ab for key, ab in weights.pairs.items() if key[1] in targets}
        device = LoraAdapter(name=read.name, lora_int_id=read.lora_int_id, path=read.path,
                             r=read.r, lora_alpha=scaling * read.r, target_modules=targets)
        self.rt.add_lora(device, LoraWeights(read.r, pairs))
        self.lora_ids = max(self.lora_ids, read.lora_int_id)

    def lora_int_ids(self, graph: str, named: dict[str, np.ndarray]) -> np.ndarray | None:
        ids = named.get("lora_int_ids")
        if ids is None:
            return None
        bad = [(row, int(i)) for row, i in enumerate(ids) if not 0 <= i <= self.lora_ids]
        if bad:
            raise RBLNRuntimeError(f"{graph}: lora_int_ids row {bad[0][0]} holds {bad[0][1]}; "
                                   f"the graph was compiled with adapter ids 0..{self.lora_ids}")
        return ids

    # -- graphs ---------------------------------------------------------------------------------
    def prefill(self, named: dict[str, np.ndarray], query_length: int) -> np.ndarray:
        cache_position = named["cache_position"]
        qp = named.get("query_position")
        last = int(qp) if qp is not None else query_length - 1
        self._check_positions(named, cache_position, prefill=True, last=last)
        inputs = SimpleNamespace(
            input_ids=named["input_ids"], cache_position=cache_position,
            block_tables=named["block_tables"],
            local_block_tables=named.get("local_block_tables", np.zeros(1, np.int16)),
            query_position=np.array(last, dtype=np.int16))
        every = self.logits_to_keep == 0
        logits = self.rt.prefill(inputs, every_position=every,
                                 lora_int_ids=self.lora_int_ids("prefill", named))
        return self._out(logits[None] if every else logits[None, None])

    def decode(self, named: dict[str, np.ndarray], rows: int) -> np.ndarray:
        cache_position = named["cache_position"]
        self._check_positions(named, cache_position, prefill=False, last=0)
        inputs = SimpleNamespace(
            input_ids=named["input_ids"], cache_position=cache_position,
            block_tables=named["block_tables"],
            local_block_tables=named.get("local_block_tables", np.zeros((rows, 1), np.int16)))
        ids = self.lora_int_ids(f"decoder_batch_{rows}", named)
        return self._out(self.rt.decode(inputs, lora_int_ids=ids)[:, None, :])

    def _out(self, logits: np.ndarray) -> np.ndarray:
        if self.dtype == "float32":
            return np.ascontiguousarray(logits, dtype=np.float32)
        import ml_dtypes

        kind = ml_dtypes.bfloat16 if self.dtype == "bfloat16" else np.float16
        return logits.astype(kind)

    def _check_positions(self, named: dict[str, np.ndarray], cache_position: np.ndarray, *,
                         prefill: bool, last: int) -> None:
        positions = np.arange(self.rt.artifact.max_seq_len)
        if "position_ids" in named and not np.array_equal(named["position_ids"], cache_position):
            raise RBLNRuntimeError("position_ids disagree with cache_position")
        mask = named.get("attention_mask")
        if mask is None:
            return
        mask = np.asarray(mask, dtype=np.float32)
        if mask.ndim == 2 and prefill:
            want = (positions <= cache_position[0, last])[None, :]
        elif mask.ndim == 2:
            want = positions[None, :] <= cache_position
        else:
            want = positions[None, None, None, :] <= cache_position[:, None, :, None]
        if not np.array_equal(mask, want.astype(np.float32)):
            raise RBLNRuntimeError("attention_mask disagrees with cache_position: the device "
                                   "would attend to other positions than the tables say")

    # -- KV methods -----------------------------------------------------------------------------
    def host_dtype(self) -> np.dtype:
        return np.dtype({"float32": np.float32, "float16": np.float16,
                         "bfloat16": np.uint16}[self.dtype])

    def cache(self, name: str) -> np.ndarray:
        try:
            return self.caches[name]
        except KeyError:
            raise RBLNRuntimeError(f"no KV cache named {name!r}") from None

    def check_host(self, host: Any, cache: np.ndarray, tokens: int) -> np.ndarray:
        if not isinstance(host, np.ndarray):
            raise RBLNRuntimeError(f"host buffer is a {type(host).__name__}, not an ndarray")
        if not host.flags.c_contiguous:
            raise RBLNRuntimeError("host buffer is not contiguous")
        if host.ctypes.data % ALIGNMENT:
            raise RBLNRuntimeError(f"host buffer at {host.ctypes.data:#x} is not "
                                   f"{ALIGNMENT}-byte aligned")
        if host.dtype != self.host_dtype():
            raise RBLNRuntimeError(f"host buffer dtype {host.dtype} is not the cache's "
                                   f"{self.dtype}")
        count = cache.shape[1] * tokens * cache.shape[3]
        if host.size != count:
            raise RBLNRuntimeError(f"host buffer holds {host.size} elements, {tokens} tokens "
                                   f"need {count}")
        return host.reshape(cache.shape[1], tokens, cache.shape[3])

    def span(self, cache: np.ndarray, block: int, offset: int, tokens: int) -> tuple[int, slice]:
        if not 0 <= int(block) < cache.shape[0]:
            raise RBLNRuntimeError(f"block {block} is outside 0..{cache.shape[0] - 1}")
        if offset < 0 or tokens <= 0 or offset + tokens > cache.shape[2]:
            raise RBLNRuntimeError(f"offset {offset} + tokens {tokens} is outside the block's "
                                   f"{cache.shape[2]} tokens")
        return int(block), slice(offset, offset + tokens)


def _device(directory: Path, device: Any) -> _DeviceModel:
    key = (str(directory.resolve()), repr(device))
    if key not in _DEVICES:
        _DEVICES[key] = _DeviceModel(directory)
    return _DEVICES[key]


class Runtime:
    """One compiled graph loaded on a device."""

    def __init__(self, compiled: str, tensor_type: str = "pt", device: Any = 0,
                 **_: Any) -> None:
        path = Path(compiled)
        if tensor_type != "np":
            raise RBLNRuntimeError(f"tensor_type={tensor_type!r}: the emulator serves 'np'")
        if not path.exists():
            raise RBLNRuntimeError(f"{path} does not exist")
        graph = json.loads(path.read_text())
        self.name: str = graph["graph"]
        self.inputs = [(n, tuple(s), d) for n, s, d in graph["input_info"]
                       if not n.startswith(KV_PREFIX)]
        self.prefill = self.name == "prefill"
        self.rows = self.inputs[0][1][0]
        self.query_length = self.inputs[0][1][1]
        self.model = _device(path.parent, device)

    def __call__(self, *args: Any) -> np.ndarray:
        if len(args) != len(self.inputs):
            raise RBLNRuntimeError(f"{self.name}: {len(args)} inputs given, the graph takes "
                                   f"{len(self.inputs)} ({', '.join(n for n, _, _ in self.inputs)})")
        named = {}
        for position, (arg, (name, shape, dtype)) in enumerate(zip(args, self.inputs,
                                                                   strict=True)):
            if not isinstance(arg, np.ndarray):
                raise RBLNRuntimeError(f"{self.name} input {position} ({name}) is a "
                                       f"{type(arg).__name__}, not an ndarray")
            if _dtype_name(arg) != dtype:
                raise RBLNRuntimeError(f"{self.name} input {position} ({name}) has dtype "
                                       f"{arg.dtype}, the graph takes {dtype}")
            if tuple(arg.shape) != shape:
                raise RBLNRuntimeError(f"{self.name} input {position} ({name}) has shape "
                                       f"{tuple(arg.shape)}, the graph takes {shape}")
            if not arg.flags.c_contiguous:
                raise RBLNRuntimeError(f"{self.name} input {position} ({name}) is not contiguous")
            named[name] = arg
        CALLS.append((self.name, self.rows))
        if self.prefill:
            return self.model.prefill(named, self.query_length)
        return self.model.decode(named, self.rows)

    # -- KV methods (vllm-rbln's `_copy_kv_cache`; block read/write through host buffers) ---------
    def _copy_kv_cache(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        KV_CALLS["_copy_kv_cache"] += 1
        model = self.model
        for name in model.global_names:
            cache = model.cache(name)
            src, span = model.span(cache, src_block, 0, num_tokens)
            dst, _ = model.span(cache, dst_block, 0, num_tokens)
            cache[dst, :, span] = cache[src, :, span]

    def _fetch_kv_cache(self, host: Any, block: int, offset: int, tokens: int,
                        layer_name: str) -> None:
        KV_CALLS["_fetch_kv_cache"] += 1
        model = self.model
        cache = model.cache(layer_name)
        index, span = model.span(cache, block, offset, tokens)
        view = model.check_host(host, cache, tokens)
        values = cache[index, :, span]
        if model.dtype == "bfloat16":
            bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
            view[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        else:
            view[...] = values

    def _update_kv_cache(self, host: Any, block: int, offset: int, tokens: int,
                         layer_name: str) -> None:
        KV_CALLS["_update_kv_cache"] += 1
        model = self.model
        cache = model.cache(layer_name)
        index, span = model.span(cache, block, offset, tokens)
        view = model.check_host(host, cache, tokens)
        if model.dtype == "bfloat16":
            cache[index, :, span] = (view.astype(np.uint32) << 16).view(np.float32)
        else:
            cache[index, :, span] = view

    def _get_kv_cache_size(self, layer_name: str) -> int:
        return int(self.model.cache(layer_name).size * self.model.host_dtype().itemsize)
