"""LoRA on the device path (issue 41): a directory compiled with `lora_config` through the emulated
`rebel` (tests/fakerebel), which checks the `lora_int_ids` input of every call and computes each
row with the adapter its id names, as optimum-rbln compiles it.

PEFT adapters are made by peft itself (tests/support/lora_models.py), the directory's
`lora_config` as optimum-rbln's classes write it (tests/fakerebel/compiler.py, held to
tests/fakerebel/optimum_lora.json). Lanes running different adapters, and the base model, decode
in one call of each decode bucket, padding rows carrying valid ids, and every lane's greedy tokens
equal transformers + peft's with its adapter; an id the directory was not compiled with is refused
by RebelRuntime (StateError) before the call, and by the emulated device (RBLNRuntimeError).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fakerebel.compiler import compile_dir, lora_adapter, lora_config
from support import hf_models as hf
from support import lora_models as lm
from support.numerics import GreedyTokens, assert_f32_close, greedy_reference, reduction_length

from atombatch import Batcher, RequestError, SamplingParams, StateError
from atombatch.artifact.lora import BASE_LORA_ID, load_peft
from atombatch.artifact.rbln_config import load
from atombatch.kernel._blocks_py import DecodeInputs, LaneTable, PrefillInputs
from atombatch.pd import Producer
from atombatch.runtime import NumpyRuntime, RebelRuntime
from atombatch.runtime.base import Capabilities
from atombatch.runtime.numpy_runtime import load_safetensors_dir
from atombatch.runtime.rebel import compiled_adapters

pytestmark = pytest.mark.numerics   # run again under a second BLAS kernel by .ci/run

B = 4
CONTEXT = 128
CHUNK = 16
NEW_TOKENS = 6
PROMPT_LENS = (21, 37, 9, 30)
ADAPTERS = tuple(lm.CASES)          # compiled lora_int_id i + 1 is ADAPTERS[i]
FLASH = dict(kvcache_block_size=32, kvcache_num_blocks=B * CONTEXT // 32 + 1)
EXPLICIT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_id(name: str | None) -> int:
    return BASE_LORA_ID if name is None else ADAPTERS.index(name) + 1


def compiled_entry(name: str, directory: Path) -> dict[str, Any]:
    """The adapter's lora_config entry. PEFT's "all-linear" is written out (optimum-rbln compares
    module names with its list), and an rsLoRA adapter gets `scaling_factor = r`: optimum-rbln
    0.12 folds `lora_alpha / r / sqrt(r)` into B where PEFT scales by `lora_alpha / sqrt(r)`."""
    case = lm.CASES[name]
    fields: dict[str, Any] = {}
    if isinstance(case.target_modules, str):
        fields["target_modules"] = list(EXPLICIT_TARGETS)
    if case.use_rslora:
        fields["scaling_factor"] = float(case.r)
    return lora_adapter(lora_id(name), name, directory, **fields)


@dataclass
class DeviceCase:
    family: str
    checkpoint: Path
    adapter_dirs: dict[str, Path]
    models: dict[str | None, Any]        # adapter name (None: the base) -> transformers model
    prompts: list[list[int]]
    greedy: dict[tuple[str | None, tuple[int, ...]], GreedyTokens]

    def compile(self, directory: Path, **options: Any) -> Path:
        config = lora_config([compiled_entry(n, self.adapter_dirs[n]) for n in ADAPTERS])
        options = {"kvcache_num_blocks": B + 1, **options}
        return compile_dir(directory, self.checkpoint, batch_size=B, max_seq_len=CONTEXT,
                           prefill_chunk_size=CHUNK, lora_config=config, **options)

    def reference(self, adapter: str | None, prompt: list[int]) -> GreedyTokens:
        """transformers + peft's greedy tokens (full recompute per token), computed once."""
        key = (adapter, tuple(prompt))
        if key not in self.greedy:
            self.greedy[key] = greedy_reference(self.models[adapter], prompt, NEW_TOKENS,
                                                lambda m, s: hf.hf_logits(m, s)[-1])
        return self.greedy[key]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DeviceCase:
    family = request.param
    root = tmp_path_factory.mktemp(f"device-lora-{family}")
    checkpoint, models, dirs = lm.save_family(family, root)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in PROMPT_LENS]
    return DeviceCase(family, checkpoint, dirs, models, prompts, {})


