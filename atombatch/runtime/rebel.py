"""`RebelRuntime`: the runtime protocol over an optimum-rbln compiled directory on an ATOM.

Theory of operation
-------------------
`RebelRuntime.from_optimum(model_dir)` reads the directory with `atombatch.artifact.rbln_config.load`
(shapes, decode buckets, and each graph's positional input list, from `rbln_config.json` or derived
as optimum-rbln's `get_input_info` does) and opens one `rebel.Runtime` per graph: `prefill.rbln`
and every `decoder_batch_{b}.rbln`. The KV caches live on the device and are shared by all graphs.

Each call builds its positional arguments *by name* from the graph's input list: the tables come
from the in-place builders the scheduler fills (`PrefillInputs` / `DecodeInputs`); what the graphs
take beyond them (the attention mask, 2-D `[b, max_seq_len]` with position ids or the 4-D chunk
mask `[b, 1, Q, max_seq_len]` without, and `position_ids`) is written into buffers allocated once
per graph. A decode call runs the graph whose batch equals the inputs' row count
(`inputs.input_ids.shape[0]`). A prefill graph compiled with `logits_to_keep=0` takes no
`query_position` and returns `[1, Q, vocab]`; the host picks the last real token's row.

KV moves go through the runtime's KV methods, feature-detected (`hasattr`), with host buffers
4 KiB-aligned and allocated once:
    _copy_kv_cache(src_block, dst_block, num_tokens)            every layer's cache, on device
    _fetch_kv_cache(host, block, offset, tokens, layer_name)    device -> host
    _update_kv_cache(host, block, offset, tokens, layer_name)   host -> device
    _get_kv_cache_size(layer_name)                               bytes of one cache tensor
`host` is a C-contiguous `[kv_heads, tokens, head_dim]` array of the cache's dtype (bfloat16 as
uint16 bit patterns); `layer_name` is `past_key_values_{2l}` (K) or `{2l+1}` (V); for a sliding
layer `block` is the lane's sliding slot. `python -m atombatch.bench device` checks them on a device.

LoRA: a directory compiled with `lora_config` holds its adapters inside the graphs, ids 1..N
(0 is the base model). Every graph then takes `lora_int_ids` int32 `[batch]` after the other
inputs, one id per row, padding rows included: `prefill(..., lora_int_ids=)` and
`decode(..., lora_int_ids=)` copy the ids into a buffer of the graph's recorded shape and dtype
(allocated once per graph), after refusing an id the directory was not compiled with
(`StateError`: a device indexes its adapter table with it and does not check). Without the
keyword every row runs the base model. `lora_adapters` names the compiled adapters; a directory
without LoRA has no such attribute (the engine's `Capabilities.lora` is False there).

`rebel` is imported lazily; without it the constructor raises `ConfigError` with install guidance.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import ModelSpec
from atombatch.artifact.lora import BASE_LORA_ID, TARGET_MODULES, LoraAdapter, load_peft
from atombatch.artifact.rbln_config import (
    LORA_INPUT,
    CompiledAdapter,
    CompiledGraph,
    LoraCompileConfig,
    OptimumArtifact,
    load,
)
from atombatch.errors import ConfigError, StateError
from atombatch.runtime.base import DecodeArrays, PrefillArrays, check_decode_rows

INSTALL_HINT = ("rebel-sdk is not installed: its `rebel` module is the distribution rebel-compiler "
                "on Rebellions' package index, not the public one: pip install "
                "--extra-index-url https://pypi.rbln.ai/simple 'atombatch[rebel]' "
                "(docs/device.md)")
HOST_ALIGNMENT = 4096
F32 = np.float32

# the feature each KV method serves, for the error when the SDK lacks it
KV_FEATURES = {
    "_copy_kv_cache": "copy_block (prefix-cache copies)",
    "_fetch_kv_cache": "read_block / read_layer_kv (host-cache saves, PD export)",
    "_update_kv_cache": "write_block / write_layer_kv (host-cache restores, PD import)",
}


def _import_rebel() -> Any:
    try:
        return importlib.import_module("rebel")
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None


def numpy_dtype(name: str) -> Any:
    """The NumPy dtype of a graph input's dtype name (bfloat16 through `ml_dtypes`)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ConfigError("a bfloat16 graph input (attention_mask) needs the ml_dtypes "
                              "package: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise ConfigError(f"graph input dtype {name!r} is not a NumPy dtype") from None


