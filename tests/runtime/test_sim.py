"""SimRuntime and its cost model: calibration to the origin figures, formulas, JSON, pseudo-logits,
and the simulated PD producer on the engine's real consumer path."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.errors import ConfigError, KVTransferError, StateError
from atombatch.pd import LayerKV, validate_header
from atombatch.runtime.sim import (
    ORIGIN_KONI_B1,
    CostModel,
    ObservedFigures,
    SimProducer,
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
    done = batcher.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
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


def test_a_decode_step_is_billed_by_the_bucket_that_ran() -> None:
    """With decode buckets a step pays for the rows of the compiled batch it ran, not for B."""
    costs = CostModel.default()
    plain = koni(4, 5)
    bucketed = ArtifactConfig(**{**{f: getattr(plain, f) for f in plain.__struct_fields__},
                                 "decoder_batch_sizes": (1, 2, 4)})
    assert costs.decode_step_s(bucketed, [8200], rows=1) == pytest.approx(
        costs.decode_step_s(koni(), [8200]))
    assert costs.decode_step_s(bucketed, [8200], rows=1) < costs.decode_step_s(plain, [8200])
    # the same one-request workload through the Batcher: rows, device time and tokens
    prompts, params = [[5] * 300], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for art in (plain, bucketed):
        rt = SimRuntime(art, costs)
        batcher = Batcher(rt)
        runs[art.decoder_batch_sizes] = (batcher.generate(prompts, params), rt.device, batcher)
    (done4, dev4, b4), (done1, dev1, b1) = runs[(4,)], runs[(1, 2, 4)]
    assert done4[0].token_ids == done1[0].token_ids
    assert dev4.decode_calls == dev1.decode_calls == 5
    assert (dev4.decode_rows, dev1.decode_rows) == (20, 5)
    assert b1.stats().bucket_steps == {1: 5} and b4.stats().bucket_steps == {4: 5}
    assert dev1.decode_s < dev4.decode_s
    with pytest.raises(StateError, match="decode inputs have 3 rows; the compiled decode batches "
                                         r"are \(1, 2, 4\)"):
        SimRuntime(bucketed).decode(_Rows(3))


class _Rows:
    """Decode inputs of `n` padding rows (a bucket the artifact does not have)."""

    def __init__(self, n: int) -> None:
        self.input_ids = np.zeros((n, 1), np.int64)
        self.cache_position = np.zeros((n, 1), np.int32)


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
    costs = msgspec.structs.replace(CostModel.default(), pd_header="producer-start",
                                    import_bandwidth=16e9)
    path = tmp_path / "costs.json"
    costs.save(path)
    again = CostModel.load(path)
    assert again == costs
    assert again.calibration is not None and again.calibration.figures == ORIGIN_KONI_B1


def test_bad_cost_model_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="pd_header"):
        CostModel(memory_bandwidth=1e9, prefill_flops=1e12, pd_header="carrier-pigeon")
    with pytest.raises(ConfigError, match="import_bandwidth"):
        CostModel(memory_bandwidth=1e9, prefill_flops=1e12, import_bandwidth=0)
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
    done = batcher.generate([[5] * 300, [6] * 300], SamplingParams(temperature=0.0, max_tokens=4))
    assert rt.clock() == pytest.approx(rt.device.prefill_s + rt.device.decode_s)
    assert done[0].token_ids != done[1].token_ids
    again = Batcher(SimRuntime(art)).generate([[5] * 300, [6] * 300],
                                              SamplingParams(temperature=0.0, max_tokens=4))
    assert [c.token_ids for c in again] == [c.token_ids for c in done]   # deterministic
    assert not set(KONI.eos_token_ids) & {t for c in done for t in c.token_ids}
    rt.advance_to(rt.clock() + 5.0)
    assert rt.clock() == pytest.approx(rt.device.prefill_s + rt.device.decode_s + 5.0)


def test_write_layer_kv_charges_import_and_counts_calls() -> None:
    costs = CostModel.default()
    art = koni(4, 5)
    rt = SimRuntime(art, costs)
    k = np.broadcast_to(np.zeros((), np.float32), (KONI.num_kv_heads, 8192, KONI.head_dim))
    rt.write_layer_kv(3, k, k, (2,), 0)
    # 32 MiB of bf16 K+V per KONI layer at 32 GB/s, plus the per-call overhead
    assert rt.clock() == pytest.approx(costs.import_call_s + 2 * 8 * 128 * 2 * 8192 / 32e9)
    assert rt.device.import_s == rt.clock() and rt.device.import_calls == 1
    assert rt.device.prefill_calls == 0
    with pytest.raises(StateError, match="layer 32"):
        rt.write_layer_kv(32, k, k, (2,))
    with pytest.raises(StateError, match="kv_heads"):
        rt.write_layer_kv(0, k[:1], k[:1], (2,))
    with pytest.raises(StateError, match="block 5"):
        rt.write_layer_kv(0, k, k, (5,))
    assert rt.device.import_calls == 1


def run_pd(artifact: ArtifactConfig, mode: str, prompts: list, params: SamplingParams,
           costs: CostModel | None = None) -> tuple[list, Batcher, SimRuntime, list]:
    """All prompts submitted together with simulated KV sources, run to the end; the virtual clock
    jumps to the producer's next event whenever the Batcher has nothing to run."""
    rt = SimRuntime(artifact, costs)
    producer = SimProducer(rt, mode)
    batcher = Batcher(rt, pd_timeout=math.inf)
    trace = batcher.record_trace()
    ids = [batcher.submit(p, params, kv=producer.source(f"r{i}", p, params))
           for i, p in enumerate(prompts)]
    done = {}
    while batcher.has_unfinished():
        steps = batcher.scheduler.counters.steps
        for out in batcher.step():
            if out.finished:
                done[out.request_id] = out.completion
        if batcher.scheduler.counters.steps == steps:
            wake = producer.next_event()
            assert wake is not None and wake > rt.clock()
            rt.advance_to(wake)
    return [done[i] for i in ids], batcher, rt, trace


