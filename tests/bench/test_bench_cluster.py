"""`bench cluster`: many simulated replicas behind the routing policies, with and without PD."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atombatch.bench import cluster
from atombatch.bench.__main__ import main as bench_main

SMALL = cluster.Workload(rate=2.0, conversations=12, turns=3, system_prompts=2, system_len=512,
                         user_len=64, output_len=16, think_s=1.0, seed=1)


def test_prefix_affinity_raises_the_hit_rate_over_pow2() -> None:
    cells = {p: cluster.run_cell("qwen3-0.6b", 4, p, SMALL) for p in ("pow2", "prefix")}
    for cell in cells.values():
        assert cell.status == "ok", cell.error
        assert cell.failed == 0 and cell.completed == cell.requests == 12 * 3
        assert sum(cell.per_replica) == cell.requests
        assert 0 < cell.prefix_hit_tokens < cell.prompt_tokens
    # the same arrivals and prompts: the prefix router finds more of them cached
    assert cells["prefix"].prompt_tokens == cells["pow2"].prompt_tokens
    assert cells["prefix"].prefix_hit_tokens > cells["pow2"].prefix_hit_tokens


def test_pd_pool_cells_and_hybrid_models_with_and_without_the_prefix_cache() -> None:
    pd = cluster.run_cell("qwen3-0.6b", 2, "prefix", SMALL, producers=2)
    assert pd.status == "ok", pd.error
    assert pd.completed == pd.requests and pd.atoms == 4
    assert pd.prefix_hit_tokens == 0   # imported KV is not a prefix hit: it crossed the link
    # a hybrid model's hits restore sliding-slot checkpoints from its replicas' host caches
    gemma = cluster.run_cell("gemma3-1b", 2, "prefix", SMALL)
    assert gemma.status == "ok", gemma.error
    assert gemma.prefix_cache and gemma.host_cache_bytes == cluster.HYBRID_HOST_CACHE_BYTES
    assert gemma.prefix_hit_tokens > 0 and gemma.slot_restores > 0
    cold = cluster.run_cell("gemma3-1b", 2, "prefix", SMALL, prefix_cache=False)
    assert cold.status == "ok" and not cold.prefix_cache and cold.prefix_hit_tokens == 0
    assert cold.prompt_tokens == gemma.prompt_tokens
    assert gemma.ttft.p50 < cold.ttft.p50   # the same arrivals: hits shorten prefills
    starved = cluster.run_cell("gemma3-1b", 1, "prefix", SMALL, host_cache_bytes=0)
    assert starved.status == "rejected" and "sliding-slot checkpoints" in (starved.error or "")
    too_long = cluster.run_cell("qwen3-0.6b", 2, "pow2", cluster.Workload(system_len=9000))
    assert too_long.status == "rejected" and "max_seq_len" in (too_long.error or "")


def test_cli_sizes_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.json"
    status = bench_main(["cluster", "--models", "qwen3-0.6b", "--replicas", "1,2",
                         "--policies", "prefix", "--rates", "1", "--conversations", "6",
                         "--turns", "2", "--system-len", "256", "--user-len", "32",
                         "--output-len", "8", "--slo-ttft", "30", "--size", "--json", str(out)])
    assert status == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "ATOMs" in printed
    # one progress line per cell on stderr (not a terminal here), as it finishes
    lines = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert [line[:5] for line in lines] == ["[1/2]", "[2/2]"]
    assert "qwen3-0.6b rate 1 N1 M0 prefix: meets the SLO in" in lines[0]
    report = json.loads(out.read_text())
    assert [c["replicas"] for c in report["cells"]] == [1, 2]
    (row,) = report["sizing"]
    assert row["replicas"] == 1 and row["atoms"] == 1      # one replica meets a 30 s TTFT
    assert bench_main(["cluster", "--policies", "random"]) == 2


def test_paced_simulator_sleeps_its_device_time_and_serves_from_the_cli() -> None:
    from atombatch.api.structs import SamplingParams
    from atombatch.errors import ConfigError
    from atombatch.runtime.sim import SimRuntime
    from atombatch.serve.cli import build_engine, parser

    flags = ["--runtime", "sim", "--model", "qwen3-0.6b", "--batch-size", "2", "--max-seq-len",
             "512", "--block-size", "64", "--num-blocks", "12", "--prefill-chunk-size", "64",
             "--prefix-cache"]
    prompt = list(range(3, 300))
    outputs = {}
    for pace in ("0", "1"):
        batcher, name, _ = build_engine(parser().parse_args(flags + ["--sim-pace", pace]))
        runtime = batcher.runtime
        assert isinstance(runtime, SimRuntime) and name == "qwen3-0.6b"
        params = SamplingParams(max_tokens=3, temperature=0.0)
        outputs[pace] = [list(batcher.generate([p], params)[0].token_ids)
                         for p in (prompt, prompt + [7])]
        device = runtime.device.prefill_s + runtime.device.decode_s
        if pace == "0":
            assert runtime.clock() == pytest.approx(device)     # virtual: the device time only
        else:
            # paced: every call slept its device time, so the (wall) clock is past their sum
            assert runtime.clock() >= device > 0
        assert batcher.stats().prefix_hit_tokens > 0           # the second prompt hit the first
    assert outputs["0"] == outputs["1"]                        # pacing changes no token
    with pytest.raises(ConfigError, match="pace=-1"):
        SimRuntime(batcher.runtime.artifact, pace=-1)
    with pytest.raises(ConfigError, match="needs a preset"):
        build_engine(parser().parse_args(["--runtime", "sim", "--model", "nope"]))
