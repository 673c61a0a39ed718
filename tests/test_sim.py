"""SimRuntime and its cost model: calibration to the origin figures, formulas, JSON, pseudo-logits."""

from __future__ import annotations

import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.errors import ConfigError
from atombatch.runtime.sim import (
    ORIGIN_KONI_B1,
    CostModel,
    ObservedFigures,
    SimRuntime,
    calibrate,
    origin_artifact,
)

KONI = ModelSpec.preset("koni-8b")


def koni(batch_size: int = 1, num_blocks: int = 1, tp: int = 1) -> ArtifactConfig:
    return ArtifactConfig(model=KONI, batch_size=batch_size, max_seq_len=9216, block_size=9216,
                          num_blocks=num_blocks, prefill_chunk_size=128, tensor_parallel=tp)


def run_origin(artifact: ArtifactConfig, costs: CostModel | None = None,
               policy: str = "prefill-first") -> tuple[list, Batcher]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, KONI.vocab_size, 8192) for _ in range(16)]
    batcher = Batcher(SimRuntime(artifact, costs), policy=policy)
    done = batcher.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True))
    return done, batcher


def test_default_calibration_reproduces_origin_figures_through_the_batcher() -> None:
    done, batcher = run_origin(koni())
    assert all(len(c.token_ids) == 128 and c.finish_reason == "length" for c in done)
    max_first = max(c.timings.ttft for c in done)
    max_done = max(c.timings.e2e for c in done)
    tok_s = sum(len(c.token_ids) for c in done) / max_done
    figures = ORIGIN_KONI_B1
    assert max_first == pytest.approx(figures.max_first_token_s, rel=0.01)
    assert max_done == pytest.approx(figures.max_completion_s, rel=0.01)
    assert tok_s == pytest.approx(figures.throughput_tok_s, rel=0.01)
    # strictly serial: 16 x 64 prefill chunks and 16 x 127 single-lane decode steps
    stats = batcher.stats()
    assert stats.prefill_chunks == 16 * 64
    assert stats.lane_histogram == (0, 16 * 127)


def test_calibration_record_and_plausible_rates() -> None:
    costs = CostModel.default()
    cal = costs.calibration
    assert cal is not None and cal.max_relative_error < 1e-3
    assert cal.prefill_s == pytest.approx(7.2925, abs=2e-3)
    assert cal.decode_step_s == pytest.approx(9.15 / 127, rel=1e-3)
    # KONI streams ~15 GB per decode step: an effective bandwidth near ATOM's 256 GB/s
    assert 150e9 < costs.memory_bandwidth < 300e9
    assert 5e12 < costs.prefill_flops < 64e12
    assert "253.93" in costs.describe() and "263.08" in costs.describe()


def test_b4_step_costs_more_than_b1_but_far_less_than_four() -> None:
    costs = CostModel.default()
    b1 = costs.decode_step_s(koni(), [8200])
    b4 = costs.decode_step_s(koni(4, 5), [8200] * 4)
    assert b1 < b4 < 2 * b1
    # idle lanes of a static graph cost their per-lane share, without KV
    one_of_four = costs.decode_step_s(koni(4, 5), [8200])
    assert b1 < one_of_four < b4
    cheaper_idle = CostModel(**{**_fields(costs), "idle_lane_fraction": 0.0})
    assert cheaper_idle.decode_step_s(koni(4, 5), [8200]) == pytest.approx(b1)
    # per_lane_fraction is the explicit knob
    steeper = CostModel(**{**_fields(costs), "per_lane_fraction": 1.0})
    assert steeper.decode_step_s(koni(4, 5), [8200] * 4) > 3.5 * b1


def _fields(costs: CostModel) -> dict:
    return {f: getattr(costs, f) for f in costs.__struct_fields__}


