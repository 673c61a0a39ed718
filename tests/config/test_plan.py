"""Memory planner: the origin issue's figures to the byte, hybrid slots, TP, verdicts, the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import msgspec
import pytest

from atombatch.artifact import plan
from atombatch.artifact.config import ArtifactConfig, ModelSpec, Quantization
from atombatch.bench import fit as fit_cli
from atombatch.errors import ConfigError

CTX = 9216
ORIGIN_USED = 16_357_785_600
ATOM = 16_877_879_296


def eager(name: str, batch_size: int, num_blocks: int, tp: int = 1) -> ArtifactConfig:
    return ArtifactConfig(model=ModelSpec.preset(name), batch_size=batch_size, max_seq_len=CTX,
                          block_size=CTX, num_blocks=num_blocks, tensor_parallel=tp)


# -- origin issue -------------------------------------------------------------------------------

def test_origin_koni_b1_k1_kv_tensors() -> None:
    tensors = plan.kv_tensor_shapes(eager("koni-8b", 1, 1))
    assert len(tensors) == 64
    assert {(shape, dtype) for _, shape, dtype in tensors} == {((1, 8, 9216, 128), "bfloat16")}
    assert tensors[0][0] == "layers.0.key"
    assert tensors[-1][0] == "layers.31.value"
    assert plan.kv_cache_bytes(eager("koni-8b", 1, 1)) == 1_207_959_552


def test_origin_koni_k5_kv_bytes() -> None:
    assert plan.kv_cache_bytes(eager("koni-8b", 1, 5)) == 6_039_797_760
    # Eager global KV does not depend on the batch: B4/k5 holds the same five blocks.
    assert plan.kv_cache_bytes(eager("koni-8b", 4, 5)) == 6_039_797_760


def test_origin_koni_k5_projection_does_not_fit() -> None:
    result = plan.fit(eager("koni-8b", 1, 5), device_bytes=ATOM, observed_used_bytes=ORIGIN_USED,
                      observed_artifact=eager("koni-8b", 1, 1))
    assert result.kv_bytes == 6_039_797_760
    assert result.projected_bytes == 21_189_623_808
    assert result.device_bytes == 16_877_879_296
    assert result.headroom_bytes == 16_877_879_296 - 21_189_623_808
    assert result.fits is False
    assert result.method == "observed"
    assert result.conditional is True
    assert "other allocations stay unchanged" in result.basis
    assert result.observed_kv_bytes == 1_207_959_552
    assert result.observed_used_bytes == ORIGIN_USED
    assert result.observed_label == "koni-8b B1/ctx9216/k1"
    assert result.other_bytes == ORIGIN_USED - 1_207_959_552
    assert result.label == "koni-8b B1/ctx9216/k5"
    assert result.identity == eager("koni-8b", 1, 5).identity


def test_origin_observation_on_itself_fits() -> None:
    art = eager("koni-8b", 1, 1)
    result = plan.fit(art, observed_used_bytes=ORIGIN_USED)  # observed_artifact defaults to art
    assert result.projected_bytes == ORIGIN_USED
    assert result.headroom_bytes == 520_093_696
    assert result.fits


def test_fit_default_device_is_the_origin_atom() -> None:
    assert plan.ATOM_DEVICE_BYTES == ATOM
    assert plan.fit(eager("koni-8b", 1, 1)).device_bytes == ATOM


def test_kv_groups_describe_the_origin_tensors() -> None:
    (group,) = plan.kv_groups(eager("koni-8b", 1, 1))
    assert group == plan.KVGroup(kind="global", count=64, shape=(1, 8, 9216, 128),
                                 dtype="bfloat16", tensor_bytes=18_874_368,
                                 total_bytes=1_207_959_552)
    text = plan.describe(plan.fit(eager("koni-8b", 1, 1), observed_used_bytes=ORIGIN_USED))
    assert "64 BF16 global KV tensors of [1,8,9216,128] = 1,207,959,552 bytes" in text


# -- Gemma3 sliding slots -----------------------------------------------------------------------

def test_gemma3_global_and_sliding_bytes() -> None:
    art = eager("gemma3-1b", 4, 5)
    global_group, sliding_group = plan.kv_groups(art)
    # 4 global layers: K and V [5 blocks, 1 KV head, 9216, 256] in BF16.
    assert global_group.kind == "global" and global_group.count == 8
    assert global_group.shape == (5, 1, 9216, 256)
    assert global_group.total_bytes == 8 * 5 * 9216 * 256 * 2 == 188_743_680
    # 22 sliding layers: K and V [4 lanes, 1 KV head, 512-token window, 256] in BF16.
    assert sliding_group.kind == "sliding" and sliding_group.count == 44
    assert sliding_group.shape == (4, 1, 512, 256)
    assert sliding_group.total_bytes == 44 * 4 * 512 * 256 * 2 == 46_137_344
    assert plan.kv_cache_bytes(art) == 234_881_024


def test_gemma3_sliding_bytes_grow_with_lanes_not_blocks() -> None:
    b1 = plan.kv_cache_bytes(eager("gemma3-1b", 1, 5))
    b4 = plan.kv_cache_bytes(eager("gemma3-1b", 4, 5))
    assert b4 - b1 == 3 * 44 * 512 * 256 * 2
    k3 = plan.kv_cache_bytes(eager("gemma3-1b", 1, 3))
    assert b1 - k3 == 2 * 8 * 9216 * 256 * 2


def test_gemma3_tensor_shapes_follow_layer_kinds() -> None:
    art = eager("gemma3-1b", 4, 5)
    tensors = {name: shape for name, shape, _ in plan.kv_tensor_shapes(art)}
    assert len(tensors) == 52
    assert tensors["layers.5.key"] == (5, 1, 9216, 256)
    assert tensors["layers.0.value"] == (4, 1, 512, 256)
    assert tensors["layers.25.key"] == (4, 1, 512, 256)


def test_sliding_window_capped_by_context() -> None:
    art = ArtifactConfig(model=ModelSpec.preset("gemma3-1b"), batch_size=2, max_seq_len=256,
                         block_size=256, num_blocks=3)
    assert plan.kv_groups(art)[1].shape == (2, 1, 256, 256)


# -- tensor parallel ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["koni-8b", "qwen3-4b", "qwen3-0.6b"])
@pytest.mark.parametrize(("batch_size", "num_blocks"), [(1, 1), (1, 5), (4, 5)])
def test_tp2_halves_kv_per_device(name: str, batch_size: int, num_blocks: int) -> None:
    tp1 = plan.kv_cache_bytes(eager(name, batch_size, num_blocks))
    tp2 = plan.kv_cache_bytes(eager(name, batch_size, num_blocks, tp=2))
    assert tp2 * 2 == tp1


def test_tp2_koni_shapes() -> None:
    tensors = plan.kv_tensor_shapes(eager("koni-8b", 1, 5, tp=2))
    assert {shape for _, shape, _ in tensors} == {(5, 4, 9216, 128)}
    assert plan.kv_cache_bytes(eager("koni-8b", 1, 5, tp=2)) == 3_019_898_880


def test_tp2_replicates_a_single_kv_head() -> None:
    # Gemma3-1B has one KV head: each device keeps a full copy.
    tp1, tp2 = eager("gemma3-1b", 4, 5), eager("gemma3-1b", 4, 5, tp=2)
    assert plan.kv_cache_bytes(tp2) == plan.kv_cache_bytes(tp1)
    assert plan.kv_heads_per_device(tp2.model, 2) == 1


def test_tp2_weights_per_device() -> None:
    spec = ModelSpec.preset("koni-8b")
    one, two = plan.weight_bytes(spec), plan.weight_bytes(spec, tensor_parallel=2)
    embeddings = 2 * 128256 * 4096 * 2  # untied input embedding and LM head, replicated
    assert two < one
    assert two - embeddings == pytest.approx((one - embeddings) / 2, rel=1e-4)


# -- weights ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "params"), [
    ("qwen3-0.6b", 596_049_920),    # Qwen/Qwen3-0.6B (tied embeddings)
    ("qwen3-4b", 4_022_468_096),    # Qwen/Qwen3-4B (tied embeddings)
    ("koni-8b", 8_030_261_248),     # meta-llama/Llama-3.1-8B (untied LM head)
    ("gemma3-1b", 999_885_952),     # google/gemma-3-1b-pt (tied embeddings)
])
def test_weight_bytes_match_public_parameter_counts(name: str, params: int) -> None:
    assert plan.weight_bytes(ModelSpec.preset(name)) == params * 2


def test_weight_bytes_rejects_bad_split() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 must divide num_heads=32"):
        plan.weight_bytes(ModelSpec.preset("koni-8b"), tensor_parallel=3)


# -- verdicts -----------------------------------------------------------------------------------

def test_estimate_is_weights_plus_kv_plus_overhead() -> None:
    art = eager("qwen3-4b", 4, 5)
    result = plan.fit(art)
    weights = plan.weight_bytes(art.model)
    assert result.method == "estimate" and not result.conditional
    assert result.runtime_overhead_bytes == plan.DEFAULT_RUNTIME_OVERHEAD_BYTES
    assert result.projected_bytes == weights + plan.kv_cache_bytes(art) + \
        plan.DEFAULT_RUNTIME_OVERHEAD_BYTES
    assert result.other_bytes == weights + plan.DEFAULT_RUNTIME_OVERHEAD_BYTES
    assert "not measured" in result.basis
    custom = plan.fit(art, runtime_overhead_bytes=0)
    assert custom.projected_bytes == result.projected_bytes - plan.DEFAULT_RUNTIME_OVERHEAD_BYTES


def test_verdict_flips_at_capacity() -> None:
    art = eager("qwen3-0.6b", 4, 5)
    projected = plan.fit(art).projected_bytes
    assert plan.fit(art, device_bytes=projected).fits
    assert plan.fit(art, device_bytes=projected).headroom_bytes == 0
    assert not plan.fit(art, device_bytes=projected - 1).fits


@pytest.mark.parametrize(("num_blocks", "fits"), [(1, True), (2, False), (3, False), (5, False)])
def test_origin_koni_tp1_verdicts(num_blocks: int, fits: bool) -> None:
    # 520,093,696 bytes of headroom at k1: not even one more 1,207,959,552-byte block fits.
    result = plan.fit(eager("koni-8b", 1, num_blocks), observed_used_bytes=ORIGIN_USED,
                      observed_artifact=eager("koni-8b", 1, 1))
    assert result.fits is fits


def test_koni_tp2_b4_k5_fits_by_estimate() -> None:
    result = plan.fit(eager("koni-8b", 4, 5, tp=2))
    assert result.fits
    assert result.method == "estimate"


def test_observation_must_match_model_and_split() -> None:
    with pytest.raises(ConfigError, match=r"observed artifact model qwen3-4b differs from koni-8b"):
        plan.fit(eager("koni-8b", 1, 5), observed_used_bytes=ORIGIN_USED,
                 observed_artifact=eager("qwen3-4b", 1, 1))
    with pytest.raises(ConfigError, match=r"observed tensor_parallel=1 differs from "
                                          r"tensor_parallel=2"):
        plan.fit(eager("koni-8b", 1, 5, tp=2), observed_used_bytes=ORIGIN_USED,
                 observed_artifact=eager("koni-8b", 1, 1))
    with pytest.raises(ConfigError, match=r"observed_artifact was given without "
                                          r"observed_used_bytes"):
        plan.fit(eager("koni-8b", 1, 5), observed_artifact=eager("koni-8b", 1, 1))
    with pytest.raises(ConfigError, match=r"below the observed artifact's own KV bytes"):
        plan.fit(eager("koni-8b", 1, 5), observed_used_bytes=1000,
                 observed_artifact=eager("koni-8b", 1, 1))


def test_fit_rejects_bad_figures() -> None:
    with pytest.raises(ConfigError, match=r"device_bytes=0 must be positive"):
        plan.fit(eager("koni-8b", 1, 1), device_bytes=0)
    with pytest.raises(ConfigError, match=r"runtime_overhead_bytes=-1 must be >= 0"):
        plan.fit(eager("koni-8b", 1, 1), runtime_overhead_bytes=-1)


def test_fit_result_is_a_frozen_json_value() -> None:
    result = plan.fit(eager("koni-8b", 1, 5), observed_used_bytes=ORIGIN_USED,
                      observed_artifact=eager("koni-8b", 1, 1))
    with pytest.raises(AttributeError):
        result.fits = True  # type: ignore[misc]
    decoded = msgspec.json.decode(msgspec.json.encode(result), type=plan.FitResult)
    assert decoded == result


# -- the `fit` command --------------------------------------------------------------------------

def test_fit_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert fit_cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("qwen3-0.6b", "qwen3-4b", "koni-8b", "gemma3-1b"):
        assert name in out
    for shape in ("B1/k1", "B1/k3", "B1/k5", "B4/k5"):
        assert shape in out
    assert "DOES NOT FIT" in out
    assert "fits" in out
    assert "rejected: hybrid single-block" in out
    assert "observed (conditional)" in out
    assert "21,189,623,808" in out  # KONI TP1 k5 from the origin observation
    assert "16,357,785,600" in out


def test_fit_table_rows(capsys: pytest.CaptureFixture[str]) -> None:
    fit_cli.main(["--table"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    cells = {(row[0], row[1], row[2]): row for row in rows if len(row) > 3 and
             row[0] in fit_cli.MODELS}
    assert len(cells) == 4 * 2 * 4
    assert cells[("koni-8b", "1", "B1/k1")][7] == "fits"
    assert cells[("koni-8b", "1", "B1/k5")][5] == "21,189,623,808"
    assert cells[("koni-8b", "1", "B4/k5")][7:9] == ["DOES", "NOT"]
    assert cells[("koni-8b", "2", "B4/k5")][7] == "fits"
    assert cells[("gemma3-1b", "2", "B1/k1")][7] == "rejected:"


def test_fit_table_cells_use_origin_observation_only_for_koni_tp1() -> None:
    args = fit_cli._parser().parse_args([])
    for cell in fit_cli.table_cells(args):
        if cell.result is None:
            assert cell.model == "gemma3-1b" and (cell.batch_size, cell.num_blocks) == (1, 1)
            continue
        observed = cell.model == "koni-8b" and cell.tensor_parallel == 1
        assert (cell.result.method == "observed") is observed


def test_fit_single_artifact_origin(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "fit.json"
    status = fit_cli.main(["--model", "koni-8b", "--batch-size", "1", "--max-seq-len", "9216",
                           "--block-size", "9216", "--num-blocks", "5",
                           "--observed-used-bytes", str(ORIGIN_USED), "--observed-num-blocks", "1",
                           "--observed-batch-size", "1", "--json", str(path)])
    assert status == 1  # does not fit
    out = capsys.readouterr().out
    assert "64 BF16 global KV tensors of [5,8,9216,128] = 6,039,797,760 bytes" in out
    assert "21,189,623,808" in out
    assert "DOES NOT FIT" in out
    report = msgspec.json.decode(path.read_bytes(), type=fit_cli.FitReport)
    (cell,) = report.cells
    assert cell.result is not None
    assert cell.result.projected_bytes == 21_189_623_808
    assert report.params["observed_used_bytes"] == ORIGIN_USED


def test_fit_single_artifact_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    status = fit_cli.main(["--model", "koni-8b", "--batch-size", "4", "--num-blocks", "5",
                           "--tensor-parallel", "2"])
    assert status == 0
    out = capsys.readouterr().out
    assert "[5,4,9216,128]" in out
    assert re.search(r"^  verdict +fits$", out, re.M)


def test_fit_single_artifact_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert fit_cli.main(["--model", "gemma3-1b", "--num-blocks", "1"]) == 2
    assert "single-block mode" in capsys.readouterr().err


def test_fit_table_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "table.json"
    assert fit_cli.main(["--table", "--json", str(path)]) == 0
    capsys.readouterr()
    report = msgspec.json.decode(path.read_bytes(), type=fit_cli.FitReport)
    assert len(report.cells) == 32
    assert report.command == "fit"


# -- tiny checkpoints: independent counts of their tensors ------------------------------------------

def _safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors header (8-byte length, then JSON): no library."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        shapes.update({name: tuple(info["shape"]) for name, info in header.items()
                       if name != "__metadata__"})
    return shapes


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[str, tuple[ModelSpec, dict[str, tuple[int, ...]]]]:
    """Each family's tiny bfloat16 checkpoint: its spec (config.json) and its tensors' shapes."""
    from support.hf_models import FAMILIES, save_checkpoint

    out = {}
    for family in FAMILIES:
        directory = save_checkpoint(family, tmp_path_factory.mktemp(family), dtype="bfloat16")
        out[family] = (ModelSpec.from_pretrained(directory), _safetensors_shapes(directory))
    return out


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projection(name: str) -> str | None:
    """`model.layers.3.mlp.up_proj.weight` -> `up_proj`; None for any other tensor."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "weight" and parts[-2] in PROJECTIONS else None


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_weight_bytes_equal_the_checkpoint_tensors(
        family: str, tiny_checkpoints: dict[str, tuple[ModelSpec, dict[str, tuple[int, ...]]]]
) -> None:
    spec, shapes = tiny_checkpoints[family]
    assert sum(math.prod(shape) for shape in shapes.values()) * 2 == plan.weight_bytes(spec)


