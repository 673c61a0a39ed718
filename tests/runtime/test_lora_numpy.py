"""LoRA adapters on the NumPy runtime (issue 41): PEFT directories made by peft itself, loaded
without torch, and the runtime's output against transformers + peft.

For Llama, Qwen3 and Gemma3 (its sliding and global layers), lanes running adapter 1, adapter 2,
... and the base model decode in the same call, through the device tables, and every lane's greedy
tokens equal peft's model with that adapter (the base lane: the plain model), token for token, with
logits within the float32 bound. A row's output does not depend on its neighbours' adapters; a
base-only call is the base math bit for bit; adapters load and unload; a bad adapter directory is
a ConfigError naming the rule it breaks.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import hf_models as hf
from support import lora_models as lm
from support.numerics import GreedyTokens, assert_f32_close, greedy_reference, reduction_length

from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.artifact.lora import BASE_LORA_ID, LoraAdapter, load_peft
from atombatch.errors import ConfigError, RequestError, StateError
from atombatch.kernel._blocks_py import DecodeInputs, LaneTable, PrefillInputs
from atombatch.pd.producer import Producer
from atombatch.runtime.base import Capabilities
from atombatch.runtime.numpy_runtime import NumpyRuntime, load_safetensors_dir

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

CONTEXT = 128
NEW_TOKENS = 6
PROMPT_LENS = (21, 37, 9)    # across Gemma3's 16-token window and the 16-token blocks
ADAPTERS = tuple(lm.CASES)   # lora_int_id i + 1 is ADAPTERS[i]


@dataclass
class FamilyCase:
    family: str
    spec: ModelSpec
    checkpoint: Path
    weights: dict[str, np.ndarray]
    adapter_dirs: dict[str, Path]
    models: dict[str | None, Any]    # adapter name (None: the base) -> the transformers model
    prompts: list[list[int]]
    greedy: dict[tuple[str | None, tuple[int, ...]], GreedyTokens]

    def runtime(self, batch: int, *, partitioned: bool = False, chunk: int = 16,
                adapters: tuple[str, ...] = ADAPTERS) -> NumpyRuntime:
        block_size = 16 if partitioned else CONTEXT
        bps = CONTEXT // block_size
        art = ArtifactConfig(model=self.spec, batch_size=batch, max_seq_len=CONTEXT,
                             block_size=block_size, num_blocks=batch * bps + 1,
                             prefill_chunk_size=chunk, kv_dtype="float32")
        runtime = NumpyRuntime(art, self.weights)
        for name in adapters:
            runtime.add_lora(*self.load(name))
        return runtime

    def load(self, name: str, **kw: Any) -> tuple[LoraAdapter, Any]:
        return load_peft(self.adapter_dirs[name], name=name, lora_int_id=lora_id(name),
                         spec=self.spec, **kw)

    def reference(self, adapter: str | None, prompt: list[int]) -> GreedyTokens:
        """transformers + peft's greedy tokens (full recompute per token), computed once."""
        key = (adapter, tuple(prompt))
        if key not in self.greedy:
            self.greedy[key] = greedy_reference(self.models[adapter], prompt, NEW_TOKENS,
                                                lambda m, s: hf.hf_logits(m, s)[-1])
        return self.greedy[key]


def lora_id(name: str | None) -> int:
    return BASE_LORA_ID if name is None else ADAPTERS.index(name) + 1


@pytest.fixture(scope="module", params=hf.FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    checkpoint, models, dirs = lm.save_family(family, root)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in PROMPT_LENS]
    return FamilyCase(family, ModelSpec.from_pretrained(checkpoint), checkpoint,
                      load_safetensors_dir(checkpoint), dirs, models, prompts, {})


def close(spec: ModelSpec, actual: object, desired: object, err_msg: str = "") -> None:
    """Equal up to float32 reordering. An adapted projection is two chained reductions (x A^T,
    then B^T) where the base has one, so an adapted layer's bound is at most twice a base
    layer's: depth 2 * layers + 1 (the head)."""
    assert_f32_close(actual, desired, reduction=reduction_length(spec, CONTEXT),
                     depth=2 * spec.num_layers + 1, err_msg=err_msg)


