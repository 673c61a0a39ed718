"""Past one device: routing policies shared by the Ray Serve application (`atombatch.serve.ray`)
and the cluster simulation (`python -m atombatch.bench cluster`). See docs/cluster.md."""

from atombatch.cluster.routing import (
    LoadOnlyPolicy,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoutingStats,
    make_policy,
    route_digests,
)

__all__ = ["LoadOnlyPolicy", "PrefixAffinityPolicy", "ReplicaLoad", "RoutingStats", "make_policy",
           "route_digests"]
