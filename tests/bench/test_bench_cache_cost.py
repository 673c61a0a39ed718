"""`python -m atombatch.bench cache_cost` in its smallest mode: the two servers ran the same
rounds, the cache-on server looked every prompt up and found nothing (the workload shares no
prefix), the cache-off server looked nothing up, and the ratios are those of the medians."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from atombatch.bench.cache_cost import CacheCost, unshared_prompts

B, REPEATS, PROMPT, TOKENS = 2, 2, 130, 6


def test_unshared_prompts_share_no_first_block() -> None:
    rounds = unshared_prompts(5, 8, 40, vocab_size=12, seed=3)  # 81 pairs for 40 prompts
    prompts = [p for batch in rounds for p in batch]
    assert len(prompts) == 40 and all(len(p) == 40 for p in prompts)
    assert len({tuple(p[:2]) for p in prompts}) == 40
    assert all(3 <= t < 12 for p in prompts for t in p)
    with pytest.raises(ValueError, match="distinct leading pairs"):
        unshared_prompts(10, 9, 4, vocab_size=12, seed=0)


def test_cache_cost_runs_both_sides_on_unshared_prompts(tmp_path: Path) -> None:
    path = tmp_path / "cc.json"
    done = subprocess.run([sys.executable, "-m", "atombatch.bench", "cache_cost", "--batch-size",
                           str(B), "--repeats", str(REPEATS), "--prompt-len", str(PROMPT),
                           "--max-tokens", str(TOKENS), "--step-ms", "2", "--json", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = msgspec.json.decode(path.read_bytes(), type=CacheCost)
    off, on = report.sides
    assert (off.cache, on.cache) == ("off", "on")
    assert "--no-enable-prefix-caching" in off.command and \
        "--enable-prefix-caching" in on.command.replace("--no-enable-prefix-caching", "")
    for side in report.sides:
        assert len(side.rounds) == REPEATS
        assert all(r.ok == r.requests == B and r.tokens == B * TOKENS for r in side.rounds)
    # the warm-up round and every measured round were looked up, nothing was found
    assert on.queried_tokens == (REPEATS + 1) * B * PROMPT and on.hit_tokens == 0
    assert off.queried_tokens == 0 and off.hit_tokens == 0
    assert report.tok_per_s_ratio == pytest.approx(on.tok_per_s / off.tok_per_s)
    assert report.front_cpu_ratio == pytest.approx(on.front_us_per_token / off.front_us_per_token)
    assert report.engine_us_per_token is not None and report.engine_cpu_ratio is not None
    assert report.engine_cpu_ratio == pytest.approx(
        report.engine_us_per_token["on"] / report.engine_us_per_token["off"])
    assert "on/off" in done.stdout and "load average" in done.stdout and "engine alone" in done.stdout
