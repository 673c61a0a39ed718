"""`bench invariance`: B4 logits of a lane equal its B1 logits bit for bit (stated, and measured)."""

from __future__ import annotations

import json

import pytest

from atombatch.bench import invariance

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run


def test_b4_logits_equal_b1_bit_for_bit_and_the_cli_reports_it(tmp_path, capsys):
    records = invariance.run(steps=6)
    assert {r.family for r in records} == {"llama", "qwen3", "gemma3"}
    for r in records:
        assert r.steps == 6 and r.tokens_equal
        assert r.max_abs_diff == 0.0  # exact: each lane computes with B1 matmul shapes
    out = tmp_path / "inv.json"
    assert invariance.main(["--steps", "3", "--json", str(out)]) == 0
    assert "max |Δlogit| B4 vs B1" in capsys.readouterr().out
    assert [r["family"] for r in json.loads(out.read_text())] == ["llama", "qwen3", "gemma3"]
