"""The prefix cache and the host cache are keyed by LoRA adapter (issue 41): KV computed under
one adapter never serves another, the base model included.

A prompt runs under adapter A; the same prompt then runs under B and under the base model: no
prefix hit, on the device or from the host, and each output equals transformers + peft's with
its own adapter. The same prompt under A again hits (and stays exact). Without the adapter in the
chain's root, B and the base would hit A's blocks (and answer with A's KV): these tests fail.
Eager blocks (a whole sequence per block, every cached block partial: found among block 0's
siblings) and paged blocks; a hybrid model's sliding-slot checkpoints too; the index alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.lora_engine import ADAPTERS, LoraFamily, greedy, make_family

from atombatch import Batcher
from atombatch.kernel.prefix import ROOT, PrefixIndex, adapter_root

A, B = ADAPTERS
NEW = 6


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> LoraFamily:
    return make_family(request.param, tmp_path_factory.mktemp(f"lora-prefix-{request.param}"))


def serve(batcher: Batcher, prompt: list[int], lora: str | None) -> tuple[int, list[int]]:
    """Run one request to its end: (its cached_tokens, its tokens)."""
    rid = batcher.submit(prompt, greedy(NEW), lora=lora)
    cached, tokens = None, None
    while batcher.has_unfinished():
        for out in batcher.step():
            assert out.request_id == rid
            if out.cached_tokens is not None:
                cached = out.cached_tokens
            if out.completion is not None:
                assert out.completion.finish_reason == "length", out
                tokens = list(out.completion.token_ids)
        batcher.check_invariants()
    assert cached is not None and tokens is not None
    return cached, tokens


def test_a_prefix_serves_its_adapter_only(family: LoraFamily) -> None:
    keyed(family, {})


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_eager_blocks_are_keyed_too(family: LoraFamily) -> None:
    """One block per sequence: every cached block is a partial block 0, found among the
    children of its chain's root."""
    keyed(family, {"block_size": 128})


def keyed(family: LoraFamily, kw: dict[str, int]) -> None:
    batcher = family.engine(family.runtime(2, **kw), prefix_cache=True,
                            host_cache_bytes=1 << 22)
    prompt = np.random.default_rng(2).integers(3, 512, size=45).tolist()
    cached, tokens = serve(batcher, prompt, A)
    assert cached == 0 and family.reference(A, prompt, NEW) == tokens
    for other in (B, None):
        cached, tokens = serve(batcher, prompt, other)
        assert cached == 0, f"{other} was served {cached} tokens of {A}'s prefix"
        assert family.reference(other, prompt, NEW) == tokens
    cached, tokens = serve(batcher, prompt, A)
    assert cached > 0 and family.reference(A, prompt, NEW) == tokens
    cached, tokens = serve(batcher, prompt, None)  # the base's own prefix now
    assert cached > 0 and family.reference(None, prompt, NEW) == tokens


def test_the_host_cache_is_keyed_too(family: LoraFamily) -> None:
    """A's blocks evicted to the host: B misses there as well; A is restored from it."""
    batcher = family.engine(family.runtime(1, num_blocks=9), prefix_cache=True,
                            host_cache_bytes=1 << 24)
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 512, size=70).tolist()
    _, tokens = serve(batcher, prompt, A)
    assert family.reference(A, prompt, NEW) == tokens
    evict = rng.integers(3, 512, size=110).tolist()  # fills the pool: A's blocks go to the host
    serve(batcher, evict, None)
    host = batcher.host_cache
    assert host is not None and len(host) > 0
    stores = host.stores
    cached, tokens = serve(batcher, prompt, B)
    assert cached == 0 and family.reference(B, prompt, NEW) == tokens
    hits = host.hits
    serve(batcher, evict, None)  # B's blocks out again
    assert host.stores > stores
    cached, tokens = serve(batcher, prompt, A)
    assert host.hits > hits, "A's prefix was meant to come back from the host"
    assert cached > 0 and family.reference(A, prompt, NEW) == tokens


