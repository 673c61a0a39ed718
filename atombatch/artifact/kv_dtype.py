"""KV element types: how each sits in host memory, and the exact conversions to and from float32.

A compiled graph's KV caches are `float32`, `float16`, `bfloat16` or, with optimum-rbln's
`quantization.kv_caches="fp8"`, `float8_e4m3fn` (OCP FP8 E4M3, "fn": finite, no infinities,
largest magnitude 448). Host buffers keep what NumPy cannot name natively as bit patterns:
bfloat16 as `uint16`, float8_e4m3fn as `uint8`. Every host copy (host cache, prefix checkpoints,
block moves) is those bytes as they are; only a change of dtype (a PD payload of another dtype,
float32 attention math) goes through `encode` / `decode`.

Narrowing rounds to nearest, ties to even. Into float8 it also saturates: a magnitude past 448
becomes +-448 (there is no infinity to round to), NaN stays NaN. Widening is exact. float8 goes
through `ml_dtypes` (numpy's `float8_e4m3fn`), imported when first needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.errors import ConfigError

FLOAT8 = "float8_e4m3fn"
E4M3_MAX = 448.0
KV_DTYPES = ("float32", "bfloat16", "float16", FLOAT8)
# the host representation of each KV dtype (little-endian; bfloat16 and float8 as bit patterns)
HOST_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    FLOAT8: np.dtype("u1"),
}


def host_dtype(kv_dtype: str) -> np.dtype[Any]:
    """How `kv_dtype`'s elements sit in host memory.

    Raises:
        ConfigError: `kv_dtype` is not one of `KV_DTYPES`.
    """
    try:
        return HOST_DTYPES[kv_dtype]
    except KeyError:
        raise ConfigError(f"kv_dtype={kv_dtype!r} is not one of {list(KV_DTYPES)}") from None


def float8_dtype() -> np.dtype[Any]:
    """NumPy's `float8_e4m3fn` (from `ml_dtypes`).

    Raises:
        ConfigError: `ml_dtypes` is not installed.
    """
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - a dependency of atombatch
        raise ConfigError("float8_e4m3fn KV needs the ml_dtypes package: "
                          "pip install ml_dtypes") from None
    return np.dtype(ml_dtypes.float8_e4m3fn)


def to_float8(values: npt.ArrayLike) -> npt.NDArray[Any]:
    """`values` as float8_e4m3fn: round to nearest even, saturating at +-448."""
    x = np.asarray(values, dtype=np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(float8_dtype())


def round_float8(values: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """float32 values that float8_e4m3fn holds exactly: `values` rounded as `to_float8` rounds."""
    return to_float8(values).astype(np.float32)


def encode(values: npt.ArrayLike, kv_dtype: str,
           out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
    """Float values in `kv_dtype`'s host representation (into `out` when given).

    bfloat16 and float8 round to nearest even (float8 saturates); the others are NumPy casts.
    """
    wire = host_dtype(kv_dtype)
    x = np.ascontiguousarray(values, dtype=np.float32)
    if kv_dtype == "bfloat16":
        bits = x.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
                   ) >> np.uint32(16)
        quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
        result = np.where(np.isnan(x), quiet_nan, rounded).astype(wire)
    elif kv_dtype == FLOAT8:
        result = to_float8(x).view(wire)
    else:
        result = x.astype(wire)
    if out is None:
        return result
    out[...] = result
    return out


def decode(host: npt.NDArray[Any], kv_dtype: str) -> npt.NDArray[np.float32]:
    """A float32 copy of a host buffer of `kv_dtype` (exact: every KV dtype widens losslessly)."""
    wire = host_dtype(kv_dtype)
    if host.dtype != wire:
        raise ConfigError(f"a {kv_dtype} host buffer must be {wire}, not {host.dtype}")
    if kv_dtype == "bfloat16":
        return (host.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if kv_dtype == FLOAT8:
        return np.ascontiguousarray(host).view(float8_dtype()).astype(np.float32)
    return np.array(host, dtype=np.float32)


def widens_exactly(narrow: str, wide: str) -> bool:
    """True when every `narrow` value is a `wide` value (float8 into any of the others, the
    16-bit types into float32, a type into itself)."""
    if narrow == wide or wide == "float32":
        return True
    return narrow == FLOAT8
