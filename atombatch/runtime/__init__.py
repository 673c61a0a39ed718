"""Runtimes: the NumPy reference (real math), the simulator (device-time model), the ATOM adapter."""

from atombatch.runtime.base import DecodeArrays, PrefillArrays, Runtime

__all__ = ["DecodeArrays", "PrefillArrays", "Runtime"]