def _host_dtype(kv_dtype: str) -> np.dtype[Any]:
    """How a KV cache's elements sit in host memory (bfloat16 as its uint16 bit pattern)."""
    return np.dtype({"float32": np.float32, "float16": np.float16,
                     "bfloat16": np.uint16}[kv_dtype])


def to_host(values: npt.NDArray[Any], kv_dtype: str, out: npt.NDArray[Any]) -> None:
    """Write float values into a host buffer of the cache's dtype (bfloat16: round to nearest
    even, as a device cast does)."""
    if kv_dtype != "bfloat16":
        out[...] = values
        return
    bits = np.ascontiguousarray(values, dtype=F32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out[...] = (rounded >> np.uint32(16)).astype(np.uint16)


def from_host(host: npt.NDArray[Any], kv_dtype: str) -> npt.NDArray[np.float32]:
    """A float32 copy of a host buffer of the cache's dtype."""
    if kv_dtype != "bfloat16":
        return np.array(host, dtype=F32)
    return (host.astype(np.uint32) << np.uint32(16)).view(F32)


def aligned_empty(nbytes: int, alignment: int = HOST_ALIGNMENT) -> npt.NDArray[np.uint8]:
    """`nbytes` of host memory whose first byte sits on an `alignment` boundary."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


class _GraphArgs:
    """The positional arguments of one graph, built by name from its input list.

    Buffers for what the scheduler's builders do not hold (mask, position ids) are allocated
    here once; every call rewrites them in place.
    """

    def __init__(self, graph: CompiledGraph, max_seq_len: int) -> None:
        self.graph = graph
        self.prefill = graph.name == "prefill"
        self._positions = np.arange(max_seq_len, dtype=np.int32)
        self._mask: npt.NDArray[Any] | None = None
        self._visible: npt.NDArray[np.bool_] | None = None
        self._position_ids: npt.NDArray[np.int32] | None = None
        # lora_int_ids: the buffer the graph takes, refilled every call (0: the base model)
        self.lora_ids: npt.NDArray[Any] | None = None
        self.getters: list[tuple[str, Callable[[Any], Any]]] = []
        for item in graph.inputs:
            if item.name == "attention_mask":
                self._mask = np.zeros(item.shape, dtype=numpy_dtype(item.dtype))
                self._visible = np.zeros(item.shape, dtype=np.bool_)
                self.getters.append((item.name, self._attention_mask))
            elif item.name == "position_ids":
                self._position_ids = np.zeros(item.shape, dtype=np.int32)
                self.getters.append((item.name, self._fill_position_ids))
            elif item.name == LORA_INPUT:
                self.lora_ids = np.zeros(item.shape, dtype=numpy_dtype(item.dtype))
                self.getters.append((item.name, self._lora_ids))
            else:
                self.getters.append((item.name, _field_getter(item.name)))

    def build(self, inputs: Any) -> list[tuple[str, npt.NDArray[Any]]]:
        return [(name, getter(inputs)) for name, getter in self.getters]

    def _attention_mask(self, inputs: Any) -> npt.NDArray[Any]:
        """1 where a query may attend: positions up to its own (decode, 2-D/4-D prefill) or up to
        the chunk's last real token (2-D prefill: one row for the whole chunk)."""
        assert self._mask is not None and self._visible is not None
        cache_position = inputs.cache_position
        visible = self._visible
        if visible.ndim == 2 and self.prefill:         # [1, L]
            last = cache_position[0, int(inputs.query_position)]
            np.less_equal(self._positions, last, out=visible[0])
        elif visible.ndim == 2:                         # decode [b, L]
            np.less_equal(self._positions[None, :], cache_position, out=visible)
        else:                                           # [b, 1, Q, L]: row q sees <= position q
            np.less_equal(self._positions[None, None, None, :],
                          cache_position[:, None, :, None], out=visible)
        np.copyto(self._mask, visible, casting="unsafe")
        return self._mask

    def _lora_ids(self, inputs: Any) -> npt.NDArray[Any]:
        assert self.lora_ids is not None
        return self.lora_ids

    def _fill_position_ids(self, inputs: Any) -> npt.NDArray[np.int32]:
        assert self._position_ids is not None
        self._position_ids[...] = inputs.cache_position
        return self._position_ids


def _field_getter(name: str) -> Callable[[Any], Any]:
    def get(inputs: Any) -> Any:
        return getattr(inputs, name)
    return get


def compiled_adapters(lora: LoraCompileConfig, spec: ModelSpec) -> dict[str, LoraAdapter]:
    """The compiled adapters of a `lora_config` as `LoraAdapter`s, by name.

    An adapter's `identity` (what the prefix cache and PD tell adapters apart by) is the one
    `load_peft` gives its PEFT directory when `lora_path` is still readable and agrees with the
    compiled fields, so a NumPy producer that loaded the same directory shares it; otherwise it
    is a digest of the compiled fields, name and path (the graph's weights cannot be read back).
    """
    return {a.lora_name: LoraAdapter(
        name=a.lora_name, lora_int_id=a.lora_int_id, path=a.lora_path, r=a.r,
        lora_alpha=a.lora_alpha, target_modules=a.target_modules, use_rslora=a.use_rslora,
        scaling_factor=a.scaling_factor, identity=_adapter_identity(a, lora, spec))
        for a in lora.adapters}


def device_scaling_factor(adapter: CompiledAdapter) -> float | None:
    """The `scaling_factor` that makes `LoraAdapter.scaling` equal what optimum-rbln 0.12 folds
    into a compiled adapter's B: `lora_alpha / r * scaling_factor`, and with `use_rslora` a
    further `1 / sqrt(r)` (PEFT's rsLoRA scaling is `lora_alpha / sqrt(r)`: a compiled rsLoRA
    adapter is scaled by another `1 / r`; docs/lora.md). None stands for 1.0."""
    factor = adapter.scaling_factor / (adapter.r if adapter.use_rslora else 1)
    return None if factor == 1.0 else factor


def _adapter_identity(adapter: CompiledAdapter, lora: LoraCompileConfig, spec: ModelSpec) -> str:
    try:
        loaded, _ = load_peft(adapter.lora_path, name=adapter.lora_name,
                              lora_int_id=adapter.lora_int_id, spec=spec,
                              max_lora_rank=lora.max_lora_rank,
                              scaling_factor=device_scaling_factor(adapter))
    except (ConfigError, OSError):
        loaded = None
    compiled = (adapter.r, adapter.lora_alpha, adapter.use_rslora,
                tuple(m for m in TARGET_MODULES if m in adapter.target_modules))
    if loaded is not None and (loaded.r, loaded.lora_alpha, loaded.use_rslora,
                               loaded.target_modules) == compiled:
        return loaded.identity
    fields = {"compiled": True, "lora_name": adapter.lora_name, "lora_path": adapter.lora_path,
              "r": adapter.r, "lora_alpha": adapter.lora_alpha,
              "target_modules": sorted(adapter.target_modules), "use_rslora": adapter.use_rslora,
              "scaling_factor": adapter.scaling_factor}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class RebelRuntime:
    """Runs an optimum-rbln compiled directory's graphs with the tables atombatch builds.

    Args:
        compiled: the directory as `atombatch.artifact.rbln_config.load` read it.
        device: ATOM device index (or a list of indices for tensor parallel).
    Attributes:
        artifact: shapes derived from `rbln_config.json`.
        decoder_batch_sizes: the compiled decode batches, ascending.
        kv_methods: which KV methods this SDK's runtime has (`hasattr`).
        prefill_calls, decode_calls: graph calls run; decode_calls_by_batch: per decode graph.
        lora_adapters: (LoRA directories only) the compiled adapters by `lora_name`.
    Raises:
        ConfigError: rebel-sdk is missing, or a KV cache's device size contradicts the config.
    """

    def __init__(self, compiled: OptimumArtifact, device: int | list[int] = 0) -> None:
        rebel = _import_rebel()
        self.compiled = compiled
        self.artifact = compiled.artifact
        self.spec: ModelSpec = compiled.artifact.model
        self.decoder_batch_sizes = compiled.decoder_batch_sizes
        self.version = str(getattr(rebel, "__version__", "unknown"))
        self.prefill_calls = 0
        self.decode_calls = 0
        self.decode_calls_by_batch: dict[int, int] = {b: 0 for b in compiled.decoder_batch_sizes}
        length = self.artifact.max_seq_len
        self._prefill = rebel.Runtime(compiled.prefill.file, tensor_type="np", device=device)
        self._prefill_args = _GraphArgs(compiled.prefill, length)
        self._decoders: dict[int, tuple[Any, _GraphArgs]] = {}
        for graph in compiled.decoders:
            runtime = rebel.Runtime(graph.file, tensor_type="np", device=device)
            self._decoders[graph.batch] = (runtime, _GraphArgs(graph, length))
        self._query_position_input = "query_position" in compiled.prefill.input_names
        self._lora = compiled.lora
        if compiled.lora is not None:
            self.lora_adapters: Mapping[str, LoraAdapter] = compiled_adapters(
                compiled.lora, self.spec)
        self.kv_methods = {name: hasattr(self._prefill, name) for name in
                           (*KV_FEATURES, "_get_kv_cache_size")}
        self._kv_dtype = compiled.dtype
        self._host_dtype = _host_dtype(compiled.dtype)
        self._check_kv_sizes()
        spec = self.spec
        window = spec.sliding_window if spec.is_hybrid else 0
        largest = spec.num_kv_heads * max(self.artifact.block_size, window) * spec.head_dim
        # one staging buffer for every host<->device move, allocated once
        self._staging = aligned_empty(largest * self._host_dtype.itemsize).view(self._host_dtype)

    @classmethod
    def from_optimum(cls, model_dir: str | os.PathLike[str], device: int | list[int] = 0,
                     model: ModelSpec | None = None) -> RebelRuntime:
        """Open a directory compiled by optimum-rbln (see docs/device.md).

        Raises:
            ConfigError: the directory is incomplete, contradicts itself or the model, uses an
                unsupported option, or rebel-sdk is missing.
        """
        return cls(load(model_dir, model), device=device)

    # -- positional inputs (pure; shared with tests and the device check) ---------------------------
    def prefill_args(self, inputs: PrefillArrays, lora_int_ids: npt.ArrayLike | None = None
                     ) -> list[tuple[str, npt.NDArray[Any]]]:
        """The prefill graph's positional inputs as (name, array), in its compiled order."""
        self._set_lora_ids(self._prefill_args, lora_int_ids)
        return self._prefill_args.build(inputs)

    def decode_args(self, inputs: DecodeArrays, lora_int_ids: npt.ArrayLike | None = None
                    ) -> list[tuple[str, npt.NDArray[Any]]]:
        """A decode graph's positional inputs; the graph is chosen by the row count."""
        builder = self._decoder(int(inputs.input_ids.shape[0]))[1]
        self._set_lora_ids(builder, lora_int_ids)
        return builder.build(inputs)

    def _set_lora_ids(self, builder: _GraphArgs, lora_int_ids: npt.ArrayLike | None) -> None:
        """Check one call's `lora_int_ids` and write them into the graph's buffer (None: every
        row runs the base model). A graph without the input takes only base rows."""
        buffer = builder.lora_ids
        if buffer is None:
            if lora_int_ids is not None and np.any(np.asarray(lora_int_ids)):
                raise StateError(f"lora_int_ids {np.asarray(lora_int_ids).tolist()} name LoRA "
                                 f"adapters, but {self.compiled.path} was compiled without "
                                 "lora_config: it runs the base model only")
            return
        if lora_int_ids is None:
            buffer.fill(BASE_LORA_ID)
            return
        ids = np.asarray(lora_int_ids)
        rows = builder.graph.batch
        if ids.shape != buffer.shape or not np.issubdtype(ids.dtype, np.integer):
            raise StateError(f"lora_int_ids has shape {ids.shape} and dtype {ids.dtype}; graph "
                             f"{builder.graph.name} takes integers [{rows}] (one id per row, "
                             "padding rows included)")
        assert self._lora is not None
        top = len(self._lora.adapters)
        if ids.size and (ids.min() < 0 or ids.max() > top):    # scalars: nothing allocated
            row = int(np.flatnonzero((ids < 0) | (ids > top))[0])
            names = ", ".join(a.lora_name for a in self._lora.adapters[:8])
            more = ", ..." if top > 8 else ""
            raise StateError(f"lora_int_ids row {row} holds {int(ids[row])}, which "
                             f"{self.compiled.path} was not compiled with (its ids: 0 = the base "
                             f"model, 1..{top} = {names}{more})")
        buffer[...] = ids

    def _decoder(self, rows: int) -> tuple[Any, _GraphArgs]:
        check_decode_rows(rows, self.decoder_batch_sizes)
        return self._decoders[rows]

    # -- protocol -----------------------------------------------------------------------------------
    @property
    def every_position_logits(self) -> bool:
        """The prefill graph returns every chunk position's logits (`logits_to_keep=0`), so
        `prefill(every_position=True)` (prompt logprobs) works."""
        return self.compiled.logits_to_keep == 0

    @property
    def every_position_hint(self) -> str:
        """Why prompt logprobs cannot be served from this directory, for the request's error."""
        return (f"the prefill graph of {self.compiled.path} was compiled with logits_to_keep="
                f"{self.compiled.logits_to_keep} (rbln_config.json) and returns only the last "
                "position's logits; compile the model with rbln_logits_to_keep=0 to serve "
                "prompt_logprobs (docs/device.md)")

    def prefill(self, inputs: PrefillArrays, *, every_position: bool = False,
                lora_int_ids: npt.ArrayLike | None = None) -> npt.NDArray[np.float32]:
        """One prefill chunk: the last real token's logits `[vocab]`, or with `every_position`
        (a `logits_to_keep=0` graph only) every chunk position's, `[Q, vocab]`.

        `lora_int_ids` (int32 `[1]`): the compiled adapter the chunk runs with (None or 0: the
        base model).

        Raises:
            StateError: `every_position` on a graph compiled with `logits_to_keep=1`; an id the
                directory was not compiled with, or ids of the wrong shape.
        """
        if every_position and not self.every_position_logits:
            raise StateError(self.every_position_hint)
        self._set_lora_ids(self._prefill_args, lora_int_ids)
        args = self._prefill_args.build(inputs)
        out = self._first_output(self._prefill(*(array for _, array in args)))
        self.prefill_calls += 1
        vocab = self.spec.vocab_size
        if self.compiled.logits_to_keep == 1:
            return np.asarray(out, dtype=F32).reshape(vocab)
        # logits_to_keep=0: every chunk position comes back; keep the last real token's row
        rows = np.asarray(out).reshape(-1, vocab)
        if every_position:
            return np.asarray(rows, dtype=F32)
        return np.asarray(rows[int(inputs.query_position)], dtype=F32)

    def decode(self, inputs: DecodeArrays, *, lora_int_ids: npt.ArrayLike | None = None
               ) -> npt.NDArray[np.float32]:
        """One decode step on the graph of the inputs' row count; logits `[rows, vocab]`.

        `lora_int_ids` (int32 `[rows]`): each row's compiled adapter, padding rows included
        (None: every row runs the base model).

        Raises:
            StateError: no decode graph of that batch; an id the directory was not compiled
                with, or ids of the wrong shape.
        """
        rows = int(inputs.input_ids.shape[0])
        runtime, builder = self._decoder(rows)
        self._set_lora_ids(builder, lora_int_ids)
        out = self._first_output(runtime(*(array for _, array in builder.build(inputs))))
        self.decode_calls += 1
        self.decode_calls_by_batch[rows] += 1
        return np.asarray(out, dtype=F32).reshape(rows, self.spec.vocab_size)

    def _first_output(self, out: Any) -> Any:
        # a graph compiled with output_hidden_states returns (logits, hidden states...)
        if isinstance(out, (list, tuple)):
            return out[0]
        return out

    # -- device KV ----------------------------------------------------------------------------------
    def _kv(self, method: str, feature: str) -> Callable[..., Any]:
        fn = getattr(self._prefill, method, None)
        if fn is None:
            raise ConfigError(f"{feature} needs rebel.Runtime.{method}, which this rebel-sdk "
                              f"({self.version}) does not have; run with that feature off "
                              "(docs/device.md)")
        return fn  # type: ignore[no-any-return]

    def _check_kv_sizes(self) -> None:
        size_of = getattr(self._prefill, "_get_kv_cache_size", None)
        if size_of is None:
            return
        tp = self.artifact.tensor_parallel
        for cache in self.compiled.kv_caches:
            want = int(np.prod(cache.shape)) * self._host_dtype.itemsize
            got = int(size_of(cache.name))
            if got not in (want, want // tp):
                raise ConfigError(f"KV cache {cache.name} holds {got} bytes on the device, "
                                  f"rbln_config.json gives {list(cache.shape)} {cache.dtype} = "
                                  f"{want} bytes")

    def _check_block(self, block: int) -> int:
        if not 0 <= block < self.artifact.num_blocks:
            raise StateError(f"block={block} is outside 0..{self.artifact.num_blocks - 1}")
        return int(block)

    def _host(self, tokens: int) -> npt.NDArray[Any]:
        """The staging buffer's aligned head as a contiguous [kv_heads, tokens, head_dim]."""
        spec = self.spec
        count = spec.num_kv_heads * tokens * spec.head_dim
        return self._staging[:count].reshape(spec.num_kv_heads, tokens, spec.head_dim)

    @staticmethod
    def cache_name(layer: int, value: bool) -> str:
        """The device name of layer `layer`'s K (`value=False`) or V cache."""
        return f"past_key_values_{2 * layer + int(value)}"

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of `read_block`'s result: [num_global, 2, kv_heads, block_size, head_dim]."""
        spec = self.spec
        return (len(spec.global_layers), 2, spec.num_kv_heads, self.artifact.block_size,
                spec.head_dim)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer, on the device."""
        copy = self._kv("_copy_kv_cache", "copy_block (prefix-cache copies)")
        copy(self._check_block(src), self._check_block(dst), self.artifact.block_size)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one lane's sliding-window slot in every sliding layer (n > 1 forks on hybrid
        models), through the host: `_fetch_kv_cache` then `_update_kv_cache` per cache."""
        fetch = self._kv("_fetch_kv_cache", "copy_slot (n > 1 on hybrid models)")
        update = self._kv("_update_kv_cache", "copy_slot (n > 1 on hybrid models)")
        src, dst = self._check_slot(src), self._check_slot(dst)
        window = self.spec.sliding_window
        for layer in self.spec.sliding_layers:
            for value in (False, True):
                name = self.cache_name(layer, value)
                host = self._host(window)
                fetch(host, src, 0, window, name)
                update(host, dst, 0, window, name)

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """Shape of `read_slot`'s result: [num_sliding, 2, kv_heads, window, head_dim]."""
        spec = self.spec
        return (len(spec.sliding_layers), 2, spec.num_kv_heads, spec.sliding_window,
                spec.head_dim)

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one `read_slot` result (a sliding-slot checkpoint)."""
        return int(np.prod(self.slot_shape)) * self._host_dtype.itemsize

    def read_slot(self, slot: int) -> npt.NDArray[Any]:
        """One lane's sliding slot in every sliding layer, in the cache's dtype (a checkpoint
        for the hybrid prefix cache): `_fetch_kv_cache` of the slot's `window` tokens per cache."""
        fetch = self._kv("_fetch_kv_cache", "read_slot (hybrid prefix-cache checkpoints)")
        slot = self._check_slot(slot)
        window = self.spec.sliding_window
        out = np.empty(self.slot_shape, dtype=self._host_dtype)
        for s, layer in enumerate(self.spec.sliding_layers):
            for value in (0, 1):
                host = self._host(window)
                fetch(host, slot, 0, window, self.cache_name(layer, bool(value)))
                out[s, value] = host
        return out

    def write_slot(self, slot: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a lane's sliding slot from `read_slot`'s result (`_update_kv_cache`)."""
        update = self._kv("_update_kv_cache", "write_slot (hybrid prefix-cache restores)")
        slot = self._check_slot(slot)
        data = np.asarray(data)
        if data.shape != self.slot_shape or data.dtype != self._host_dtype:
            raise StateError(f"slot data is {data.shape} {data.dtype}, slots are "
                             f"{self.slot_shape} {self._host_dtype}")
        window = self.spec.sliding_window
        for s, layer in enumerate(self.spec.sliding_layers):
            for value in (0, 1):
                host = self._host(window)
                host[...] = data[s, value]
                update(host, slot, 0, window, self.cache_name(layer, bool(value)))

    def read_block(self, block: int) -> npt.NDArray[Any]:
        """One block's K/V of every global layer in the cache's dtype, `block_shape`."""
        fetch = self._kv("_fetch_kv_cache", "read_block (host-cache saves)")
        block = self._check_block(block)
        size = self.artifact.block_size
        out = np.empty(self.block_shape, dtype=self._host_dtype)
        for g, layer in enumerate(self.spec.global_layers):
            for value in (0, 1):
                host = self._host(size)
                fetch(host, block, 0, size, self.cache_name(layer, bool(value)))
                out[g, value] = host
        return out

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a block from `read_block`'s result."""
        update = self._kv("_update_kv_cache", "write_block (host-cache restores)")
        block = self._check_block(block)
        data = np.asarray(data)
        if data.shape != self.block_shape or data.dtype != self._host_dtype:
            raise StateError(f"block data is {data.shape} {data.dtype}, blocks are "
                             f"{self.block_shape} {self._host_dtype}")
        size = self.artifact.block_size
        for g, layer in enumerate(self.spec.global_layers):
            for value in (0, 1):
                host = self._host(size)
                host[...] = data[g, value]
                update(host, block, 0, size, self.cache_name(layer, bool(value)))

    def _layer_kind(self, layer: int) -> bool:
        if not 0 <= layer < self.spec.num_layers:
            raise StateError(f"layer={layer} is outside 0..{self.spec.num_layers - 1}")
        return self.spec.layer_kinds[layer] != "full_attention"

    def _check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.artifact.batch_size:
            raise StateError(f"sliding slot {slot} is outside 0..{self.artifact.batch_size - 1}")
        return int(slot)

    def _row(self, block_row: Sequence[int], tokens: int) -> list[int]:
        needed = -(-tokens // self.artifact.block_size)
        row = [self._check_block(int(b)) for b in np.asarray(block_row).reshape(-1)[:needed]]
        if len(row) < needed:
            raise StateError(f"block_row has {len(row)} blocks, {tokens} tokens of block_size="
                             f"{self.artifact.block_size} need {needed}")
        return row

    def write_layer_kv(self, layer: int, k: npt.ArrayLike, v: npt.ArrayLike,
                       block_row: Sequence[int], slot: int = 0) -> None:
        """PD import of one layer: K/V `[kv_heads, tokens, head_dim]` of positions 0..tokens-1
        into the blocks of `block_row` (global layer), or a sliding layer's window tail into lane
        slot `slot` (oldest first)."""
        update = self._kv("_update_kv_cache", "write_layer_kv (PD import)")
        sliding = self._layer_kind(layer)
        spec = self.spec
        k, v = np.asarray(k), np.asarray(v)
        tokens = k.shape[1] if k.ndim == 3 else -1
        if k.shape != v.shape or k.shape != (spec.num_kv_heads, tokens, spec.head_dim):
            raise StateError(f"K {k.shape} and V {v.shape} must both be [kv_heads="
                             f"{spec.num_kv_heads}, tokens, head_dim={spec.head_dim}]")
        limit = spec.sliding_window if sliding else self.artifact.max_seq_len
        if not 0 < tokens <= limit:
            what = "window" if sliding else "max_seq_len"
            raise StateError(f"layer {layer} got {tokens} tokens, outside 1..{what}={limit}")
        if sliding:
            spans = [(self._check_slot(slot), 0, tokens)]
        else:
            size = self.artifact.block_size
            spans = [(block, j * size, min(size, tokens - j * size))
                     for j, block in enumerate(self._row(block_row, tokens))]
        for value, source in ((False, k), (True, v)):
            name = self.cache_name(layer, value)
            for block, start, count in spans:
                host = self._host(count)
                to_host(source[:, start : start + count], self._kv_dtype, host)
                update(host, block, 0, count, name)

    def read_layer_kv(self, layer: int, block_row: Sequence[int], length: int, slot: int = 0
                      ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """K and V `[kv_heads, tokens, head_dim]` (float32) of one layer of a sequence: global
        layers positions 0..length-1, sliding layers the last min(length, window) tokens (PD
        export: an ATOM as the producer)."""
        fetch = self._kv("_fetch_kv_cache", "read_layer_kv (PD export)")
        sliding = self._layer_kind(layer)
        if not 0 < length <= self.artifact.max_seq_len:
            raise StateError(f"length={length} is outside 1..{self.artifact.max_seq_len}")
        if sliding:
            held = min(length, self.spec.sliding_window)
            spans = [(self._check_slot(slot), 0, held)]
            tokens = held
        else:
            size = self.artifact.block_size
            spans = [(block, j * size, min(size, length - j * size))
                     for j, block in enumerate(self._row(block_row, length))]
            tokens = length
        out = []
        for value in (False, True):
            name = self.cache_name(layer, value)
            result = np.empty((self.spec.num_kv_heads, tokens, self.spec.head_dim), dtype=F32)
            for block, start, count in spans:
                host = self._host(count)
                fetch(host, block, 0, count, name)
                result[:, start : start + count] = from_host(host, self._kv_dtype)
            out.append(result)
        return out[0], out[1]
