"""The decoder's producer pool (by load, failover) and the ingress helpers, without Ray."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atombatch.errors import CapacityError, KVTransferError
from atombatch.pd.pool import ProducerPool
from atombatch.serve.metrics_merge import merge_metrics


class FakeSource:
    def __init__(self, endpoint: str, request_id: str, prompt: list[int], params: Any,
                 mode: str) -> None:
        self.endpoint = endpoint
        self.fail = endpoint.endswith("down")
        self.closed = False

    def poll(self) -> Any:
        if self.fail:
            raise KVTransferError(f"KV producer at {self.endpoint} disconnected")
        return None, []

    def done(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def test_requests_go_to_the_least_loaded_producer() -> None:
    pool = ProducerPool([("p0", "tcp://a"), ("p1", "tcp://b")], source_factory=FakeSource)
    first = pool.open("r0", [1, 2], None)
    second = pool.open("r1", [1, 2], None)
    assert (first._inner.endpoint, second._inner.endpoint) == ("tcp://a", "tcp://b")
    first.close()
    first.close()                                  # closing twice counts once
    third = pool.open("r2", [1, 2], None)
    assert third._inner.endpoint == first._inner.endpoint
    assert [(p.name, p.in_flight, p.opened) for p in pool.snapshot()] == \
        [("p0", 1, 2), ("p1", 1, 1)]


def test_a_failed_producer_gets_no_new_requests_until_checked() -> None:
    pool = ProducerPool([("p0", "tcp://down"), ("p1", "tcp://up")], source_factory=FakeSource)
    sources = [pool.open(f"r{i}", [1], None) for i in range(2)]
    bad = next(s for s in sources if s._inner.fail)
    with pytest.raises(KVTransferError, match="disconnected"):
        bad.poll()
    assert pool.available == ["p1"]
    assert all(pool.open(f"n{i}", [1], None)._inner.endpoint == "tcp://up" for i in range(3))
    pool.check(lambda p: True)                     # it answers again: back in the pool
    assert sorted(pool.available) == ["p0", "p1"]
    pool.check(lambda p: p.name != "p0")           # found dead: removed for good
    assert pool.available == ["p1"]
    pool.check(lambda p: (_ for _ in ()).throw(RuntimeError("ping failed")))
    with pytest.raises(CapacityError, match="no PD producer is available"):
        pool.open("last", [1], None)


def test_unreachable_producer_at_open() -> None:
    def refuse(endpoint: str, *args: Any) -> Any:
        raise KVTransferError(f"cannot reach a KV producer at {endpoint!r}")

    pool = ProducerPool([("p0", "tcp://x")], source_factory=refuse)
    with pytest.raises(KVTransferError, match="cannot reach"):
        pool.open("r", [1], None)
    (state,) = pool.snapshot()
    assert state.suspect and state.in_flight == 0 and state.failed == 1


def test_merge_metrics_labels_every_sample_by_replica() -> None:
    a = (b"# HELP atombatch_lanes Lanes.\n# TYPE atombatch_lanes gauge\natombatch_lanes 4.0\n"
         b"# HELP atombatch_blocks Blocks.\n# TYPE atombatch_blocks gauge\n"
         b'atombatch_blocks{state="free"} 3.0\n')
    b = b"# HELP atombatch_lanes Lanes.\n# TYPE atombatch_lanes gauge\natombatch_lanes 2.0\n"
    merged = merge_metrics({"r1": a, "r2": b}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    lanes = {s.labels["replica"]: s.value for s in families["atombatch_lanes"].samples}
    assert lanes == {"r1": 4.0, "r2": 2.0}
    (free,) = families["atombatch_blocks"].samples
    assert free.labels == {"replica": "r1", "state": "free"}
    assert merged.count("# TYPE atombatch_lanes gauge") == 1


def test_prompt_for_routing_reads_completions_and_chats() -> None:
    pytest.importorskip("ray")
    from atombatch.serve.ray import prompt_for_routing
    from atombatch.serve.tokens import IdCodec

    codec = IdCodec()
    assert prompt_for_routing(b'{"prompt": [5, 6, 7], "max_tokens": 2}', codec) == [5, 6, 7]
    assert prompt_for_routing(b'{"prompt": "<5><6>"}', codec) == codec.encode("<5><6>")
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "<9>"}]}]}'
    assert prompt_for_routing(chat, codec) == list(codec.render_chat([{"role": "user", "content": "<9>"}]))
    assert prompt_for_routing(b"not json", codec) == []
    assert prompt_for_routing(b'{"prompt": [1], "unknown": {"x": 1}}', codec) == [1]


def test_app_builder_takes_serve_config_args() -> None:
    pytest.importorskip("ray")
    from atombatch.errors import ConfigError
    from atombatch.serve.ray import app_builder

    app = app_builder({"engine": "--batch-size 2 --prefix-cache", "replicas": 3,
                       "max_imbalance": 2})
    assert type(app).__name__ == "Application"
    with pytest.raises(ConfigError, match=r"\['replica'\] are unknown"):
        app_builder({"replica": 3})
    with pytest.raises(ConfigError, match="router='random'"):
        app_builder({"router": "random"})


def test_producers_join_and_leave_while_requests_run() -> None:
    pool = ProducerPool(source_factory=FakeSource)
    with pytest.raises(CapacityError):
        pool.open("r0", [1], None)
    pool.sync({"a": "tcp://a"})
    running = pool.open("r1", [1], None)
    pool.sync({"a": "tcp://a", "b": "tcp://b"})                 # a new producer: used at once
    assert pool.open("r2", [1], None)._inner.endpoint == "tcp://b"
    # "a" leaves with a request in flight: retired, never chosen, kept until its request ends
    pool.sync({"b": "tcp://b"})
    assert pool.available == ["b"]
    assert [(p.name, p.retired, p.in_flight) for p in pool.snapshot()] == \
        [("a", True, 1), ("b", False, 1)]
    assert all(pool.open(f"n{i}", [1], None)._inner.endpoint == "tcp://b" for i in range(3))
    assert pool.check(lambda p: True) == []
    running.close()                                             # its request ended: gone
    assert [p.name for p in pool.snapshot()] == ["b"]
    # a producer found dead is not re-added from a stale registry, but its restart (a new
    # endpoint under the same name) is
    pool.sync({"b": "tcp://b", "c": "tcp://c"})
    assert pool.check(lambda p: p.name != "c")[0].name == "c"
    pool.sync({"b": "tcp://b", "c": "tcp://c"})
    assert pool.available == ["b"]
    pool.sync({"b": "tcp://b", "c": "tcp://c2"})
    assert sorted(pool.available) == ["b", "c"]


def test_verdicts_found_elsewhere_and_probes_of_static_producers() -> None:
    """`apply`: what an engine core does with its front's verdicts; `probe`: what it does with
    static producers (never removed, suspect while unreachable)."""
    pool = ProducerPool([("p0", "tcp://a"), ("p1", "tcp://b")], source_factory=FakeSource)
    running = pool.open("r0", [1], None)                       # on p0
    # a verdict on an endpoint the name no longer has is ignored
    assert pool.apply([("p0", "tcp://old", False)]) == []
    dead = pool.apply([("p0", "tcp://a", False), ("p1", "tcp://b", True)])
    assert [(d.name, d.in_flight) for d in dead] == [("p0", 1)]
    assert pool.available == ["p1"]
    running.close()                                            # the dead producer's request ends
    pool.sync({"p0": "tcp://a", "p1": "tcp://b"})
    assert pool.available == ["p1"]                            # dead at that endpoint for good

    static = ProducerPool([("s0", "tcp://a"), ("s1", "tcp://b")], source_factory=FakeSource)
    assert static.probe(lambda p: p.name == "s1") == ([], ["s0"])
    assert static.available == ["s1"] and len(static.snapshot()) == 2   # suspect, not removed
    assert static.probe(lambda p: p.name == "s1") == ([], [])          # still down: no change
    assert static.probe(lambda p: (_ for _ in ()).throw(OSError("probe failed"))) == \
        ([], ["s1"])                                           # a failing probe: unreachable
    assert static.probe(lambda p: True) == (["s0", "s1"], [])  # both back
    assert sorted(static.available) == ["s0", "s1"]
