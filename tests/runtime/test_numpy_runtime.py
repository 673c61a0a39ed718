"""NumpyRuntime: transformers parity, device-faithful tables and slots, padding, batch invariance.

The tiny checkpoints are built by transformers (tests/support/hf_models.py) once per session. Everything the
runtime is compared with is computed independently: transformers' logits and greedy tokens, and the
runtime's own no-cache `reference_logits`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support import hf_models as hf
from support.numerics import assert_f32_close, assert_same_argmax, f32_atol, reduction_length

from atombatch.artifact.config import FULL, SLIDING, ArtifactConfig, ModelSpec, RopeScaling
from atombatch.errors import StateError
from atombatch.kernel._blocks_py import DecodeInputs, LaneTable, PrefillInputs
from atombatch.runtime.numpy_runtime import (
    NumpyRuntime,
    _embed_scale,
    default_artifact,
    load_safetensors_dir,
)

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

FAMILIES = hf.FAMILIES
WINDOW = hf.SLIDING_WINDOW
PROMPT_LEN = 37          # longer than the sliding window, not a multiple of any chunk size
DECODE_STEPS = 6
CONTEXT = 128


def close(spec: ModelSpec, actual: object, desired: object, err_msg: str = "") -> None:
    """Equal up to float32 reordering through every layer and the head (tests/support/numerics)."""
    assert_f32_close(actual, desired, reduction=reduction_length(spec, CONTEXT),
                     depth=spec.num_layers + 1, err_msg=err_msg)


def prompt(seed: int = 1, length: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, size=length).tolist()


# -- session fixtures: checkpoints and transformers' answers, built once ---------------------------
@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """`checkpoint(family, dtype)`: a saved tiny transformers checkpoint directory."""
    root = tmp_path_factory.mktemp("hf")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str = "float32") -> Path:
        if (family, dtype) not in made:
            made[family, dtype] = hf.save_checkpoint(family, root / f"{family}-{dtype}", dtype)
        return made[family, dtype]

    return get


@pytest.fixture(scope="session")
def hf_reference(checkpoint: Callable[[str, str], Path]) -> Callable[..., dict[str, object]]:
    """`hf_reference(family, dtype)`: transformers' float32 logits and greedy tokens of prompt()."""
    cache: dict[tuple[str, str], dict[str, object]] = {}

    def get(family: str, dtype: str = "float32") -> dict[str, object]:
        if (family, dtype) not in cache:
            model = hf.load_float32(checkpoint(family, dtype))
            cache[family, dtype] = {
                "logits": hf.hf_logits(model, prompt()),
                "greedy": hf.hf_greedy(model, prompt(), DECODE_STEPS),
            }
        return cache[family, dtype]

    return get


@pytest.fixture(scope="session")
def runtime_weights(checkpoint: Callable[[str, str], Path]
                    ) -> Callable[[str], tuple[ModelSpec, dict[str, np.ndarray]]]:
    """`runtime_weights(family)`: the float32 checkpoint's spec and weights, loaded once."""
    cache: dict[str, tuple[ModelSpec, dict[str, np.ndarray]]] = {}

    def get(family: str) -> tuple[ModelSpec, dict[str, np.ndarray]]:
        if family not in cache:
            path = checkpoint(family, "float32")
            cache[family] = (ModelSpec.from_pretrained(path), load_safetensors_dir(path))
        return cache[family]

    return get


