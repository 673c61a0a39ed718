"""`AtomRequestRouter`: the Ray Serve request router that ranks replicas by prefix affinity
under a bound on imbalance, from the lane, queue and cache-summary figures replicas report."""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from atombatch.cluster.routing import (
    DEFAULT_ROUTE_BLOCK,
    OtherRouters,
    PrefixAffinityPolicy,
    ReplicaLoad,
)
from atombatch.cluster.summary import CacheSummary, check_summary_size
from atombatch.errors import ConfigError
from atombatch.logs import logger

log = logger("atombatch.serve.ray")


class AtomRequestRouter(RequestRouter):
    """Ray Serve request router: prefix affinity under a bound on imbalance.

    Replicas report `{"lanes", "occupied", "queue"}` and a summary of what their prefix cache
    holds (`summary_*`: `atombatch.cluster.summary.CacheSummary`) through `record_routing_stats`;
    the router adds its own count of requests in flight per replica (sent, not completed) and
    what it sent in the last `pending_s` seconds. Configured with `request_router_kwargs`:
    `max_imbalance`, `min_match_blocks`, `capacity`, `pending_s`.
    """

    def initialize_state(self, max_imbalance: int = 4, min_match_blocks: int = 1,
                         capacity: int = 200_000, pending_s: float = 2.0, **_: Any) -> None:
        self.policy = PrefixAffinityPolicy(max_imbalance=max_imbalance,
                                           min_match_blocks=min_match_blocks, capacity=capacity,
                                           pending_s=pending_s)
        self.in_flight: dict[str, int] = {}
        # internal request id -> (replica id, the request's digests)
        self._requests: dict[str, tuple[str, tuple[bytes, ...]]] = {}
        self.others = OtherRouters()

    def _state(self) -> PrefixAffinityPolicy:
        if not hasattr(self, "policy"):
            self.initialize_state()
        return self.policy

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        """The replica's load: this router's requests in flight there (exact) plus the other
        routers' (`atombatch.cluster.routing.OtherRouters`, from its reports)."""
        stats = replica.routing_stats or {}
        key = replica.replica_id.unique_id
        self.policy.report(key, summary_from_stats(stats))
        mine = self.in_flight.get(key, 0)
        others = self.others.estimate(key, stats.get("seq"), int(stats.get("occupied", 0)) +
                                      int(stats.get("queue", 0)), mine)
        return ReplicaLoad(key, lanes=int(stats.get("lanes", 1)), in_flight=mine + others,
                           prefix_cache=bool(stats.get("prefix_cache", True)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        policy = self._state()
        if not candidate_replicas:
            return []
        digests = _digests_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = policy.rank(digests, [self._load(r) for r in candidate_replicas],
                              time.monotonic())
        return [[by_id[key]] for key in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        policy = self._state()
        key = replica_id.unique_id
        digests = _digests_of(pending_request)
        policy.routed(digests, key, time.monotonic())
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self.others.sent(key, self.in_flight[key])
        self._requests[pending_request.metadata.internal_request_id] = (key, digests)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        policy = self._state()
        key, digests = self._requests.pop(internal_request_id, (None, ()))
        if key is None:
            return
        policy.completed(digests, key, time.monotonic())
        if self.in_flight.get(key, 0) > 0:
            self.in_flight[key] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set) if hasattr(self, "_replica_id_set") else set()
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self._forget(gone.unique_id)

    def _forget(self, key: str) -> None:
        self._state().forget(key)
        self.in_flight.pop(key, None)
        self.others.forget(key)
        self._requests = {rid: v for rid, v in self._requests.items() if v[0] != key}


def summary_from_stats(stats: dict[str, Any]) -> CacheSummary | None:
    """The cache summary a replica put in its routing stats, None if it reports none."""
    bits = stats.get("summary_bits")
    if not isinstance(bits, bytes) or not bits:
        return None
    hashes, count = stats.get("summary_hashes", 7), stats.get("summary_count", 0)
    route_block = stats.get("route_block", DEFAULT_ROUTE_BLOCK)
    try:
        # a replica's report is bounded like a summary built here: a forged one (10**6 hashes:
        # seconds and hundreds of MiB per routing decision) is ignored, not trusted
        if not all(isinstance(v, int) and not isinstance(v, bool)
                   for v in (hashes, count, route_block)):
            raise ConfigError(f"summary fields must be ints: hashes={hashes!r}, "
                              f"count={count!r}, route_block={route_block!r}")
        check_summary_size(len(bits) * 8, hashes)
        if not 1 <= route_block <= MAX_ROUTE_BLOCK or count < 0:
            raise ConfigError(f"route_block={route_block} must be in 1..{MAX_ROUTE_BLOCK} and "
                              f"count={count} >= 0")
    except ConfigError as exc:
        _warn_bad_summary(str(exc))
        return None
    return CacheSummary(bits, hashes=hashes, count=count, route_block=route_block,
                        truncated=bool(stats.get("summary_truncated", False)))


MAX_ROUTE_BLOCK = 1 << 16
_bad_summaries = 0


def _warn_bad_summary(reason: str) -> None:
    """Log the first and every 1000th refused summary (a flood must not flood the log)."""
    global _bad_summaries
    _bad_summaries += 1
    if _bad_summaries % 1000 == 1:
        log.warning("router.summary_ignored", reason=reason[:200], ignored=_bad_summaries)


def _digests_of(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None:
        return ()
    for arg in pending_request.args or ():
        # by attribute, not isinstance: Ray may load this module twice (by value and by name)
        digests = getattr(arg, "digests", None)
        if isinstance(digests, tuple):
            return digests
    return ()
