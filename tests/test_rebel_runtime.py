"""RebelRuntime: lazy SDK import with install guidance, and the exact positional inputs it passes.

The ATOM is not here, so a stand-in `rebel` module records what the compiled graphs would receive.
It stands in for the SDK, not for the code under test: the argument lists are built by RebelRuntime
from the same table builders the scheduler fills, and replaying them through the NumPy reference
must give the NumPy runtime's own tokens.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from atombatch import ArtifactConfig, Batcher, ConfigError, ModelSpec, SamplingParams
from atombatch.blocks import DecodeInputs, LaneTable, PrefillInputs
from atombatch.runtime import NumpyRuntime, RebelRuntime

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8)


def tiny_artifact(family="llama", batch_size=2):
    if family == "gemma3":
        spec = ModelSpec(name="tiny-gemma3", family="gemma3", sliding_window=8,
                         layer_types=("sliding_attention", "full_attention"),
                         query_pre_attn_scalar=8.0, tie_word_embeddings=True, **TINY)
    else:
        spec = ModelSpec(name="tiny-llama", family="llama", **TINY)
    return ArtifactConfig(model=spec, batch_size=batch_size, max_seq_len=64, block_size=32,
                          num_blocks=batch_size * 2 + 1, prefill_chunk_size=16)


def test_missing_sdk_raises_config_error_with_install_guidance(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "rebel", None)  # makes `import rebel` raise ImportError
    with pytest.raises(ConfigError, match="rebel-sdk is not installed.*pip install"):
        RebelRuntime(tiny_artifact(), tmp_path / "p.rbln", tmp_path / "d.rbln")


class FakeGraph:
    """Records positional calls; optionally answers by replaying them on a NumPy reference."""

    calls: list[tuple[str, tuple[np.ndarray, ...]]] = []

    def __init__(self, path, tensor_type, device):
        assert tensor_type == "np"
        self.path = path
        self.reference: NumpyRuntime | None = None

    def __call__(self, *args):
        FakeGraph.calls.append((self.path, tuple(np.array(a, copy=True) for a in args)))
        ref = self.reference
        if ref is None:
            return np.zeros((1, 1, 128), dtype=np.float32)
        hybrid = ref.spec.is_hybrid
        if "prefill" in self.path:
            inputs = PrefillInputs(ref.artifact.prefill_chunk_size, ref.artifact.blocks_per_seq)
            inputs.input_ids[...], inputs.cache_position[...], inputs.block_tables[...] = args[:3]
            if hybrid:
                inputs.local_block_tables[...] = args[3]
            inputs.query_position[...] = args[4 if hybrid else 3]
            return ref.prefill(inputs)[None, None, :]
        inputs = DecodeInputs(ref.artifact.batch_size, ref.artifact.blocks_per_seq)
        inputs.input_ids[...], inputs.cache_position[...], inputs.block_tables[...] = args[:3]
        if hybrid:
            inputs.local_block_tables[...] = args[3]
        return ref.decode(inputs)[:, None, :]


@pytest.fixture
def fake_rebel(monkeypatch, tmp_path):
    module = types.ModuleType("rebel")
    module.Runtime = FakeGraph
    module.__version__ = "0.0-test"
    monkeypatch.setitem(sys.modules, "rebel", module)
    FakeGraph.calls = []
    for name in ("prefill.rbln", "decoder.rbln"):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def make(art, folder):
    return RebelRuntime(art, folder / "prefill.rbln", folder / "decoder.rbln")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_positional_arguments_names_order_dtypes_shapes(fake_rebel, family):
    art = tiny_artifact(family, batch_size=4)
    rt = make(art, fake_rebel)
    lanes = LaneTable(4, art.blocks_per_seq, art.block_size)
    lane = lanes.assign()
    lanes.push_block(lane, 3)
    lanes.start_decode(lane, 5, 42)
    decode = DecodeInputs(4, art.blocks_per_seq)
    decode.build(lanes, 8)
    prefill = PrefillInputs(art.prefill_chunk_size, art.blocks_per_seq)
    prefill.build(np.arange(1, 21), 16, [3, 4], 2, 1)

    bps, q = art.blocks_per_seq, art.prefill_chunk_size
    want_prefill = [("input_ids", np.int64, (1, q)), ("cache_position", np.int32, (1, q)),
                    ("block_tables", np.int16, (bps,))]
    want_decode = [("input_ids", np.int64, (4, 1)), ("cache_position", np.int32, (4, 1)),
                   ("block_tables", np.int16, (4, bps))]
    if family == "gemma3":
        want_prefill.append(("local_block_tables", np.int16, (1,)))
        want_decode.append(("local_block_tables", np.int16, (4, 1)))
    want_prefill.append(("query_position", np.int16, ()))
    if family == "gemma3":
        want_prefill += [("attention_mask", np.float32, (1, art.max_seq_len)),
                         ("position_ids", np.int32, (1, q))]
        want_decode += [("attention_mask", np.float32, (4, art.max_seq_len)),
                        ("position_ids", np.int32, (4, 1))]
    got_prefill = rt.prefill_args(prefill)
    got_decode = rt.decode_args(decode)
    assert [(n, a.dtype.type, a.shape) for n, a in got_prefill] == want_prefill
    assert [(n, a.dtype.type, a.shape) for n, a in got_decode] == want_decode
    # the arrays are the builders' own buffers, not copies
    assert got_decode[2][1] is decode.block_tables and got_prefill[0][1] is prefill.input_ids
    assert got_decode[2][1][0].tolist() == [3, 3] and got_decode[2][1][1].tolist() == [8, 8]
    assert int(got_prefill[-1 if family == "llama" else 4][1]) == 3  # query_position: 4 real - 1
    if family == "gemma3":
        mask = dict(got_decode)["attention_mask"]
        assert mask[0, :6].tolist() == [1.0] * 6 and mask[0, 6:].sum() == 0  # lane 0 at pos 5
        assert mask[1, 0] == 1.0 and mask[1, 1:].sum() == 0                  # idle lane at pos 0
        pmask = dict(got_prefill)["attention_mask"]
        assert pmask[0, :20].sum() == 20 and pmask[0, 20:].sum() == 0        # last real pos 19
        assert dict(got_prefill)["position_ids"][0].tolist() == list(range(16, 32))
    rt.prefill(prefill)
    rt.decode(decode)
    assert [len(args) for _, args in FakeGraph.calls] == [len(want_prefill), len(want_decode)]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batcher_through_rebel_inputs_matches_numpy_runtime(fake_rebel, family):
    art = tiny_artifact(family)
    rt = make(art, fake_rebel)
    rt._prefill.reference = rt._decode.reference = NumpyRuntime.random(art, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(1, 20)), list(range(5, 12)), [7, 8, 9]]
    via_rebel = Batcher(rt).generate(prompts, params)
    native = Batcher(NumpyRuntime.random(art, seed=3)).generate(prompts, params)
    assert [c.token_ids for c in via_rebel] == [c.token_ids for c in native]
