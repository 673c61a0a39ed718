"""`python -m atombatch.bench lora`: the price of adapters in a step, on the simulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atombatch.bench import lora


def test_bench_lora_prices_distinct_adapters_and_ranks(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "lora.json"
    assert lora.main(["--model", "qwen3-4b", "--batch-size", "4", "--context", "2048",
                      "--ranks", "8,32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qwen3-4b B4" in text and "calibration:" in text
    rows = json.loads(out.read_bytes())["rows"]
    for rank in (8, 32):
        mine = [r for r in rows if r["rank"] == rank]
        assert [(r["adapters"], r["adapted_rows"]) for r in mine] == \
            [(0, 0), (1, 1), (1, 4), (2, 4), (4, 4)]
        assert mine[0]["increase"] == 0.0
        steps = [r["step_ms"] for r in mine]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
    by_rank = {r["rank"]: r["increase"] for r in rows if r["adapters"] == 4}
    assert by_rank[32] > by_rank[8] > 0
    chunks = json.loads(out.read_bytes())["chunks"]
    assert all(adapted > plain for _, plain, adapted in chunks)


def test_bench_lora_refuses_bad_ranks(capsys: Any) -> None:
    assert lora.main(["--ranks", "0"]) == 2
    assert "--ranks '0' must be integers in 1..512" in capsys.readouterr().err
