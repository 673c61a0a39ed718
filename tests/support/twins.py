"""Both block/lane cores driven side by side (`Twin`): every call made on each; results, errors
and arrays compared."""

from __future__ import annotations

from typing import Any

import atombatch.kernel._blocks as c_impl
import numpy as np

import atombatch.kernel._blocks_py as py_impl
from atombatch.errors import AtomBatchError

LANE_ARRAYS = ("_state", "_seq_len", "_next_token", "_num_held", "_rows")


class Raised:
    """The outcome of a call that raised one of atombatch's errors."""

    def __init__(self, exc: AtomBatchError) -> None:
        self.exc = exc
        self.key = (type(exc), str(exc))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raised) and self.key == other.key

    def __repr__(self) -> str:
        return f"Raised{self.key}"


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(a, b))
    return type(a) is type(b) and a == b


class Twin:
    """One compiled and one pure-Python object; every call goes to both and must agree."""

    def __init__(self, c: Any, py: Any) -> None:
        self.c, self.py = c, py

    def __getattr__(self, name: str) -> Any:
        c_attr, py_attr = getattr(self.c, name), getattr(self.py, name)
        if not callable(c_attr):
            assert same(c_attr, py_attr), (name, c_attr, py_attr)
            return c_attr

        def call(*args: Any, **kwargs: Any) -> Any:
            outcomes = []
            for side, fn in (("c", c_attr), ("py", py_attr)):
                side_args = [getattr(a, side) if isinstance(a, Twin) else a for a in args]
                try:
                    outcomes.append(fn(*side_args, **kwargs))
                except AtomBatchError as exc:
                    outcomes.append(Raised(exc))
            c_out, py_out = outcomes
            assert (c_out == py_out if isinstance(c_out, Raised) else same(c_out, py_out)), (
                name, args, c_out, py_out)
            if isinstance(c_out, Raised):
                raise c_out.exc
            return c_out

        return call


def assert_same_arrays(twin: Twin, names: tuple[str, ...]) -> None:
    for name in names:
        a, b = getattr(twin.c, name), getattr(twin.py, name)
        assert same(np.asarray(a), np.asarray(b)), (name, a, b)


def twin(name: str, *args: Any) -> Twin:
    return Twin(getattr(c_impl, name)(*args), getattr(py_impl, name)(*args))


def admit_lane(pool: Twin, lanes: Twin, block_size: int, seq_len: int, token: int) -> int | None:
    """An idle lane that decodes `token` at position `seq_len`, holding the blocks positions
    0..seq_len need from `pool`; None (the lane released again) when the pool runs dry first."""
    lane = lanes.assign()
    for _ in range(-(-(seq_len + 1) // block_size)):
        if pool.first_free() >= 0:
            lanes.push_block(lane, pool.allocate(py_impl.LANE, lane))
    if lanes.num_held(lane) * block_size <= seq_len:
        for block in lanes.release(lane):
            pool.free(block)
        return None
    lanes.start_decode(lane, seq_len, token)
    return lane
