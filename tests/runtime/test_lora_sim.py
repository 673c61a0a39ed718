"""LoRA adapters on the simulator (issue 41): a step's rows under adapters cost their matrices once
per distinct adapter and their FLOPs per row; base rows cost what they did; adapters move the
pseudo-logits so a wrong id is visible."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from atombatch.artifact.config import ArtifactConfig, ModelSpec
from atombatch.artifact.lora import TARGET_MODULES, LoraAdapter
from atombatch.errors import ConfigError, StateError
from atombatch.kernel._blocks_py import DecodeInputs, LaneTable, PrefillInputs
from atombatch.runtime.base import Capabilities
from atombatch.runtime.sim import CostModel, SimRuntime, lora_cost

SPEC = ModelSpec.preset("koni-8b")
ART = ArtifactConfig(model=SPEC, batch_size=4, max_seq_len=4096, block_size=4096, num_blocks=5,
                     prefill_chunk_size=128)
ALL = LoraAdapter(name="all-r16", lora_int_id=1, path="-", r=16, lora_alpha=32.0,
                  target_modules=TARGET_MODULES)
ATTN = LoraAdapter(name="qv-r8", lora_int_id=2, path="-", r=8, lora_alpha=8.0,
                   target_modules=("q_proj", "v_proj"))


def adapter_elements(adapter: LoraAdapter) -> int:
    """A and B elements of an adapter on SPEC, from the model's dimensions (tensor_parallel 1)."""
    hidden, inter = SPEC.hidden_size, SPEC.intermediate_size
    q, kv = SPEC.num_heads * SPEC.head_dim, SPEC.num_kv_heads * SPEC.head_dim
    dims = {"q_proj": hidden + q, "k_proj": hidden + kv, "v_proj": hidden + kv,
            "o_proj": q + hidden, "gate_proj": hidden + inter, "up_proj": hidden + inter,
            "down_proj": inter + hidden}
    return SPEC.num_layers * adapter.r * sum(dims[m] for m in adapter.target_modules)


def test_lora_cost_counts_the_matrices() -> None:
    for adapter in (ALL, ATTN):
        cost = lora_cost(ART, adapter.r, adapter.target_modules)
        assert cost.bytes == adapter_elements(adapter) * SPEC.dtype_bytes
        assert cost.flops_per_token == 2 * adapter_elements(adapter)
    tp2 = msgspec.structs.replace(ART, tensor_parallel=2)
    assert lora_cost(tp2, 16, TARGET_MODULES).bytes < lora_cost(ART, 16, TARGET_MODULES).bytes


class Step:
    """Four lanes decoding at context 1000 on a simulator holding both adapters."""

    def __init__(self) -> None:
        self.runtime = SimRuntime(ART, lora_adapters=[ALL, ATTN])
        lanes = LaneTable(4, 1, ART.block_size)
        for lane in range(4):
            lanes.assign()
            lanes.push_block(lane, lane)
            lanes.start_decode(lane, 999, 7 + lane)
        self.inputs = DecodeInputs(4, 1)
        self.inputs.build(lanes, 4)

    def run(self, ids: list[int] | None) -> tuple[float, np.ndarray]:
        before, lora_before = self.runtime.device.decode_s, self.runtime.device.lora_s
        kwargs = {} if ids is None else {"lora_int_ids": np.array(ids, dtype=np.int32)}
        logits = self.runtime.decode(self.inputs, **kwargs).copy()
        spent = self.runtime.device.decode_s - before
        assert self.runtime.device.lora_s - lora_before == pytest.approx(
            spent - Step.base_s(), rel=1e-9, abs=1e-15)
        return spent, logits

    @staticmethod
    def base_s() -> float:
        return CostModel.default().decode_step_s(ART, [1000] * 4, 4)


