"""Past one device: routing policies shared by the Ray Serve application (`atombatch.serve.ray`)
and the cluster simulation (`python -m atombatch.bench cluster`). See docs/cluster.md."""

from atombatch.cluster.routing import (
    LoadOnlyPolicy,
    OtherRouters,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoutingStats,
    make_policy,
    route_digests,
)
from atombatch.cluster.summary import CacheSummarizer, CacheSummary

__all__ = ["CacheSummarizer", "CacheSummary", "LoadOnlyPolicy", "OtherRouters",
           "PrefixAffinityPolicy", "ReplicaLoad", "RoutingStats", "make_policy", "route_digests"]
