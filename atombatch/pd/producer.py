"""The producer side of PD: prefill a prompt on one's own runtime and export its KV as a payload."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from atombatch.api.structs import SamplingParams
from atombatch.artifact.config import ArtifactConfig
from atombatch.artifact.lora import BASE_LORA_ID
from atombatch.errors import RequestError
from atombatch.pd.wire import (
    MODES,
    WIRE_DTYPES,
    KVHeader,
    KVPayload,
    LayerKV,
    Mode,
    expected_layer_tokens,
    model_identity,
)
from atombatch.sampling.sampler import sample


class Producer:
    """Prefills prompts on its own runtime (lane/slot 0, its own blocks) and exports the KV.

    `runtime` is a `NumpyRuntime` or anything with `artifact`, `prefill(PrefillInputs)` and
    `read_layer_kv`. Calls are serialized (one prefill at a time on the runtime).
    """

    def __init__(self, runtime: Any, *, dtype: str = "float32") -> None:
        from atombatch.kernel.blocks import PrefillInputs

        if dtype not in WIRE_DTYPES:
            raise RequestError(f"dtype={dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        self.runtime = runtime
        self.artifact: ArtifactConfig = runtime.artifact
        self.spec = self.artifact.model
        self.dtype = dtype
        self.identity = model_identity(self.spec)
        self._inputs = PrefillInputs(self.artifact.prefill_chunk_size,
                                     self.artifact.blocks_per_seq)
        self._row = np.arange(self.artifact.blocks_per_seq, dtype=np.int32)
        self._lock = threading.Lock()
        self.requests = 0

    def produce(self, request_id: str, prompt: Sequence[int],
                params: SamplingParams | None = None,
                covered_len: int | None = None, *,
                lora_int_id: int = BASE_LORA_ID) -> KVPayload:
        """Prefill `prompt[:covered_len]` (default: all of it) and return the whole payload.

        `lora_int_id` is the adapter the prefill runs under (0: the base model); the runtime
        must have it loaded (`lora_adapters`).

        Raises:
            RequestError: an empty prompt, covered_len outside 1..len(prompt), a prefix longer
                than this producer's max_seq_len, a token outside the vocabulary, or an adapter
                id this producer's runtime does not have.
        """
        params = params or SamplingParams(temperature=0.0)  # no params: greedy
        spec, art = self.spec, self.artifact
        tokens = np.asarray(list(prompt), dtype=np.int64)
        covered = len(tokens) if covered_len is None else int(covered_len)
        if not 0 < covered <= len(tokens):
            raise RequestError(f"covered_len={covered} is outside 1..{len(tokens)} (prompt length)")
        if covered > art.max_seq_len:
            raise RequestError(f"covered_len={covered} exceeds the producer's max_seq_len="
                               f"{art.max_seq_len}")
        if tokens.min() < 0 or tokens.max() >= spec.vocab_size:
            raise RequestError(f"prompt tokens {tokens.min()}..{tokens.max()} are outside the "
                               f"vocabulary 0..{spec.vocab_size - 1}")
        lora = self._lora_kwargs(lora_int_id)
        prefix = tokens[:covered]
        window = spec.sliding_window if spec.is_hybrid else 0
        with self._lock:
            self.requests += 1
            logits = None
            for start in range(0, covered, art.prefill_chunk_size):
                self._inputs.build(prefix, start, self._row, len(self._row), 0)
                logits = self.runtime.prefill(self._inputs, **lora)
            layers = []
            for i in range(spec.num_layers):
                k, v = self.runtime.read_layer_kv(i, self._row, covered)
                layers.append(LayerKV.from_float32(i, k, v, self.dtype))
        first = None
        if covered == len(tokens):
            assert logits is not None
            if not np.isfinite(np.max(logits)):  # a NaN or +inf anywhere, or only -inf
                raise RequestError(f"prefill returned non-finite logits for {request_id!r}: "
                                   "the producer has no first token to send")
            first = sample(logits, params, np.random.default_rng(params.seed), spec.eos_token_ids,
                           tokens)
        header = KVHeader(
            request_id=request_id, model_identity=self.identity, num_layers=spec.num_layers,
            layer_kinds=spec.layer_kinds, prompt_len=len(tokens), covered_len=covered,
            first_token=first, dtype=self.dtype, kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, sliding_window=window,
            layer_tokens=expected_layer_tokens(spec.layer_kinds, covered, window),
            lora_identity=self._lora_identity(lora_int_id))
        return KVPayload(header, layers)

    def _lora_identity(self, lora_int_id: int) -> str:
        """What the header says of the adapter the prefill ran (checked by `_lora_kwargs`)."""
        if lora_int_id == BASE_LORA_ID:
            return ""
        adapters = getattr(self.runtime, "lora_adapters", None) or {}
        return next(a.identity for a in adapters.values() if a.lora_int_id == lora_int_id)

    def lora_int_id_of(self, name: str | None) -> int:
        """The id this producer's runtime gives adapter `name` (None: the base model, 0); a
        decoder asks by name (`KVRequest.lora`): ids are each process's own.

        Raises:
            RequestError: no adapter of that name is loaded here.
        """
        if name is None:
            return BASE_LORA_ID
        adapters = getattr(self.runtime, "lora_adapters", None) or {}
        adapter = adapters.get(name)
        if adapter is None:
            raise RequestError(f"lora={name[:80]!r} is not a LoRA adapter of this producer "
                               f"(loaded: {', '.join(sorted(adapters)) or 'none'})")
        return int(adapter.lora_int_id)

    def _lora_kwargs(self, lora_int_id: int) -> dict[str, np.ndarray]:
        """The prefill's `lora_int_ids` keyword: none for the base on a runtime without LoRA."""
        adapters = getattr(self.runtime, "lora_adapters", None)
        if adapters is None:
            if lora_int_id != BASE_LORA_ID:
                raise RequestError(f"lora_int_id={lora_int_id}: this producer's runtime has no "
                                   "LoRA adapters")
            return {}
        ids = {a.lora_int_id for a in adapters.values()}
        if lora_int_id != BASE_LORA_ID and lora_int_id not in ids:
            raise RequestError(f"lora_int_id={lora_int_id} is not loaded on this producer "
                               f"(loaded ids: {sorted(ids)})")
        return {"lora_int_ids": np.array([lora_int_id], dtype=np.int32)}

    def stream(self, request_id: str, prompt: Sequence[int],
               params: SamplingParams | None = None, mode: Mode = "layer-stream",
               covered_len: int | None = None, *,
               lora_int_id: int = BASE_LORA_ID) -> Iterator[KVHeader | LayerKV]:
        """The header, then every `LayerKV` in layer order (what a transport sends).

        The prefill runs when the first item is taken. Both modes read every layer right after the
        prefill (the runtime's KV is then free for the next request); `mode` is the pacing the
        consumer asked for, which the transports apply.
        """
        if mode not in MODES:
            raise RequestError(f"mode={mode!r} is not one of {MODES}")
        return self._stream(request_id, list(prompt), params, covered_len, lora_int_id)

    def _stream(self, request_id: str, prompt: list[int], params: SamplingParams | None,
                covered_len: int | None, lora_int_id: int) -> Iterator[KVHeader | LayerKV]:
        yield from self.produce(request_id, prompt, params, covered_len,
                                lora_int_id=lora_int_id).items()