def test_a_decode_step_pays_each_distinct_adapter_once_and_its_flops_per_row() -> None:
    costs = CostModel.default()
    step = Step()
    base, base_logits = step.run(None)
    assert base == Step.base_s()
    zeros, zero_logits = step.run([0, 0, 0, 0])
    assert zeros == base    # a base-only step costs what it cost without adapters
    np.testing.assert_array_equal(zero_logits, base_logits)

    def extra(adapter: LoraAdapter, rows: int) -> float:
        return (adapter_elements(adapter) * SPEC.dtype_bytes / costs.memory_bandwidth +
                rows * 2 * adapter_elements(adapter) / costs.prefill_flops)

    one, one_logits = step.run([1, 0, 0, 0])
    assert one - base == pytest.approx(extra(ALL, 1), rel=1e-9)
    two_rows, _ = step.run([1, 1, 0, 0])
    assert two_rows - base == pytest.approx(extra(ALL, 2), rel=1e-9)
    mixed, mixed_logits = step.run([1, 2, 0, 1])
    assert mixed - base == pytest.approx(extra(ALL, 2) + extra(ATTN, 1), rel=1e-9)
    # streaming a second adapter costs more than a second row of the first
    assert mixed - two_rows > 0
    # rows under adapters answer otherwise; base rows as before
    assert not np.array_equal(one_logits[0], base_logits[0])
    assert not np.array_equal(mixed_logits[1], mixed_logits[0])
    np.testing.assert_array_equal(mixed_logits[2], base_logits[2])


def test_a_prefill_chunk_under_an_adapter_costs_more() -> None:
    runtime = SimRuntime(ART, lora_adapters=[ALL])
    lanes = LaneTable(4, 1, ART.block_size)
    lanes.assign()
    lanes.push_block(0, 0)
    inputs = PrefillInputs(128, 1)
    inputs.build(list(range(3, 131)), 0, lanes.blocks(0), 1, sliding_slot=0)
    base = runtime.prefill(inputs).copy()
    base_s = runtime.device.prefill_s
    adapted = runtime.prefill(inputs, lora_int_ids=np.array([1], dtype=np.int32)).copy()
    assert runtime.device.prefill_s - base_s > base_s
    assert runtime.device.lora_s == pytest.approx(runtime.device.prefill_s - 2 * base_s)
    assert base.argmax() != adapted.argmax()


def test_adapters_are_compiled_in_and_checked() -> None:
    runtime = SimRuntime(ART, lora_adapters=[ALL])
    caps = Capabilities(runtime)
    assert caps.lora and not caps.lora_loadable
    assert runtime.lora_adapters == {"all-r16": ALL}
    assert not Capabilities(SimRuntime(ART)).lora_loadable
    step = Step()
    with pytest.raises(StateError, match=r"lora_int_ids holds \[3\]"):
        step.runtime.decode(step.inputs, lora_int_ids=np.array([0, 3, 0, 0], dtype=np.int32))
    with pytest.raises(StateError, match="one id per row"):
        step.runtime.decode(step.inputs, lora_int_ids=np.array([0, 1], dtype=np.int32))
    with pytest.raises(ConfigError, match="repeats a name or an id"):
        SimRuntime(ART, lora_adapters=[ALL, msgspec.structs.replace(ATTN, lora_int_id=1)])
    with pytest.raises(ConfigError, match="base model's id 0"):
        SimRuntime(ART, lora_adapters=[msgspec.structs.replace(ALL, lora_int_id=0)])


def test_adapters_without_an_identity_do_not_share_cached_prefixes() -> None:
    """Review: adapters described without an `identity` (the simulator's, `bench lora`'s, an
    embedder's) all had identity "", whose cache root is the base model's: under a prefix cache
    one adapter's blocks served another and the base model (and a PD header of the base would
    pass for them). A missing identity is made from the adapter's description."""
    from atombatch import Batcher, SamplingParams
    from atombatch.kernel.prefix import ROOT, adapter_root

    art = ArtifactConfig(model=SPEC, batch_size=2, max_seq_len=256, block_size=16,
                         num_blocks=40, prefill_chunk_size=32)
    batcher = Batcher(SimRuntime(art, lora_adapters=[ALL, ATTN]), prefix_cache=True)
    prompt = list(range(100, 164))

    def cached(lora: str | None) -> int:
        rid = batcher.submit(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                    ignore_eos=True), lora=lora)
        seen = None
        while batcher.has_unfinished():
            for out in batcher.step():
                if out.request_id == rid and out.cached_tokens is not None:
                    seen = out.cached_tokens
        assert seen is not None
        return seen

    assert cached(ALL.name) == 0
    assert cached(ATTN.name) == 0, "adapter qv-r8 hit all-r16's prefix"
    assert cached(None) == 0, "the base model hit all-r16's prefix"
    assert cached(ALL.name) > 0   # its own prefix still hits
    assert len({ALL.identity, ATTN.identity}) == 2 and "" not in (ALL.identity, ATTN.identity)
    assert adapter_root(ALL.identity) != ROOT
