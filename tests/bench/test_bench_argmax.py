"""`python -m atombatch.bench argmax`: runs, checks the two picks agree, refuses bad shapes."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from atombatch.bench import argmax


def test_it_prints_one_row_per_shape_and_its_provenance(capsys: Any) -> None:
    assert argmax.main(["--shapes", "3x40,2x7", "--repeats", "2", "--sleep-ms", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:3]] == ["3x40", "2x7"]
    assert all(float(x) > 0 for line in out[1:3] for x in line.split()[1:])
    assert out[3].startswith("commit ") and "load average" in out[3]


def test_a_kernel_that_picks_another_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def last_row_off(logits: Any, greedy: Any, best: Any = None) -> int:
        greedy[:logits.shape[0]] = logits.argmax(axis=1)
        greedy[logits.shape[0] - 1] += 1
        return int(logits.shape[0])

    monkeypatch.setattr(argmax.core, "argmax_rows", last_row_off)
    with pytest.raises(AssertionError, match="other tokens than numpy at 2x9"):
        argmax.measure(2, 9, 1, 0.0)


@pytest.mark.parametrize("bad", ["64", "0x10", "4x0", "ax3", "8192x8193", "4x4,"])
def test_shapes_are_checked(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="ROWSxVOCAB"):
        argmax.parse_shapes(bad)
