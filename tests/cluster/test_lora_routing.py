"""The router's prefix affinity knows the request's LoRA adapter (issue 41).

A replica that served a prompt under adapter A reports, in its cache summary, the routing
digests the router computes for that prompt under A (`route_digests(lora=A)`), and not the ones
of the same prompt under B or the base model: the router sends an A request to it, and a B or
base request with the same tokens is not drawn there by a prefix it cannot use. Through the
engine core's own summary path too (`CoreSummaries`).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.driving import run_to_end
from support.lora_engine import ADAPTERS, LoraFamily, greedy, make_family

from atombatch.cluster import PrefixAffinityPolicy, ReplicaLoad, route_digests
from atombatch.cluster.summary import CacheSummarizer, cache_roots, route_root
from atombatch.core.messages import SummaryRequest
from atombatch.core.routing import CoreSummaries
from atombatch.kernel.prefix import ROOT

A, B = ADAPTERS
ROUTE_BLOCK, MAX_BLOCKS = 16, 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> LoraFamily:
    return make_family("llama", tmp_path_factory.mktemp("lora-routing-llama"))


def test_summaries_and_affinity_know_the_adapter(llama: LoraFamily) -> None:
    assert route_root(None) == ROOT and len({route_root(A), route_root(B), ROOT}) == 3
    batcher = llama.engine(llama.runtime(2), prefix_cache=True)
    prompt = np.random.default_rng(8).integers(3, 512, size=60).tolist()
    batcher.submit(prompt, greedy(4), lora=A)
    run_to_end(batcher)
    scheduler = batcher.scheduler
    summary = CacheSummarizer(ROUTE_BLOCK, MAX_BLOCKS).summary(
        scheduler.prefix, scheduler.host, roots=cache_roots(batcher.lora_adapters.values()))
    under = {lora: route_digests(prompt, ROUTE_BLOCK, MAX_BLOCKS, lora=lora)
             for lora in (A, B, None)}
    assert len(under[A]) == 3 and len(set().union(*under.values())) == 9
    assert all(d in summary for d in under[A])
    assert not any(d in summary for d in under[B] + under[None])
    # the core answers the same summary
    core = CoreSummaries().answer(batcher, SummaryRequest(ROUTE_BLOCK, MAX_BLOCKS, summary.num_bits))
    assert core.summary is not None and all(d in core.summary for d in under[A])
    assert not any(d in core.summary for d in under[None])
    # the router: an A request goes where A's prefix is, a base one is not drawn there
    policy = PrefixAffinityPolicy(max_imbalance=4)
    replicas = [ReplicaLoad("holder", lanes=4), ReplicaLoad("other", lanes=4)]
    policy.report("holder", summary)
    assert policy.rank(under[A], replicas)[0] == "holder"
    assert policy.match_blocks(under[A], "holder") == 3
    assert policy.match_blocks(under[None], "holder") == policy.match_blocks(under[B], "holder") == 0


def test_the_ingress_reads_the_adapter_from_the_body() -> None:
    """vLLM serves an adapter under its own name: a body naming a model other than the base's
    names an adapter, and its prompt is digested from that adapter's root."""
    from atombatch.serve.ray.ingress import lora_for_routing

    base = frozenset({"models/tiny", "tiny"})
    assert lora_for_routing(b'{"model": "sql", "prompt": [1, 2]}', base) == "sql"
    assert lora_for_routing(b'{"model": "tiny", "prompt": [1, 2]}', base) is None
    assert lora_for_routing(b'{"prompt": [1, 2]}', base) is None
    assert lora_for_routing(b'{"model": 7}', base) is None
    assert lora_for_routing(b"not json", base) is None
    prompt = list(range(3, 40))
    assert route_digests(prompt, ROUTE_BLOCK, MAX_BLOCKS, lora="sql") != \
        route_digests(prompt, ROUTE_BLOCK, MAX_BLOCKS)
