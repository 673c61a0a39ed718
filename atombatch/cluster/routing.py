"""Which replica serves a request: prefix affinity under a bound on load imbalance.

Theory of operation
-------------------
A replica's prefix cache (atombatch/kernel/prefix.py) keeps the KV of the sequences it served, so a
request whose leading tokens another request already brought to a replica skips that part of its
prefill there and nowhere else. The router therefore remembers where it sent which prefixes: a
prompt is cut into `route_block` tokens at a time and each full block gets the chained digest the
prefix cache uses (`atombatch.kernel.prefix.chain_digest`: a digest covers every token before it), so a
matching run of leading digests is a shared prefix of that many blocks, whatever the replicas'
own block sizes. The table maps digest -> replicas that were sent it, bounded in entries (LRU).

Load is what the router itself has in flight on each replica (sent, not yet finished: exact for
its own traffic) plus what other routers hold there, estimated from the replica's reports (lanes
holding a request, requests without a lane) by `OtherRouters`: reports are stale by a period or
more, so a report only adds the requests it shows beyond this router's own.

What replicas hold is learned two ways. Each replica reports a summary of what its prefix cache
actually holds (`atombatch.cluster.summary.CacheSummary`: a Bloom filter of the routing digests of
its cached chains, device and host cache), refreshed every report period: evictions, restarts and
prefixes other routers brought there show up in the next report. Between reports the router adds
what it sent itself: a digest sent to a replica counts there for `pending_s` after the request was
sent or completed (the time the replica needs to cache and report it); past that only the
replica's own report counts. A replica that never reported a summary (another router's replicas,
the simulator) is judged by what was sent to it alone, until the table forgets it (LRU).

The choice, for one request:
1. `floor` = the smallest load among the candidates. A replica is *eligible* when its load is at
   most `floor + max_imbalance`: affinity may pile work onto a replica only that far beyond the
   least loaded one, so a hot prefix never starves the others and never queues without bound.
   Lanes come first: while some candidate has a free lane, only replicas with a free lane are
   eligible (a request never waits for a lane on a prefix holder while a lane is free elsewhere:
   a lane wait costs whole requests' decode time, a missed prefix costs only its prefill).
2. Among eligible replicas, the one holding the longest run of the prompt's leading digests wins
   (reported or recently sent; only runs of at least `min_match_blocks` count, and only on
   replicas with a prefix cache);
   ties go to the lower load.
3. With no match, the least loaded replica wins; ties are broken by rendezvous hashing of the
   prompt's first digest, so requests of a new prefix group that arrive together land together and
   different groups spread.
The ranking returned puts that replica first and the others by load, for a caller (Ray Serve)
that tries the next one when the first is full or gone.

Sans-I/O: the policy reads no clock and does no I/O; the caller reports routing, completion and
replica removal.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.cluster.summary import CacheSummary, _positions, route_root
from atombatch.errors import CapacityError, ConfigError
from atombatch.kernel import prefix

DEFAULT_ROUTE_BLOCK = 64
DEFAULT_MAX_BLOCKS = 64


def route_digests(prompt: Sequence[int] | npt.NDArray[np.integer],
                  route_block: int = DEFAULT_ROUTE_BLOCK,
                  max_blocks: int = DEFAULT_MAX_BLOCKS, *,
                  lora: str | None = None) -> tuple[bytes, ...]:
    """Chained digests of the prompt's leading full `route_block`-token blocks (at most
    `max_blocks`), computed with the prefix cache's own digest function, from the root of the
    request's LoRA adapter (`lora`, by name; None: the base model)."""
    if route_block < 1 or max_blocks < 0:
        raise ConfigError(f"route_block={route_block} must be >= 1 and max_blocks={max_blocks} "
                          ">= 0")
    tokens = np.asarray(prompt, dtype=np.int64)
    blocks = min(len(tokens) // route_block, max_blocks)
    digests: list[bytes] = []
    parent = route_root(lora)
    for j in range(blocks):
        parent = prefix.chain_digest(parent, tokens[j * route_block:(j + 1) * route_block], True)
        digests.append(parent)
    return tuple(digests)


class ReplicaLoad(msgspec.Struct, frozen=True):
    """What the router knows about one replica's load."""

    replica: str                        # the replica's id
    lanes: int = 1                      # decode lanes of its artifact (B)
    occupied: int = 0                   # lanes holding a request (last report)
    queue: int = 0                      # requests without a lane (last report)
    in_flight: int = 0                  # requests this router sent there and saw no end of yet
    prefix_cache: bool = True           # the replica keeps prefixes (False: affinity is moot)

    @property
    def load(self) -> int:
        """Requests the replica holds: the larger of its report and the router's own count."""
        return max(self.occupied + self.queue, self.in_flight)

    @property
    def free_lanes(self) -> int:
        return max(0, self.lanes - self.load)


class OtherRouters:
    """Requests other routers hold on each replica, estimated from the replicas' reports.

    A report (`occupied + queue`) counts every request a replica held when it was made, this
    router's included, and reaches the router a report period or more later (seconds, on a
    loaded machine). Taken as it is (or as a lower bound on the load), a report made while this
    router's own requests ran keeps a replica "full" long after they ended, and affinity spills
    for nothing. So, per replica, the router keeps the most requests it had in flight there
    since the previous report arrived (the new one was made in that window) and counts only the
    report's excess over it as other routers' requests. A replica numbers its reports (`seq`,
    changed whenever its figure changes); each is judged once, when it first arrives.
    """

    def __init__(self) -> None:
        # replica -> (seq of the last report judged, most in flight since it arrived, others)
        self._state: dict[str, tuple[object, int, int]] = {}

    def sent(self, replica: str, mine: int) -> None:
        """This router now has `mine` requests in flight on `replica`."""
        seq, window, others = self._state.get(replica, (None, 0, 0))
        self._state[replica] = (seq, max(window, mine), others)

    def estimate(self, replica: str, seq: object, reported: int, mine: int) -> int:
        """Other routers' requests on `replica`, given its latest report (`seq`, `reported`)
        and this router's `mine` in flight there now."""
        last, window, others = self._state.get(replica, (None, mine, 0))
        if seq is None or seq != last:
            others = max(0, reported - max(window, mine))
            window = mine
        self._state[replica] = (seq, max(window, mine), others)
        return others

    def forget(self, replica: str) -> None:
        self._state.pop(replica, None)


class RoutingStats(msgspec.Struct):
    """Counters of the decisions a policy made (for logs and the benchmark)."""

    routed: int = 0                     # requests routed
    affinity: int = 0                   # sent to the replica holding the longest prefix
    reported: int = 0                   # ... whose match the replica's own cache report vouched for
    spilled: int = 0                    # a prefix holder existed but was over the imbalance bound
    fresh: int = 0                      # no replica held a usable prefix: least loaded


class PrefixAffinityPolicy:
    """Prefix affinity with a bound on imbalance (see the module docstring).

    Args:
        max_imbalance: requests a replica may hold beyond the least loaded candidate and still be
            chosen for affinity (0: affinity only breaks ties between equally loaded replicas).
        min_match_blocks: leading route blocks that must match for affinity to count.
        capacity: digests remembered (least recently used ones are forgotten first).
        holders_per_digest: replicas remembered per digest (a prefix spilled to several replicas
            is kept on the most recent ones).
        pending_s: seconds a digest sent to a replica that reports summaries counts there
            without its report (see the module docstring).

    Times (`now`) are the caller's clock, in seconds; the policy reads none.
    """

    def __init__(self, *, max_imbalance: int = 4, min_match_blocks: int = 1,
                 capacity: int = 200_000, holders_per_digest: int = 4,
                 pending_s: float = 2.0) -> None:
        if max_imbalance < 0:
            raise ConfigError(f"max_imbalance={max_imbalance} must be >= 0")
        if min_match_blocks < 1:
            raise ConfigError(f"min_match_blocks={min_match_blocks} must be >= 1")
        if capacity < 1 or holders_per_digest < 1:
            raise ConfigError(f"capacity={capacity} and holders_per_digest={holders_per_digest} "
                              "must be >= 1")
        self.max_imbalance = max_imbalance
        self.min_match_blocks = min_match_blocks
        self.capacity = capacity
        self.holders_per_digest = holders_per_digest
        if pending_s < 0:
            raise ConfigError(f"pending_s={pending_s} must be >= 0")
        self.pending_s = pending_s
        self.stats = RoutingStats()
        # digest -> {replica: when it was last sent (or completed) there}, most recent last
        self._table: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self._summaries: dict[str, CacheSummary] = {}

    def __len__(self) -> int:
        return len(self._table)

    # -- decisions --------------------------------------------------------------------------------
    def report(self, replica: str, summary: CacheSummary | None) -> None:
        """`replica`'s latest report of what its cache holds (None: it reports none)."""
        if summary is None:
            self._summaries.pop(replica, None)
        else:
            self._summaries[replica] = summary

    def summary(self, replica: str) -> CacheSummary | None:
        return self._summaries.get(replica)

    def match_blocks(self, digests: Sequence[bytes], replica: str, now: float = 0.0) -> int:
        """How many of the leading digests `replica` holds (a run from block 0): in its last
        report, or sent there recently (see the module docstring)."""
        return self._matches(digests, [replica], now)[replica][0]

    def _matches(self, digests: Sequence[bytes], replicas: Sequence[str], now: float
                 ) -> dict[str, tuple[int, int]]:
        """replica -> (leading digests held, of which the replica's report vouches for)."""
        positions: dict[tuple[int, int], npt.NDArray[np.int64]] = {}
        out: dict[str, tuple[int, int]] = {}
        for replica in replicas:
            summary = self._summaries.get(replica)
            reported = 0
            if summary is not None and digests:
                key = (summary.num_bits, summary.hashes)
                if key not in positions:
                    positions[key] = _positions(digests, *key)
                reported = summary.run(digests, positions[key])
            n = reported
            horizon = now - self.pending_s if summary is not None else -np.inf
            while n < len(digests):
                sent = self._table.get(digests[n])
                when = sent.get(replica) if sent is not None else None
                if (when is None or when < horizon) and \
                        (summary is None or digests[n] not in summary):
                    break
                n += 1
            out[replica] = (n, reported)
        return out

    def rank(self, digests: Sequence[bytes], replicas: Sequence[ReplicaLoad],
             now: float = 0.0) -> list[str]:
        """Replica ids, best first. Records nothing: call `routed` once a replica took it.

        Raises:
            CapacityError: no replicas.
        """
        if not replicas:
            raise CapacityError("no replicas to route to")
        floor = min(r.load for r in replicas)
        found = self._matches(digests, [r.replica for r in replicas if r.prefix_cache], now)
        matches = {r.replica: found.get(r.replica, (0, 0))[0] for r in replicas}
        bound = floor + self.max_imbalance
        lane_free = any(r.free_lanes > 0 for r in replicas)
        usable = [r for r in replicas if matches[r.replica] >= self.min_match_blocks]
        eligible = [r for r in usable
                    if r.load <= bound and (r.free_lanes > 0 or not lane_free)]
        first = digests[0] if digests else b""

        def spread(r: ReplicaLoad) -> bytes:  # rendezvous hash: a stable order per prefix
            return hashlib.blake2b(first + r.replica.encode(), digest_size=8).digest()

        if eligible:
            best = min(eligible, key=lambda r: (-matches[r.replica], r.load, spread(r)))
            self.stats.affinity += 1
            if found[best.replica][1] >= self.min_match_blocks:
                self.stats.reported += 1
        else:
            best = min(replicas, key=lambda r: (r.load, spread(r)))
            if usable:
                self.stats.spilled += 1
            else:
                self.stats.fresh += 1
        self.stats.routed += 1
        rest = sorted((r for r in replicas if r is not best),
                      key=lambda r: (r.load, -matches[r.replica], spread(r)))
        return [best.replica] + [r.replica for r in rest]

    def choose(self, digests: Sequence[bytes], replicas: Sequence[ReplicaLoad],
               now: float = 0.0) -> str:
        """Rank, take the best, and record that it now holds the prompt's prefix."""
        chosen = self.rank(digests, replicas, now)[0]
        self.routed(digests, chosen, now)
        return chosen

    # -- what happened ----------------------------------------------------------------------------
    def routed(self, digests: Iterable[bytes], replica: str, now: float = 0.0) -> None:
        """`replica` took a request with these leading digests (its cache will hold them)."""
        table = self._table
        for digest in digests:
            holders = table.get(digest)
            if holders is None:
                table[digest] = {replica: now}
            else:
                holders.pop(replica, None)
                holders[replica] = now
                while len(holders) > self.holders_per_digest:
                    del holders[next(iter(holders))]
                table.move_to_end(digest)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def completed(self, digests: Iterable[bytes], replica: str, now: float = 0.0) -> None:
        """A request `replica` took with these digests ended: they count there for another
        `pending_s` (its cache holds them now; its next report will say so)."""
        for digest in digests:
            holders = self._table.get(digest)
            if holders is None or replica not in holders:
                break
            holders[replica] = max(holders[replica], now)

    def forget(self, replica: str) -> None:
        """`replica` is gone (died, removed): nothing will be sent there for its prefixes."""
        self._summaries.pop(replica, None)
        for digest in list(self._table):
            holders = self._table[digest]
            if replica in holders:
                del holders[replica]
                if not holders:
                    del self._table[digest]


class LoadOnlyPolicy:
    """The baselines: "pow2" (Ray Serve's default: two random replicas, the less loaded wins),
    "least-loaded" and "round-robin". Same interface as `PrefixAffinityPolicy`."""

    KINDS = ("pow2", "least-loaded", "round-robin")

    def __init__(self, kind: str = "pow2", seed: int = 0) -> None:
        if kind not in self.KINDS:
            raise ConfigError(f"policy {kind!r} is not one of {self.KINDS}")
        self.kind = kind
        self.stats = RoutingStats()
        self._rng = np.random.default_rng(seed)
        self._next = 0

    def rank(self, digests: Sequence[bytes], replicas: Sequence[ReplicaLoad],
             now: float = 0.0) -> list[str]:
        if not replicas:
            raise CapacityError("no replicas to route to")
        order = list(replicas)
        if self.kind == "round-robin":
            start = self._next % len(order)
            self._next += 1
            order = order[start:] + order[:start]
        elif self.kind == "pow2":
            picks = self._rng.permutation(len(order))
            two = sorted((order[i] for i in picks[:2]), key=lambda r: r.load)
            order = two + [order[i] for i in picks[2:]]
        else:
            order.sort(key=lambda r: r.load)
        self.stats.routed += 1
        self.stats.fresh += 1
        return [r.replica for r in order]

    def choose(self, digests: Sequence[bytes], replicas: Sequence[ReplicaLoad],
               now: float = 0.0) -> str:
        return self.rank(digests, replicas, now)[0]

    def routed(self, digests: Iterable[bytes], replica: str, now: float = 0.0) -> None:
        pass

    def completed(self, digests: Iterable[bytes], replica: str, now: float = 0.0) -> None:
        pass

    def report(self, replica: str, summary: CacheSummary | None) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


def make_policy(name: str, *, seed: int = 0, max_imbalance: int = 4
                ) -> PrefixAffinityPolicy | LoadOnlyPolicy:
    """"prefix" (`PrefixAffinityPolicy`) or a `LoadOnlyPolicy` kind."""
    if name == "prefix":
        return PrefixAffinityPolicy(max_imbalance=max_imbalance)
    return LoadOnlyPolicy(name, seed=seed)
