"""The serving benchmark: origin figures through the harness, B4, timeouts, fit, CLI, numpy."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.bench import serve
from atombatch.runtime.sim import ORIGIN_KONI_B1, CostModel, SimRuntime


@pytest.fixture(scope="module")
def koni_b1() -> serve.Cell:
    return serve.run_cell("koni-8b", "native", 8192, 128, "B1/k1", "prefill-first")


@pytest.fixture(scope="module")
def koni_b4() -> serve.Cell:
    return serve.run_cell("koni-8b", "native", 8192, 128, "B4/k5", "prefill-first",
                          ignore_fit=True)


def test_origin_cell_reproduces_figures_and_keeps_timeouts_out(koni_b1: serve.Cell) -> None:
    cell = koni_b1
    assert cell.status == "ok" and cell.fit.fits and not cell.hypothetical
    assert cell.fit.projected_bytes == 16_357_785_600 and cell.fit.method == "observed"
    assert cell.max_first_token_all == pytest.approx(ORIGIN_KONI_B1.max_first_token_s, rel=0.01)
    assert cell.max_completion_all == pytest.approx(ORIGIN_KONI_B1.max_completion_s, rel=0.01)
    assert cell.output_tok_s == pytest.approx(ORIGIN_KONI_B1.throughput_tok_s, rel=0.01)
    # origin: six timed requests exceed 180 s; they are failures, not latency samples
    assert cell.timeouts == 6 and cell.completed == 10 and cell.requests == 16
    assert cell.completion.count == cell.ttft.count == 10
    assert cell.completion.max <= 180.0
    assert sum(r.failed for r in cell.request_records) == 6
    assert cell.lane_histogram == (0, 16 * 127)
    assert "253.93" in cell.calibration and cell.identity


def test_b4_is_different_and_plausible(koni_b1: serve.Cell, koni_b4: serve.Cell) -> None:
    b1, b4 = koni_b1, koni_b4
    assert b4.status == "ok" and b4.hypothetical  # KONI B4/k5 does not fit one ATOM
    # memory-bound decode: four lanes per step cost far less than four steps
    assert b1.output_tok_s * 1.2 < b4.output_tok_s < b1.output_tok_s * 4
    assert b4.max_first_token_all < b1.max_first_token_all
    assert b4.max_completion_all < b1.max_completion_all
    assert b4.timeouts < b1.timeouts
    assert b4.lane_histogram[4] > 0 and b4.mean_decoding_lanes > 3
    assert b4.prefill_device_s == pytest.approx(b1.prefill_device_s)  # same prompts
    assert b4.decode_device_s < b1.decode_device_s


def test_not_fitting_and_rejected_cells_are_reported_not_run() -> None:
    cell = serve.run_cell("koni-8b", "native", 8192, 128, "B4/k5", "prefill-first")
    assert cell.status == "not-run: does not fit" and cell.fit.fits is False
    assert cell.fit.projected_bytes == 21_189_623_808 and cell.requests == 0
    gemma = serve.run_cell("gemma3-1b", "native", 128, 32, "B1/k1", "prefill-first")
    assert gemma.status == "rejected" and "hybrid" in (gemma.error or "")
    too_long = serve.run_cell("qwen3-0.6b", "native", 8192, 128, "B1/k1/ctx4096",
                              "prefill-first")
    assert too_long.status == "rejected" and "max_seq_len" in (too_long.error or "")


def test_timeouts_count_as_failures_and_abort_frees_lanes() -> None:
    load = serve.Load(concurrency=8, timeout_s=9.0)
    counted = serve.run_cell("qwen3-4b", "native", 2048, 32, "B1/k1", "prefill-first", load=load)
    assert counted.timeouts > 0 and counted.completed + counted.timeouts == 8
    assert counted.completion.max <= 9.0 and counted.ttft.count == counted.completed
    aborted = serve.run_cell("qwen3-4b", "native", 2048, 32, "B1/k1", "prefill-first",
                             load=msgspec.structs.replace(load, timeout_action="abort"))
    assert aborted.timeouts > 0 and aborted.completion.max <= 9.0
    # aborting late requests frees the device: the survivors finish no later
    assert aborted.makespan_s <= counted.makespan_s


def test_pd_routes_and_poisson_and_closed_loop() -> None:
    load = serve.Load(concurrency=4, requests=8)
    native = serve.run_cell("qwen3-0.6b", "native", 2048, 32, "B4/k5", "prefill-first", load=load)
    whole = serve.run_cell("qwen3-0.6b", "pd-whole", 2048, 32, "B4/k5", "prefill-first",
                           load=load)
    stream = serve.run_cell("qwen3-0.6b", "pd-layer-stream", 2048, 32, "B4/k5", "prefill-first",
                            load=load)
    assert native.requests == whole.requests == stream.requests == 8 and native.completed == 8
    assert whole.completed == stream.completed == 8 and whole.errors == stream.errors == 0
    # the real consumer path: import steps and layer writes on the decoder, no prefill there
    layers = ModelSpec.preset("qwen3-0.6b").num_layers
    for pd in (whole, stream):
        assert pd.prefill_device_s == 0 and pd.prefill_calls == 0
        assert pd.import_device_s > 0 and pd.import_calls == 8 * layers and pd.import_steps >= 8
        assert pd.import_device_s < native.prefill_device_s / 5
        # one serial producer computing the prompts natively (producer_speed 1)
        assert pd.producer_busy_s == pytest.approx(native.prefill_device_s, rel=1e-6)
    assert native.import_device_s == 0 and native.import_calls == 0
    assert whole.import_steps == 8  # whole: one import step writes every layer
    assert stream.ttft.max <= whole.ttft.max and stream.ttft.p50 <= whole.ttft.p50
    poisson = serve.run_cell("qwen3-0.6b", "native", 512, 32, "B4/k5", "decode-first",
                             load=serve.Load(requests=10, arrivals="poisson", rate=2.0))
    assert poisson.status == "ok" and poisson.completed == 10
    arrivals = [r.arrival for r in poisson.request_records]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_pd_timeout_counts_the_producer_queue() -> None:
    """The Batcher's pd_timeout runs from submit: behind a serial producer at c16, requests whose
    header comes later than the timeout fail (each alone); without one, all finish."""
    load = serve.Load(concurrency=8, pd_timeout_s=5.0)
    cell = serve.run_cell("qwen3-4b", "pd-layer-stream", 2048, 16, "B4/k5", "prefill-first",
                          load=load)
    assert cell.status == "ok" and cell.errors > 0 and cell.completed == 8 - cell.errors
    assert {r.reason for r in cell.request_records if r.failed} == {"error"}
    patient = serve.run_cell("qwen3-4b", "pd-layer-stream", 2048, 16, "B4/k5", "prefill-first",
                             load=serve.Load(concurrency=8))
    assert patient.completed == 8 and patient.errors == 0


def test_cli_writes_table_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "serve.json"
    costs = tmp_path / "costs.json"
    argv = ["--models", "qwen3-0.6b,gemma3-1b", "--routes", "native,pd-whole", "--inputs", "512",
            "--outputs", "32", "--artifacts", "B1/k1,B4/k5", "--policies",
            "prefill-first,interleave:2", "--concurrency", "4", "--json", str(out),
            "--save-costs", str(costs), "--no-progress"]
    assert serve.main(argv) == 0
    text = capsys.readouterr().out
    assert "calibration:" in text and "253.93" in text and "PD (assumed)" in text
    assert "rejected" in text and "B1/k1 -> B4/k5" in text and " import " in text
    report = msgspec.json.decode(out.read_bytes(), type=serve.ServeReport)
    assert report.argv == argv and report.command.startswith("python -m atombatch.bench serve")
    assert report.machine.cpu_count and report.version and report.max_rss_bytes > 0
    assert report.cost_model == CostModel.load(costs)
    assert len(report.cells) == 2 * 2 * 2 * 2
    assert {c.status for c in report.cells} == {"ok", "rejected"}
    assert serve.main(["--routes", "teleport", "--no-progress"]) == 2
    assert serve.main(["--arrivals", "poisson", "--no-progress"]) == 2


def test_numpy_runtime_measures_wall_time(capsys) -> None:
    argv = ["--runtime", "numpy", "--models", "qwen3-0.6b", "--inputs", "48", "--outputs", "6",
            "--artifacts", "B1/k1,B4/k5", "--policies", "prefill-first", "--concurrency", "4",
            "--no-progress"]
    assert serve.main(argv) == 0
    text = capsys.readouterr().out
    assert "wall s" in text and "B1/k1 -> B4/k5" in text
    report = serve.run(models=["qwen3-0.6b"], routes=["native"], inputs=[48], outputs=[6],
                       artifacts=["B4/k5"], policies=["prefill-first"], runtime="numpy",
                       load=serve.Load(concurrency=4), context=256, chunk=32)
    cell = report.cells[0]
    assert cell.status == "ok" and cell.fit.fits is None and cell.completed == 4
    assert cell.decode_device_s > 0 and cell.prefill_device_s > 0


@pytest.mark.parametrize("policy", ["prefill-first", "decode-first", "interleave:2"])
def test_sim_and_numpy_runtimes_step_alike(policy: str) -> None:
    """Same requests and policy: the same sequence of device calls on both runtimes."""
    from atombatch.runtime.numpy_runtime import NumpyRuntime

    spec = serve.small_spec("koni-8b")
    artifact = ArtifactConfig(model=spec, batch_size=2, max_seq_len=128, block_size=128,
                              num_blocks=3, prefill_chunk_size=16, kv_dtype="float32")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, spec.vocab_size, n) for n in (20, 40, 7, 33, 16)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 3, 9, 4, 6)]
    traces = []
    for runtime in (SimRuntime(artifact), NumpyRuntime.random(artifact, seed=0)):
        batcher = Batcher(runtime, policy=policy)
        trace = batcher.record_trace()
        done = batcher.generate(prompts, params)
        assert [len(c.token_ids) for c in done] == [5, 3, 9, 4, 6]
        traces.append(list(trace))
    assert traces[0] == traces[1]
    if policy != "decode-first":  # decode-first prefills only while no lane decodes
        assert any(r.kind == "decode" and r.lanes == 2 for r in traces[0])


def test_dispatcher_routes_subcommands(capsys) -> None:
    from atombatch.bench.__main__ import main
    assert main(["--help"]) == 0
    assert main(["nope"]) == 2
    assert main(["serve", "--models", "qwen3-0.6b", "--routes", "native", "--inputs", "128",
                 "--outputs", "32", "--artifacts", "B1/k1", "--policies", "prefill-first",
                 "--no-progress"]) == 0
    assert "qwen3-0.6b" in capsys.readouterr().out


# -- quantized artifacts (issue 42 item 2) ----------------------------------------------------------
def test_artifact_spec_names_a_quantization() -> None:
    koni = ModelSpec.preset("koni-8b")
    fields, art = serve.parse_artifact("B4/k5/wint4/kvfp8", koni, 9216, 128)
    assert isinstance(art, ArtifactConfig) and art.quantization is not None
    assert (art.quantization.weights, art.quantization.activations,
            art.quantization.kv_caches) == ("int4", "fp16", "fp8")
    assert art.kv_dtype == "float8_e4m3fn" and fields["batch_size"] == 4
    _, fp8 = serve.parse_artifact("B2/k3/wfp8/afp8", koni, 9216, 128)
    assert isinstance(fp8, ArtifactConfig) and fp8.quantization is not None
    assert fp8.quantization.activations == "fp8" and fp8.kv_dtype == "bfloat16"
    _, plain = serve.parse_artifact("B4/k5", koni, 9216, 128)
    assert isinstance(plain, ArtifactConfig) and plain.quantization is None
    with pytest.raises(Exception, match="part 'wint3' is not"):
        serve.parse_artifact("B4/k5/wint3", koni, 9216, 128)


def test_a_quantized_koni_fits_more_lanes_and_decodes_faster(koni_b1: serve.Cell) -> None:
    # KONI B4/k5 does not fit one ATOM in bf16 (above); with int4 weights and fp8 KV it does.
    cell = serve.run_cell("koni-8b", "native", 8192, 128, "B4/k5/wint4/kvfp8", "prefill-first")
    assert cell.status == "ok" and cell.fit.fits and not cell.hypothetical
    assert "int4 weights" in (cell.fit.basis or "")
    assert cell.prefill_device_s == pytest.approx(koni_b1.prefill_device_s)  # same FLOPs
    assert cell.decode_device_s < koni_b1.decode_device_s / 2
    assert cell.output_tok_s > koni_b1.output_tok_s
    assert cell.max_first_token_all < koni_b1.max_first_token_all
    assert cell.label.endswith("/wint4/kvfp8")


def test_a_mix_of_adapters_costs_their_device_time_and_the_cap_serialises_them(capsys) -> None:
    """`--lora-adapters N --lora-share S`: S of the requests over N adapters in turn on the
    simulator; the adapters' device seconds are the whole difference from the base-only cell
    (the same steps run), `--max-loras` makes requests of other adapters wait."""
    assert serve.Load(concurrency=8, lora_adapters=3, lora_share=0.5).loras() == \
        [None, "lora-1", None, "lora-2", None, "lora-3", None, "lora-1"]
    assert serve.Load(concurrency=3, lora_adapters=2).loras() == ["lora-1", "lora-2", "lora-1"]

    def cell(**lora: Any) -> serve.Cell:
        return serve.run_cell("qwen3-0.6b", "native", 512, 32, "B4/k5", "prefill-first",
                              load=serve.Load(concurrency=8, **lora))

    base = cell()
    mixed = cell(lora_adapters=4, lora_share=0.5, lora_rank=64)
    for c in (base, mixed):
        assert c.status == "ok" and c.completed == c.requests == 8
    assert (base.lora_requests, base.lora_device_s) == (0, 0.0)
    assert mixed.lora_requests == 4 and mixed.lora_device_s > 0
    assert mixed.decode_calls == base.decode_calls and mixed.prefill_calls == base.prefill_calls
    added = (mixed.prefill_device_s + mixed.decode_device_s) - \
        (base.prefill_device_s + base.decode_device_s)
    assert added == pytest.approx(mixed.lora_device_s, rel=1e-9)
    capped = cell(lora_adapters=4, lora_share=1.0, max_loras=1)
    free = cell(lora_adapters=4, lora_share=1.0)
    assert capped.completed == free.completed == 8
    # one adapter per step: its matrices are streamed once a step, not up to four times, and
    # the requests of the other adapters wait for a lane
    assert capped.lora_device_s < free.lora_device_s
    assert capped.ttft is not None and free.ttft is not None and capped.ttft.max > free.ttft.max
    assert serve.main(["--models", "qwen3-0.6b", "--routes", "native", "--inputs", "128",
                       "--outputs", "8", "--artifacts", "B4/k5", "--policies", "prefill-first",
                       "--concurrency", "4", "--lora-adapters", "2", "--lora-share", "0.5",
                       "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "LoRA: 50% of the requests under 2 adapters of rank 16" in text
    assert " lora  lanes/step" in text
    for bad in (["--lora-adapters", "2", "--lora-share", "0"], ["--lora-adapters", "-1"],
                ["--lora-adapters", "2", "--runtime", "numpy"],
                ["--lora-adapters", "2", "--max-loras", "0"]):
        assert serve.main([*bad, "--no-progress"]) == 2, bad
        assert bad[-2] in capsys.readouterr().err, bad  # the flag named