@pytest.mark.parametrize("mode", ["whole", "layer-stream"])
@pytest.mark.parametrize("model,shape", [("koni-8b", (1, 1)), ("koni-8b", (4, 5)),
                                         ("gemma3-1b", (4, 5))])
def test_pd_routes_equal_native_through_the_real_consumer_path(model: str, shape: tuple,
                                                               mode: str) -> None:
    spec = ModelSpec.preset(model)
    art = ArtifactConfig(model=spec, batch_size=shape[0], max_seq_len=4096, block_size=4096,
                         num_blocks=shape[1], prefill_chunk_size=128)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, spec.vocab_size, n) for n in (700, 1500, 130, 1024, 900, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    native = Batcher(SimRuntime(art)).generate(prompts, params)
    done, batcher, rt, trace = run_pd(art, mode, prompts, params)
    assert [c.token_ids for c in done] == [c.token_ids for c in native]
    assert all(c.finish_reason == "length" for c in done)
    kinds = {r.kind for r in trace}
    assert "import" in kinds and "prefill" not in kinds and "decode" in kinds
    assert rt.device.prefill_calls == 0 and rt.device.prefill_s == 0
    assert rt.device.import_calls == len(prompts) * spec.num_layers
    assert batcher.stats().imports == sum(r.kind == "import" for r in trace)
    batcher.check_invariants()


def test_layer_stream_first_token_no_later_than_whole() -> None:
    art = koni(4, 5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, KONI.vocab_size, 8192) for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    costs = msgspec.structs.replace(CostModel.default(), transfer_bandwidth=2e9)  # a slow link
    whole, *_ = run_pd(art, "whole", prompts, params, costs)
    stream, *_ = run_pd(art, "layer-stream", prompts, params, costs)
    for w, s in zip(whole, stream, strict=True):
        assert s.timings.ttft <= w.timings.ttft
    # at 2 GB/s the 1 GiB of a KONI 8192-token prompt takes ~0.5 s: layer-stream hides it
    assert stream[0].timings.ttft < whole[0].timings.ttft - 0.4
    assert [c.token_ids for c in stream] == [c.token_ids for c in whole]


@pytest.mark.parametrize("pd_header", ["first-token", "producer-start"])
def test_pd_request_holds_no_lane_until_its_header_arrives(pd_header: str) -> None:
    costs = msgspec.structs.replace(CostModel.default(), pd_header=pd_header)
    art = koni(4, 5)
    rt = SimRuntime(art, costs)
    producer = SimProducer(rt, "layer-stream")
    batcher = Batcher(rt, pd_timeout=math.inf)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = np.arange(3, 3 + 2048)
    producer.source("other", prompt, params).close()  # occupies the producer first
    rt.advance_to(1.0)
    source = producer.source("r", prompt, params)
    batcher.submit(prompt, params, request_id="r", kv=source)
    compute = costs.producer_prefill_s(art, 2048)
    # queued behind the other prompt: the producer starts on it at `compute`
    expected = 2 * compute if pd_header == "first-token" else compute
    assert source.header_at == pytest.approx(expected)
    request = batcher.scheduler.requests["r"]
    for when in (1.0, source.header_at - 1e-6):
        rt.advance_to(when)
        assert batcher.step() == []
        assert batcher.scheduler.lanes.num_busy == 0 and request.lane < 0
        assert request.state.name == "WAITING" and request.admitted_at is None
    rt.advance_to(source.header_at)
    batcher.step()
    assert batcher.scheduler.lanes.num_busy == 1 and request.lane >= 0
    validate_header(source.header, art, prompt, require_full=True)
    assert source.header.first_token == int(np.argmax(rt.prompt_logits(prompt)))
    if pd_header == "producer-start":  # layers stream in behind the header, one by one
        assert not source.done() and source.next_event() > rt.clock()
    while batcher.has_unfinished():
        steps = batcher.scheduler.counters.steps
        batcher.step()
        if batcher.scheduler.counters.steps == steps:
            wake = producer.next_event()
            assert wake is not None and wake > rt.clock()
            rt.advance_to(wake)
    assert rt.clock() > source.ready_at


def test_sim_sources_hand_out_zero_stride_float32_without_copies() -> None:
    art = koni(4, 5)
    rt = SimRuntime(art)
    source = SimProducer(rt, "whole").source("r", list(range(3, 1003)))
    assert source.poll() == (None, [])
    rt.advance_to(source.ready_at)
    header, layers = source.poll()
    assert header is not None and header.dtype == "float32" and len(layers) == KONI.num_layers
    layer: LayerKV = layers[0]
    assert layer.k.shape == (KONI.num_kv_heads, 1000, KONI.head_dim)
    assert layer.k.strides == (0, 0, 0) and not layer.k.flags.writeable
    k, v = layer.float32()
    assert k is layer.k and v is layer.v            # float32 passes through, nothing allocated
    assert source.done() and source.poll() == (header, []) and source.next_event() is None
    source.close()
    with pytest.raises(KVTransferError, match="closed"):
        source.poll()


# -- quantized artifacts (issue 42 item 2): decode time follows the bytes streamed ---------------------
def _quantized(weights: str | None, kv_fp8: bool = False, model: ModelSpec = KONI
               ) -> ArtifactConfig:
    from atombatch.artifact.config import Quantization

    quant = None
    if weights is not None or kv_fp8:
        quant = Quantization(weights=weights or "fp16", kv_caches="fp8" if kv_fp8 else "fp16")
    return ArtifactConfig(model=model, batch_size=1, max_seq_len=9216, block_size=9216,
                          num_blocks=2, prefill_chunk_size=128, quantization=quant,
                          kv_dtype="float8_e4m3fn" if kv_fp8 else "bfloat16")


def test_decode_time_falls_with_the_quantized_weight_bytes() -> None:
    costs = CostModel.default()
    step = {w: costs.decode_step_s(_quantized(w), (8193,)) for w in (None, "int8", "fp8", "int4")}
    assert step[None] > step["int8"] == step["fp8"] > step["int4"]
    # KONI's seven projections per layer as (out, in); the fp16 -> int4 saving per layer is
    # 2 - 1/2 bytes per element less one float32 scale per output channel.
    projections = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
                   (14336, 4096), (4096, 14336)]
    saved = 32 * sum(out * inp * 2 - out * inp // 2 - 4 * out for out, inp in projections)
    assert step[None] - step["int4"] == pytest.approx(saved / costs.memory_bandwidth, rel=1e-9)
    saved8 = 32 * sum(out * inp - 4 * out for out, inp in projections)
    assert step[None] - step["int8"] == pytest.approx(saved8 / costs.memory_bandwidth, rel=1e-9)


def test_fp8_kv_halves_the_kv_read_time() -> None:
    costs = CostModel.default()
    context = 8193
    bf16 = costs.decode_step_s(_quantized("int8"), (context,))
    fp8 = costs.decode_step_s(_quantized("int8", kv_fp8=True), (context,))
    kv_bf16 = 32 * 2 * 8 * 128 * 2 * context  # layers x (K, V) x kv heads x head_dim x bytes
    # the two K/V scales per layer are the only other bytes fp8 KV adds
    assert bf16 - fp8 == pytest.approx((kv_bf16 / 2 - 32 * 2 * 4) / costs.memory_bandwidth,
                                       rel=1e-9)


def test_quantized_prefill_keeps_its_flops_and_calibration_is_untouched() -> None:
    costs = CostModel.default()
    # KONI's 128-token chunk is compute-bound: its time does not change with the weight format.
    assert costs.prefill_chunk_s(_quantized("int4"), 4096, 128) == \
        costs.prefill_chunk_s(_quantized(None), 4096, 128)
    assert costs.calibration is not None and costs.calibration.max_relative_error < 1e-3
    # a longer B1 decode run at int4 finishes sooner than at bf16 on the same schedule
    from atombatch.runtime.sim.costs import serial_figures
    fp16 = serial_figures(costs, _quantized(None), 8192, 128, 16)
    int4 = serial_figures(costs, _quantized("int4"), 8192, 128, 16)
    assert int4[0] > fp16[0] and int4[1] < fp16[1]