def test_index_roots() -> None:
    """Full and partial blocks cached under one root are found under it alone."""
    index = PrefixIndex(4, seed=1, num_blocks=16)
    tokens = list(range(10, 20))
    roots = [ROOT, adapter_root("a" * 32), adapter_root("b" * 32)]
    assert len(set(roots)) == 3 and adapter_root("") == ROOT
    chain = index.chain(tokens, roots[1])
    index.insert_full_blocks([3, 4], chain, 0, 2)
    index.insert_digest(5, chain.partial_digest(10), chain.parent(2), chain.tokens[8:10], False)
    assert index.lookup(tokens, roots[1]).tokens == 10
    assert index.lookup(tokens[:9], roots[1]).tokens == 9
    for root in (roots[0], roots[2]):
        assert index.lookup(tokens, root).tokens == 0
    short = index.chain(tokens[:3], roots[1])  # a partial block 0: found among the root's children
    index.insert_digest(6, short.partial_digest(3), roots[1], short.tokens, False)
    assert index.lookup(tokens[:3], roots[1]).tokens == 3
    assert index.lookup(tokens[:3], roots[0]).tokens == 0


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_name_reloaded_with_other_weights_misses_the_old_prefixes(family: LoraFamily) -> None:
    """Unload adapter "x" (A's files) and load "x" again from B's: the same prompt under "x" then
    misses A's cached blocks (the identity digests the weights, not the name) and answers B's
    tokens; loading A's files again under "x" hits A's blocks again."""
    batcher = family.engine(family.runtime(2), adapters=(), prefix_cache=True,
                            host_cache_bytes=1 << 22)
    prompt = np.random.default_rng(5).integers(3, 512, size=45).tolist()
    batcher.load_lora("x", str(family.adapter_dirs[A]))
    assert serve(batcher, prompt, "x")[1] == family.reference(A, prompt, NEW)
    batcher.unload_lora("x")
    batcher.load_lora("x", str(family.adapter_dirs[B]))
    cached, tokens = serve(batcher, prompt, "x")
    assert cached == 0 and tokens == family.reference(B, prompt, NEW)
    batcher.unload_lora("x")
    batcher.load_lora("x", str(family.adapter_dirs[A]))
    cached, tokens = serve(batcher, prompt, "x")
    assert cached > 0 and tokens == family.reference(A, prompt, NEW)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_reload_while_a_submit_resolves_the_name_keys_the_new_adapter(
        family: LoraFamily) -> None:
    """Review: `submit` resolved the adapter's name before it took the engine's lock and checked
    only that the name was still loaded. An unload + load of the same name with other weights in
    between (another thread; here the engine's clock, which submit calls in that window) ran the
    request with the new weights under the old adapter's cache root: its blocks, computed under
    B, were later served to a request under A. The request must take the adapter loaded when it
    is queued."""
    swap = {"armed": False}
    engine: list[Batcher] = []

    def clock() -> float:
        if swap["armed"]:
            swap["armed"] = False
            engine[0].unload_lora("x")
            engine[0].load_lora("x", str(family.adapter_dirs[B]))
        return 0.0

    batcher = family.engine(family.runtime(2), adapters=(), prefix_cache=True, clock=clock)
    engine.append(batcher)
    prompt = np.random.default_rng(6).integers(3, 512, size=45).tolist()
    batcher.load_lora("x", str(family.adapter_dirs[A]))
    swap["armed"] = True
    cached, tokens = serve(batcher, prompt, "x")          # queued after the swap: B's adapter
    assert not swap["armed"], "the clock was meant to swap the adapter inside submit"
    assert cached == 0 and tokens == family.reference(B, prompt, NEW)
    batcher.unload_lora("x")
    batcher.load_lora("x", str(family.adapter_dirs[A]))
    cached, tokens = serve(batcher, prompt, "x")          # B's blocks must not serve A
    assert tokens == family.reference(A, prompt, NEW), f"A was served B's prefix ({cached})"
