"""NumPy reference executor: real decoder math, KV kept exactly as the ATOM device keeps it.

Theory of operation
-------------------
`NumpyRuntime` is what proves the scheduler's tables right, so it behaves like the compiled graphs
of docs/scheduling.md rather than like a convenient model:

* Global-attention layers keep K and V in `kv[g, 0|1]`, each `[num_blocks, kv_heads, block_size,
  head_dim]`. Position p of a sequence lives in block `table[p // block_size]` at offset
  `p % block_size`. Every call first writes the K/V of every position it processes (a prefill
  chunk's padding positions and every decode lane, idle lanes included), then reads the keys it
  attends to back *through the table*. A wrong table row therefore corrupts real output instead of
  being ignored.
* Sliding-window layers (Gemma3) keep a lane slot `sliding_kv[s, 0|1, slot]`, `[kv_heads, window,
  head_dim]`: a shift buffer with the newest `window` tokens, oldest first (position p < window
  sits at index p). Prefill writes only the chunk's real tokens into it; decode writes every lane's.
* Decode runs lane by lane inside each layer, so a lane's matmuls have the same shapes whatever the
  batch size and whatever the other lanes hold: a lane's logits are bit-identical at B1 and B4.
* `reference_logits` recomputes a whole sequence with plain masked attention and no cache or table,
  the independent answer every cached path is tested against.

The math is float32 and follows transformers' Llama, Qwen3 and Gemma3 modeling code (eager
attention): RMSNorm with w (Llama, Qwen3) or 1 + w (Gemma3), Qwen3/Gemma3 per-head q/k norms before
RoPE, llama3/linear RoPE scaling (Gemma3: global layers only; sliding layers use
`rope_local_theta`), Gemma3's sqrt(hidden) embedding scale rounded to the checkpoint dtype,
`query_pre_attn_scalar`, sandwich norms, GELU-tanh MLP, final logit softcapping, and HF's sliding
mask (a query at p sees keys at positions > p - window, itself included). Gemma3's
`attn_logit_softcapping` is ignored, as transformers' Gemma3 attention ignores it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import SLIDING, ArtifactConfig, ModelSpec
from atombatch.artifact.lora import BASE_LORA_ID, LoraAdapter, LoraWeights, module_shapes
from atombatch.errors import ConfigError, StateError
from atombatch.runtime.base import DecodeArrays, PrefillArrays, check_decode_rows

F32 = np.float32
Array = npt.NDArray[np.float32]

# Checkpoint-name prefixes of Gemma3's multimodal wrapper (old and new transformers layouts).
_NAME_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


@dataclass
class _Layer:
    """One decoder layer's weights (projections transposed to [in, out]) and constants."""

    sliding: bool
    ordinal: int                    # index into `kv` (global) or `sliding_kv` (sliding)
    inv_freq: Array                 # [head_dim // 2] RoPE inverse frequencies of this layer
    wq: Array
    wk: Array
    wv: Array
    wo: Array
    bq: Array | None
    bk: Array | None
    bv: Array | None
    bo: Array | None
    q_norm: Array | None            # effective per-head-dim norm weight (1 + w for Gemma3)
    k_norm: Array | None
    input_norm: Array
    post_attention_norm: Array
    pre_feedforward_norm: Array | None   # Gemma3 sandwich norms
    post_feedforward_norm: Array | None
    w_gate: Array
    w_up: Array
    w_down: Array


class _LoraLayer:
    """One adapter's deltas on one decoder layer: per module, A^T [in, r] and scaling * B^T
    [r, out], so a row's delta is `(x @ a_t) @ b_t` (optimum-rbln folds the scaling into B too)."""

    __slots__ = ("modules",)

    def __init__(self, modules: dict[str, tuple[Array, Array]]) -> None:
        self.modules = modules

    def add(self, module: str, x: Array, y: Array) -> Array:
        """`y` (the base projection of `x`) plus this adapter's delta where it targets `module`."""
        pair = self.modules.get(module)
        if pair is None:
            return y
        return cast(Array, y + (x @ pair[0]) @ pair[1])


