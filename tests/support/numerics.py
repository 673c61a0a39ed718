"""Float tolerances that follow from what is compared, not from the machine that compares.

Two float32 evaluations of the same math in another order (another BLAS kernel, another matrix
shape, another chunking) differ by rounding alone. For a reduction of length K, each evaluation is
within gamma_K = K * u of the exact sum of |terms| (u = 2**-24, float32's unit roundoff; Higham,
"Accuracy and Stability of Numerical Algorithms", eq. 3.5), so two of them are within 2 * K * u of
each other, relative to the magnitude of what is summed. A decoder layer chains a few such
reductions (projections over the hidden size, the MLP over the intermediate size, attention over
the context) and its residual stream carries the errors of every layer before it, so a value that
went through `depth` layers gets `depth` times that bound. The bound is worst-case (rounding errors
of the same sign everywhere); real differences are about sqrt(K) times smaller, and a wrong table
entry changes values by O(1), far above it.

Where a test is about tables rather than rounding, comparing in float64 would be tighter still;
the NumPy runtime computes in float32 as the device does, so these bounds are what is left.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

U32 = 2.0 ** -24   # float32 unit roundoff


def reduction_length(spec: Any, context: int) -> int:
    """The longest reduction in one decoder layer of `spec` over `context` tokens."""
    q_dim = spec.num_heads * spec.head_dim
    return max(spec.hidden_size, spec.intermediate_size, q_dim, context)


def f32_atol(reference: npt.ArrayLike, *, reduction: int, depth: int) -> float:
    """Absolute bound on the difference between two float32 evaluations of `reference`'s math:
    `depth` chained layers of reductions of length `reduction`, scaled by the largest magnitude
    compared (an element-wise relative tolerance means nothing for elements near zero)."""
    scale = max(1.0, float(np.max(np.abs(np.asarray(reference, dtype=np.float64)))))
    return 2.0 * depth * reduction * U32 * scale


def assert_f32_close(actual: npt.ArrayLike, desired: npt.ArrayLike, *, reduction: int, depth: int,
                     err_msg: str = "") -> None:
    """`actual` equals `desired` up to float32 reordering (`f32_atol`)."""
    atol = f32_atol(desired, reduction=reduction, depth=depth)
    np.testing.assert_allclose(actual, desired, rtol=0, atol=atol,
                               err_msg=f"{err_msg} (derived atol {atol:.3g})".strip())


def assert_same_argmax(actual: npt.ArrayLike, desired: npt.ArrayLike, *, reduction: int,
                       depth: int) -> None:
    """Row-wise argmax agrees wherever rounding cannot decide it: a row whose two best logits in
    `desired` are closer than twice the float32 bound may pick either of them, but never a token
    whose logit is further than the bound from the best."""
    a = np.atleast_2d(np.asarray(actual, dtype=np.float64))
    d = np.atleast_2d(np.asarray(desired, dtype=np.float64))
    atol = f32_atol(d, reduction=reduction, depth=depth)
    picked = a.argmax(-1)
    best = d.argmax(-1)
    top2 = np.sort(d, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * atol
    assert np.array_equal(picked[decided], best[decided]), (picked, best)
    rows = np.arange(len(d))
    assert np.all(d[rows, best] - d[rows, picked] <= 2 * atol), (picked, best)


def f32_logprob_atol(logits: npt.ArrayLike) -> float:
    """Absolute bound on a float32 log-softmax against a float64 one of the same logits: the
    shift by the maximum rounds each logit once (|x| * u), the sum of V exponentials (each at
    most 1) is within V * u of its exact value relatively, which its log turns into an absolute
    V * u, and the exponentials and the log round once more each. Probabilities from them are
    within the same bound relatively."""
    x = np.asarray(logits, dtype=np.float64)
    vocab = x.shape[-1]
    return 2.0 * (vocab + 4 + 2 * float(np.max(np.abs(x)))) * U32