class Lanes:
    """Plays the scheduler for a B-lane directory whose every lane holds a whole sequence: lane l
    holds blocks l*bps..(l+1)*bps-1 (eager: block l), block B*bps is the spare every padding
    row points at. Each admitted prompt runs its chunked prefill under its
    adapter; `step` decodes the decoding lanes in the smallest bucket that holds them, each row
    with its lane's id and padding rows with `padding_id` (any compiled id is valid there)."""

    def __init__(self, runtime: RebelRuntime, padding_id: int = 0) -> None:
        art = runtime.artifact
        self.runtime = runtime
        self.padding_id = padding_id
        self.lanes = LaneTable(art.batch_size, art.blocks_per_seq, art.block_size)
        self.prefill_inputs = PrefillInputs(art.prefill_chunk_size, art.blocks_per_seq)
        self.decode_inputs = DecodeInputs(art.batch_size, art.blocks_per_seq,
                                          art.decoder_batch_sizes)
        self.bps = art.blocks_per_seq
        self.spare = art.batch_size * self.bps
        self.lane_lora = np.zeros(art.batch_size, dtype=np.int32)
        self.tokens: dict[int, list[int]] = {}
        self.row_ids: list[list[int]] = []

    def admit(self, prompt: list[int], lora: int | None) -> int:
        lane = self.lanes.assign()
        for block in range(lane * self.bps, (lane + 1) * self.bps):
            self.lanes.push_block(lane, block)
        self.lane_lora[lane] = lora or 0
        ids = None if lora is None else np.array([lora], dtype=np.int32)
        logits = None
        for start in range(0, len(prompt), self.runtime.artifact.prefill_chunk_size):
            blocks = self.lanes.blocks(lane)
            self.prefill_inputs.build(prompt, start, blocks, len(blocks), sliding_slot=lane)
            logits = self.runtime.prefill(self.prefill_inputs, lora_int_ids=ids)
        assert logits is not None
        first = int(logits.argmax())
        self.lanes.start_decode(lane, len(prompt), first)
        self.tokens[lane] = [first]
        return lane

    def step(self) -> None:
        decoding = self.decode_inputs.build(self.lanes, self.spare)
        ids = np.full(self.decode_inputs.num_rows, self.padding_id, dtype=np.int32)
        ids[:decoding] = self.lane_lora[self.decode_inputs.row_lanes[:decoding]]
        self.row_ids.append(ids.tolist())
        out = self.runtime.decode(self.decode_inputs, lora_int_ids=ids)
        for row in range(decoding):
            lane = int(self.decode_inputs.row_lanes[row])
            self.tokens[lane].append(int(out[row].argmax()))
            self.lanes.advance(lane, self.tokens[lane][-1])

    def finish(self, lane: int) -> None:
        self.lanes.release(lane)


# -- the compiled adapters, by name -------------------------------------------------------------------
def test_compiled_adapters_are_served_under_their_names(fake_rebel, tmp_path, case):
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c"))
    assert list(rt.lora_adapters) == list(ADAPTERS)
    caps = Capabilities(rt)
    assert caps.lora and not caps.lora_loadable
    spec = rt.spec
    for name, adapter in rt.lora_adapters.items():
        lm_case = lm.CASES[name]
        assert (adapter.name, adapter.lora_int_id, adapter.r, adapter.use_rslora) == (
            name, lora_id(name), lm_case.r, lm_case.use_rslora)
        # the identity of the directory as the NumPy runtime loads it (the rsLoRA adapter's
        # compiled scaling_factor = r makes the device compute what PEFT does)
        read, _ = load_peft(case.adapter_dirs[name], name=name, lora_int_id=lora_id(name),
                            spec=spec)
        assert adapter.identity == read.identity, name
    assert len({a.identity for a in rt.lora_adapters.values()}) == len(ADAPTERS)


def test_a_directory_without_lora_has_no_adapters(fake_rebel, tmp_path, case):
    d = compile_dir(tmp_path / "c", case.checkpoint, batch_size=B, max_seq_len=CONTEXT,
                    prefill_chunk_size=CHUNK, kvcache_num_blocks=B + 1)
    rt = RebelRuntime.from_optimum(d)
    assert not hasattr(rt, "lora_adapters") and not Capabilities(rt).lora