# -- LoRA adapters (issue 41 item 5) -------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize(("count", "rank", "modules"), [
    (1, 8, PROJECTIONS), (3, 16, ("q_proj", "v_proj")), (5, 4, ("o_proj", "down_proj", "k_proj"))])
def test_lora_bytes_equal_an_independent_sum_over_modules_and_layers(
        family: str, count: int, rank: int, modules: tuple[str, ...],
        tiny_checkpoints: dict[str, tuple[ModelSpec, dict[str, tuple[int, ...]]]]) -> None:
    spec, shapes = tiny_checkpoints[family]
    # Each targeted projection weight [out, in] of each layer holds A [adapters, in, rank] and
    # B [adapters, rank, out], adapters = count + the reserved base adapter 0, in bf16.
    expected = 0
    for name, shape in shapes.items():
        if _projection(name) in modules:
            out_features, in_features = shape
            expected += (count + 1) * (in_features * rank + rank * out_features) * 2
    lora = plan.LoraPlan(count=count, max_rank=rank, target_modules=modules)
    assert plan.lora_bytes(spec, lora) == expected
    assert expected > 0


def test_lora_counts_in_the_projection_and_the_headroom() -> None:
    art = eager("koni-8b", 4, 5, tp=2)
    bare = plan.fit(art)
    lora = plan.LoraPlan(count=8, max_rank=16)
    with_lora = plan.fit(art, lora=lora)
    # KONI, all seven projections: 32 layers x 16 x (in + out summed over them) x 2 bytes, x 9.
    per_adapter = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)) * 2
    assert with_lora.lora_bytes == 9 * per_adapter == 754_974_720
    assert with_lora.other_bytes - bare.other_bytes == with_lora.lora_bytes
    assert with_lora.kv_bytes == bare.kv_bytes
    assert with_lora.lora == lora
    assert "LoRA 754,974,720" in with_lora.basis
    # observed method: the adapters are added to the observed non-KV bytes as well
    observed = plan.fit(eager("koni-8b", 1, 1), observed_used_bytes=ORIGIN_USED, lora=lora)
    assert observed.projected_bytes == ORIGIN_USED + 754_974_720
    assert not observed.fits
    # no adapter, no LoRA graph: nothing counted
    assert plan.lora_bytes(art.model, plan.LoraPlan(count=0, max_rank=64)) == 0


