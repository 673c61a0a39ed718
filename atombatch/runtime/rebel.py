"""`RebelRuntime`: the runtime protocol over rebel-sdk compiled prefill/decode graphs on an ATOM.

Thin on purpose: the tables come from the same in-place builders the NumPy reference consumes, and
this module only adds what the compiled graphs take beyond them (Gemma3's `position_ids` and 2-D
attention mask) and passes everything positionally in the compiled input order:

    prefill: input_ids, cache_position, block_tables, [local_block_tables], query_position,
             [attention_mask [1, max_seq_len], position_ids [1, Q]]
    decode:  input_ids, cache_position, block_tables, [local_block_tables],
             [attention_mask [B, max_seq_len], position_ids [B, 1]]

`rebel` is imported lazily; without it the constructor raises `ConfigError` with install guidance.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.config import ArtifactConfig
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.runtime.base import DecodeArrays, PrefillArrays

INSTALL_HINT = ("rebel-sdk is not installed: it ships with the Rebellions SDK (not on the public "
                "index); install it from your Rebellions package feed, e.g. "
                "`pip install -i <rebellions-index> rebel-compiler`, then `pip install "
                "atombatch[rebel]`")


def _import_rebel() -> Any:
    try:
        return importlib.import_module("rebel")
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None


class RebelRuntime:
    """Runs compiled prefill/decode graphs with the tables atombatch builds.

    Args:
        artifact: the shapes the graphs were compiled for.
        prefill: path of the compiled prefill graph (`.rbln`).
        decode: path of the compiled decode graph (`.rbln`).
        device: ATOM device index (or a list for tensor parallel).
    """

    def __init__(self, artifact: ArtifactConfig, prefill: str | os.PathLike[str],
                 decode: str | os.PathLike[str], device: int | list[int] = 0) -> None:
        rebel = _import_rebel()
        for path in (prefill, decode):
            if not Path(path).exists():
                raise ConfigError(f"compiled graph {path} does not exist")
        self.artifact = artifact
        self.spec = artifact.model
        self._prefill = rebel.Runtime(str(prefill), tensor_type="np", device=device)
        self._decode = rebel.Runtime(str(decode), tensor_type="np", device=device)
        self.version = getattr(rebel, "__version__", "unknown")
        self._uses_mask = self.spec.family == "gemma3"
        length = artifact.max_seq_len
        self._prefill_mask = np.zeros((1, length), dtype=np.float32)
        self._decode_mask = np.zeros((artifact.batch_size, length), dtype=np.float32)
        self._positions = np.arange(length, dtype=np.int32)
        self._prefill_position_ids = np.zeros((1, artifact.prefill_chunk_size), dtype=np.int32)
        self._decode_position_ids = np.zeros((artifact.batch_size, 1), dtype=np.int32)

    @classmethod
    def from_cache_dir(cls, artifact: ArtifactConfig, root: str | os.PathLike[str],
                       device: int | list[int] = 0) -> RebelRuntime:
        """Load `prefill.rbln` / `decoder.rbln` from the artifact's own compiled-cache folder, so
        a B4 run can never pick up a B1 graph."""
        folder = artifact.compiled_cache_dir(root)
        return cls(artifact, folder / "prefill.rbln", folder / "decoder.rbln", device=device)

    # -- positional inputs (pure; shared with tests) ----------------------------------------------
    def _table_args(self, inputs: PrefillArrays | DecodeArrays) -> list[tuple[str, Any]]:
        """The inputs both graphs start with: ids, positions, global and (hybrid) local tables."""
        args: list[tuple[str, Any]] = [
            ("input_ids", inputs.input_ids),
            ("cache_position", inputs.cache_position),
            ("block_tables", inputs.block_tables),
        ]
        if self.spec.is_hybrid:
            args.append(("local_block_tables", inputs.local_block_tables))
        return args

    def prefill_args(self, inputs: PrefillArrays) -> list[tuple[str, npt.NDArray[Any]]]:
        args = self._table_args(inputs)
        args.append(("query_position", inputs.query_position))
        if self._uses_mask:
            last = int(inputs.cache_position[0, int(inputs.query_position)])
            np.less_equal(self._positions, last, out=self._prefill_mask[0], casting="unsafe")
            self._prefill_position_ids[...] = inputs.cache_position
            args += [("attention_mask", self._prefill_mask),
                     ("position_ids", self._prefill_position_ids)]
        return args

    def decode_args(self, inputs: DecodeArrays) -> list[tuple[str, npt.NDArray[Any]]]:
        args = self._table_args(inputs)
        if self._uses_mask:
            np.less_equal(self._positions[None, :], inputs.cache_position, out=self._decode_mask,
                          casting="unsafe")
            self._decode_position_ids[...] = inputs.cache_position
            args += [("attention_mask", self._decode_mask),
                     ("position_ids", self._decode_position_ids)]
        return args

    # -- protocol ---------------------------------------------------------------------------------
    def prefill(self, inputs: PrefillArrays) -> npt.NDArray[np.float32]:
        logits = self._prefill(*(array for _, array in self.prefill_args(inputs)))
        return np.asarray(logits, dtype=np.float32).reshape(-1)

    def decode(self, inputs: DecodeArrays) -> npt.NDArray[np.float32]:
        logits = self._decode(*(array for _, array in self.decode_args(inputs)))
        return np.asarray(logits, dtype=np.float32).reshape(self.artifact.batch_size, -1)

    def _kv_unsupported(self, what: str) -> AtomBatchError:
        return AtomBatchError(f"{what} needs device KV tensor access, which this rebel-sdk "
                              f"({self.version}) runtime does not expose; run with prefix and "
                              "host caching off")

    def copy_block(self, src: int, dst: int) -> None:
        raise self._kv_unsupported("copy_block")

    def read_block(self, block: int) -> npt.NDArray[np.generic]:
        raise self._kv_unsupported("read_block")

    def write_block(self, block: int, data: npt.NDArray[np.generic]) -> None:
        raise self._kv_unsupported("write_block")

    def write_layer_kv(self, layer: int, k: npt.NDArray[np.float32], v: npt.NDArray[np.float32],
                       block_row: Any, slot: int = 0) -> None:
        raise self._kv_unsupported("a PD KV import")