def test_identity_from_the_config_when_the_adapter_files_are_gone(tmp_path, case):
    d = case.compile(tmp_path / "c")
    compiled = load(d)
    assert compiled.lora is not None
    spec = compiled.artifact.model
    with_files = compiled_adapters(compiled.lora, spec)
    moved = tmp_path / "moved"
    moved.mkdir()
    for name, directory in case.adapter_dirs.items():
        (directory).rename(moved / name)
    try:
        without = compiled_adapters(compiled.lora, spec)
        again = compiled_adapters(compiled.lora, spec)
    finally:
        for name, directory in case.adapter_dirs.items():
            (moved / name).rename(directory)
    assert {n: a.identity for n, a in without.items()} == \
        {n: a.identity for n, a in again.items()}
    assert len({a.identity for a in without.values()}) == len(ADAPTERS)
    assert all(without[n].identity != with_files[n].identity for n in ADAPTERS)


# -- mixed adapters in one batch = transformers + peft ----------------------------------------------
# (prompt index, adapter) per lane: three adapters and the base, then the fourth adapter and a
# prompt again under another adapter
WAVES: tuple[tuple[tuple[int, str | None], ...], ...] = (
    ((0, ADAPTERS[0]), (1, ADAPTERS[1]), (2, None), (3, ADAPTERS[2])),
    ((0, ADAPTERS[3]), (1, ADAPTERS[0])),
)


@pytest.mark.parametrize("buckets, layout", [([B], {}), ([1, 2, 4], FLASH)],
                         ids=["eager-full", "flash-buckets"])
def test_mixed_adapters_in_one_decode_batch_equal_peft(fake_rebel, tmp_path, case, buckets,
                                                       layout):
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c", decoder_batch_sizes=buckets,
                                                **layout))
    top = len(ADAPTERS)
    for wave in WAVES:
        # padding rows carry the last compiled id: valid, and not the base
        lanes = Lanes(rt, padding_id=top)
        admitted = [(lanes.admit(case.prompts[p], lora_id(name)), p, name) for p, name in wave]
        for _ in range(NEW_TOKENS - 1):
            lanes.step()
        for lane, p, name in admitted:
            assert lanes.tokens[lane] == case.reference(name, case.prompts[p]), (
                case.family, name, p)
            lanes.finish(lane)
        rows = {len(ids) for ids in lanes.row_ids}
        assert rows == ({4} if buckets == [B] else {4 if len(wave) > 2 else 2})
        if len(wave) < max(rows):
            assert all(ids[len(wave):] == [top] * (len(ids) - len(wave))
                       for ids in lanes.row_ids)
    # the test can fail: each adapter moves its prompt's tokens away from the base model's
    for wave in WAVES:
        for p, name in wave:
            if name is not None:
                assert case.reference(name, case.prompts[p]) != \
                    case.reference(None, case.prompts[p]), (case.family, name, p)
    used = {rows for graph, rows in fake_rebel.CALLS if graph.startswith("decoder_batch_")}
    assert used == ({4} if buckets == [B] else {2, 4})


def test_a_wrong_id_is_a_wrong_token(fake_rebel, tmp_path, case):
    """Each prompt under the other adapters' ids says those adapters' tokens: the id selects the
    adapter row by row, nothing else does."""
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c", decoder_batch_sizes=[1, 2, 4]))
    prompt = case.prompts[0]
    lanes = Lanes(rt)
    admitted = [(lanes.admit(prompt, lora_id(name)), name) for name in (None, *ADAPTERS[:3])]
    for _ in range(NEW_TOKENS - 1):
        lanes.step()
    got = {name: lanes.tokens[lane] for lane, name in admitted}
    for name, tokens in got.items():
        assert tokens == case.reference(name, prompt), (case.family, name)
    assert len({tuple(t) for t in got.values()}) == len(got)


