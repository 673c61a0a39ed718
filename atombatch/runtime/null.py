"""`NullRuntime`: a device that only waits. No math, no KV, wall-clock device time.

Theory of operation
-------------------
A decode call costs exactly what an ideal device of a fixed step time would cost the host: the
call returns `step_ms` after it was made, and the wait is a `time.sleep`, which releases the GIL
the way a wait on a real device does (the event loop, the front and any other thread run
meanwhile). A prefill chunk waits `prefill_ms` (default: the same as a step). The logits are
written into an array allocated once and the remaining time is slept, so the runtime's own host
work is inside the device time, as the device's LM head is.

Nothing else costs time: KV import, block copies and host-cache reads and writes are no-ops that
only check their arguments. Against this runtime, what the serving path delivers divided by
`batch_size / step` (tokens per second of a full batch) is the share of the device the host keeps
busy (`python -m atombatch.bench overlap`, docs/overlap.md).

The logits are a zero row with one spike at `1.0` whose token is a hash of the row's input token
and position (never an EOS id, so greedy requests run to `max_tokens`): greedy output is
deterministic, differs by position and by prompt, and does not depend on the lane.

With `lora_adapters=N` it has the LoRA capability (docs/lora.md, "Measuring adapters"): N
synthetic adapters (`null-1`..`null-N`, ids 1..N) that requests may name, and `prefill` and
`decode` take `lora_int_ids=` (int32 `[1]` / `[rows]`), which they check (shape, ids in 0..N)
and otherwise ignore: the logits do not change and no time is added, so what a mixed-adapter run
costs beyond a base-only one is the engine's host work, not the device's.
"""

from __future__ import annotations

import math
import select
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import ArtifactConfig
from atombatch.artifact.lora import TARGET_MODULES, LoraAdapter
from atombatch.errors import ConfigError, StateError
from atombatch.runtime.base import DecodeArrays, PrefillArrays, check_decode_rows

MAX_ADAPTERS = 1024  # synthetic adapters a NullRuntime may hold
SPIN_S = 0.0003   # the last 0.3 ms of a wait are spun (GIL released), not slept

# Multipliers of the spike hash (Knuth's multiplicative constant and a small odd prime).
_TOKEN_MULT = 2654435761
_POSITION_MULT = 40503


class NullCalls(msgspec.Struct):
    """What a `NullRuntime` was asked to do, and the wall time its calls took."""

    decode_calls: int = 0
    decode_rows: int = 0                 # rows of every decode call (padding rows included)
    prefill_calls: int = 0
    decode_s: float = 0.0                # wall seconds inside decode calls (the sleep and the rest)
    prefill_s: float = 0.0               # wall seconds inside prefill calls