class Lanes:
    """Plays the scheduler on hand-built tables: each admitted prompt takes a lane and runs its
    chunked prefill under its adapter; `step` decodes every decoding lane in one call, each row
    with its lane's `lora_int_ids` entry (padding rows 0). Blocks are handed out shuffled.
    `with_ids=False` calls the runtime without `lora_int_ids`, as the engine calls a runtime
    without LoRA."""

    def __init__(self, runtime: NumpyRuntime, seed: int = 0, with_ids: bool = True) -> None:
        art = runtime.artifact
        self.runtime = runtime
        self.with_ids = with_ids
        self.lanes = LaneTable(art.batch_size, art.blocks_per_seq, art.block_size)
        self.prefill_inputs = PrefillInputs(art.prefill_chunk_size, art.blocks_per_seq)
        self.decode_inputs = DecodeInputs(art.batch_size, art.blocks_per_seq)
        order = np.random.default_rng(seed).permutation(art.num_blocks).tolist()
        self.spare = order.pop()
        self.free = order
        self.lane_lora = np.zeros(art.batch_size, dtype=np.int32)
        self.tokens: dict[int, list[int]] = {}
        self.logits: dict[int, list[np.ndarray]] = {}

    def _hold(self, lane: int, positions: int) -> None:
        need = min(self.lanes.blocks_for(positions), self.runtime.artifact.blocks_per_seq)
        while self.lanes.num_held(lane) < need:
            self.lanes.push_block(lane, self.free.pop())

    def admit(self, prompt: list[int], lora: int) -> int:
        lane = self.lanes.assign()
        self.lane_lora[lane] = lora
        chunk = self.runtime.artifact.prefill_chunk_size
        logits = None
        for start in range(0, len(prompt), chunk):
            self._hold(lane, start + chunk)
            blocks = self.lanes.blocks(lane)
            self.prefill_inputs.build(prompt, start, blocks, len(blocks), sliding_slot=lane)
            logits = self.runtime.prefill(self.prefill_inputs, **self._ids(np.array(
                [lora], dtype=np.int32)))
        assert logits is not None
        first = int(logits.argmax())
        self.lanes.start_decode(lane, len(prompt), first)
        self.tokens[lane] = [first]
        self.logits[lane] = []
        return lane

    def _ids(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if not self.with_ids:
            assert not ids.any()
            return {}
        return {"lora_int_ids": ids}

    def step(self) -> np.ndarray:
        for lane in self.tokens:
            self._hold(lane, self.lanes.seq_len(lane) + 1)
        decoding = self.decode_inputs.build(self.lanes, self.spare)
        rows = self.decode_inputs.num_rows
        ids = np.zeros(rows, dtype=np.int32)
        ids[:decoding] = self.lane_lora[self.decode_inputs.row_lanes[:decoding]]
        out = self.runtime.decode(self.decode_inputs, **self._ids(ids))
        for row in range(decoding):
            lane = int(self.decode_inputs.row_lanes[row])
            self.logits[lane].append(out[row])
            self.tokens[lane].append(int(out[row].argmax()))
            self.lanes.advance(lane, self.tokens[lane][-1])
        return ids


# (prompt index, adapter) per lane: each adapter, the base, and one prompt under two adapters
MIX: tuple[tuple[int, str | None], ...] = (
    (0, ADAPTERS[0]), (1, ADAPTERS[1]), (2, None), (0, ADAPTERS[2]), (1, ADAPTERS[3]))


@pytest.mark.parametrize("partitioned", [False, True], ids=["eager", "partitioned"])
def test_mixed_adapters_in_one_decode_step_equal_peft(case: FamilyCase, partitioned: bool) -> None:
    # six lanes, five decoding: row 5 is padding (id 0) in every step
    runtime = case.runtime(6, partitioned=partitioned, chunk=8 if partitioned else 16)
    lanes = Lanes(runtime, seed=3)
    admitted = [(lanes.admit(case.prompts[p], lora_id(name)), p, name) for p, name in MIX]
    for _ in range(NEW_TOKENS - 1):
        ids = lanes.step()
        assert sorted(ids.tolist()) == [0, 0, 1, 2, 3, 4]   # four adapters + base + padding
    for lane, p, name in admitted:
        prompt, want = case.prompts[p], case.reference(name, case.prompts[p])
        assert lanes.tokens[lane] == want, (case.family, name, p)
        seq = prompt + lanes.tokens[lane][:-1]
        reference = hf.hf_logits(case.models[name], seq)
        for step, logits in enumerate(lanes.logits[lane]):
            close(case.spec, logits, reference[len(prompt) + step],
                  err_msg=f"{case.family} {name} prompt {p} decode step {step}")
    # the test can fail: every adapter moves its prompt's greedy tokens away from the base's
    for p, name in MIX:
        if name is not None:
            assert case.reference(name, case.prompts[p]) != case.reference(None, case.prompts[p])


def test_a_row_does_not_depend_on_its_neighbours_adapters(case: FamilyCase) -> None:
    mixed = Lanes(case.runtime(4))
    alone = Lanes(case.runtime(4))
    for p, name in MIX[:3]:       # lane 1 runs adapter 2 between adapter 1's lane and a base lane
        mixed.admit(case.prompts[p], lora_id(name))
    alone.lanes.assign()          # lane 0 stays prefilling (no decode row): lane 1 is alone
    lane = alone.admit(case.prompts[1], lora_id(ADAPTERS[1]))
    assert lane == 1
    for _ in range(3):
        mixed.step()
        alone.step()
    np.testing.assert_array_equal(np.stack(mixed.logits[1]), np.stack(alone.logits[1]))
    assert mixed.tokens[1] == case.reference(ADAPTERS[1], case.prompts[1])[:4]


def test_base_only_calls_run_the_base_math_bit_for_bit(case: FamilyCase) -> None:
    plain = Lanes(case.runtime(4, adapters=()), with_ids=False)
    zeros = Lanes(case.runtime(4))
    prompt = case.prompts[0]
    lane = plain.admit(prompt, BASE_LORA_ID)
    zeros.admit(prompt, BASE_LORA_ID)
    for _ in range(3):
        # no lora_int_ids at all against all-zero ids on a runtime holding four adapters
        plain.step()
        zeros.step()
    np.testing.assert_array_equal(np.stack(plain.logits[lane]), np.stack(zeros.logits[lane]))
    assert plain.tokens[lane] == case.reference(None, prompt)[:4]


def test_adapters_load_and_unload(case: FamilyCase) -> None:
    runtime = case.runtime(2, adapters=())
    caps = Capabilities(runtime)
    assert caps.lora and caps.lora_loadable
    prompt = case.prompts[0]
    base_before = runtime.reference_logits(prompt)
    name = ADAPTERS[0]
    adapter, weights = case.load(name)
    runtime.add_lora(adapter, weights)
    assert runtime.lora_adapters == {name: adapter}
    lanes = Lanes(runtime)
    lane = lanes.admit(prompt, adapter.lora_int_id)
    for _ in range(NEW_TOKENS - 1):
        lanes.step()
    assert lanes.tokens[lane] == case.reference(name, prompt)
    with pytest.raises(ConfigError, match="already loaded"):
        runtime.add_lora(adapter, weights)
    other, other_weights = case.load(ADAPTERS[1])
    with pytest.raises(ConfigError, match="already adapter"):
        runtime.add_lora(LoraAdapter(**{**_fields(other), "lora_int_id": adapter.lora_int_id}),
                         other_weights)
    runtime.remove_lora(name)
    assert runtime.lora_adapters == {}
    with pytest.raises(StateError, match=f"lora_int_ids holds {adapter.lora_int_id}"):
        runtime.reference_logits(prompt, adapter.lora_int_id)
    with pytest.raises(ConfigError, match="no LoRA adapter named"):
        runtime.remove_lora(name)
    np.testing.assert_array_equal(runtime.reference_logits(prompt), base_before)
    # loaded again under another id, it computes the same
    again = LoraAdapter(**{**_fields(adapter), "lora_int_id": 7})
    runtime.add_lora(again, weights)
    assert int(runtime.reference_logits(prompt, 7)[-1].argmax()) == \
        case.reference(name, prompt)[0]


def _fields(adapter: LoraAdapter) -> dict[str, Any]:
    return {f: getattr(adapter, f) for f in adapter.__struct_fields__}


def test_bad_lora_int_ids_are_refused(case: FamilyCase) -> None:
    runtime = case.runtime(2, adapters=ADAPTERS[:1])
    lanes = Lanes(runtime)
    lanes.admit(case.prompts[2], 1)
    lanes.decode_inputs.build(lanes.lanes, lanes.spare)
    with pytest.raises(StateError, match="lora_int_ids holds 2"):
        runtime.decode(lanes.decode_inputs, lora_int_ids=np.array([1, 2], dtype=np.int32))
    with pytest.raises(StateError, match="one id per row"):
        runtime.decode(lanes.decode_inputs, lora_int_ids=np.array([1], dtype=np.int32))
    with pytest.raises(StateError, match="one id per row"):
        runtime.prefill(lanes.prefill_inputs, lora_int_ids=np.array([1.0], dtype=np.float32))


def test_pd_producer_prefills_under_the_adapter(case: FamilyCase) -> None:
    runtime = case.runtime(1, adapters=ADAPTERS[:2])
    producer = Producer(runtime)
    prompt = case.prompts[1]
    for name in (ADAPTERS[0], ADAPTERS[1], None):
        payload = producer.produce(f"r-{name}", prompt, lora_int_id=lora_id(name))
        assert payload.header.first_token == case.reference(name, prompt)[0]
    with pytest.raises(RequestError, match="lora_int_id=3 is not loaded"):
        producer.produce("r", prompt, lora_int_id=3)


# -- the adapter files -----------------------------------------------------------------------------
def test_adapter_description_and_identity(case: FamilyCase) -> None:
    adapter, weights = case.load(ADAPTERS[1])
    config = json.loads((case.adapter_dirs[ADAPTERS[1]] / "adapter_config.json").read_text())
    assert (adapter.r, adapter.lora_alpha, adapter.use_rslora) == \
        (config["r"], config["lora_alpha"], True)
    assert adapter.scaling == pytest.approx(config["lora_alpha"] / config["r"] ** 0.5)
    assert set(adapter.target_modules) == {"gate_proj", "up_proj", "down_proj", "q_proj"}
    assert len(weights.pairs) == 4 * case.spec.num_layers
    assert weights.nbytes == sum(a.nbytes + b.nbytes for a, b in weights.pairs.values())
    # the same files give the same identity; another adapter or another scaling does not
    assert case.load(ADAPTERS[1])[0].identity == adapter.identity
    assert case.load(ADAPTERS[1], scaling_factor=0.5)[0].identity != adapter.identity
    assert case.load(ADAPTERS[1], scaling_factor=0.5)[0].scaling == \
        pytest.approx(adapter.scaling / 2)
    assert case.load(ADAPTERS[0])[0].identity != adapter.identity
    layer1, layer1_weights = case.load("layer1-r16")
    assert {layer for layer, _ in layer1_weights.pairs} == {1}
    assert layer1.scaling == 4.0


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


BAD = {
    "rank above max_lora_rank": (lambda d: None, dict(max_lora_rank=2),
                                 r"r=4 is outside 1\.\.max_lora_rank=2"),
    "rank not the weights'": (lambda d: _edit_config(d, r=5), {},
                              r"has shape \[.*\]; r=5 on .* needs \["),
    "unknown module": (lambda d: _edit_config(d, target_modules=["q_proj", "lm_head"]), {},
                       "target module 'lm_head' is not a linear layer"),
    "weights outside target_modules": (lambda d: _edit_config(d, target_modules=["q_proj"]), {},
                                       r"changes (k|v|o)_proj, which is not in target_modules"),
    "bias": (lambda d: _edit_config(d, bias="lora_only"), {}, "only bias='none'"),
    "dora": (lambda d: _edit_config(d, use_dora=True), {}, "DoRA"),
    "rank pattern": (lambda d: _edit_config(d, rank_pattern={"q_proj": 2}), {},
                     "one r and one lora_alpha"),
    "no weights file": (lambda d: (d / "adapter_model.safetensors").unlink(), {},
                        "has no adapter_model.safetensors"),
    "no config": (lambda d: (d / "adapter_config.json").unlink(), {},
                  "has no adapter_config.json"),
    "config too large": (lambda d: (d / "adapter_config.json").write_bytes(b" " * (1 << 21)), {},
                         "more than the 1048576 an adapter config may have"),
    "weights file too large": (lambda d: _grow(d / "adapter_model.safetensors", 1 << 25), {},
                               "adapter_model.safetensors is .* bytes, more than the"),
    "truncated weights": (lambda d: _truncate(d / "adapter_model.safetensors"), {},
                          "data_offsets .* inside the file"),
    "not safetensors": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\xff" * 64), {},
                        "not a safetensors file"),
    "alpha": (lambda d: _edit_config(d, lora_alpha=0), {}, "lora_alpha=0.0 must be a positive number"),
    # review: finite in float64, infinite once folded into B in float32 (every row NaN)
    "alpha past float32": (lambda d: _edit_config(d, lora_alpha=1e39), {},
                           "past float32's range"),
    "garbled offsets": (lambda d: _edit_header(d / "adapter_model.safetensors", "data_offsets",
                                               ["0", "x"]), {}, "data_offsets .* inside the file"),
    "integer tensors": (lambda d: _edit_header(d / "adapter_model.safetensors", "dtype", "I32"),
                        {}, "has dtype I32, not one of"),
    "a tensor of another kind": (lambda d: _rename_tensor(d / "adapter_model.safetensors",
                                                          "lora_A", "lora_embedding_A"), {},
                                 "is not a LoRA A/B matrix"),
    # review: a header nested past the JSON parser's recursion limit, a layer number past int()'s
    # digit limit, a shape that is a number: each was a RecursionError / ValueError / TypeError
    "deeply nested header": (lambda d: _write_raw_header(d / "adapter_model.safetensors",
                                                          b"[" * 200_000), {},
                             "header is not JSON"),
    "a layer of 5000 digits": (lambda d: _rename_tensor(d / "adapter_model.safetensors",
                                                        "layers.0.", "layers." + "9" * 5000 + "."),
                               {}, "is not a LoRA A/B matrix"),
    "a shape that is a number": (lambda d: _edit_header(d / "adapter_model.safetensors", "shape",
                                                        4), {}, r"has shape \[\]; r=4"),
    "config is a directory": (lambda d: _replace_with_dir(d / "adapter_config.json"), {},
                              "adapter_config.json is not a regular file"),
    "weights are /dev/zero": (lambda d: _link(d / "adapter_model.safetensors", "/dev/zero"), {},
                              "adapter_model.safetensors is not a regular file"),
}


