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


class GreedyTokens(list):  # type: ignore[type-arg]
    """A reference's greedy tokens that knows where rounding could have chosen otherwise.

    `decided` is the number of leading tokens whose reference logits had their best two further
    apart than twice the float32 bound (`f32_atol`): another evaluation of the same math (another
    BLAS kernel, another chunking) picks the same token there. At the first closer pair either
    token is right and everything after it may differ. Equality with a token list therefore
    compares the decided prefix only, and the whole list (its length included) when every token
    was decided, which is the usual case: with random weights a near tie is rare, and this keeps
    a test's verdict the same on every machine. Slices keep what they cover of `decided`.
    """

    def __init__(self, tokens: Any = (), decided: int | None = None) -> None:
        super().__init__(tokens)
        self.decided = len(self) if decided is None else min(decided, len(self))

    def _matches(self, other: Any) -> bool:
        other = list(other)
        if self.decided == len(self):
            return other == list(self)
        return other[:self.decided] == list(self)[:self.decided]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return self._matches(other)

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None  # type: ignore[assignment]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            part = list.__getitem__(self, index)
            if step != 1:
                return list(part)
            return GreedyTokens(part, max(0, min(self.decided, stop) - start))
        return list.__getitem__(self, index)


def hf_margin_atol(config: Any, logits: npt.ArrayLike, context: int) -> float:
    """`f32_atol` for one position's logits of a transformers model with `config` (its hidden,
    intermediate and attention sizes, over `context` tokens, through every layer)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    reduction = max(config.hidden_size, config.intermediate_size, heads * head_dim, context)
    return f32_atol(logits, reduction=reduction, depth=config.num_hidden_layers + 2)


def greedy_reference(model: Any, prompt: Any, new_tokens: int, logits_of: Any) -> GreedyTokens:
    """transformers' greedy continuation by full recompute (`logits_of(model, seq)` gives the
    last position's logits), with where each choice was decided (`GreedyTokens`)."""
    config = getattr(model.config, "text_config", None) or model.config
    seq, decided = list(prompt), None
    for step in range(new_tokens):
        logits = np.asarray(logits_of(model, seq), dtype=np.float64)
        top2 = np.sort(logits)[-2:]
        if decided is None and top2[1] - top2[0] <= 2 * hf_margin_atol(config, logits, len(seq)):
            decided = step
        seq.append(int(np.argmax(logits)))
    return GreedyTokens(seq[len(prompt):], decided)
