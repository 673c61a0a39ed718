"""The projected gain of speculative decoding (atombatch/runtime/sim/speculative.py): the exact
expectation against a Monte Carlo of accept/reject runs on the same cost constants, the plain row
against the simulator's Batcher run, and the crossover batch size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from atombatch import ArtifactConfig, ModelSpec
from atombatch.bench.serve import run_cell
from atombatch.errors import ConfigError
from atombatch.runtime.sim import ORIGIN_KONI_B1, CostModel, origin_artifact
from atombatch.runtime.sim import speculative as spec
from atombatch.runtime.sim.costs import CostModel as _CostModel

COSTS = CostModel.default()
KONI_B1 = origin_artifact()


def monte_carlo_decode(costs: _CostModel, artifact: ArtifactConfig, input_len: int,
                       output_len: int, acceptance: float, drafts: int, runs: int,
                       seed: int) -> tuple[np.ndarray, int, int]:
    """Plays `runs` decode phases draft by draft: each draft accepted with probability
    `acceptance` until the first rejection. Returns each run's device time, and the calls and
    tokens of uncapped calls (those that could draft all `drafts`)."""
    rng = np.random.default_rng(seed)
    times = np.empty(runs)
    full_calls = full_tokens = 0
    for run in range(runs):
        out, elapsed = 1, 0.0
        while out < output_len:
            position = input_len + out - 1
            room = min(drafts, output_len - out - 1, 127 - position % 128)
            if room == 0:
                elapsed += costs.decode_step_s(artifact, (position + 1,))
                out += 1
                continue
            elapsed += spec.verify_call_s(costs, artifact, position, room)
            accepted = 0
            while accepted < room and rng.random() < acceptance:
                accepted += 1
            out += accepted + 1
            if room == drafts:
                full_calls += 1
                full_tokens += accepted + 1
        times[run] = elapsed
    return times, full_calls, full_tokens


@pytest.mark.parametrize(("acceptance", "drafts", "input_len", "output_len"),
                         [(0.2, 1, 8192, 128), (0.5, 3, 8192, 128), (0.8, 6, 8192, 128),
                          (0.95, 8, 8192, 128), (0.9, 8, 8000, 200)])  # the last crosses a chunk
def test_expectation_matches_a_monte_carlo_of_accept_reject_runs(
        acceptance: float, drafts: int, input_len: int, output_len: int) -> None:
    expected, calls = spec.expected_decode_s(COSTS, KONI_B1, input_len, output_len, acceptance,
                                             drafts)
    times, full_calls, full_tokens = monte_carlo_decode(COSTS, KONI_B1, input_len, output_len,
                                                        acceptance, drafts, runs=400, seed=7)
    error = times.std(ddof=1) / math.sqrt(len(times))
    assert abs(times.mean() - expected) < 4.5 * error + 1e-9
    # tokens per uncapped call: the closed form (1 - a^(k+1)) / (1 - a)
    per_call = full_tokens / full_calls
    assert per_call == pytest.approx(spec.tokens_per_call(acceptance, drafts), rel=0.05)
    assert calls < output_len - 1


def test_drafts_stop_at_the_chunk_the_call_starts_in() -> None:
    # 8190: the lane's first call is at position 8190, one slot before the chunk ends at 8191;
    # every draft accepted, 9 tokens to go: 1 draft there, then 6 from the next chunk's start
    near_end, calls = spec.expected_decode_s(COSTS, KONI_B1, 8190, 10, 1.0, 8)
    assert calls == 2.0
    assert near_end == pytest.approx(spec.verify_call_s(COSTS, KONI_B1, 8190, 1) +
                                     spec.verify_call_s(COSTS, KONI_B1, 8192, 6))
    aligned, calls = spec.expected_decode_s(COSTS, KONI_B1, 8192, 10, 1.0, 8)
    assert calls == 1.0 and aligned == pytest.approx(spec.verify_call_s(COSTS, KONI_B1, 8192, 8))


def test_tokens_per_call_closed_form_and_its_inverse() -> None:
    assert spec.tokens_per_call(0.0, 5) == 1.0
    assert spec.tokens_per_call(1.0, 5) == 6.0
    assert spec.tokens_per_call(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    for a in (0.1, 0.45, 0.9):
        assert spec.equivalent_acceptance(spec.tokens_per_call(a, 4), 4) == pytest.approx(a)
    with pytest.raises(ConfigError, match="acceptance=1.5 must lie in"):
        spec.tokens_per_call(1.5, 2)


def test_a_verify_call_costs_a_full_chunk_whatever_the_drafts() -> None:
    one = spec.verify_call_s(COSTS, KONI_B1, 8192, 1)
    eight = spec.verify_call_s(COSTS, KONI_B1, 8192, 8)
    chunk = COSTS.prefill_chunk_s(KONI_B1, 8192, KONI_B1.prefill_chunk_size)
    assert chunk < one < eight < chunk * 1.02   # only the LM head of the extra positions differs
    assert spec.verify_to_decode_ratio(COSTS, KONI_B1, 8200, 4) > 1.5
    with pytest.raises(ConfigError, match="exceeds prefill_chunk_size=128"):
        spec.verify_call_s(COSTS, KONI_B1, 0, 128)


def test_plain_row_is_the_simulators_plain_figure() -> None:
    plain = spec.serial_projection(COSTS, KONI_B1, 8192, 128, 16)
    assert plain.throughput_tok_s == pytest.approx(ORIGIN_KONI_B1.throughput_tok_s, rel=1e-4)
    assert plain.max_first_token_s == pytest.approx(ORIGIN_KONI_B1.max_first_token_s, rel=1e-4)
    cell = run_cell("koni-8b", "native", 8192, 128, "B1/k1", "prefill-first", costs=COSTS)
    assert cell.status == "ok"
    assert plain.throughput_tok_s == pytest.approx(cell.output_tok_s, rel=1e-6)
    assert plain.max_first_token_s == pytest.approx(cell.max_first_token_all, rel=1e-6)
    # with zero acceptance every draft is wasted: slower than plain
    wasted = spec.serial_projection(COSTS, KONI_B1, 8192, 128, 16, acceptance=0.0, drafts=2)
    assert wasted.throughput_tok_s < plain.throughput_tok_s


def test_high_acceptance_beats_plain_and_moves_first_tokens_earlier() -> None:
    plain = spec.serial_projection(COSTS, KONI_B1, 8192, 128, 16)
    k, _ = spec.best_drafts(COSTS, KONI_B1, 8192, 128, 0.8, range(1, 9))
    fast = spec.serial_projection(COSTS, KONI_B1, 8192, 128, 16, acceptance=0.8, drafts=k)
    assert fast.throughput_tok_s > plain.throughput_tok_s
    assert fast.max_first_token_s < plain.max_first_token_s
    assert fast.median_first_token_s < plain.median_first_token_s
    assert fast.tokens_per_call > 2


def test_crossover_batch_exists_and_grows_with_acceptance() -> None:
    drafts = range(1, 9)
    crossings = [spec.crossover_batch(COSTS, KONI_B1, 8192, 128, a, drafts, max_batch=32)
                 for a in (0.2, 0.4, 0.6, 0.8, 0.95)]
    assert all(b is not None for b in crossings)
    assert crossings == sorted(crossings)            # type: ignore[type-var]
    assert crossings[0] == 1 and crossings[-1] > 1   # 0.2 never pays; 0.95 pays at B1


@pytest.mark.parametrize("model", ["qwen3-0.6b", "gemma3-1b"])
def test_other_models_cross_over_too(model: str) -> None:
    # a hybrid model may not use a single block; the block count does not change a call's cost
    artifact = ArtifactConfig(model=ModelSpec.preset(model), batch_size=1, max_seq_len=9216,
                              block_size=9216, num_blocks=2, prefill_chunk_size=128)
    low = spec.crossover_batch(COSTS, artifact, 8192, 128, 0.4, range(1, 9), max_batch=64)
    high = spec.crossover_batch(COSTS, artifact, 8192, 128, 0.8, range(1, 9), max_batch=64)
    assert low is not None and high is not None and high > low >= 1


def test_projection_refuses_a_batched_artifact() -> None:
    with pytest.raises(ConfigError, match="batch_size=4: the serial projection is for B1"):
        spec.serial_projection(COSTS, spec.batched_artifact(KONI_B1, 4), 8192, 128, 16)


def test_break_even_acceptance_separates_loss_from_gain() -> None:
    drafts = range(1, 9)
    even = spec.break_even_acceptance(COSTS, KONI_B1, 8192, 128, drafts)
    assert even is not None and 0.0 < even < 1.0
    plain = spec.plain_decode_s(COSTS, KONI_B1, 8192, 128)
    below = spec.best_drafts(COSTS, KONI_B1, 8192, 128, even - 0.02, drafts)[1]
    above = spec.best_drafts(COSTS, KONI_B1, 8192, 128, even + 0.02, drafts)[1]
    assert below > plain > above
    # a short verify graph (what-if) costs about a decode step: speculation pays sooner
    short = ArtifactConfig(model=KONI_B1.model, batch_size=1, max_seq_len=9216,
                           block_size=9216, num_blocks=1, prefill_chunk_size=16)
    sooner = spec.break_even_acceptance(COSTS, KONI_B1, 8192, 128, drafts, short)
    assert sooner is not None and sooner < even
