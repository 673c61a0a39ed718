"""Prefix-cache summaries computed in the engine core, for a front that routes.

The Ray replicas report a Bloom filter of what their prefix cache holds to the router
(atombatch/cluster/summary.py). The cache lives in the core, so the core computes the summary when
the front asks (`SummaryRequest`) and answers one `Summary`: a fixed-size filter (at most
`MAX_SUMMARY_BITS`, 1 MiB; 8 KiB by default) whatever the cache holds. The summarizer is kept
between requests, so each one hashes only the blocks cached since the last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atombatch.cluster.summary import CacheSummarizer, cache_roots
from atombatch.core.messages import Summary, SummaryRequest
from atombatch.errors import ConfigError
from atombatch.logs import logger

if TYPE_CHECKING:
    from atombatch.engine.batcher import Batcher

log = logger("atombatch.core")


class CoreSummaries:
    """Answers `SummaryRequest`s from one engine's prefix index and host cache."""

    def __init__(self) -> None:
        self._summarizer: CacheSummarizer | None = None
        self._key: tuple[int, int, int] | None = None

    def answer(self, batcher: Batcher, request: SummaryRequest) -> Summary:
        scheduler = batcher.scheduler
        if scheduler.prefix is None:
            return Summary(None)
        key = (request.route_block, request.max_blocks, request.bits)
        if self._summarizer is None or key != self._key:
            try:
                self._summarizer = CacheSummarizer(request.route_block, request.max_blocks,
                                                   bits=request.bits)
            except ConfigError as exc:
                log.warning("core.summary_refused", error=str(exc))
                return Summary(None)
            self._key = key
        return Summary(self._summarizer.summary(
            scheduler.prefix, scheduler.host,
            roots=cache_roots(batcher.lora_adapters.values())))