def test_without_lora_int_ids_every_row_runs_the_base_model(fake_rebel, tmp_path, case):
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c", decoder_batch_sizes=[1, 2, 4]))
    lanes = Lanes(rt)
    admitted = [(lanes.admit(case.prompts[p], None), p) for p in range(3)]
    for _ in range(NEW_TOKENS - 1):
        decoding = lanes.decode_inputs.build(lanes.lanes, lanes.spare)
        out = rt.decode(lanes.decode_inputs)          # no lora_int_ids: the graph gets zeros
        for row in range(decoding):
            lane = int(lanes.decode_inputs.row_lanes[row])
            lanes.tokens[lane].append(int(out[row].argmax()))
            lanes.lanes.advance(lane, lanes.tokens[lane][-1])
    for lane, p in admitted:
        assert lanes.tokens[lane] == case.reference(None, case.prompts[p])


# -- the input's checks -------------------------------------------------------------------------------
def prefill_inputs(rt: RebelRuntime, prompt: list[int]) -> PrefillInputs:
    inputs = PrefillInputs(rt.artifact.prefill_chunk_size, rt.artifact.blocks_per_seq)
    inputs.build(prompt, 0, [0], 1, sliding_slot=0)
    return inputs


def decode_inputs(rows: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=np.zeros((rows, 1), np.int64),
                           cache_position=np.zeros((rows, 1), np.int32),
                           block_tables=np.full((rows, 1), B, np.int16),
                           local_block_tables=np.arange(rows, dtype=np.int16).reshape(rows, 1))


@pytest.mark.parametrize("ids, message", [
    ([len(ADAPTERS) + 1], r"lora_int_ids row 0 holds 5, which .* was not compiled with \(its "
                          r"ids: 0 = the base model, 1..4 = attn-r4, "),
    ([-1], "row 0 holds -1"),
    ([0, 1], r"lora_int_ids has shape \(2,\).*graph prefill takes integers \[1\]"),
    ([1.0], "dtype float64"),
])
def test_runtime_refuses_bad_prefill_ids_before_the_call(fake_rebel, tmp_path, case, ids,
                                                         message):
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c"))
    with pytest.raises(StateError, match=message):
        rt.prefill(prefill_inputs(rt, case.prompts[2]), lora_int_ids=np.array(ids))
    assert fake_rebel.CALLS == [] and rt.prefill_calls == 0


def test_runtime_refuses_a_decode_row_id_not_compiled(fake_rebel, tmp_path, case):
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c", decoder_batch_sizes=[2, 4]))
    ids = np.array([1, 0, 9, 2], dtype=np.int32)
    with pytest.raises(StateError, match="lora_int_ids row 2 holds 9"):
        rt.decode(decode_inputs(4), lora_int_ids=ids)
    with pytest.raises(StateError, match=r"graph decoder_batch_2 takes integers \[2\]"):
        rt.decode(decode_inputs(2), lora_int_ids=ids)
    assert fake_rebel.CALLS == []
    # int64 ids are copied into the graph's int32 buffer
    args = dict(rt.decode_args(decode_inputs(2), np.array([3, 4], dtype=np.int64)))
    assert args["lora_int_ids"].dtype == np.int32 and args["lora_int_ids"].tolist() == [3, 4]
    assert list(args)[-1] == "lora_int_ids"


def test_a_directory_without_lora_refuses_adapter_ids(fake_rebel, tmp_path, case):
    d = compile_dir(tmp_path / "c", case.checkpoint, batch_size=B, max_seq_len=CONTEXT,
                    prefill_chunk_size=CHUNK, kvcache_num_blocks=B + 1)
    rt = RebelRuntime.from_optimum(d)
    with pytest.raises(StateError, match="compiled without lora_config"):
        rt.decode(decode_inputs(B), lora_int_ids=np.array([0, 1, 0, 0], np.int32))
    rt.decode(decode_inputs(B), lora_int_ids=np.zeros(B, np.int32))    # base rows: fine
    assert "lora_int_ids" not in dict(rt.decode_args(decode_inputs(B)))