def test_max_lora_adapters_is_the_last_count_that_fits() -> None:
    for art in (eager("koni-8b", 4, 5, tp=2), eager("qwen3-4b", 2, 3), eager("gemma3-1b", 4, 5)):
        for rank, modules in ((16, PROJECTIONS), (64, ("q_proj", "v_proj"))):
            n = plan.max_lora_adapters(art, rank, modules)
            assert n > 0
            assert plan.fit(art, lora=plan.LoraPlan(n, rank, modules)).fits
            assert not plan.fit(art, lora=plan.LoraPlan(n + 1, rank, modules)).fits
    # an artifact that does not fit alone has room for none
    assert plan.max_lora_adapters(eager("koni-8b", 1, 5), 8, observed_used_bytes=ORIGIN_USED,
                                  observed_artifact=eager("koni-8b", 1, 1)) == -1


def test_lora_plan_rejects_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="max_lora_rank=0 must be a positive integer"):
        plan.LoraPlan(count=1, max_rank=0)
    with pytest.raises(ConfigError, match="lora count=-1"):
        plan.LoraPlan(count=-1, max_rank=8)
    with pytest.raises(ConfigError, match="'lm_head' is not one of q_proj"):
        plan.LoraPlan(count=1, max_rank=8, target_modules=("lm_head",))
    with pytest.raises(ConfigError, match="names a module twice"):
        plan.LoraPlan(count=1, max_rank=8, target_modules=("q_proj", "q_proj"))
    with pytest.raises(ConfigError, match="target_modules is empty"):
        plan.LoraPlan(count=1, max_rank=8, target_modules=())


