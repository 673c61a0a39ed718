"""The small protocol every runtime implements; nothing above it knows which runtime it talks to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import ArtifactConfig
from atombatch.errors import StateError


def check_decode_rows(rows: int, decoder_batch_sizes: Sequence[int]) -> None:
    """The decode-bucket guard every runtime runs on a decode call: `rows` (the input arrays'
    batch) must be one of the artifact's compiled decode batches, or the call is refused before
    it touches the device (a scheduler bug, never a client's)."""
    if rows not in decoder_batch_sizes:
        raise StateError(f"decode inputs have {rows} rows; the compiled decode batches are "
                         f"{tuple(decoder_batch_sizes)} (decoder_batch_sizes="
                         f"{list(decoder_batch_sizes)})")


class PrefillArrays(Protocol):
    """What a prefill call reads (built in place by `atombatch.kernel.blocks.PrefillInputs`)."""

    input_ids: npt.NDArray[np.int64]            # [1, Q]
    cache_position: npt.NDArray[np.int32]       # [1, Q] absolute positions, padding continues
    block_tables: npt.NDArray[np.int16]         # [max_seq_len // block_size]
    local_block_tables: npt.NDArray[np.int16]   # [1] the lane's sliding slot (hybrid only)
    query_position: npt.NDArray[np.int16]       # 0-d: index of the last real token in the chunk


class DecodeArrays(Protocol):
    """What a decode call reads (built in place by `atombatch.kernel.blocks.DecodeInputs`)."""

    input_ids: npt.NDArray[np.int64]            # [B, 1]
    cache_position: npt.NDArray[np.int32]       # [B, 1]
    block_tables: npt.NDArray[np.int16]         # [B, max_seq_len // block_size]
    local_block_tables: npt.NDArray[np.int16]   # [B, 1]


@runtime_checkable
class Runtime(Protocol):
    """A compiled artifact's executor: prefill one chunk, decode one step, move KV blocks."""

    artifact: ArtifactConfig

    def prefill(self, inputs: PrefillArrays) -> npt.NDArray[np.float32]:
        """Run one prefill chunk; returns the logits [vocab] of the last real token.

        Optional capability (prompt logprobs): a runtime whose attribute `every_position_logits`
        is True also takes `prefill(inputs, every_position=True)` and returns `[Q, vocab]`, the
        logits of every chunk position (padding rows included). Without it the engine refuses
        `prompt_logprobs` at submit, with the runtime's `every_position_hint` when it has one.
        """
        ...

    def decode(self, inputs: DecodeArrays) -> npt.NDArray[np.float32]:
        """Run one decode step for all B lanes (idle lanes too); returns logits [B, vocab]."""
        ...

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every global layer (the device's KV copy).

        Optional companion (hybrid models): `copy_slot(src, dst)` copies a lane's sliding-window
        slot in every sliding layer; with it an n > 1 request's choices start from choice 0's
        prompt KV on hybrid models too (see docs/sampling.md).

        Optional companions (hybrid models, needed by their prefix cache): `read_slot(slot)`
        returns one lane's sliding slot in every sliding layer as one host array, and
        `write_slot(slot, data)` restores it; `slot_bytes` (if present) is that array's size.
        A checkpoint is taken and restored through them (docs/prefix-cache.md)."""
        ...

    def read_block(self, block: int) -> npt.NDArray[np.generic]:
        """One block's K/V of every global layer, as one host array (host cache)."""
        ...

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        """Restore a block previously returned by `read_block`."""
        ...

    def write_layer_kv(self, layer: int, k: npt.NDArray[np.float32], v: npt.NDArray[np.float32],
                       block_row: Sequence[int], slot: int = 0) -> None:
        """PD import of one layer: K/V `[kv_heads, tokens, head_dim]` of positions 0..tokens-1
        into the blocks of `block_row` (global layer), or a sliding layer's window tail into
        lane slot `slot` (oldest first)."""
        ...


class Capabilities:
    """What a runtime offers beyond `Runtime`, read once, in one place (the engine never probes
    a runtime itself). Each is optional; a runtime declares one by having the attribute:

    - `clock()`: the runtime's time in seconds (virtual for the simulator); else wall time.
    - `copy_slot(src, dst)`: copy a lane's sliding slot (hybrid n > 1 forks).
    - `read_slot(slot)` / `write_slot(slot, data)` / `slot_bytes`: a lane's sliding slot to and
      from the host (hybrid prefix-cache checkpoints).
    - `kv_methods`: which KV operations the device SDK has (`RebelRuntime`: `_copy_kv_cache`,
      `_fetch_kv_cache`, `_update_kv_cache` -> bool); a runtime without it has every operation
      its methods show.
    - `every_position_logits` / `every_position_hint`: `prefill(inputs, every_position=True)`
      returns every chunk position's logits (prompt logprobs), or why not.
    - `lora`: the runtime has `lora_adapters` (name -> `LoraAdapter`) and its `prefill` and
      `decode` take `lora_int_ids=` (int32, [1] / [rows], one id per row, padding rows
      included; 0 = the base model). The engine passes it only to such a runtime.
    - `lora_loadable`: adapters load at run time, `add_lora(adapter, weights)` and
      `remove_lora(name)` (the NumPy runtime; a device's adapters are compiled in).
    """

    __slots__ = ("clock", "copy_slot", "every_position_hint", "every_position_logits",
                 "kv_methods", "lora", "lora_loadable", "read_slot", "slot_bytes", "write_slot")

    def __init__(self, runtime: object) -> None:
        def method(name: str) -> bool:
            return callable(getattr(runtime, name, None))

        clock = getattr(runtime, "clock", None)
        self.clock = clock if callable(clock) else None
        self.copy_slot = method("copy_slot")
        self.read_slot = method("read_slot")
        self.write_slot = method("write_slot")
        slot_bytes = getattr(runtime, "slot_bytes", None)
        self.slot_bytes = int(slot_bytes) if isinstance(slot_bytes, int) and slot_bytes > 0 \
            else None
        kv_methods = getattr(runtime, "kv_methods", None)
        self.kv_methods: dict[str, bool] | None = dict(kv_methods) \
            if isinstance(kv_methods, dict) else None
        self.every_position_logits = bool(getattr(runtime, "every_position_logits", False))
        hint = getattr(runtime, "every_position_hint", None)
        self.every_position_hint = hint if isinstance(hint, str) else None
        self.lora = hasattr(runtime, "lora_adapters")
        self.lora_loadable = self.lora and method("add_lora") and method("remove_lora")

    def has_kv(self, *names: str) -> bool:
        """The device SDK has these KV operations (always True without `kv_methods`)."""
        return self.kv_methods is None or all(self.kv_methods.get(n, False) for n in names)