def test_the_emulated_device_checks_the_input(fake_rebel, tmp_path, case):
    d = case.compile(tmp_path / "c")
    rt = RebelRuntime.from_optimum(d)
    args = [a for _, a in rt.decode_args(decode_inputs(B), np.array([0, 1, 2, 3], np.int32))]
    graph = fake_rebel.Runtime(str(d / "decoder_batch_4.rbln"), tensor_type="np")
    graph(*args)                                                    # as compiled: runs
    with pytest.raises(fake_rebel.RBLNRuntimeError, match="inputs given, the graph takes"):
        graph(*args[:-1])                                           # the input missing
    with pytest.raises(fake_rebel.RBLNRuntimeError, match=r"\(lora_int_ids\) has dtype int64"):
        graph(*args[:-1], args[-1].astype(np.int64))
    with pytest.raises(fake_rebel.RBLNRuntimeError, match=r"\(lora_int_ids\) has shape \(2,\)"):
        graph(*args[:-1], args[-1][:2].copy())
    with pytest.raises(fake_rebel.RBLNRuntimeError,
                       match="lora_int_ids row 1 holds 7; the graph was compiled with adapter "
                             "ids 0..4"):
        graph(*args[:-1], np.array([0, 7, 0, 0], np.int32))


# -- the ATOM as a PD producer under an adapter ------------------------------------------------------
def test_pd_producer_on_the_device_prefills_under_the_compiled_adapter(fake_rebel, tmp_path, case):
    """A RebelRuntime producer's payload under adapter k: its first token is peft's, and its KV
    equals a NumPy producer's with the same PEFT directory loaded (and differs from the base's)."""
    d = case.compile(tmp_path / "c")
    device = Producer(RebelRuntime.from_optimum(d))
    spec = device.runtime.spec
    host_runtime = NumpyRuntime(device.runtime.artifact, load_safetensors_dir(case.checkpoint))
    for name in ADAPTERS:
        host_runtime.add_lora(*load_peft(case.adapter_dirs[name], name=name,
                                         lora_int_id=lora_id(name), spec=spec))
    host = Producer(host_runtime)
    prompt = case.prompts[1]
    base = device.produce("base", prompt)
    for name in ADAPTERS:
        got = device.produce(f"d-{name}", prompt, lora_int_id=lora_id(name))
        want = host.produce(f"h-{name}", prompt, lora_int_id=lora_id(name))
        assert got.header.first_token == case.reference(name, prompt)[0]
        for mine, theirs in zip(got.layers, want.layers, strict=True):
            for a, b in zip(mine.float32(), theirs.float32(), strict=True):
                assert_f32_close(a, b, reduction=reduction_length(spec, CONTEXT),
                                 depth=2 * spec.num_layers + 1, err_msg=f"{name} {mine.layer}")
        # the KV moves under every adapter but the one that adapts layer 1's outputs only
        moved = any(not np.allclose(a, b) for mine, plain in zip(got.layers, base.layers,
                                                                strict=True)
                    for a, b in zip(mine.float32(), plain.float32(), strict=True))
        assert moved == (name != "layer1-r16" or spec.num_layers > 2), name
    with pytest.raises(RequestError, match="lora_int_id=9 is not loaded"):
        device.produce("r", prompt, lora_int_id=9)


# -- through the engine ----------------------------------------------------------------------------
def _run(batcher: Batcher) -> dict[str, Any]:
    finals = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("layout", [{}, FLASH], ids=["eager", "flash"])
def test_the_engine_serves_compiled_adapters_on_the_device(fake_rebel, tmp_path, case, overlap,
                                                           layout):
    """`Batcher.submit(lora=name)` on a compiled LoRA directory: base and adapters mixed in the
    decode buckets, with the prefix and host caches on, equal transformers + peft; the same
    prompts again (prefix hits) keep each adapter's answer, so no adapter read another's
    cached prefix."""
    rt = RebelRuntime.from_optimum(case.compile(tmp_path / "c", decoder_batch_sizes=[1, 2, 4],
                                                **layout))
    batcher = Batcher(rt, prefix_cache=True, overlap=overlap, host_cache_bytes=1 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    jobs = [(p, name) for p in range(4) for name in (None, *ADAPTERS)][:12]
    for attempt in range(2):
        ids = {batcher.submit(case.prompts[p], params, lora=name): (p, name) for p, name in jobs}
        finals = _run(batcher)
        for rid, (p, name) in ids.items():
            out = finals[rid]
            assert out.finish_reason == "length", out.error
            assert list(out.completion.token_ids) == case.reference(name, case.prompts[p]), \
                (attempt, name, p)
    assert batcher.stats().prefix_hits > 0