def test_fit_cli_lora(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "lora.json"
    status = fit_cli.main(["--model", "koni-8b", "--batch-size", "4", "--num-blocks", "5",
                           "--tensor-parallel", "2", "--lora-count", "8", "--max-lora-rank", "16",
                           "--json", str(path)])
    assert status == 0
    out = capsys.readouterr().out
    assert re.search(r"^  LoRA +754,974,720 bytes, inside other \(8 adapters", out, re.M)
    expected = plan.max_lora_adapters(eager("koni-8b", 4, 5, tp=2), 16)
    assert f"rank 16 adapters that fit beside 4 lanes: {expected}" in out
    (cell,) = msgspec.json.decode(path.read_bytes(), type=fit_cli.FitReport).cells
    assert cell.max_lora_adapters == {16: expected}
    assert cell.result is not None and cell.result.lora_bytes == 754_974_720

    # the rank alone asks how many fit; target modules narrow the count
    assert fit_cli.main(["--model", "qwen3-4b", "--batch-size", "2", "--max-lora-rank", "64",
                         "--lora-target-modules", "q_proj,v_proj"]) == 0
    expected = plan.max_lora_adapters(eager("qwen3-4b", 2, 3), 64, ("q_proj", "v_proj"))
    assert f"rank 64 adapters that fit beside 2 lanes: {expected}" in capsys.readouterr().out


def test_fit_cli_lora_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert fit_cli.main(["--model", "qwen3-4b", "--lora-count", "3"]) == 2
    assert "--lora-count=3 needs one --max-lora-rank" in capsys.readouterr().err
    assert fit_cli.main(["--model", "qwen3-4b", "--lora-count", "3", "--max-lora-rank",
                         "8,16"]) == 2
    assert "--lora-count=3 needs one --max-lora-rank" in capsys.readouterr().err
    assert fit_cli.main(["--model", "qwen3-4b", "--lora-count", "3", "--max-lora-rank", "8",
                         "--lora-target-modules", "q_proj,embed"]) == 2
    assert "'embed' is not one of" in capsys.readouterr().err
    # the table: each cell says how many adapters of each rank fit beside it
    assert fit_cli.main(["--table", "--model", "qwen3-4b", "--max-lora-rank", "16,64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("qwen3-4b")]
    expected = plan.max_lora_adapters(eager("qwen3-4b", 4, 5, tp=2), 64)
    assert any(row.split()[:3] == ["qwen3-4b", "2", "B4/k5"] and row.endswith(f", r64 {expected}")
               for row in rows)
    for ranks in ("0", "8,-1", "x", ",".join(["8"] * 17)):
        with pytest.raises(SystemExit):
            fit_cli.main(["--max-lora-rank", ranks])
        assert "--max-lora-rank" in capsys.readouterr().err


# -- quantized artifacts (issue 42 item 2) --------------------------------------------------------------

QUANTIZATIONS = [
    Quantization(weights="int4"),
    Quantization(weights="int8", activations="int8"),
    Quantization(weights="fp8", activations="fp8", kv_caches="fp8"),
    Quantization(weights="int8", activations="int8", dynamic=True),
    Quantization(weights="fp16", activations="fp8", kv_caches="fp8"),
]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("quant", QUANTIZATIONS, ids=lambda q: f"{q.weights}-{q.activations}-"
                         f"{q.kv_caches}{'-dyn' if q.dynamic else ''}")
def test_weight_bytes_by_format_equal_an_independent_count_of_the_checkpoint(
        family: str, quant: Quantization,
        tiny_checkpoints: dict[str, tuple[ModelSpec, dict[str, tuple[int, ...]]]]) -> None:
    spec, shapes = tiny_checkpoints[family]
    bits = {"int4": 4, "int8": 8, "fp8": 8, "fp16": 16}[quant.weights]
    expected = 0
    layers = set()
    for name, shape in shapes.items():
        if ".layers." in name:
            layers.add(int(name.split(".layers.")[1].split(".")[0]))
        elements = math.prod(shape)
        if _projection(name) is None or bits == 16:
            expected += elements * 2  # bf16, as the checkpoint stores it
            continue
        out_features = shape[0]
        expected += math.ceil(elements * bits / 8) + 4 * out_features  # float32 [out, 1] scale
        if quant.activations != "fp16" and not quant.dynamic:
            expected += 4  # the static input scale [1]
    if quant.kv_caches == "fp8":
        expected += len(layers) * 2 * 4  # k_scale, v_scale per attention layer
    assert plan.weight_bytes(spec, 1, quant) == expected


def test_presets_shrink_by_format() -> None:
    for name in ("koni-8b", "qwen3-4b", "qwen3-0.6b", "gemma3-1b"):
        spec = ModelSpec.preset(name)
        sizes = [plan.weight_bytes(spec, 1, Quantization(weights=w, activations="fp8"))
                 for w in ("fp16", "fp8", "int4")]
        assert sizes[0] > sizes[1] > sizes[2]
        assert plan.weight_bytes(spec, 1, Quantization(weights="fp16", activations="fp8")) == \
            plan.weight_bytes(spec)


def _art(name: str, batch_size: int, num_blocks: int, quant: Quantization | None = None,
         kv_dtype: str = "bfloat16", ctx: int = CTX, block_size: int | None = None,
         tp: int = 1) -> ArtifactConfig:
    return ArtifactConfig(model=ModelSpec.preset(name), batch_size=batch_size, max_seq_len=ctx,
                          block_size=block_size or ctx, num_blocks=num_blocks, tensor_parallel=tp,
                          quantization=quant, kv_dtype=kv_dtype)


FP8 = "float8_e4m3fn"
# koni-8b B4/ctx9216/k5's identity as computed before ArtifactConfig had `quantization` (69903b6).
KONI_B4_K5_IDENTITY = "fb2948c5579393a5"


@pytest.mark.parametrize("name", ["koni-8b", "qwen3-4b", "qwen3-0.6b", "gemma3-1b"])
@pytest.mark.parametrize(("batch_size", "num_blocks", "tp"), [(1, 2, 1), (4, 5, 1), (4, 5, 2)])
def test_fp8_kv_halves_the_kv_bytes_exactly(name: str, batch_size: int, num_blocks: int,
                                            tp: int) -> None:
    bf16 = _art(name, batch_size, num_blocks, tp=tp)
    fp8 = _art(name, batch_size, num_blocks, Quantization(weights="int8", kv_caches="fp8"),
               kv_dtype=FP8, tp=tp)
    assert plan.kv_cache_bytes(fp8) * 2 == plan.kv_cache_bytes(bf16)
    assert {g.dtype for g in plan.kv_groups(fp8)} == {FP8}
    assert plan.fit(fp8).kv_bytes * 2 == plan.fit(bf16).kv_bytes
    # an fp16-weights artifact with fp8 KV (no weight quantization) halves the KV as well
    assert plan.kv_cache_bytes(_art(name, batch_size, num_blocks, kv_dtype=FP8, tp=tp)) * 2 == \
        plan.kv_cache_bytes(bf16)


def test_quantization_and_kv_dtype_must_agree() -> None:
    with pytest.raises(ConfigError, match="kv_dtype='bfloat16' contradicts quantization.kv_caches"):
        _art("koni-8b", 1, 2, Quantization(weights="int4", kv_caches="fp8"))
    with pytest.raises(ConfigError, match="kv_dtype='float8_e4m3fn' contradicts"):
        _art("koni-8b", 1, 2, Quantization(weights="int4"), kv_dtype=FP8)
    with pytest.raises(ConfigError, match="quantization.weights='int3'"):
        Quantization(weights="int3")


def test_quantized_identity_and_label() -> None:
    plain = _art("koni-8b", 4, 5)
    int4 = _art("koni-8b", 4, 5, Quantization(weights="int4"))
    fp8 = _art("koni-8b", 4, 5, Quantization(weights="fp8", activations="fp8", kv_caches="fp8"),
               kv_dtype=FP8)
    assert len({plain.identity, int4.identity, fp8.identity}) == 3
    assert int4.label == "koni-8b B4/ctx9216/k5/wint4"
    assert fp8.label == "koni-8b B4/ctx9216/k5/wfp8/afp8/kvfp8"
    # an unquantized artifact keeps the identity it had before the field existed
    assert plain.identity == KONI_B4_K5_IDENTITY


def test_observation_transfers_across_weight_formats() -> None:
    # KONI observed at B1/k1 in bf16; the same model in int4 swaps the weights' bytes too.
    int4 = Quantization(weights="int4")
    result = plan.fit(_art("koni-8b", 4, 5, int4), observed_used_bytes=ORIGIN_USED,
                      observed_artifact=eager("koni-8b", 1, 1))
    saved = plan.weight_bytes(ModelSpec.preset("koni-8b")) - \
        plan.weight_bytes(ModelSpec.preset("koni-8b"), 1, int4)
    assert result.other_bytes == ORIGIN_USED - 1_207_959_552 - saved
    assert result.projected_bytes == ORIGIN_USED - 1_207_959_552 - saved + 6_039_797_760
    assert "its weights" in result.basis and "int4 weights" in result.basis
    assert result.method == "observed" and result.conditional


# -- agreement with optimum-rbln 0.12's own sizing -------------------------------------------------------

def _optimum_num_blocks(tensor_bytes_at_one_block: list[int], fixed_tensor_bytes: list[int],
                        non_kv_bytes: int, num_full_blocks: int) -> int:
    """optimum-rbln 0.12's `_search_num_kvcache_blocks` restated: available DRAM of an RBLN-CA is
    16 GiB - 288 MiB; a resizable KV tensor's bytes are (bytes at one block) x blocks, a sliding
    tensor's are fixed, each aligned up to 2 MiB; the answer is num_full_blocks when it fits, else
    the largest count that fits (1 when none)."""
    available = 16 * 1024**3 - 288 * 1024**2

    def kv(blocks: int) -> int:
        sizes = [size * blocks for size in tensor_bytes_at_one_block] + fixed_tensor_bytes
        return sum((size + 2**21 - 1) // 2**21 * 2**21 for size in sizes)

    fitting = [n for n in range(1, num_full_blocks + 1) if non_kv_bytes + kv(n) <= available]
    return max(fitting, default=1)


def test_the_atom_capacity_is_optimum_rblns_available_dram() -> None:
    assert plan.ATOM_DEVICE_BYTES == 16 * 1024**3 - 288 * 1024**2 == ATOM


def test_kv_alloc_bytes_align_each_tensor_to_2_mib() -> None:
    # KONI's [k, 8, 9216, 128] bf16 tensors are whole MiBs of 9: already aligned.
    koni = eager("koni-8b", 1, 5)
    assert plan.kv_alloc_bytes(koni) == plan.kv_cache_bytes(koni) == plan.fit(koni).kv_alloc_bytes
    # Gemma3's sliding slot of one lane, [1, 1, 512, 256] bf16 = 256 KiB, takes 2 MiB.
    gemma = eager("gemma3-1b", 1, 2)
    global_tensor = 2 * 9216 * 256 * 2  # two blocks, aligned up
    assert plan.kv_alloc_bytes(gemma) == 8 * (-(-global_tensor // 2**21) * 2**21) + 44 * 2**21
    assert plan.kv_alloc_bytes(gemma) > plan.kv_cache_bytes(gemma)


@pytest.mark.parametrize(("name", "batch_size", "ctx", "block_size"), [
    ("koni-8b", 4, 9216, 9216), ("qwen3-4b", 8, 8192, 1024), ("qwen3-0.6b", 16, 8192, 8192),
    ("gemma3-1b", 4, 4096, 1024), ("gemma3-1b", 12, 8192, 8192), ("qwen3-0.6b", 3, 2048, 1024)])
@pytest.mark.parametrize("quant", [None, Quantization(weights="int4"),
                                   Quantization(weights="fp8", activations="fp8",
                                                kv_caches="fp8")])
def test_max_num_blocks_agrees_with_optimum_rbln(name: str, batch_size: int, ctx: int,
                                                 block_size: int, quant: Quantization | None
                                                 ) -> None:
    kv_dtype = FP8 if quant is not None and quant.kv_caches == "fp8" else "bfloat16"
    art = _art(name, batch_size, batch_size * (ctx // block_size) + 1, quant, kv_dtype, ctx,
               block_size)
    spec = art.model
    item = 1 if kv_dtype == FP8 else 2
    window = min(spec.sliding_window, ctx)
    per_block = [spec.num_kv_heads * block_size * spec.head_dim * item] * \
        (2 * len(spec.global_layers))
    fixed = [batch_size * spec.num_kv_heads * window * spec.head_dim * item] * \
        (2 * len(spec.sliding_layers))
    full = batch_size * (ctx // block_size)
    for non_kv in (plan.weight_bytes(spec, 1, quant) + plan.DEFAULT_RUNTIME_OVERHEAD_BYTES,
                   ORIGIN_USED - 1_207_959_552, 12 * 1024**3, 16 * 1024**3):
        assert plan.max_num_blocks(art, non_kv) == \
            _optimum_num_blocks(per_block, fixed, non_kv, full)


# -- the quantization table (`bench fit --quant-table`) -----------------------------------------------

def test_quant_table_finds_the_largest_fitting_batch(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "quant.json"
    assert fit_cli.main(["--quant-table", "--no-project", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "7.7847 tok/s, max first SSE 253.93 s" in out
    report = msgspec.json.decode(path.read_bytes(), type=fit_cli.FitReport)
    cells = {(c.model, c.weights, c.kv): c for c in report.quant_cells}
    assert len(cells) == 4 * 4 * 2
    for (model, weights, kv), cell in cells.items():
        assert cell.result is not None and cell.result.fits
        quant, kv_dtype = fit_cli._quantization(dict(fit_cli.QUANT_FORMATS)[weights], kv)
        if cell.num_blocks == 1:  # single block: B1/k2 did not fit
            assert cell.batch_size == 1
            assert not _koni_like(model, 1, 2, quant, kv_dtype).fits
            continue
        assert cell.num_blocks == cell.batch_size + 1
        assert _koni_like(model, cell.batch_size, cell.num_blocks, quant, kv_dtype).fits
        if cell.batch_size < fit_cli.QUANT_MAX_BATCH:
            assert not _koni_like(model, cell.batch_size + 1, cell.batch_size + 2, quant,
                                  kv_dtype).fits
    # the origin: KONI in bf16 fits B1/k1 only; fewer bytes per weight or per KV entry buy lanes
    assert (cells[("koni-8b", "fp16", "bf16")].batch_size,
            cells[("koni-8b", "fp16", "bf16")].num_blocks) == (1, 1)
    for model in fit_cli.MODELS:
        b = {key[1:]: cell.batch_size for key, cell in cells.items() if key[0] == model}
        assert b[("w4a16", "bf16")] >= b[("w8a16", "bf16")] >= b[("fp16", "bf16")]
        assert b[("w4a16", "fp8")] >= b[("w4a16", "bf16")]
        assert b[("w8a16", "bf16")] == b[("fp8", "bf16")]  # both 8 bits per weight
    assert cells[("koni-8b", "w4a16", "fp8")].batch_size >= 16


def _koni_like(model: str, batch_size: int, num_blocks: int, quant: Quantization | None,
               kv_dtype: str) -> plan.FitResult:
    """plan.fit as the table takes it: KONI from the origin observation, the others estimated."""
    art = _art(model, batch_size, num_blocks, quant, kv_dtype)
    if model == "koni-8b":
        return plan.fit(art, observed_used_bytes=ORIGIN_USED,
                        observed_artifact=eager("koni-8b", 1, 1))
    return plan.fit(art)


def test_quant_table_projects_on_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    assert fit_cli.main(["--quant-table", "--model", "qwen3-0.6b", "--input-len", "512",
                         "--output-len", "8", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    args = fit_cli._parser().parse_args(["--quant-table", "--model", "qwen3-0.6b", "--input-len",
                                         "512", "--output-len", "8", "--concurrency", "4"])
    cells = fit_cli.quant_cells(args)
    assert len(cells) == 8
    for cell in cells:
        assert cell.serve_batch_size == min(cell.batch_size, 4)
        assert cell.output_tok_s is not None and cell.output_tok_s > 0
        assert cell.max_first_token_s is not None and cell.timeouts == 0
        assert cell.serve_artifact is not None and cell.serve_artifact in out
    by = {(c.weights, c.kv): c for c in cells}
    # the same B4 run at fewer weight bytes finishes sooner
    assert (by[("w4a16", "bf16")].output_tok_s or 0) > (by[("fp16", "bf16")].output_tok_s or 1e9)


def test_fit_cli_quantized_artifact_with_adapters_of_several_ranks(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    status = fit_cli.main(["--model", "koni-8b", "--batch-size", "4", "--weights", "int4",
                           "--kv-caches", "fp8", "--max-lora-rank", "8,16,64", "--json",
                           str(path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "64 FP8 global KV tensors of [5,8,9216,128] = 3,019,898,880 bytes" in out
    art = _art("koni-8b", 4, 5, Quantization(weights="int4", kv_caches="fp8"), FP8)
    observed = dict(observed_used_bytes=ORIGIN_USED, observed_artifact=eager("koni-8b", 1, 1))
    assert f"{plan.fit(art, **observed).projected_bytes:,}" in out  # type: ignore[arg-type]
    (cell,) = msgspec.json.decode(path.read_bytes(), type=fit_cli.FitReport).cells
    assert cell.max_lora_adapters is not None and list(cell.max_lora_adapters) == [8, 16, 64]
    for rank, count in cell.max_lora_adapters.items():
        assert count == plan.max_lora_adapters(art, rank, **observed)  # type: ignore[arg-type]
        assert f"rank {rank} adapters that fit beside 4 lanes: {count}" in out
    # halving the rank (at least) doubles what fits: the stacks are linear in the rank
    assert cell.max_lora_adapters[8] >= 2 * cell.max_lora_adapters[16]
    with pytest.raises(SystemExit):  # argparse: not one of the formats
        fit_cli.main(["--model", "koni-8b", "--weights", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("case", ["attn-r4", "mlp-r8-rslora", "all-linear-r2"])
def test_lora_bytes_equal_a_peft_adapters_tensors_padded_to_the_rank(
        family: str, case: str, tmp_path: Path,
        tiny_checkpoints: dict[str, tuple[ModelSpec, dict[str, tuple[int, ...]]]]) -> None:
    """A real PEFT adapter (peft, on the tiny model): its lora_A [r, in] and lora_B [out, r]
    tensors, zero-padded to max_lora_rank as optimum-rbln stacks them, in the weight dtype."""
    from support.lora_models import CASES, save_adapter

    spec, _ = tiny_checkpoints[family]
    adapter = CASES[case]
    save_adapter(family, adapter, tmp_path / case)
    shapes = _safetensors_shapes(tmp_path / case)
    lora_tensors = {name: shape for name, shape in shapes.items() if ".lora_" in name}
    targets = tuple(module for module in PROJECTIONS
                    if any(f".{module}.lora_" in name for name in lora_tensors))
    elements = sum(math.prod(shape) for shape in lora_tensors.values())
    for max_rank in (adapter.r, 4 * adapter.r):
        padded = elements * max_rank // adapter.r
        assert plan.lora_bytes_per_adapter(spec, max_rank, targets) == padded * 2
        assert plan.lora_bytes(spec, plan.LoraPlan(3, max_rank, targets)) == 4 * padded * 2


def test_the_planner_and_the_simulator_count_an_adapter_alike() -> None:
    from atombatch.runtime.sim.costs import lora_cost

    for name in ("koni-8b", "qwen3-4b", "gemma3-1b"):
        art = eager(name, 1, 2)
        for rank, modules in ((16, PROJECTIONS), (8, ("q_proj", "v_proj"))):
            assert lora_cost(art, rank, modules).bytes == \
                plan.lora_bytes_per_adapter(art.model, rank, modules)