class NumpyRuntime:
    """Device-faithful float32 executor of one artifact (Llama, Qwen3, Gemma3).

    Attributes:
        artifact: the compiled shapes this runtime executes.
        spec: `artifact.model`.
        kv: global layers' KV, `[num_global, 2 (K, V), num_blocks, kv_heads, block_size, head_dim]`;
            `kv[g, 0]` is global layer g's K tensor as the device holds it.
        sliding_kv: sliding layers' lane slots, `[num_sliding, 2, batch_size, kv_heads, window,
            head_dim]` (zero-sized first axis for models without sliding layers).
        prefill_calls, decode_calls: how many graph calls ran.
        import_calls, export_calls: how many `write_layer_kv` / `read_layer_kv` calls ran (PD).
        lora_adapters: the LoRA adapters loaded (name -> adapter); `prefill`/`decode` take
            `lora_int_ids` naming one of their ids (or 0, the base) per row.
    """

    every_position_logits = True  # `prefill(every_position=True)` works (prompt logprobs)

    def __init__(self, artifact: ArtifactConfig, weights: dict[str, np.ndarray]) -> None:
        """Build from Hugging Face-named weights (any float dtype; kept as float32).

        Raises:
            ConfigError: a weight the spec needs is missing or has the wrong shape.
        """
        self.artifact = artifact
        self.spec = spec = artifact.model
        self.prefill_calls = 0
        self.decode_calls = 0
        self.decode_rows = 0     # rows computed by decode calls (a bucket's padding rows included)
        self.import_calls = 0
        self.export_calls = 0
        self._window = spec.sliding_window if spec.is_hybrid else 0
        self._gemma = spec.family == "gemma3"
        self._groups = spec.num_heads // spec.num_kv_heads
        if self._gemma:
            self._scaling = F32((spec.query_pre_attn_scalar or spec.head_dim) ** -0.5)
        else:
            self._scaling = F32(spec.head_dim ** -0.5)
        self._embed_scale = _embed_scale(spec.hidden_size, spec.dtype) if self._gemma else None
        self._load(_canonical_names(weights))
        self.lora_adapters: dict[str, LoraAdapter] = {}
        # lora_int_id -> per decoder layer, that adapter's deltas (None: the layer is untouched)
        self._lora_layers: dict[int, list[_LoraLayer | None]] = {}

        kv_shape = (spec.num_kv_heads, artifact.block_size, spec.head_dim)
        self.kv = np.zeros((len(spec.global_layers), 2, artifact.num_blocks, *kv_shape), dtype=F32)
        slot_shape = (spec.num_kv_heads, max(self._window, 1), spec.head_dim)
        self.sliding_kv = np.zeros((len(spec.sliding_layers), 2, artifact.batch_size, *slot_shape),
                                   dtype=F32)

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def random(cls, artifact: ArtifactConfig, seed: int = 0) -> NumpyRuntime:
        """Random weights of the spec's shapes, scaled for spread-out logits (std ~3, no ties)."""
        return cls(artifact, random_weights(artifact.model, seed))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str],
                        artifact: ArtifactConfig | None = None) -> NumpyRuntime:
        """Load a Hugging Face checkpoint directory (config.json + safetensors, no torch).

        Args:
            path: the checkpoint directory; single-file or sharded (`model.safetensors.index.json`)
                safetensors with F32, F16 or BF16 weights (BF16 is widened exactly to float32).
            artifact: the shapes to run with; its model must have this checkpoint's shapes. None
                builds `default_artifact(spec)`.
        Raises:
            ConfigError: missing files, an unsupported family or dtype, or a shape mismatch.
        """
        spec = ModelSpec.from_pretrained(path)
        if artifact is None:
            artifact = default_artifact(spec)
        else:
            _check_same_shapes(spec, artifact.model)
        return cls(artifact, load_safetensors_dir(path))

    # -- weights --------------------------------------------------------------------------------
    def _load(self, weights: dict[str, np.ndarray]) -> None:
        spec = self.spec
        hidden, d = spec.hidden_size, spec.head_dim
        q_dim, kv_dim = spec.num_heads * d, spec.num_kv_heads * d

        def get(name: str, shape: tuple[int, ...]) -> Array:
            try:
                value = weights[name]
            except KeyError:
                raise ConfigError(f"weight {name!r} is missing for {spec.family} model "
                                  f"{spec.name}") from None
            if tuple(value.shape) != shape:
                raise ConfigError(f"weight {name!r} has shape {tuple(value.shape)}, the spec "
                                  f"needs {shape}")
            return np.asarray(value, dtype=F32)

        def linear(name: str, out_dim: int, in_dim: int) -> Array:
            return np.ascontiguousarray(get(name, (out_dim, in_dim)).T)

        def norm(name: str, dim: int) -> Array:
            w = get(name, (dim,))
            return (F32(1.0) + w).astype(F32) if self._gemma else w.copy()

        def bias(name: str, dim: int) -> Array | None:
            return get(name, (dim,)) if spec.attention_bias else None

        self._embed = np.ascontiguousarray(get("model.embed_tokens.weight",
                                               (spec.vocab_size, hidden)))
        if spec.tie_word_embeddings or "lm_head.weight" not in weights:
            head = self._embed
        else:
            head = get("lm_head.weight", (spec.vocab_size, hidden))
        self._lm_head_t = np.ascontiguousarray(head.T)
        self._final_norm = norm("model.norm.weight", hidden)

        global_freq = _inv_freq(spec.rope_theta, d, spec.rope_scaling)
        local_freq = _inv_freq(spec.sliding_rope_theta, d, None)
        qk_norm = spec.family in ("qwen3", "gemma3")
        self._layers: list[_Layer] = []
        counters = {False: 0, True: 0}
        for i, kind in enumerate(spec.layer_kinds):
            sliding = kind == SLIDING
            p = f"model.layers.{i}."
            self._layers.append(_Layer(
                sliding=sliding,
                ordinal=counters[sliding],
                inv_freq=local_freq if sliding else global_freq,
                wq=linear(p + "self_attn.q_proj.weight", q_dim, hidden),
                wk=linear(p + "self_attn.k_proj.weight", kv_dim, hidden),
                wv=linear(p + "self_attn.v_proj.weight", kv_dim, hidden),
                wo=linear(p + "self_attn.o_proj.weight", hidden, q_dim),
                bq=bias(p + "self_attn.q_proj.bias", q_dim),
                bk=bias(p + "self_attn.k_proj.bias", kv_dim),
                bv=bias(p + "self_attn.v_proj.bias", kv_dim),
                bo=bias(p + "self_attn.o_proj.bias", hidden),
                q_norm=norm(p + "self_attn.q_norm.weight", d) if qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight", d) if qk_norm else None,
                input_norm=norm(p + "input_layernorm.weight", hidden),
                post_attention_norm=norm(p + "post_attention_layernorm.weight", hidden),
                pre_feedforward_norm=(norm(p + "pre_feedforward_layernorm.weight", hidden)
                                      if self._gemma else None),
                post_feedforward_norm=(norm(p + "post_feedforward_layernorm.weight", hidden)
                                       if self._gemma else None),
                w_gate=linear(p + "mlp.gate_proj.weight", spec.intermediate_size, hidden),
                w_up=linear(p + "mlp.up_proj.weight", spec.intermediate_size, hidden),
                w_down=linear(p + "mlp.down_proj.weight", hidden, spec.intermediate_size),
            ))
            counters[sliding] += 1

    # -- the decoder math, per lane ---------------------------------------------------------------
    def _embed_tokens(self, token_ids: npt.NDArray[np.integer[Any]]) -> Array:
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
            raise StateError(f"token ids {ids.min()}..{ids.max()} are outside the vocabulary "
                             f"0..{self.spec.vocab_size - 1}")
        h = self._embed[ids]
        return h * self._embed_scale if self._embed_scale is not None else h.copy()

    def _rms(self, x: Array, weight: Array) -> Array:
        variance = np.mean(x * x, axis=-1, keepdims=True)
        return (x * (F32(1.0) / np.sqrt(variance + F32(self.spec.rms_norm_eps)))) * weight

    def _qkv(self, layer: _Layer, h: Array, positions: npt.NDArray[np.int64],
             lora: _LoraLayer | None = None) -> tuple[Array, Array, Array]:
        """Normed projections with RoPE: q [heads, T, d], k and v [kv_heads, T, d]."""
        spec = self.spec
        t, d = h.shape[0], spec.head_dim
        x = self._rms(h, layer.input_norm)
        q, k, v = x @ layer.wq, x @ layer.wk, x @ layer.wv
        if lora is not None:
            q, k, v = lora.add("q_proj", x, q), lora.add("k_proj", x, k), lora.add("v_proj", x, v)
        if layer.bq is not None:
            assert layer.bk is not None and layer.bv is not None
            q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
        q = q.reshape(t, spec.num_heads, d)
        k = k.reshape(t, spec.num_kv_heads, d)
        v = v.reshape(t, spec.num_kv_heads, d)
        if layer.q_norm is not None:
            assert layer.k_norm is not None
            q = self._rms(q, layer.q_norm)
            k = self._rms(k, layer.k_norm)
        cos, sin = _rope_tables(layer.inv_freq, positions)  # [T, d]
        q = _rotate(q, cos[:, None, :], sin[:, None, :])
        k = _rotate(k, cos[:, None, :], sin[:, None, :])
        return (np.ascontiguousarray(q.transpose(1, 0, 2)),
                np.ascontiguousarray(k.transpose(1, 0, 2)),
                np.ascontiguousarray(v.transpose(1, 0, 2)))

    def _attend(self, layer: _Layer, q: Array, keys: Array, values: Array,
                q_pos: npt.NDArray[np.int64], k_pos: npt.NDArray[np.int64]) -> Array:
        """Masked softmax attention; q [heads, T, d], keys/values [kv_heads, L, d] -> [T, heads*d].

        A query at p sees keys at positions <= p, and on sliding layers only those > p - window.
        """
        spec = self.spec
        kvh, g = spec.num_kv_heads, self._groups
        t, d = q.shape[1], spec.head_dim
        grouped = q.reshape(kvh, g * t, d)
        scores = (grouped @ keys.transpose(0, 2, 1)) * self._scaling        # [kvh, g*T, L]
        scores = scores.reshape(kvh, g, t, -1)
        visible = k_pos[None, :] <= q_pos[:, None]
        if layer.sliding:
            visible &= k_pos[None, :] > q_pos[:, None] - self._window
        scores = np.where(visible, scores, F32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        ctx = weights.reshape(kvh, g * t, -1) @ values                     # [kvh, g*T, d]
        return np.ascontiguousarray(ctx.reshape(spec.num_heads, t, d).transpose(1, 0, 2)
                                    ).reshape(t, spec.num_heads * d)

    def _finish(self, layer: _Layer, h: Array, ctx: Array, lora: _LoraLayer | None = None
                ) -> Array:
        """Output projection, residuals, norms and MLP of one layer."""
        attn = ctx @ layer.wo
        if lora is not None:
            attn = lora.add("o_proj", ctx, attn)
        if layer.bo is not None:
            attn = attn + layer.bo
        if self._gemma:
            h = h + self._rms(attn, layer.post_attention_norm)
            x = self._rms(h, layer.pre_feedforward_norm)  # type: ignore[arg-type]
        else:
            h = h + attn
            x = self._rms(h, layer.post_attention_norm)
        gate = x @ layer.w_gate
        if lora is None:
            act = _gelu_tanh(gate) if self._gemma else _silu(gate)
            mlp = (act * (x @ layer.w_up)) @ layer.w_down
        else:
            gate = lora.add("gate_proj", x, gate)
            act = _gelu_tanh(gate) if self._gemma else _silu(gate)
            inner = cast(Array, act * lora.add("up_proj", x, x @ layer.w_up))
            mlp = lora.add("down_proj", inner, inner @ layer.w_down)
        if self._gemma:
            mlp = self._rms(mlp, layer.post_feedforward_norm)  # type: ignore[arg-type]
        return h + mlp

    def _logits(self, h: Array) -> Array:
        logits = self._rms(h, self._final_norm) @ self._lm_head_t
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = np.tanh(logits / F32(cap)) * F32(cap)
        return logits.astype(F32, copy=False)

    # -- the no-cache reference --------------------------------------------------------------------
    def reference_logits(self, token_ids: npt.ArrayLike, lora_int_id: int = BASE_LORA_ID
                         ) -> Array:
        """Logits [T, vocab] of every position by full recompute: no cache, no table, no slot
        (under adapter `lora_int_id`; 0 = the base model)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        positions = np.arange(len(ids), dtype=np.int64)
        loras = self._lora_of(lora_int_id)
        h = self._embed_tokens(ids)
        for i, layer in enumerate(self._layers):
            lora = loras[i] if loras is not None else None
            q, k, v = self._qkv(layer, h, positions, lora)
            h = self._finish(layer, h, self._attend(layer, q, k, v, positions, positions), lora)
        return self._logits(h)

    # -- LoRA adapters -------------------------------------------------------------------------
    def add_lora(self, adapter: LoraAdapter, weights: LoraWeights) -> None:
        """Load an adapter (from `atombatch.artifact.lora.load_peft`): rows whose
        `lora_int_ids` entry is `adapter.lora_int_id` then run with its deltas.

        Raises:
            ConfigError: id 0 (the base), a name or id already loaded, or a matrix whose shape
                does not fit this model.
        """
        if adapter.lora_int_id == BASE_LORA_ID or adapter.lora_int_id < 0:
            raise ConfigError(f"adapter {adapter.name!r} has lora_int_id={adapter.lora_int_id}; "
                              f"ids start at 1 ({BASE_LORA_ID} is the base model)")
        if adapter.name in self.lora_adapters:
            raise ConfigError(f"a LoRA adapter named {adapter.name!r} is already loaded "
                              "(remove it first)")
        if adapter.lora_int_id in self._lora_layers:
            other = next(a.name for a in self.lora_adapters.values()
                         if a.lora_int_id == adapter.lora_int_id)
            raise ConfigError(f"lora_int_id={adapter.lora_int_id} of adapter {adapter.name!r} "
                              f"is already adapter {other!r}'s")
        shapes = module_shapes(self.spec)
        scaling = F32(adapter.scaling)
        per_layer: list[dict[str, tuple[Array, Array]]] = [{} for _ in self._layers]
        for (index, module), (a, b) in weights.pairs.items():
            in_dim, out_dim = shapes.get(module, (-1, -1))
            if not 0 <= index < len(self._layers) or module not in adapter.target_modules or \
                    a.shape != (adapter.r, in_dim) or b.shape != (out_dim, adapter.r):
                raise ConfigError(f"adapter {adapter.name!r}: layer {index}'s {module} matrices "
                                  f"A {a.shape} / B {b.shape} do not fit r={adapter.r} on "
                                  f"{self.spec.name}")
            per_layer[index][module] = (np.ascontiguousarray(np.asarray(a, dtype=F32).T),
                                        np.ascontiguousarray((np.asarray(b, dtype=F32) *
                                                              scaling).T))
        self._lora_layers[adapter.lora_int_id] = [_LoraLayer(m) if m else None
                                                  for m in per_layer]
        self.lora_adapters[adapter.name] = adapter

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; its id is then refused until an adapter takes it again.

        Raises:
            ConfigError: no adapter of that name is loaded.
        """
        adapter = self.lora_adapters.pop(name, None)
        if adapter is None:
            raise ConfigError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                              f"{sorted(self.lora_adapters)})")
        del self._lora_layers[adapter.lora_int_id]

    def _lora_of(self, lora_int_id: int) -> list[_LoraLayer | None] | None:
        """The per-layer deltas of an adapter id (None for the base model)."""
        if lora_int_id == BASE_LORA_ID:
            return None
        try:
            return self._lora_layers[lora_int_id]
        except KeyError:
            raise StateError(f"lora_int_ids holds {lora_int_id}, which no loaded adapter has "
                             f"(loaded ids: {sorted(self._lora_layers)}; {BASE_LORA_ID} is the "
                             "base)") from None

    def _row_loras(self, lora_int_ids: npt.ArrayLike | None, rows: int
                   ) -> list[list[_LoraLayer | None] | None] | None:
        """Each row's per-layer deltas, or None when every row runs the base model."""
        if lora_int_ids is None:
            return None
        ids = np.asarray(lora_int_ids)
        if ids.shape != (rows,) or not np.issubdtype(ids.dtype, np.integer):
            raise StateError(f"lora_int_ids has shape {ids.shape} and dtype {ids.dtype}; the "
                             f"graph takes int32 [{rows}] (one id per row)")
        if not ids.any():
            return None
        return [self._lora_of(int(i)) for i in ids]

    # -- KV through the tables --------------------------------------------------------------------
    def _check_table(self, table: npt.NDArray[np.integer[Any]], what: str) -> npt.NDArray[np.int64]:
        blocks = np.asarray(table, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.artifact.num_blocks):
            raise StateError(f"{what} holds blocks {blocks.min()}..{blocks.max()}, outside "
                             f"0..{self.artifact.num_blocks - 1} (the device would read out "
                             "of range)")
        return blocks

    def _check_positions(self, positions: npt.NDArray[np.int64], what: str) -> None:
        if positions.size and (positions.min() < 0 or positions.max() >= self.artifact.max_seq_len):
            raise StateError(f"{what} {positions.min()}..{positions.max()} is outside "
                             f"0..{self.artifact.max_seq_len - 1}")

    def _check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.artifact.batch_size:
            raise StateError(f"sliding slot {slot} is outside 0..{self.artifact.batch_size - 1}")
        return slot

    def _write_global(self, layer: _Layer, table: npt.NDArray[np.int64],
                      positions: npt.NDArray[np.int64], k: Array, v: Array) -> None:
        bs = self.artifact.block_size
        blocks, offsets = table[positions // bs], positions % bs
        cache = self.kv[layer.ordinal]
        # Advanced indices [T] on axes 0 and 2 put T first: cache[...] is [T, kv_heads, d].
        cache[0, blocks, :, offsets] = k.transpose(1, 0, 2)
        cache[1, blocks, :, offsets] = v.transpose(1, 0, 2)

    def _read_global(self, layer: _Layer, table: npt.NDArray[np.int64], length: int
                     ) -> tuple[Array, Array]:
        """K and V [kv_heads, length, d] of positions 0..length-1, gathered through `table`."""
        bs = self.artifact.block_size
        positions = np.arange(length)
        blocks, offsets = table[positions // bs], positions % bs
        cache = self.kv[layer.ordinal]
        keys = cache[0, blocks, :, offsets].transpose(1, 0, 2)
        values = cache[1, blocks, :, offsets].transpose(1, 0, 2)
        return np.ascontiguousarray(keys), np.ascontiguousarray(values)

    # -- the two graphs ---------------------------------------------------------------------------
    def prefill(self, inputs: PrefillArrays, *, every_position: bool = False,
                lora_int_ids: npt.NDArray[np.int32] | None = None) -> Array:
        """Run one prefill chunk (batch 1); returns the logits [vocab] of the last real token
        (`every_position`: of every chunk position, [Q, vocab], as a graph compiled with
        optimum-rbln's `logits_to_keep=0` returns them).

        `lora_int_ids` (int32 [1]) names the adapter the chunk runs under (0 or None: the base).

        K/V of all Q positions (padding included) go into the global layers' blocks; only the real
        tokens (up to `query_position`) enter the sliding slot.
        """
        art = self.artifact
        ids = np.asarray(inputs.input_ids).reshape(-1)
        positions = np.asarray(inputs.cache_position, dtype=np.int64).reshape(-1)
        if ids.shape != (art.prefill_chunk_size,) or positions.shape != ids.shape:
            raise StateError(f"prefill inputs hold {ids.shape[0]} tokens and "
                             f"{positions.shape[0]} positions, the graph takes "
                             f"{art.prefill_chunk_size}")
        if np.any(np.diff(positions) != 1):
            raise StateError("prefill cache_position must be consecutive")
        self._check_positions(positions, "prefill cache_position")
        table = self._check_table(np.asarray(inputs.block_tables).reshape(-1), "block_tables")
        if table.shape != (art.blocks_per_seq,):
            raise StateError(f"prefill block_tables has {table.shape[0]} entries, "
                             f"blocks_per_seq={art.blocks_per_seq}")
        last = int(inputs.query_position)
        if not 0 <= last < len(ids):
            raise StateError(f"query_position={last} is outside the chunk 0..{len(ids) - 1}")
        slot = (self._check_slot(int(np.asarray(inputs.local_block_tables).reshape(-1)[0]))
                if self._window else 0)
        row_loras = self._row_loras(lora_int_ids, 1)
        loras = row_loras[0] if row_loras is not None else None
        self.prefill_calls += 1

        start, window = int(positions[0]), self._window
        h = self._embed_tokens(ids)
        for i, layer in enumerate(self._layers):
            lora = loras[i] if loras is not None else None
            q, k, v = self._qkv(layer, h, positions, lora)
            if not layer.sliding:
                self._write_global(layer, table, positions, k, v)
                keys, values = self._read_global(layer, table, int(positions[-1]) + 1)
                key_pos = np.arange(keys.shape[1], dtype=np.int64)
            else:
                buffer = self.sliding_kv[layer.ordinal, :, slot]        # [2, kvh, W, d] (view)
                held = min(start, window)                               # positions start-held..
                keys = np.concatenate([buffer[0, :, :held], k], axis=1)
                values = np.concatenate([buffer[1, :, :held], v], axis=1)
                key_pos = np.concatenate([np.arange(start - held, start), positions])
                # Afterwards the slot holds the newest `window` real tokens, oldest first.
                newest = slice(max(0, held + last + 1 - window), held + last + 1)
                kept = newest.stop - newest.start
                buffer[0, :, :kept] = keys[:, newest]
                buffer[1, :, :kept] = values[:, newest]
            h = self._finish(layer, h, self._attend(layer, q, keys, values, positions, key_pos),
                             lora)
        if every_position:
            return self._logits(h)
        return self._logits(h[last : last + 1])[0]

    def decode(self, inputs: DecodeArrays, *,
               lora_int_ids: npt.NDArray[np.int32] | None = None) -> Array:
        """Run one decode step of a compiled decode batch (one of the artifact's
        `decoder_batch_sizes`), padding rows too; returns logits [rows, vocab].

        `lora_int_ids` (int32 [rows], padding rows included) names each row's adapter (0: the
        base). A row's adapter deltas are computed on that row alone, like the rest of its math,
        so its logits depend neither on its neighbours' adapters nor on the bucket; a step whose
        rows are all base (or None) runs exactly the base math.

        Within each layer every row first writes its K/V at its `cache_position` into the block its
        table row names (and into the sliding slot its `local_block_tables` entry names), then every
        row reads its keys through its table row. Each row is computed on its own (matmuls of batch
        1), so its logits depend neither on B nor on the bucket.
        """
        art = self.artifact
        ids = np.asarray(inputs.input_ids).reshape(-1)
        b = ids.shape[0]
        positions = np.asarray(inputs.cache_position, dtype=np.int64).reshape(-1)
        tables = self._check_table(np.asarray(inputs.block_tables), "block_tables")
        check_decode_rows(b, art.decoder_batch_sizes)
        if positions.shape != (b,) or tables.shape != (b, art.blocks_per_seq):
            raise StateError(f"decode inputs have shapes {ids.shape}, {positions.shape}, "
                             f"{tables.shape}; blocks_per_seq={art.blocks_per_seq}")
        self._check_positions(positions, "decode cache_position")
        slots = [self._check_slot(int(s)) for s in np.asarray(inputs.local_block_tables).reshape(-1)
                 ] if self._window else [0] * b
        row_loras = self._row_loras(lora_int_ids, b)
        self.decode_calls += 1
        self.decode_rows += b

        window = self._window
        lane_pos = [positions[lane : lane + 1] for lane in range(b)]
        hidden = [self._embed_tokens(ids[lane : lane + 1]) for lane in range(b)]
        lane_lora: list[_LoraLayer | None] = [None] * b
        for i, layer in enumerate(self._layers):
            if row_loras is not None:
                lane_lora = [rl[i] if rl is not None else None for rl in row_loras]
            qkv = [self._qkv(layer, hidden[lane], lane_pos[lane], lane_lora[lane])
                   for lane in range(b)]
            # Writes first, for every lane: exactly what the device does with a padding row.
            for lane, (_, k, v) in enumerate(qkv):
                if not layer.sliding:
                    self._write_global(layer, tables[lane], lane_pos[lane], k, v)
                else:
                    buffer = self.sliding_kv[layer.ordinal, :, slots[lane]]
                    p = int(positions[lane])
                    if p >= window:  # full: shift out the oldest token
                        buffer[:, :, :-1] = buffer[:, :, 1:].copy()
                    index = min(p, window - 1)
                    buffer[0, :, index] = k[:, 0]
                    buffer[1, :, index] = v[:, 0]
            for lane, (q, _, _) in enumerate(qkv):
                p = int(positions[lane])
                if not layer.sliding:
                    keys, values = self._read_global(layer, tables[lane], p + 1)
                    key_pos = np.arange(p + 1, dtype=np.int64)
                else:
                    held = min(p + 1, window)
                    buffer = self.sliding_kv[layer.ordinal, :, slots[lane]]
                    keys, values = buffer[0, :, :held], buffer[1, :, :held]
                    key_pos = np.arange(p + 1 - held, p + 1, dtype=np.int64)
                ctx = self._attend(layer, q, keys, values, lane_pos[lane], key_pos)
                hidden[lane] = self._finish(layer, hidden[lane], ctx, lane_lora[lane])
        return np.stack([self._logits(h)[0] for h in hidden])

    # -- block moves -------------------------------------------------------------------------------
    def _check_block(self, block: int) -> int:
        if not 0 <= block < self.artifact.num_blocks:
            raise StateError(f"block={block} is outside 0..{self.artifact.num_blocks - 1}")
        return int(block)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of `read_block`'s result: [num_global, 2, kv_heads, block_size, head_dim]."""
        return (self.kv.shape[0], 2, *self.kv.shape[3:])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every global layer."""
        self.kv[:, :, self._check_block(dst)] = self.kv[:, :, self._check_block(src)]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one lane's sliding-window slot in every sliding layer (n > 1 forks, hybrid)."""
        if self._window:
            src, dst = self._check_slot(src), self._check_slot(dst)
            self.sliding_kv[:, :, dst] = self.sliding_kv[:, :, src]

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """Shape of `read_slot`'s result: [num_sliding, 2, kv_heads, window, head_dim]."""
        return (self.sliding_kv.shape[0], 2, *self.sliding_kv.shape[3:])

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one `read_slot` result (a sliding-slot checkpoint)."""
        return int(np.prod(self.slot_shape)) * self.sliding_kv.itemsize

    def read_slot(self, slot: int) -> Array:
        """A copy of one lane's sliding slot in every sliding layer, `slot_shape` (a
        checkpoint for the hybrid prefix cache)."""
        if not self._window:
            raise StateError(f"{self.spec.name} has no sliding layers: there is no slot to read")
        return self.sliding_kv[:, :, self._check_slot(slot)].copy()

    def write_slot(self, slot: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a lane's sliding slot from `read_slot`'s result."""
        data = np.asarray(data)
        if not self._window or data.shape != self.slot_shape:
            raise StateError(f"slot data has shape {data.shape}, slots are {self.slot_shape}")
        self.sliding_kv[:, :, self._check_slot(slot)] = data

    def read_block(self, block: int) -> Array:
        """A copy of one block's K/V of every global layer, `block_shape`."""
        return self.kv[:, :, self._check_block(block)].copy()

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a block from `read_block`'s result."""
        data = np.asarray(data)
        if data.shape != self.block_shape:
            raise StateError(f"block data has shape {data.shape}, blocks are {self.block_shape}")
        self.kv[:, :, self._check_block(block)] = data


    # -- PD: one layer's K/V by token ------------------------------------------------------------
    def _pd_layer(self, layer: int) -> _Layer:
        if not 0 <= layer < len(self._layers):
            raise StateError(f"layer={layer} is outside 0..{len(self._layers) - 1}")
        return self._layers[layer]

    def _pd_row(self, block_row: Sequence[int], length: int) -> npt.NDArray[np.int64]:
        """The blocks holding positions 0..length-1, checked against the pool."""
        needed = -(-length // self.artifact.block_size)
        row = self._check_table(np.asarray(block_row, dtype=np.int64).reshape(-1), "block_row")
        if len(row) < needed:
            raise StateError(f"block_row has {len(row)} blocks, {length} tokens of block_size="
                             f"{self.artifact.block_size} need {needed}")
        return row

    def read_layer_kv(self, layer: int, block_row: Sequence[int], length: int, slot: int = 0
                      ) -> tuple[Array, Array]:
        """K and V `[kv_heads, tokens, head_dim]` (float32 copies) of one layer of a sequence.

        Args:
            layer: the model layer index, 0..num_layers-1.
            block_row: the sequence's blocks in order (global layers); entry j holds positions
                `j*block_size ..`.
            length: the sequence length the blocks and the slot hold now.
            slot: the sequence's sliding slot (sliding layers).
        Returns:
            Global layer: positions 0..length-1. Sliding layer: the last min(length, window) tokens,
            oldest first, as the slot's shift buffer holds them.
        Raises:
            StateError: a layer, block, slot or length outside the artifact.
        """
        target = self._pd_layer(layer)
        if not 0 < length <= self.artifact.max_seq_len:
            raise StateError(f"length={length} is outside 1..{self.artifact.max_seq_len}")
        self.export_calls += 1
        if not target.sliding:
            return self._read_global(target, self._pd_row(block_row, length), length)
        held = min(length, self._window)
        buffer = self.sliding_kv[target.ordinal, :, self._check_slot(slot)]
        return buffer[0, :, :held].copy(), buffer[1, :, :held].copy()

    def write_layer_kv(self, layer: int, k: npt.ArrayLike, v: npt.ArrayLike,
                       block_row: Sequence[int], slot: int = 0) -> None:
        """Import one layer's K/V `[kv_heads, tokens, head_dim]` (the decoder side of PD).

        A global layer's tokens are positions 0..T-1, written to `block_row[p // block_size]` at
        offset `p % block_size`. A sliding layer's tokens are the window tail, oldest first, written
        to indices 0..T-1 of the slot (T <= window), which is how the shift buffer holds a sequence
        whose last T tokens they are. Values are stored as float32.

        Raises:
            StateError: a shape, layer, block or slot outside the artifact.
        """
        target = self._pd_layer(layer)
        k = np.asarray(k, dtype=F32)
        v = np.asarray(v, dtype=F32)
        spec = self.spec
        tokens = k.shape[1] if k.ndim == 3 else -1
        if k.shape != v.shape or k.shape != (spec.num_kv_heads, tokens, spec.head_dim):
            raise StateError(f"K {k.shape} and V {v.shape} must both be [kv_heads="
                             f"{spec.num_kv_heads}, tokens, head_dim={spec.head_dim}]")
        limit = self._window if target.sliding else self.artifact.max_seq_len
        if not 0 < tokens <= limit:
            what = "window" if target.sliding else "max_seq_len"
            raise StateError(f"layer {layer} got {tokens} tokens, outside 1..{what}={limit}")
        if not target.sliding:
            row = self._pd_row(block_row, tokens)
            self._write_global(target, row, np.arange(tokens, dtype=np.int64), k, v)
        else:
            buffer = self.sliding_kv[target.ordinal, :, self._check_slot(slot)]
            buffer[0, :, :tokens] = k
            buffer[1, :, :tokens] = v
        self.import_calls += 1


# -- math helpers ----------------------------------------------------------------------------------
def _silu(x: Array) -> Array:
    # x * sigmoid(x) through tanh: no overflow warning for large |x|.
    return cast(Array, x * (F32(0.5) * (F32(1.0) + np.tanh(x * F32(0.5)))))


def _gelu_tanh(x: Array) -> Array:
    c = F32(math.sqrt(2.0 / math.pi))
    return cast(Array, F32(0.5) * x * (F32(1.0) + np.tanh(c * (x + F32(0.044715) * x * x * x))))


def _inv_freq(theta: float, head_dim: int, scaling: Any) -> Array:
    """transformers' RoPE inverse frequencies (float32), with llama3 or linear scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)
    inv_freq = (F32(1.0) / np.power(F32(theta), exponents)).astype(F32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / F32(scaling.factor)).astype(F32)
    if scaling.rope_type != "llama3":
        raise ConfigError(f"rope_type={scaling.rope_type!r} is not supported (linear, llama3)")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = F32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / F32(factor), inv_freq).astype(F32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(F32)
    smoothed = (F32(1) - smooth) * scaled / F32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def _rope_tables(inv_freq: Array, positions: npt.NDArray[np.int64]) -> tuple[Array, Array]:
    freqs = positions.astype(F32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return cast(Array, x * cos + rotated * sin)


def _round_to(value: float, dtype: str) -> np.float32:
    """`value` as float32, rounded through the checkpoint dtype (round to nearest even)."""
    x = np.array([value], dtype=F32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & \
            np.uint32(0xFFFF0000)
        x = bits.view(F32)
    elif dtype == "float16":
        x = x.astype(np.float16).astype(F32)
    return F32(x[0])


def _embed_scale(hidden: int, dtype: str) -> np.float32:
    """Gemma3's embedding normalizer: transformers casts sqrt(hidden) to the weight dtype."""
    return _round_to(math.sqrt(hidden), dtype)


# -- weights and checkpoints -----------------------------------------------------------------------
def default_artifact(spec: ModelSpec) -> ArtifactConfig:
    """A small artifact for trying a model: B4, context 256 in one block per lane, chunk 64."""
    context = 256
    return ArtifactConfig(model=spec, batch_size=4, max_seq_len=context, block_size=context,
                          num_blocks=4 + 1, prefill_chunk_size=64, kv_dtype="float32")


def _check_same_shapes(checkpoint: ModelSpec, artifact_model: ModelSpec) -> None:
    mine = {k: v for k, v in checkpoint.shape_fields.items()
            if k not in ("name", "bos_token_id", "eos_token_ids", "dtype")}
    theirs = {k: v for k, v in artifact_model.shape_fields.items() if k in mine}
    diff = sorted(k for k in mine if mine[k] != theirs.get(k))
    if diff:
        raise ConfigError(f"the artifact's model differs from the checkpoint in {diff}")


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face weight name `spec` needs, with its shape."""
    hidden, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_dim, kv_dim = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for name, out_dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (out_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if spec.attention_bias:
            for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim), ("o", hidden)):
                shapes[p + f"self_attn.{name}_proj.bias"] = (dim,)
        if spec.family in ("qwen3", "gemma3"):
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if spec.family == "gemma3":
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            shapes[p + f"{norm}.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights of `spec`'s shapes, scaled for well-spread logits.

    Embeddings and lm_head have std 3/sqrt(hidden), so unit-RMS final states give logits of std ~3
    (no near-ties). q/k/o/down projections at 3/sqrt(fan_in) and q/k and Gemma3 post norms near a
    gain of 3 make attention sharp and layer outputs large against the token's own embedding, so
    greedy decoding wanders instead of settling on one repeated token at once.
    """
    rng = np.random.default_rng(seed)
    gemma = spec.family == "gemma3"
    weights: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(spec).items():
        if name.endswith("norm.weight"):
            gain = 3.0 if any(part in name for part in ("q_norm", "k_norm")) else 1.0
            if gemma and any(part in name for part in ("post_attention", "post_feedforward")):
                gain = 3.0
            offset = gain - 1.0 if gemma else gain   # Gemma3 multiplies by 1 + w
            value = offset + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or name.startswith("lm_head"):
            value = rng.standard_normal(shape) * (3.0 / math.sqrt(spec.hidden_size))
        else:
            sharp = any(part in name for part in ("q_proj", "k_proj", "o_proj", "down_proj"))
            value = rng.standard_normal(shape) * ((3.0 if sharp else 1.0) / math.sqrt(shape[-1]))
        weights[name] = value.astype(F32)
    return weights


def _canonical_names(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in weights.items():
        for prefix, replacement in _NAME_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        out[name] = value
    return out


def _wanted(name: str) -> bool:
    """A decoder weight (after prefix canonicalization), not a vision-tower or projector one."""
    for prefix, replacement in _NAME_PREFIXES:
        if name.startswith(prefix):
            name = replacement + name[len(prefix):]
            break
    return name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."))


_SAFETENSORS_FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The decoder weights of one safetensors file as float32 arrays (BF16 widened exactly).

    F32/F16/F64 tensors are read with `safetensors.safe_open(framework="np")`; NumPy has no
    bfloat16, so BF16 tensors are read from the raw bytes the header points at and widened by
    shifting each uint16 into the high half of a float32.
    """
    path = Path(path)
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    out: dict[str, np.ndarray] = {}
    typed: list[str] = []
    for name, info in header.items():
        if name == "__metadata__" or not _wanted(name):
            continue
        dtype = info["dtype"]
        if dtype == "BF16":
            begin, end = info["data_offsets"]
            raw = np.fromfile(path, dtype="<u2", count=(end - begin) // 2,
                              offset=data_start + begin)
            out[name] = (raw.astype(np.uint32) << np.uint32(16)).view(F32).reshape(info["shape"])
        elif dtype in _SAFETENSORS_FLOATS:
            typed.append(name)
        else:
            raise ConfigError(f"{path.name}: tensor {name!r} has dtype {dtype}, not one of "
                              "F32, F16, BF16")
    if typed:
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as reader:
            for name in typed:
                out[name] = reader.get_tensor(name).astype(F32)
    return out


def load_safetensors_dir(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """All decoder weights of a checkpoint directory, single-file or sharded."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / shard for shard in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory} holds no *.safetensors weights")
    weights: dict[str, np.ndarray] = {}
    for file in files:
        weights.update(read_safetensors(file))
    return _canonical_names(weights)
