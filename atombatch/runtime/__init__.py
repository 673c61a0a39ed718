"""Runtimes: the NumPy reference (real math), the simulator (device-time model), the null device
(wall-clock waits, no math), the ATOM adapter.

Imported lazily so that `import atombatch.runtime` costs nothing and never touches `rebel`.
"""

from __future__ import annotations

import importlib
from typing import Any

from atombatch.runtime.base import DecodeArrays, PrefillArrays, Runtime

_LAZY = {
    "NumpyRuntime": "atombatch.runtime.numpy_runtime",
    "SimRuntime": "atombatch.runtime.sim",
    "CostModel": "atombatch.runtime.sim",
    "NullRuntime": "atombatch.runtime.null",
    "RebelRuntime": "atombatch.runtime.rebel",
}

__all__ = ["DecodeArrays", "PrefillArrays", "Runtime", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'atombatch.runtime' has no attribute {name!r}")
