"""A fast, exact test runtime whose every output depends on the KV it reads through the tables.

It keeps integer "KV" (the token written at each position) in the device layout, writes every lane
of a decode step (idle lanes too, like the device), reads only through `block_tables` and
`local_block_tables`, and emits a one-hot logit for

    next(seq) = (sum_p v[p] * (p + 1) + 7 * sum(seq[-window:])) % (vocab - 1) + 1

where the value stored at position p is v[p] = seq[p], or for hybrid models
seq[p] + 1000 * (sum of the sliding window ending at p, as the slot held it at write time % 997),
so a wrong table entry, a clobbered block or a broken sliding shift buffer changes the tokens.
`reference(prompt, n)` computes the same function without any cache. It is not the thing under
test: the scheduler and engine are, and the NumPy runtime repeats these checks with real math.
"""

from __future__ import annotations

import numpy as np

from atombatch.artifact.config import ArtifactConfig, ModelSpec


def ledger_spec(hybrid: bool = False, window: int = 5, vocab: int = 97,
                eos: tuple[int, ...] = ()) -> ModelSpec:
    layer_types = ("sliding_attention", "full_attention") if hybrid else ()
    return ModelSpec(name="ledger-hybrid" if hybrid else "ledger", family="gemma3" if hybrid else
                     "llama", vocab_size=vocab, hidden_size=8, intermediate_size=16, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=window if hybrid else 0,
                     layer_types=layer_types, eos_token_ids=eos)


def stored_value(seq: list[int], p: int, window: int) -> int:
    if not window:
        return seq[p]
    return seq[p] + 1000 * (sum(seq[max(0, p - window + 1): p + 1]) % 997)


def next_token(seq: list[int], vocab: int, window: int) -> int:
    total = sum(stored_value(seq, p, window) * (p + 1) for p in range(len(seq)))
    if window:
        total += 7 * sum(seq[-window:])
    return total % (vocab - 1) + 1


def reference(prompt: list[int], n: int, vocab: int, window: int = 0,
              stop: frozenset[int] = frozenset()) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        token = next_token(seq, vocab, window)
        out.append(token)
        if token in stop:
            break
        seq.append(token)
    return out


class LedgerRuntime:
    def __init__(self, artifact: ArtifactConfig) -> None:
        self.artifact = artifact
        spec = artifact.model
        self.vocab = spec.vocab_size
        self.window = spec.sliding_window if spec.is_hybrid else 0
        self.kv = np.zeros((artifact.num_blocks, artifact.block_size), dtype=np.int64)
        self.slots = np.zeros((artifact.batch_size, max(self.window, 1)), dtype=np.int64)
        self.prefill_calls = 0
        self.decode_calls = 0

    # -- the device's addressing ----------------------------------------------------------------
    def _write(self, row: np.ndarray, pos: int, token: int, slot: int) -> None:
        bs = self.artifact.block_size
        value = token
        if self.window:
            value += 1000 * (int(self.slots[slot, : min(pos + 1, self.window)].sum()) % 997)
        self.kv[int(row[pos // bs]), pos % bs] = value

    def _slot_write(self, slot: int, pos: int, token: int) -> None:
        if not self.window:
            return
        if pos < self.window:
            self.slots[slot, pos] = token
        else:
            self.slots[slot, :-1] = self.slots[slot, 1:]
            self.slots[slot, -1] = token

    def _logits(self, row: np.ndarray, slot: int, pos: int) -> np.ndarray:
        bs = self.artifact.block_size
        positions = np.arange(pos + 1)
        tokens = self.kv[row[positions // bs].astype(np.int64), positions % bs]
        total = int(np.dot(tokens, positions + 1))
        if self.window:
            total += 7 * int(self.slots[slot, : min(pos + 1, self.window)].sum())
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[total % (self.vocab - 1) + 1] = 1.0
        return logits

    # -- protocol ---------------------------------------------------------------------------------
    def prefill(self, inputs) -> np.ndarray:  # type: ignore[no-untyped-def]
        self.prefill_calls += 1
        q = int(inputs.query_position)
        slot = int(inputs.local_block_tables[0])
        for i in range(inputs.input_ids.shape[1]):
            pos, token = int(inputs.cache_position[0, i]), int(inputs.input_ids[0, i])
            if i <= q:
                self._slot_write(slot, pos, token)
            self._write(inputs.block_tables, pos, token, slot)
        return self._logits(inputs.block_tables, slot, int(inputs.cache_position[0, q]))

    def decode(self, inputs) -> np.ndarray:  # type: ignore[no-untyped-def]
        self.decode_calls += 1
        b = inputs.input_ids.shape[0]
        for lane in range(b):  # every lane writes, idle ones included
            pos, token = int(inputs.cache_position[lane, 0]), int(inputs.input_ids[lane, 0])
            slot = int(inputs.local_block_tables[lane, 0])
            self._slot_write(slot, pos, token)
            self._write(inputs.block_tables[lane], pos, token, slot)
        return np.stack([self._logits(inputs.block_tables[lane], int(inputs.local_block_tables[lane, 0]),
                                      int(inputs.cache_position[lane, 0])) for lane in range(b)])

    def copy_block(self, src: int, dst: int) -> None:
        self.kv[dst] = self.kv[src]

    def copy_slot(self, src: int, dst: int) -> None:
        self.slots[dst] = self.slots[src]

    def read_slot(self, slot: int) -> np.ndarray:
        return self.slots[slot].copy()

    def write_slot(self, slot: int, data: np.ndarray) -> None:
        self.slots[slot] = data

    def read_block(self, block: int) -> np.ndarray:
        return self.kv[block].copy()

    def write_block(self, block: int, data: np.ndarray) -> None:
        self.kv[block] = data