# -- ModelSpec.from_pretrained ---------------------------------------------------------------------
def test_spec_from_checkpoints(checkpoint: Callable[[str, str], Path]) -> None:
    llama = ModelSpec.from_pretrained(checkpoint("llama", "float32"))
    assert (llama.family, llama.num_layers, llama.num_heads, llama.num_kv_heads,
            llama.head_dim) == ("llama", 2, 4, 2, 16)
    assert llama.rope_theta == 500000.0 and llama.rms_norm_eps == 1e-5
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert not llama.tie_word_embeddings and not llama.is_hybrid and llama.dtype == "float32"

    qwen = ModelSpec.from_pretrained(checkpoint("qwen3", "bfloat16"))
    assert (qwen.family, qwen.num_layers, qwen.head_dim, qwen.hidden_size) == ("qwen3", 3, 32, 64)
    assert qwen.tie_word_embeddings and qwen.rope_theta == 1e6 and qwen.rope_scaling is None
    assert qwen.layer_kinds == (FULL,) * 3 and qwen.sliding_window == 0
    assert qwen.dtype == "bfloat16"

    gemma = ModelSpec.from_pretrained(checkpoint("gemma3", "float32"))
    assert gemma.family == "gemma3" and gemma.tie_word_embeddings
    assert gemma.layer_kinds == (SLIDING, SLIDING, FULL) * 2
    assert gemma.global_layers == (2, 5) and gemma.sliding_window == WINDOW
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4)
    assert gemma.query_pre_attn_scalar == 24 and gemma.final_logit_softcapping == 30.0


def _write_config(directory: Path, raw: dict[str, object]) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


GEMMA3_COMMON = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
                 "torch_dtype": "bfloat16"}


def test_spec_from_handwritten_gemma3_configs(tmp_path: Path) -> None:
    older = {"model_type": "gemma3_text", **GEMMA3_COMMON, "rope_theta": 1e6,
             "rope_local_base_freq": 1e4, "sliding_window_pattern": 3,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    newer = {"model_type": "gemma3_text", **GEMMA3_COMMON,
             "layer_types": [SLIDING, SLIDING, FULL] * 2,
             "rope_parameters": {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 SLIDING: {"rope_type": "default", "rope_theta": 1e4}}}
    a = ModelSpec.from_pretrained(_write_config(tmp_path / "older", older), name="g")
    b = ModelSpec.from_pretrained(_write_config(tmp_path / "newer", newer), name="g")
    assert a == b
    assert a.layer_kinds == (SLIDING, SLIDING, FULL) * 2
    assert a.rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    assert (a.rope_theta, a.rope_local_theta, a.tie_word_embeddings) == (1e6, 1e4, True)

    # A multimodal wrapper whose text_config leaves Gemma3TextConfig defaults out (gemma-3-4b-it).
    wrapped = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}
    mm = ModelSpec.from_pretrained(_write_config(tmp_path / "mm", wrapped))
    assert (mm.vocab_size, mm.num_heads, mm.num_kv_heads, mm.head_dim) == (262208, 8, 4, 256)
    assert (mm.rope_theta, mm.rope_local_theta, mm.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert mm.global_layers == tuple(range(5, 34, 6)) and mm.tie_word_embeddings


def test_spec_from_handwritten_llama_configs(tmp_path: Path) -> None:
    common = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    older = {**common, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    newer = {**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                           **scaling}}
    a = ModelSpec.from_pretrained(_write_config(tmp_path / "older", older), name="l")
    b = ModelSpec.from_pretrained(_write_config(tmp_path / "newer", newer), name="l")
    assert a == b and a.rope_scaling == RopeScaling() and a.rope_theta == 500000.0
    assert a.head_dim == 16 and not a.tie_word_embeddings and not a.is_hybrid


# -- reference_logits against transformers ---------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_logits_match_transformers(family: str, dtype: str,
                                             checkpoint: Callable[[str, str], Path],
                                             hf_reference: Callable[..., dict[str, object]]
                                             ) -> None:
    runtime = NumpyRuntime.from_pretrained(checkpoint(family, dtype))
    ours = runtime.reference_logits(prompt())
    theirs = hf_reference(family, dtype)["logits"]
    assert ours.dtype == np.float32 and ours.shape == (PROMPT_LEN, 512)
    close(runtime.spec, ours, theirs)
    assert_same_argmax(ours, theirs, reduction=reduction_length(runtime.spec, CONTEXT),
                       depth=runtime.spec.num_layers + 1)