def test_prefill_chunk_grows_with_position_and_other_models_scale() -> None:
    costs = CostModel.default()
    art = koni()
    assert costs.prefill_chunk_s(art, 8064, 128) > costs.prefill_chunk_s(art, 0, 128)
    small = ArtifactConfig(model=ModelSpec.preset("qwen3-0.6b"), batch_size=1, max_seq_len=9216,
                           block_size=9216, num_blocks=1)
    assert costs.prefill_chunk_s(small, 0, 128) < costs.prefill_chunk_s(art, 0, 128) / 4
    assert costs.decode_step_s(small, [100]) < costs.decode_step_s(art, [100]) / 4
    # Gemma3's sliding layers attend at most `sliding_window` keys: late chunks grow slowly
    gemma = ArtifactConfig(model=ModelSpec.preset("gemma3-1b"), batch_size=1, max_seq_len=9216,
                           block_size=9216, num_blocks=2)
    assert costs.prefill_chunk_s(gemma, 8064, 128) > costs.prefill_chunk_s(gemma, 0, 128)
    # two devices: half the bytes and FLOPs each, plus the all-reduces
    assert costs.decode_step_s(koni(tp=2), [8200]) < 0.6 * costs.decode_step_s(art, [8200])


def test_cost_model_json_round_trip(tmp_path) -> None:
    costs = CostModel.default().with_route("pd-layer-stream")
    path = tmp_path / "costs.json"
    costs.save(path)
    again = CostModel.load(path)
    assert again == costs
    assert again.calibration is not None and again.calibration.figures == ORIGIN_KONI_B1


def test_bad_cost_model_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="route"):
        CostModel(memory_bandwidth=1e9, prefill_flops=1e12, route="carrier-pigeon")
    with pytest.raises(ConfigError, match="per_lane_fraction"):
        CostModel(memory_bandwidth=1e9, prefill_flops=1e12, per_lane_fraction=-1)


def test_calibrate_fits_other_figures_and_records_priors() -> None:
    figures = ObservedFigures(throughput_tok_s=10.0, max_first_token_s=197.0,
                              max_completion_s=204.8)
    costs = calibrate(figures, per_lane_fraction=0.2, decode_call_s=0.002)
    cal = costs.calibration
    assert costs.per_lane_fraction == 0.2 and costs.decode_call_s == 0.002
    assert cal is not None and cal.figures == figures
    assert cal.reproduced_max_completion_s == pytest.approx(204.8, rel=0.01)
    assert cal.reproduced_max_first_token_s == pytest.approx(197.0, rel=0.01)
    with pytest.raises(ConfigError):
        calibrate(ObservedFigures(max_first_token_s=300.0, max_completion_s=263.08))


def test_virtual_clock_and_pseudo_logits() -> None:
    art = origin_artifact()
    rt = SimRuntime(art)
    batcher = Batcher(rt)
    assert batcher.clock == rt.clock
    done = batcher.generate([[5] * 300, [6] * 300], SamplingParams(max_tokens=4))
    assert rt.clock() == pytest.approx(rt.device.prefill_s + rt.device.decode_s)
    assert done[0].token_ids != done[1].token_ids
    again = Batcher(SimRuntime(art)).generate([[5] * 300, [6] * 300], SamplingParams(max_tokens=4))
    assert [c.token_ids for c in again] == [c.token_ids for c in done]   # deterministic
    assert not set(KONI.eos_token_ids) & {t for c in done for t in c.token_ids}
    rt.advance_to(rt.clock() + 5.0)
    assert rt.clock() == pytest.approx(rt.device.prefill_s + rt.device.decode_s + 5.0)


def test_pd_route_charges_import_not_compute() -> None:
    native = CostModel.default()
    art = koni()
    rt = SimRuntime(art, native.with_route("pd-whole"))
    Batcher(rt).generate([[7] * 8192], SamplingParams(max_tokens=2, ignore_eos=True))
    assert rt.device.prefill_s == 0 and rt.device.import_s > 0
    assert rt.device.import_s < native.request_prefill_s(art, 8192) / 5
    whole = native.with_route("pd-whole").producer_delay(art, 8192)
    stream = native.with_route("pd-layer-stream").producer_delay(art, 8192)
    assert whole[0] == stream[0] == pytest.approx(native.request_prefill_s(art, 8192))
    assert stream[1] < whole[1]
    assert native.producer_delay(art, 8192) == (0.0, 0.0)