def _write_raw_header(path: Path, raw: bytes) -> None:
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def _write(path: Path, header: dict[str, Any], body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def _edit_header(path: Path, field: str, value: Any) -> None:
    """Set `field` of the first tensor of a safetensors file's header."""
    header, body = _header(path)
    first = next(k for k in header if k != "__metadata__")
    header[first][field] = value
    _write(path, header, body)


def _rename_tensor(path: Path, old: str, new: str) -> None:
    header, body = _header(path)
    first = next(k for k in header if k != "__metadata__")
    header[first.replace(old, new)] = header.pop(first)
    _write(path, header, body)


def _grow(path: Path, extra: int) -> None:
    with path.open("ab") as f:
        f.truncate(path.stat().st_size + extra)    # a sparse tail: nothing is read before the bound


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSpec, Path]:
    """The files' rules do not depend on the family: one Llama adapter (attention, r=4)."""
    directory = tmp_path_factory.mktemp("lora-files") / "adapter"
    lm.save_adapter("llama", lm.CASES[ADAPTERS[0]], directory)
    return ModelSpec.from_hf_config(hf.hf_config("llama").to_dict(), name="llama"), directory


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_adapter_directory_is_a_config_error_naming_the_rule(
        llama_adapter: tuple[ModelSpec, Path], bad: str, tmp_path: Path) -> None:
    spec, source = llama_adapter
    edit, kwargs, message = BAD[bad]
    directory = tmp_path / "adapter"
    shutil.copytree(source, directory)
    load_peft(directory, name="good", lora_int_id=1, spec=spec)   # loads before the edit
    edit(directory)
    with pytest.raises(ConfigError, match=message):
        load_peft(directory, name="bad", lora_int_id=1, spec=spec, **kwargs)


