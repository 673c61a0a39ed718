"""`SimRuntime`: a device-time model of a compiled ATOM artifact. No math, a virtual clock.

Every `prefill` / `decode` call advances a virtual clock by what the `CostModel`
(`atombatch.runtime.sim.costs`, where the formulas are) says the device would take, and returns
deterministic pseudo-logits. The `Batcher` picks the clock up (`runtime.clock`), so every
timestamp of a simulated run is virtual.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.artifact import plan
from atombatch.artifact.config import SLIDING, ArtifactConfig
from atombatch.artifact.lora import BASE_LORA_ID, LoraAdapter
from atombatch.errors import ConfigError, StateError
from atombatch.runtime.base import DecodeArrays, PrefillArrays, check_decode_rows
from atombatch.runtime.sim.costs import CostModel, LoraCost, _shapes, lora_cost


class DeviceTime(msgspec.Struct):
    """Virtual device seconds and calls, by kind."""

    prefill_s: float = 0.0                 # native prefill compute
    import_s: float = 0.0                  # decoder-side KV import (PD routes)
    decode_s: float = 0.0
    prefill_calls: int = 0
    import_calls: int = 0                  # write_layer_kv calls (one per imported layer)
    decode_calls: int = 0
    decode_rows: int = 0                   # rows billed by decode calls (padding rows included)
    lora_s: float = 0.0                    # of prefill_s and decode_s: what LoRA adapters added


class SimRuntime:
    """A `Runtime` that does no math: a virtual clock advanced by a `CostModel`.

    Args:
        artifact: the compiled shapes to simulate.
        costs: the cost model (default: `CostModel.default()`, fitted to the origin KONI B1 figures).
        seed: varies the pseudo-logits.
        pace: wall seconds each simulated device second takes (0, the default: none, the call
            returns at once and only the virtual clock advances; 1.0: real time). A paced runtime
            sleeps its device time in every call, so a server or a cluster driven by it costs
            what the device would (a prefix hit saves that prefill's wall time), and its clock
            is wall time divided by `pace`.
        lora_adapters: LoRA adapters compiled into the artifact (as optimum-rbln's `lora_config`
            does; none load at run time). `prefill` and `decode` then take `lora_int_ids`, and a
            call's rows under adapters cost their matrices and FLOPs (`CostModel.lora_step_s`).

    The pseudo-logits of a call are a fixed random row plus one spike at a token that is a hash of
    the input token and its position (never an EOS id), so greedy runs are deterministic and differ
    by request (and by adapter: a row under adapter i spikes elsewhere than the base). The returned
    arrays are buffers reused on every call: read them before the next one.
    """

    def __init__(self, artifact: ArtifactConfig, costs: CostModel | None = None,
                 seed: int = 0, pace: float = 0.0,
                 lora_adapters: Sequence[LoraAdapter] = ()) -> None:
        if not (pace >= 0 and math.isfinite(pace)):
            raise ConfigError(f"pace={pace} must be a finite number >= 0")
        self.lora_adapters: dict[str, LoraAdapter] = {}
        self._lora_costs: dict[int, LoraCost] = {}
        for adapter in lora_adapters:
            if adapter.lora_int_id <= BASE_LORA_ID or adapter.name in self.lora_adapters or \
                    adapter.lora_int_id in self._lora_costs:
                raise ConfigError(f"adapter {adapter.name!r} (lora_int_id={adapter.lora_int_id}) "
                                  "repeats a name or an id, or takes the base model's id 0")
            self.lora_adapters[adapter.name] = adapter
            self._lora_costs[adapter.lora_int_id] = lora_cost(artifact, adapter.r,
                                                              adapter.target_modules)
        self.pace = pace
        self._wall0 = time.perf_counter()
        self.artifact = artifact
        self.spec = artifact.model
        self.costs = costs if costs is not None else CostModel.default()
        self.seed = seed
        self.device = DeviceTime()
        self._now = 0.0
        vocab = self.spec.vocab_size
        base = np.random.default_rng(seed).random(vocab, dtype=np.float32)
        self._decode_logits = np.tile(base, (artifact.batch_size, 1))
        self._decode_spikes = np.zeros(artifact.batch_size, dtype=np.int64)
        self._prefill_logits = base.copy()
        self._prefill_spike = 0
        self._base = base
        self._eos = frozenset(self.spec.eos_token_ids)
        self._vocab = vocab

    # -- clock ------------------------------------------------------------------------------------
    def clock(self) -> float:
        """Virtual seconds since the runtime was built (paced: wall seconds / pace)."""
        if self.pace:
            self._now = max(self._now, (time.perf_counter() - self._wall0) / self.pace)
        return self._now

    def advance_to(self, when: float) -> None:
        """Let virtual time pass with the device idle (waiting for arrivals)."""
        if when > self._now:
            self._now = when

    def _spend(self, cost: float) -> None:
        """The device is busy for `cost` simulated seconds (paced: sleeps them)."""
        if self.pace:
            time.sleep(cost * self.pace)
            self.clock()
        else:
            self._now += cost

    # -- pseudo-logits ----------------------------------------------------------------------------
    def _spike(self, token: int, position: int, lora: int = BASE_LORA_ID) -> int:
        h = (token * 2654435761 + position * 40503 + self.seed * 97 + 12345 + lora * 7919) % \
            self._vocab
        while h in self._eos:
            h = (h + 1) % self._vocab
        return h

    def prompt_logits(self, prompt: Sequence[int] | npt.NDArray[np.integer]
                      ) -> npt.NDArray[np.float32]:
        """The logits the last prefill chunk of `prompt` returns (a fresh array): what a
        simulated PD producer of the same model samples its first token from."""
        row = self._base.copy()
        row[self._spike(int(prompt[-1]), len(prompt) - 1)] = 32.0
        return row

    # -- Runtime protocol -------------------------------------------------------------------------
    every_position_logits = True  # `prefill(every_position=True)` works (prompt logprobs)

    def _lora_ids(self, lora_int_ids: npt.ArrayLike | None, rows: int) -> npt.NDArray[np.int32]:
        ids = np.asarray(lora_int_ids)
        if ids.shape != (rows,) or not np.issubdtype(ids.dtype, np.integer):
            raise StateError(f"lora_int_ids has shape {ids.shape} and dtype {ids.dtype}; the "
                             f"graph takes int32 [{rows}] (one id per row)")
        unknown = set(np.unique(ids).tolist()) - set(self._lora_costs) - {BASE_LORA_ID}
        if unknown:
            raise StateError(f"lora_int_ids holds {sorted(unknown)}, which no compiled adapter "
                             f"has (ids: {sorted(self._lora_costs)}; {BASE_LORA_ID} is the base)")
        return ids.astype(np.int32, copy=False)

    def prefill(self, inputs: PrefillArrays, *, every_position: bool = False,
                lora_int_ids: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.float32]:
        """One chunk's pseudo-logits: the last real token's row (a reused buffer), or with
        `every_position` a fresh `[Q, vocab]` array, row i spiking at the hash of token i (the
        cost model charges the same time: the LM head over Q rows is not modelled).
        `lora_int_ids` (int32 [1]): the adapter the chunk runs under (0: the base)."""
        q = int(inputs.query_position)
        start = int(inputs.cache_position[0, 0])
        lora = BASE_LORA_ID
        if lora_int_ids is not None:
            lora = int(self._lora_ids(lora_int_ids, 1)[0])
        cost = self.costs.prefill_chunk_s(self.artifact, start, q + 1)
        if lora != BASE_LORA_ID:
            adapted = self.costs.prefill_chunk_s(self.artifact, start, q + 1,
                                                 self._lora_costs[lora])
            self.device.lora_s += adapted - cost
            cost = adapted
        self.device.prefill_s += cost
        self.device.prefill_calls += 1
        self._spend(cost)
        if every_position:
            ids = np.asarray(inputs.input_ids).reshape(-1)
            rows = np.tile(self._base, (len(ids), 1))
            for i, token in enumerate(ids.tolist()):
                rows[i, self._spike(int(token), start + i, lora)] = 32.0
            return rows
        row = self._prefill_logits
        row[self._prefill_spike] = self._base[self._prefill_spike]
        spike = self._spike(int(inputs.input_ids[0, q]), start + q, lora)
        row[spike] = 32.0
        self._prefill_spike = spike
        return row

    def decode(self, inputs: DecodeArrays, *,
               lora_int_ids: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.float32]:
        """One step's pseudo-logits, `[rows, vocab]` (a reused buffer). `lora_int_ids` (int32
        [rows]): each row's adapter; each distinct adapter of the step adds its cost once, and
        its FLOPs per row that uses it."""
        positions = inputs.cache_position[:, 0]
        rows = len(positions)
        check_decode_rows(rows, self.artifact.decoder_batch_sizes)
        contexts = [int(p) + 1 for p in positions if p > 0]  # padding rows sit at position 0
        cost = self.costs.decode_step_s(self.artifact, contexts, rows)
        loras: list[int] | None = None
        if lora_int_ids is not None:
            ids = self._lora_ids(lora_int_ids, rows)
            if ids.any():
                loras = ids.tolist()
                used, counts = np.unique(ids[ids != BASE_LORA_ID], return_counts=True)
                extra = self.costs.lora_step_s([(self._lora_costs[int(i)], int(n))
                                                for i, n in zip(used, counts, strict=True)])
                self.device.lora_s += extra
                cost += extra
        self.device.decode_s += cost
        self.device.decode_calls += 1
        self.device.decode_rows += rows
        self._spend(cost)
        logits, spikes, base = self._decode_logits, self._decode_spikes, self._base
        for row in range(rows):
            old = spikes[row]
            logits[row, old] = base[old]
            spike = self._spike(int(inputs.input_ids[row, 0]), int(positions[row]),
                                loras[row] if loras is not None else BASE_LORA_ID)
            logits[row, spike] = 32.0
            spikes[row] = spike
        return logits[:rows]

    def write_layer_kv(self, layer: int, k: npt.NDArray[np.generic], v: npt.NDArray[np.generic],
                       block_row: Sequence[int], slot: int = 0) -> None:
        """Import one layer's K/V `[kv_heads, tokens, head_dim]` (the decoder side of PD): no data
        moves, the clock advances by `CostModel.layer_import_s` of its tokens.

        Raises:
            StateError: a layer, shape, block row or slot the device could not take.
        """
        spec, art = self.spec, self.artifact
        if not 0 <= layer < spec.num_layers:
            raise StateError(f"layer {layer} is outside 0..{spec.num_layers - 1}")
        tokens = k.shape[1] if k.ndim == 3 else -1
        if k.shape != v.shape or k.shape != (spec.num_kv_heads, tokens, spec.head_dim):
            raise StateError(f"K {k.shape} and V {v.shape} must both be [kv_heads="
                             f"{spec.num_kv_heads}, tokens, head_dim={spec.head_dim}]")
        sliding = spec.layer_kinds[layer] == SLIDING
        limit = plan.sliding_window_len(art) if sliding else art.max_seq_len
        if not 0 < tokens <= limit:
            raise StateError(f"layer {layer} got {tokens} tokens, outside 1..{limit}")
        if sliding:
            if not 0 <= slot < art.batch_size:
                raise StateError(f"slot {slot} is outside 0..{art.batch_size - 1}")
        else:
            if len(block_row) * art.block_size < tokens:
                raise StateError(f"block row {list(block_row)} holds {len(block_row)} blocks of "
                                 f"{art.block_size}, too few for {tokens} tokens")
            bad = [b for b in block_row if not 0 <= b < art.num_blocks]
            if bad:
                raise StateError(f"block {bad[0]} is outside 0..{art.num_blocks - 1}")
        cost = self.costs.layer_import_s(art, tokens)
        self.device.import_s += cost
        self.device.import_calls += 1
        self._spend(cost)

    def copy_block(self, src: int, dst: int) -> None:
        shapes = _shapes(self.artifact)
        cost = 2 * shapes.global_kv_bytes_per_token * self.artifact.block_size / \
            self.costs.memory_bandwidth
        self._spend(cost)

    def copy_slot(self, src: int, dst: int) -> None:
        """A sliding-window slot copy (n > 1 forks on hybrid models): charged like a block."""
        self.copy_block(src, dst)

    def read_slot(self, slot: int) -> npt.NDArray[np.generic]:
        """A sliding-slot checkpoint (hybrid prefix cache): no data, charged like a block
        copy's transfer of the slot's bytes."""
        self._spend(plan.checkpoint_bytes(self.artifact) / self.costs.memory_bandwidth)
        return np.zeros(1, dtype=np.float32)

    def write_slot(self, slot: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a sliding-slot checkpoint: charged like `read_slot`."""
        self._spend(plan.checkpoint_bytes(self.artifact) / self.costs.memory_bandwidth)

    def read_block(self, block: int) -> npt.NDArray[np.generic]:
        return np.zeros(1, dtype=np.float32)

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        return None
