"""`argmax_rows` and `argmax_call`: numpy's row argmax (and the logit it picked) in one compiled
call, on the compiled core and its twin, against `np.argmax` itself.

The compiled kernel keeps eight-float vectors of running maxima and their first indices, four
vectors per iteration, then a scalar tail: rows shorter than one iteration (32), rows of whole
iterations and rows with a tail each take another path, and ties, NaN, infinities and signed
zeros are where a vector kernel most easily departs from numpy's "first NaN, else first maximum".
"""

from __future__ import annotations

from typing import Any

import atombatch.kernel._blocks as c_impl
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atombatch.kernel._blocks_py as py_impl
from atombatch.errors import StateError

IMPLS = [pytest.param(c_impl, id="c"), pytest.param(py_impl, id="py")]
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 2.0, np.inf, -np.inf, np.nan], dtype=np.float32)


@st.composite
def logits_arrays(draw: st.DrawFn) -> np.ndarray:
    rows = draw(st.integers(1, 5), label="rows")
    vocab = draw(st.sampled_from([1, 2, 7, 31, 32, 33, 63, 64, 65, 95, 96, 100, 129, 257]),
                 label="vocab")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "ties", "special"]), label="kind")
    if kind == "normal":
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
    elif kind == "ties":  # few distinct values: the maximum recurs in many lanes and vectors
        x = rng.integers(0, 3, size=(rows, vocab)).astype(np.float32)
    else:
        weights = np.array([3, 2, 3, 2, 1, 0.3, 3, 0.2])
        x = rng.choice(SPECIAL, size=(rows, vocab), p=weights / weights.sum())
    for _ in range(draw(st.integers(0, 3), label="planted")):  # one value placed anywhere
        row = draw(st.integers(0, rows - 1))
        col = draw(st.integers(0, vocab - 1))
        x[row, col] = draw(st.sampled_from([np.nan, np.inf, 5.0, -np.inf]))
    return x


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(x=logits_arrays())
def test_argmax_rows_is_numpys_argmax_and_keeps_the_picked_logit(x: np.ndarray) -> None:
    want = np.argmax(x, axis=1)
    for impl in (c_impl, py_impl):
        greedy = np.full(x.shape[0] + 2, -7, dtype=np.int64)
        best = np.full(x.shape[0] + 2, 9.0, dtype=np.float32)
        assert impl.argmax_rows(x, greedy, best) == x.shape[0]
        assert greedy[:x.shape[0]].tolist() == want.tolist()
        assert greedy[x.shape[0]:].tolist() == [-7, -7]          # rows past the step untouched
        picked = x[np.arange(x.shape[0]), want]
        assert np.array_equal(best[:x.shape[0]], picked, equal_nan=True)
        only = np.zeros(x.shape[0], dtype=np.int64)
        impl.argmax_rows(x, only)                                 # without `best`
        assert only.tolist() == want.tolist()
        called = np.zeros(x.shape[0], dtype=np.int64)
        kept = np.zeros(x.shape[0], dtype=np.float32)
        assert impl.argmax_call(x, x.shape[0], x.shape[1], 1 << 22, called, kept)
        assert called.tolist() == want.tolist()
        assert np.array_equal(kept, picked, equal_nan=True)


def test_a_long_row_crosses_many_iterations() -> None:
    """A real vocabulary's row: the maximum late, early and in the tail, and a NaN late."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 151_936)).astype(np.float32)
    x[0, 151_935] = 50.0          # the tail (151 936 = 4 748 x 32)
    x[1, 3] = 50.0
    x[1, 140_000] = 50.0          # a tie later: the first stays
    x[2, 77_777] = np.nan
    x[2, 5] = np.inf
    for impl in (c_impl, py_impl):
        greedy = np.zeros(4, dtype=np.int64)
        best = np.zeros(4, dtype=np.float32)
        impl.argmax_rows(x, greedy, best)
        assert greedy.tolist() == np.argmax(x, axis=1).tolist()
        assert greedy[:3].tolist() == [151_935, 3, 77_777]


@pytest.mark.parametrize("impl", IMPLS)
def test_argmax_call_declines_what_it_cannot_read_as_it_is(impl: Any) -> None:
    """Anything but a plain C-contiguous float32 [rows, vocab] ndarray under the limit: False,
    and nothing written (the device thread then converts and checks it the slow way)."""
    x = np.random.default_rng(0).standard_normal((4, 100)).astype(np.float32)
    greedy = np.full(4, -1, dtype=np.int64)
    best = np.full(4, -1.0, dtype=np.float32)
    declined = [
        (x[:, ::2], 4, 50, 1 << 22),           # strided
        (x.astype(np.float64), 4, 100, 1 << 22),
        (x.astype(">f4"), 4, 100, 1 << 22),    # not native byte order
        (x, 4, 99, 1 << 22),                   # not the step's shape
        (x, 3, 100, 1 << 22),
        (x, 4, 100, 400),                      # at the limit: the threaded argmax's size
        (x.view(np.matrix), 4, 100, 1 << 22),  # a subclass
        (x.reshape(4, 10, 10), 4, 100, 1 << 22),
        (x.tolist(), 4, 100, 1 << 22),
        (np.zeros((0, 2**31), dtype=np.float32), 0, 2**31, 1 << 40),  # indices past int32
    ]
    for raw, rows, vocab, limit in declined:
        assert impl.argmax_call(raw, rows, vocab, limit, greedy, best) is False
    assert greedy.tolist() == [-1] * 4 and best.tolist() == [-1.0] * 4
    assert impl.argmax_call(x, 4, 100, 401, greedy, best) is True


@pytest.mark.parametrize("impl", IMPLS)
def test_argmax_rows_checks_its_buffers(impl: Any) -> None:
    x = np.zeros((3, 4), dtype=np.float32)
    with pytest.raises(StateError, match=r"logits of shape \(3, 4\) for greedy 2"):
        impl.argmax_rows(x, np.zeros(2, dtype=np.int64))
    with pytest.raises(StateError, match="best 1"):
        impl.argmax_rows(x, np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.float32))
    with pytest.raises(StateError, match="1 <= vocab"):
        impl.argmax_rows(np.zeros((3, 0), dtype=np.float32), np.zeros(3, dtype=np.int64))
