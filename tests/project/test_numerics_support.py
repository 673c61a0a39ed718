"""The suite's tie rule for greedy references (tests/support/numerics.py `GreedyTokens`): a
reference compares whole where every choice was decided, only up to the first near tie where one
was not, and a near tie is found where the reference's best two logits are within twice the
float32 bound of each other."""

# The plain list stands on the left on purpose: that is how a test compares its result with a
# reference, and Python then asks the subclass's reflected __eq__ first.
# ruff: noqa: SIM300
from __future__ import annotations

import numpy as np
from support.numerics import GreedyTokens, greedy_reference


def test_a_decided_reference_compares_whole_and_a_tied_one_up_to_the_tie() -> None:
    whole = GreedyTokens([4, 5, 6])
    assert [4, 5, 6] == whole and [4, 5, 7] != whole and [4, 5] != whole
    assert [[4, 5, 6]] == [whole] and [[4, 5, 7]] != [whole]   # inside containers too
    tied = GreedyTokens([4, 5, 6, 7], decided=2)
    assert [4, 5, 9, 9] == tied and [4, 5] == tied and [4, 9, 6, 7] != tied
    # slices keep what they cover of the decided prefix
    assert [4] == tied[:1] and [9] != tied[:1]
    assert [5, 9] == tied[1:] and [9, 6] != tied[1:]
    assert [1, 2] == tied[3:]           # past the tie nothing is known


class _Config:
    hidden_size, intermediate_size, num_attention_heads, head_dim = 8, 16, 2, 4
    num_hidden_layers = 1


class _Model:
    config = _Config()


def test_a_near_tie_in_the_reference_logits_ends_the_decided_prefix() -> None:
    gaps = {3: 1.0, 4: 1e-7, 5: 1.0}   # the logits at each length of the sequence

    def logits(model: object, seq: list[int]) -> np.ndarray:
        row = np.zeros(10)
        row[len(seq)] = 2.0
        row[(len(seq) + 1) % 10] = 2.0 - gaps[len(seq)]
        return row

    ref = greedy_reference(_Model(), [0, 1, 2], 3, logits)
    assert list(ref) == [3, 4, 5] and ref.decided == 1
    assert [3, 5, 6] == ref and [4, 4, 5] != ref
    gaps[4] = 1.0
    assert greedy_reference(_Model(), [0, 1, 2], 3, logits).decided == 3