@pytest.mark.parametrize("which", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_fifo_or_device_in_an_adapter_directory_never_hangs_the_loader(
        llama_adapter: tuple[ModelSpec, Path], which: str, tmp_path: Path) -> None:
    """A FIFO with no writer, or /dev/zero, where a file should be: the load is refused at once
    (before the review, opening the FIFO blocked the core's loader thread forever and /dev/zero
    as the config was read until memory ran out). The load runs on a daemon thread so that a
    regression fails here instead of hanging the run."""
    spec, source = llama_adapter
    for kind in ("fifo", "zero"):
        directory = tmp_path / kind
        shutil.copytree(source, directory)
        (directory / which).unlink()
        if kind == "fifo":
            os.mkfifo(directory / which)
        else:
            (directory / which).symlink_to("/dev/zero")
        outcome: list[BaseException | None] = []

        def load(directory: Path = directory, outcome: list[BaseException | None] = outcome
                 ) -> None:
            try:
                load_peft(directory, name="hostile", lora_int_id=1, spec=spec)
                outcome.append(None)
            except BaseException as exc:  # handed to the test thread
                outcome.append(exc)

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        thread.join(60)     # a liveness bound, not a measurement: the refusal is immediate
        assert outcome, f"load_peft of a {kind} as {which} did not return"
        assert isinstance(outcome[0], ConfigError), outcome[0]
        assert f"{which} is not a regular file" in str(outcome[0])


def test_the_identity_hashes_the_bytes_that_were_loaded(llama_adapter: tuple[ModelSpec, Path],
                                                        tmp_path: Path) -> None:
    """The weights are read once: an adapter whose file is replaced after it was read keeps the
    identity of what it loaded (before the review the digest re-read the path, so a swap between
    the read and the digest gave old weights a new identity, or a FIFO hung the digest)."""
    spec, source = llama_adapter
    directory = tmp_path / "adapter"
    shutil.copytree(source, directory)
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    import atombatch.artifact.lora as lora_module
    original = lora_module.os.open
    lora_module.os.open = counting_open  # type: ignore[assignment]
    try:
        adapter, _ = load_peft(directory, name="once", lora_int_id=1, spec=spec)
    finally:
        lora_module.os.open = original  # type: ignore[assignment]
    weights = str(directory / "adapter_model.safetensors")
    assert opened.count(weights) == 1
    assert adapter.identity == load_peft(source, name="src", lora_int_id=1, spec=spec)[0].identity


def test_bf16_adapters_are_widened_exactly(llama_adapter: tuple[ModelSpec, Path],
                                         tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    spec, source = llama_adapter
    directory = tmp_path / "bf16"
    shutil.copytree(source, directory)
    tensors = {k: v.to(torch.bfloat16) for k, v in
               load_file(directory / "adapter_model.safetensors").items()}
    save_file(tensors, directory / "adapter_model.safetensors")
    adapter, weights = load_peft(directory, name="bf16", lora_int_id=1, spec=spec)
    for key, value in tensors.items():
        layer, module = int(key.split(".")[4]), key.split(".")[6]
        a, b = weights.pairs[layer, module]
        np.testing.assert_array_equal(a if ".lora_A." in key else b, value.float().numpy())
    assert adapter.identity != load_peft(source, name="f32", lora_int_id=1, spec=spec)[0].identity


@pytest.mark.parametrize("prefix", ["base_model.model.model.language_model.layers.",
                                    "base_model.model.language_model.model.layers."])
def test_multimodal_wrapper_names_load_as_the_decoder_s(llama_adapter: tuple[ModelSpec, Path],
                                                       prefix: str, tmp_path: Path) -> None:
    spec, source = llama_adapter
    directory = tmp_path / "wrapped"
    shutil.copytree(source, directory)
    path = directory / "adapter_model.safetensors"
    header, body = _header(path)
    _write(path, {k.replace("base_model.model.model.layers.", prefix): v
                  for k, v in header.items()}, body)
    _, plain = load_peft(source, name="plain", lora_int_id=1, spec=spec)
    _, wrapped = load_peft(directory, name="wrapped", lora_int_id=1, spec=spec)
    assert plain.pairs.keys() == wrapped.pairs.keys()
    for key, (a, b) in plain.pairs.items():
        np.testing.assert_array_equal(wrapped.pairs[key][0], a)
        np.testing.assert_array_equal(wrapped.pairs[key][1], b)


def test_an_adapter_for_another_model_is_refused(case: FamilyCase) -> None:
    others = [f for f in hf.FAMILIES if f != case.family]
    spec = ModelSpec.from_hf_config(hf.hf_config(others[0]).to_dict())
    with pytest.raises(ConfigError, match=r"has shape .* needs |is for layer \d+; "):
        load_peft(case.adapter_dirs[ADAPTERS[0]], name="x", lora_int_id=1, spec=spec)
    with pytest.raises(ConfigError, match="lora_int_id=0 .* base model"):
        load_peft(case.adapter_dirs[ADAPTERS[0]], name="x", lora_int_id=0, spec=case.spec)