def test_bf16_weights_are_widened_exactly(checkpoint: Callable[[str, str], Path]) -> None:
    import torch
    from safetensors.torch import load_file

    path = checkpoint("gemma3", "bfloat16")
    ours = load_safetensors_dir(path)
    theirs = load_file(str(path / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert tensor.dtype == torch.bfloat16
        np.testing.assert_array_equal(ours[name], tensor.float().numpy(), err_msg=name)


def test_sharded_and_multimodal_named_checkpoints_load(tmp_path: Path,
                                                       checkpoint: Callable[[str, str], Path]
                                                       ) -> None:
    model = hf.load_float32(checkpoint("gemma3", "float32"))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    whole = NumpyRuntime.from_pretrained(checkpoint("gemma3", "float32"))
    np.testing.assert_array_equal(NumpyRuntime.from_pretrained(sharded).reference_logits(prompt()),
                                  whole.reference_logits(prompt()))

    weights = load_safetensors_dir(sharded)
    prefixed = {name.replace("model.", "language_model.model.", 1): value
                for name, value in weights.items()}
    mm = NumpyRuntime(whole.artifact, prefixed)
    np.testing.assert_array_equal(mm.reference_logits(prompt()), whole.reference_logits(prompt()))


def test_gemma3_embedding_scale_is_rounded_to_the_weight_dtype() -> None:
    # transformers casts sqrt(hidden) to the weight dtype: 55.4256 becomes 55.5 in bf16.
    assert _embed_scale(3072, "bfloat16") == np.float32(55.5)
    assert _embed_scale(3072, "float32") == np.float32(np.sqrt(3072.0))
    assert _embed_scale(64, "bfloat16") == np.float32(8.0)


# -- chunked prefill + decode through hand-built tables --------------------------------------------
def layout(spec: ModelSpec, kind: str, chunk: int, batch: int = 2) -> ArtifactConfig:
    block_size = CONTEXT if kind == "eager" else 16
    bps = CONTEXT // block_size
    return ArtifactConfig(model=spec, batch_size=batch, max_seq_len=CONTEXT,
                          block_size=block_size, num_blocks=batch * bps + 1,
                          prefill_chunk_size=chunk, kv_dtype="float32")


class Driver:
    """Plays the scheduler for one request on `lane`: chunked prefill, then greedy decode steps.

    Blocks are handed out in a shuffled order (never contiguous, never ascending) and only when the
    next chunk's padded extent or the next decode position needs them; every other lane is idle and
    padded onto `spare`.
    """

    def __init__(self, runtime: NumpyRuntime, lane: int, seed: int = 0) -> None:
        art = runtime.artifact
        self.runtime = runtime
        self.lanes = LaneTable(art.batch_size, art.blocks_per_seq, art.block_size)
        for _ in range(lane + 1):
            self.lanes.assign()
        for other in range(lane):
            self.lanes.release(other)
        self.lane = lane
        order = np.random.default_rng(seed).permutation(art.num_blocks).tolist()
        self.spare = order.pop()
        self.free = order
        self.prefill_inputs = PrefillInputs(art.prefill_chunk_size, art.blocks_per_seq)
        self.decode_inputs = DecodeInputs(art.batch_size, art.blocks_per_seq)

    def _hold(self, positions: int) -> None:
        need = min(self.lanes.blocks_for(positions), self.runtime.artifact.blocks_per_seq)
        while self.lanes.num_held(self.lane) < need:
            self.lanes.push_block(self.lane, self.free.pop())

    def prefill(self, tokens: list[int]) -> list[tuple[int, np.ndarray]]:
        """(position, logits) of every chunk's last real token."""
        out = []
        chunk = self.runtime.artifact.prefill_chunk_size
        for start in range(0, len(tokens), chunk):
            self._hold(start + chunk)
            blocks = self.lanes.blocks(self.lane)
            real = self.prefill_inputs.build(tokens, start, blocks, len(blocks),
                                             sliding_slot=self.lane)
            out.append((start + real - 1, self.runtime.prefill(self.prefill_inputs)))
        self.lanes.start_decode(self.lane, len(tokens), int(out[-1][1].argmax()))
        return out

    def row(self) -> int:
        """The decode row this lane was packed into by the last build."""
        return int(np.flatnonzero(self.decode_inputs.row_lanes == self.lane)[0])

    def decode(self) -> np.ndarray:
        """One decode step; returns this lane's logits and advances it greedily."""
        self._hold(self.lanes.seq_len(self.lane) + 1)
        self.decode_inputs.build(self.lanes, self.spare)
        logits = self.runtime.decode(self.decode_inputs)[self.row()]
        self.lanes.advance(self.lane, int(logits.argmax()))
        return logits


@pytest.mark.parametrize(("kind", "chunk"), [("eager", 1), ("eager", 16), ("partitioned", 8),
                                             ("partitioned", 64)])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_reproduce_reference_and_hf_greedy(
        family: str, kind: str, chunk: int,
        runtime_weights: Callable[[str], tuple[ModelSpec, dict[str, np.ndarray]]],
        hf_reference: Callable[..., dict[str, object]]) -> None:
    spec, weights = runtime_weights(family)
    runtime = NumpyRuntime(layout(spec, kind, chunk), weights)
    driver = Driver(runtime, lane=1, seed=chunk)
    tokens = prompt()
    chunk_logits = driver.prefill(tokens)
    generated = [int(chunk_logits[-1][1].argmax())]
    step_logits = []
    for _ in range(DECODE_STEPS - 1):
        step_logits.append(driver.decode())
        generated.append(int(step_logits[-1].argmax()))
    assert runtime.prefill_calls == -(-PROMPT_LEN // chunk)
    assert runtime.decode_calls == DECODE_STEPS - 1

    assert generated == hf_reference(family)["greedy"]
    reference = runtime.reference_logits(tokens + generated[:-1])
    for position, logits in chunk_logits:
        close(spec, logits, reference[position], err_msg=f"prefill position {position}")
    for step, logits in enumerate(step_logits):
        close(spec, logits, reference[PROMPT_LEN + step], err_msg=f"decode position {PROMPT_LEN + step}")
    if chunk == 1:  # one chunk per token: every prompt position went through the tables
        assert [p for p, _ in chunk_logits] == list(range(PROMPT_LEN))


def test_sliding_slot_is_a_shift_buffer_of_real_tokens(
        runtime_weights: Callable[[str], tuple[ModelSpec, dict[str, np.ndarray]]]) -> None:
    spec, weights = runtime_weights("gemma3")

    def slot_after(length: int, chunk: int = 8, decode_steps: int = 0) -> np.ndarray:
        runtime = NumpyRuntime(layout(spec, "partitioned", chunk), weights)
        driver = Driver(runtime, lane=1)
        driver.prefill(prompt(length=length))
        for _ in range(decode_steps):
            driver.decode()
        assert np.all(runtime.sliding_kv[:, :, 0] == 0)  # the idle lane's slot: only its pads
        return runtime.sliding_kv[:, :, 1].copy()        # [sliding layers, 2, kvh, W, d]

    # 11 real tokens in two chunks of 8: indices 0..10 hold them, the padding never enters.
    short = slot_after(11)
    assert np.all(np.any(short[:, :, :, :11] != 0, axis=(0, 1, 2, 4)))
    assert np.all(short[:, :, :, 11:] == 0)

    # A full slot keeps the newest WINDOW tokens, oldest first: after 37 tokens index i holds
    # position 21 + i; after 22 tokens index j holds position 6 + j; position 21 is in both.
    full = slot_after(PROMPT_LEN)
    close(spec, full[:, :, :, 0], slot_after(22)[:, :, :, 15])
    # The content does not depend on the chunking.
    close(spec, full, slot_after(PROMPT_LEN, chunk=64))

    # Decode shifts the same way: one prompt token less plus one decode step of the same token
    # (the first generated one is not the prompt's last token, so compare through a prefill that
    # ends with the generated token instead).
    runtime = NumpyRuntime(layout(spec, "partitioned", 8), weights)
    driver = Driver(runtime, lane=1)
    first = int(driver.prefill(prompt())[-1][1].argmax())
    driver.decode()
    decoded = runtime.sliding_kv[:, :, 1].copy()
    runtime2 = NumpyRuntime(layout(spec, "partitioned", 8), weights)
    Driver(runtime2, lane=1).prefill([*prompt(), first])
    close(spec, decoded, runtime2.sliding_kv[:, :, 1])


# -- padding safety --------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "kind"), [("llama", "eager"), ("gemma3", "partitioned")])
def test_idle_lane_rows_really_write(family: str, kind: str,
                                     runtime_weights: Callable[[str], tuple[ModelSpec,
                                                                             dict[str, np.ndarray]]]
                                     ) -> None:
    spec, weights = runtime_weights(family)

    def run(corrupt: bool) -> list[np.ndarray]:
        runtime = NumpyRuntime(layout(spec, kind, 16, batch=4), weights)
        driver = Driver(runtime, lane=2, seed=3)
        driver.prefill(prompt())
        out = []
        for _ in range(3):
            driver._hold(driver.lanes.seq_len(2) + 1)
            driver.decode_inputs.build(driver.lanes, driver.spare)
            assert driver.decode_inputs.row_lanes.tolist() == [2, 0, 1, 3]  # live lane first
            if corrupt:  # idle lane 0's padding row names the live lane's first block
                driver.decode_inputs.block_tables[1, :] = driver.lanes.blocks(2)[0]
            logits = runtime.decode(driver.decode_inputs)
            out.append(logits[0].copy())
            driver.lanes.advance(2, int(logits[0].argmax()))
        return out

    good, bad = run(corrupt=False), run(corrupt=True)
    runtime = NumpyRuntime(layout(spec, kind, 16, batch=4), weights)
    first = int(Driver(runtime, lane=2, seed=3).prefill(prompt())[-1][1].argmax())
    reference = runtime.reference_logits([*prompt(), first, *(int(g.argmax()) for g in good[:-1])])
    for step, logits in enumerate(good):  # correct padding rows: the live lane is unaffected
        close(spec, logits, reference[PROMPT_LEN + step])
    # Same inputs but for the idle lane's row: its padding write lands on position 0 of the live
    # block, and the live request's next logits change (and stay wrong).
    # (Without the corruption both runs are the same computation, bit for bit.)
    assert np.max(np.abs(bad[0] - good[0])) > 10 * f32_atol(
        good[0], reduction=reduction_length(spec, CONTEXT), depth=spec.num_layers + 1)
    for step in range(3):
        assert not np.array_equal(bad[step], good[step]), step


def test_idle_lane_sliding_slot_really_writes(
        runtime_weights: Callable[[str], tuple[ModelSpec, dict[str, np.ndarray]]]) -> None:
    spec, weights = runtime_weights("gemma3")
    results = []
    for corrupt in (False, True):
        runtime = NumpyRuntime(layout(spec, "eager", 16, batch=2), weights)
        driver = Driver(runtime, lane=1, seed=5)
        driver.prefill(prompt(length=6))  # a slot that is not full yet: nothing shifts out
        driver.decode_inputs.build(driver.lanes, driver.spare)
        assert driver.decode_inputs.row_lanes.tolist() == [1, 0]  # live lane 1 packed first
        if corrupt:  # the padding row (idle lane 0) names the live lane's sliding slot
            driver.decode_inputs.local_block_tables[1, 0] = 1
        runtime.decode(driver.decode_inputs)
        driver.lanes.advance(1, 7)
        driver.decode_inputs.build(driver.lanes, driver.spare)
        results.append(runtime.decode(driver.decode_inputs)[driver.row()])
    # More than rounding can explain: the corruption, not the kernel, changed the logits.
    assert np.max(np.abs(results[0] - results[1])) > 10 * f32_atol(
        results[0], reduction=reduction_length(spec, CONTEXT), depth=spec.num_layers + 1)


def test_negative_or_out_of_range_table_entries_raise() -> None:
    spec = ModelSpec(name="t", family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=32, block_size=16, num_blocks=5,
                         prefill_chunk_size=8)
    runtime = NumpyRuntime.random(art)
    inputs = DecodeInputs(2, 2)
    inputs.block_tables[1, 1] = -1
    with pytest.raises(StateError, match="outside 0..4"):
        runtime.decode(inputs)
    prefill = PrefillInputs(8, 2)
    prefill.build([1, 2, 3], 0, [4, 5], 2)
    with pytest.raises(StateError, match="outside 0..4"):
        runtime.prefill(prefill)
    assert runtime.decode_calls == runtime.prefill_calls == 0


def test_decode_runs_only_the_compiled_decode_batches() -> None:
    spec = ModelSpec(name="t", family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    art = ArtifactConfig(model=spec, batch_size=4, max_seq_len=32, block_size=16, num_blocks=9,
                         prefill_chunk_size=8, decoder_batch_sizes=(1, 4))
    runtime = NumpyRuntime.random(art)
    lanes = LaneTable(4, 2, 16)
    lane = lanes.assign()
    lanes.push_block(lane, 3)
    lanes.start_decode(lane, 4, 7)
    inputs = DecodeInputs(4, 2, (1, 2, 4))  # buckets the artifact was not compiled with
    inputs.build(lanes, 8)
    assert runtime.decode(inputs).shape == (1, 64) and runtime.decode_rows == 1
    lanes.push_block(lanes.assign(), 5)
    lanes.start_decode(1, 2, 9)
    inputs.build(lanes, 8)
    with pytest.raises(StateError, match=r"the compiled decode batches are \(1, 4\)"):
        runtime.decode(inputs)
    assert runtime.decode_calls == 1


# -- batch invariance ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_logits_are_bit_identical_at_b1_and_b4(
        family: str,
        runtime_weights: Callable[[str], tuple[ModelSpec, dict[str, np.ndarray]]]) -> None:
    spec, weights = runtime_weights(family)
    b1 = NumpyRuntime(layout(spec, "partitioned", 16, batch=1), weights)
    alone = Driver(b1, lane=0, seed=1)
    alone.prefill(prompt())

    b4 = NumpyRuntime(layout(spec, "partitioned", 16, batch=4), weights)
    lanes = LaneTable(4, b4.artifact.blocks_per_seq, b4.artifact.block_size)
    free = np.random.default_rng(9).permutation(b4.artifact.num_blocks).tolist()
    spare = free.pop()
    prefill = PrefillInputs(16, b4.artifact.blocks_per_seq)
    prompts = [prompt(seed=11, length=20), prompt(seed=12, length=45), prompt(),
               prompt(seed=13, length=5)]
    for lane, tokens in enumerate(prompts):
        assert lanes.assign() == lane
        for _ in range(lanes.blocks_for(len(tokens) + 16)):
            lanes.push_block(lane, free.pop())
        last = None
        for start in range(0, len(tokens), 16):
            prefill.build(tokens, start, lanes.blocks(lane), lanes.num_held(lane),
                          sliding_slot=lane)
            last = b4.prefill(prefill)
        assert last is not None
        lanes.start_decode(lane, len(tokens), int(last.argmax()))
    decode = DecodeInputs(4, b4.artifact.blocks_per_seq)
    for _ in range(4):
        decode.build(lanes, spare)
        together = b4.decode(decode)
        solo = alone.decode()
        assert decode.row_lanes.tolist() == [0, 1, 2, 3]
        assert np.array_equal(together[2], solo)  # bit for bit, other lanes busy
        for lane in range(4):
            lanes.advance(lane, int(together[lane].argmax()))


# -- block moves -----------------------------------------------------------------------------------
def test_copy_read_write_block_round_trip() -> None:
    spec = ModelSpec(name="t", family="gemma3", vocab_size=128, hidden_size=32,
                     intermediate_size=64, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=16,
                     sliding_window=8, layer_types=(SLIDING, SLIDING, FULL) * 2,
                     query_pre_attn_scalar=16.0)
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=64, block_size=64, num_blocks=3,
                         prefill_chunk_size=16, kv_dtype="float32")
    runtime = NumpyRuntime.random(art, seed=4)
    assert runtime.kv.shape == (2, 2, 3, 1, 64, 16)
    assert runtime.sliding_kv.shape == (4, 2, 2, 1, 8, 16)
    tokens = np.random.default_rng(0).integers(0, 128, size=20).tolist()
    inputs = PrefillInputs(16, 1)
    for start in (0, 16):
        inputs.build(tokens, start, [1], 1)
        runtime.prefill(inputs)
    data = runtime.read_block(1)
    assert data.shape == runtime.block_shape == (2, 2, 1, 64, 16)
    assert np.any(data != 0)
    mutated = runtime.read_block(1)
    mutated[...] = 7.0  # a copy, not a view into the device tensors
    np.testing.assert_array_equal(runtime.read_block(1), data)
    runtime.copy_block(1, 2)
    np.testing.assert_array_equal(runtime.read_block(2), data)
    runtime.write_block(0, data)
    np.testing.assert_array_equal(runtime.read_block(0), data)
    with pytest.raises(StateError):
        runtime.write_block(0, data[:1])

    # Decoding from the restored block is bit-identical to decoding from the original.
    decode = DecodeInputs(2, 1)
    decode.input_ids[0, 0], decode.cache_position[0, 0] = tokens[-1], 20
    decode.block_tables[:, 0] = (1, 2)  # lane 1 is padding on block 2 (a copy we may spoil)
    slots = runtime.sliding_kv.copy()
    from_original = runtime.decode(decode)[0]
    runtime.sliding_kv[...] = slots
    runtime.write_block(1, np.zeros_like(data))
    decode.block_tables[:, 0] = (0, 2)
    from_restored = runtime.decode(decode)[0]
    assert np.array_equal(from_original, from_restored)


def test_random_runtime_has_spread_logits_and_default_artifact() -> None:
    spec = ModelSpec(name="t", family="qwen3", vocab_size=256, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, tie_word_embeddings=True)
    runtime = NumpyRuntime.random(default_artifact(spec), seed=0)
    logits = runtime.reference_logits(list(range(1, 30)))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert logits.std() > 1.0 and np.min(top2[:, 1] - top2[:, 0]) > 1e-3
    assert len(set(logits.argmax(-1).tolist())) > 5
    again = NumpyRuntime.random(default_artifact(spec), seed=0).reference_logits(list(range(1, 30)))
    np.testing.assert_array_equal(logits, again)


def test_qwen3_sliding_layers_keep_the_global_rope_base(tmp_path):
    """Regression: only Gemma3 gives sliding layers a RoPE base of their own; a Qwen3 checkpoint
    with sliding-window layers uses rope_theta on them too."""
    config = hf.hf_config("qwen3")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 1
    config.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    model = hf.build_model("qwen3", config=config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec.from_pretrained(tmp_path)
    assert spec.is_hybrid and spec.sliding_rope_theta == spec.rope_theta == 1e6
    rt = NumpyRuntime.from_pretrained(tmp_path)
    ids = list(range(3, 40))
    close(spec, rt.reference_logits(ids), hf.hf_logits(model, ids))