class NullRuntime:
    """A `Runtime` whose calls only wait: the ideal device of a fixed step time.

    Args:
        artifact: the compiled shapes (batch, context, blocks, vocabulary) to stand in for.
        step_ms: milliseconds one decode call takes, whatever its rows and contexts.
        prefill_ms: milliseconds one prefill chunk takes (default: `step_ms`).
        seed: varies which token each (input token, position) pair spikes at.
        lora_adapters: N > 0: N synthetic LoRA adapters (rank 8, every target module; nothing
            is computed with them) and `lora_int_ids=` on every call (0, the default: no LoRA
            capability, the runtime's calls take no adapter ids).

    The returned logits are buffers reused on every call: read them before the next one.

    Raises:
        ConfigError: a negative or non-finite time, `lora_adapters` not an int in 0..`MAX_ADAPTERS`.
    """

    every_position_logits = True  # `prefill(every_position=True)` works (prompt logprobs)

    def __init__(self, artifact: ArtifactConfig, step_ms: float = 20.0,
                 prefill_ms: float | None = None, seed: int = 0, lora_adapters: int = 0) -> None:
        prefill_ms = step_ms if prefill_ms is None else prefill_ms
        for name, value in (("step_ms", step_ms), ("prefill_ms", prefill_ms)):
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} must be a finite number of milliseconds >= 0")
        self.artifact = artifact
        self.spec = artifact.model
        self.step_ms = float(step_ms)
        self.prefill_ms = float(prefill_ms)
        self.seed = seed
        self.calls = NullCalls()
        self._step_s = self.step_ms / 1000.0
        self._prefill_s = self.prefill_ms / 1000.0
        vocab = self.spec.vocab_size
        eos = set(self.spec.eos_token_ids)
        # the tokens a spike may land on; a hash picks one by index (EOS ids are skipped)
        self._allowed = np.array([t for t in range(vocab) if t not in eos], dtype=np.int64)
        if not len(self._allowed):
            raise ConfigError(f"vocab_size={vocab} leaves no token that is not an EOS id")
        self._offset = (seed * 97 + 12345) % len(self._allowed)
        batch = artifact.batch_size
        self._decode_logits = np.zeros((batch, vocab), dtype=np.float32)
        self._decode_spikes = np.zeros(batch, dtype=np.int64)
        self._rows = np.arange(batch, dtype=np.int64)
        self._hash = np.zeros(batch, dtype=np.int64)        # scratch for the spike hash
        self._scratch = np.zeros(batch, dtype=np.int64)
        self._prefill_logits = np.zeros(vocab, dtype=np.float32)
        self._prefill_spike = 0
        if isinstance(lora_adapters, bool) or not isinstance(lora_adapters, int) or \
                not 0 <= lora_adapters <= MAX_ADAPTERS:
            raise ConfigError(f"lora_adapters={lora_adapters!r} must be an int in "
                              f"0..{MAX_ADAPTERS}")
        self._max_lora_id = lora_adapters
        if lora_adapters:  # the capability is the attribute (`Capabilities.lora`): only when asked
            self.lora_adapters: dict[str, LoraAdapter] = {
                f"null-{i}": LoraAdapter(name=f"null-{i}", lora_int_id=i, path="-", r=8,
                                         lora_alpha=8.0, target_modules=TARGET_MODULES)
                for i in range(1, lora_adapters + 1)}

    def spike(self, token: int, position: int) -> int:
        """The token the logits of `token` at `position` spike at (greedy picks it)."""
        index = (token * _TOKEN_MULT + position * _POSITION_MULT + self._offset) % \
            len(self._allowed)
        return int(self._allowed[index])

    # -- Runtime protocol -------------------------------------------------------------------------
    def _check_lora(self, lora_int_ids: npt.NDArray[np.int32] | None, rows: int) -> None:
        """`lora_int_ids` is what a LoRA graph takes: int32 `[rows]`, each id 0 (the base) or
        one of this runtime's adapters (a StateError otherwise)."""
        if lora_int_ids is None:
            return
        if not self._max_lora_id:
            raise StateError("lora_int_ids given to a NullRuntime without adapters "
                             "(NullRuntime(lora_adapters=N))")
        ids = lora_int_ids
        if not isinstance(ids, np.ndarray) or ids.shape != (rows,) or ids.dtype != np.int32:
            raise StateError(f"lora_int_ids is {type(ids).__name__} of shape "
                             f"{getattr(ids, 'shape', None)} and dtype {getattr(ids, 'dtype', None)}"
                             f"; the call takes int32 [{rows}] (one id per row)")
        if rows and (ids.min() < 0 or ids.max() > self._max_lora_id):
            raise StateError(f"lora_int_ids holds {sorted(set(ids.tolist()))}: ids are "
                             f"0 (the base) .. {self._max_lora_id}")

    def prefill(self, inputs: PrefillArrays, *, every_position: bool = False,
                lora_int_ids: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.float32]:
        """Wait `prefill_ms`; the last real token's logits row (a reused buffer), or with
        `every_position` a fresh `[Q, vocab]` array (row i spikes at the hash of token i).
        `lora_int_ids` (int32 [1], with `lora_adapters`): checked, otherwise ignored."""
        started = time.perf_counter()
        self._check_lora(lora_int_ids, 1)
        q = int(inputs.query_position)
        start = int(inputs.cache_position[0, 0])
        result: npt.NDArray[np.float32]
        if every_position:
            ids = np.asarray(inputs.input_ids).reshape(-1).tolist()
            result = np.zeros((len(ids), self.spec.vocab_size), dtype=np.float32)
            for i, token in enumerate(ids):
                result[i, self.spike(int(token), start + i)] = 1.0
        else:
            result = self._prefill_logits
            result[self._prefill_spike] = 0.0
            self._prefill_spike = self.spike(int(inputs.input_ids[0, q]), start + q)
            result[self._prefill_spike] = 1.0
        self._wait_until(started + self._prefill_s)
        self.calls.prefill_calls += 1
        self.calls.prefill_s += time.perf_counter() - started
        return result

    def decode(self, inputs: DecodeArrays, *,
               lora_int_ids: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.float32]:
        """Wait `step_ms`; logits `[rows, vocab]` (a reused buffer), one spike per row.
        `lora_int_ids` (int32 [rows], with `lora_adapters`): checked, otherwise ignored."""
        started = time.perf_counter()
        rows = inputs.input_ids.shape[0]
        check_decode_rows(rows, self.artifact.decoder_batch_sizes)
        self._check_lora(lora_int_ids, rows)
        logits, spikes, lanes = self._decode_logits, self._decode_spikes[:rows], self._rows[:rows]
        hashed, scratch = self._hash[:rows], self._scratch[:rows]
        logits[lanes, spikes] = 0.0
        # hashed = (token * T + position * P + offset) % allowed, in preallocated int64 buffers
        np.multiply(inputs.input_ids[:, 0], _TOKEN_MULT, out=hashed, dtype=np.int64)
        np.multiply(inputs.cache_position[:, 0], _POSITION_MULT, out=scratch, dtype=np.int64)
        np.add(hashed, scratch, out=hashed)
        np.add(hashed, self._offset, out=hashed)
        np.remainder(hashed, len(self._allowed), out=hashed)
        np.take(self._allowed, hashed, out=spikes)
        logits[lanes, spikes] = 1.0
        self._wait_until(started + self._step_s)
        self.calls.decode_calls += 1
        self.calls.decode_rows += rows
        self.calls.decode_s += time.perf_counter() - started
        return logits[:rows]

    def copy_block(self, src: int, dst: int) -> None:
        self._check_block(src)
        self._check_block(dst)

    def copy_slot(self, src: int, dst: int) -> None:
        """A sliding-window slot copy (n > 1 forks on hybrid models): nothing to copy."""
        for slot in (src, dst):
            if not 0 <= slot < self.artifact.batch_size:
                raise StateError(f"slot {slot} is outside 0..{self.artifact.batch_size - 1}")

    def read_slot(self, slot: int) -> npt.NDArray[np.generic]:
        """A sliding-slot checkpoint (hybrid prefix cache): nothing to read."""
        self.copy_slot(slot, slot)
        return np.zeros(1, dtype=np.float32)

    def write_slot(self, slot: int, data: npt.NDArray[np.generic]) -> None:
        self.copy_slot(slot, slot)

    def read_block(self, block: int) -> npt.NDArray[np.generic]:
        self._check_block(block)
        return np.zeros(1, dtype=np.float32)

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        self._check_block(block)

    def write_layer_kv(self, layer: int, k: npt.NDArray[np.generic], v: npt.NDArray[np.generic],
                       block_row: Sequence[int], slot: int = 0) -> None:
        """A PD import: nothing is stored (the logits never depend on KV)."""
        if not 0 <= layer < self.spec.num_layers:
            raise StateError(f"layer {layer} is outside 0..{self.spec.num_layers - 1}")
        for block in block_row:
            self._check_block(block)

    # -- helpers ----------------------------------------------------------------------------------
    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.artifact.num_blocks:
            raise StateError(f"block {block} is outside 0..{self.artifact.num_blocks - 1}")

    @staticmethod
    def _wait_until(deadline: float) -> None:
        """Wait, with the GIL released, until `deadline` on the perf_counter clock.

        A device call returns when the device is done; a plain sleep returns 0.1-1 ms late on a
        loaded VM (timer slack and wakeup latency), which would be charged to the serving path.
        So it sleeps until `SPIN_S` before the deadline and then spins on a zero-timeout
        `select` (a system call that releases the GIL and returns at once) until the deadline: at
        most `SPIN_S` of CPU per call. Not a zero-length `time.sleep` (a nanosleep, which timer
        slack stretches to ~50 us: the call returned 50-100 us late) nor `os.sched_yield` (which
        hands the CPU to any other runnable thread for the rest of its slice: milliseconds when
        the front and the client keep both CPUs busy)."""
        left = deadline - time.perf_counter()
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
        while time.perf_counter() < deadline:
            select.select((), (), (), 0)
