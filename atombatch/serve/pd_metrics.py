"""Prometheus metrics of a decoder's PD producer pool (docs/pd.md), read at scrape time.

| metric | type | labels |
|---|---|---|
| atombatch_pd_producers | gauge | state = live, suspect, retired |
| atombatch_pd_in_flight | gauge | producer (requests whose KV it is producing for this decoder) |
| atombatch_pd_opened_total | counter | producer (requests sent to it) |
| atombatch_pd_failed_total | counter | producer (sources that failed on the transport) |
| atombatch_pd_native_fallbacks_total | counter | (PD requests prefilled by the decoder: none up) |

Producer labels are bounded by the pool's size (`atombatch.core.pd.MAX_PRODUCERS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from atombatch.core.messages import PDStats


class PDCollector(Collector):
    """Reads `PDStats` (the core's last report, or an in-process pool's) when scraped."""

    def __init__(self, pd_stats: Callable[[], PDStats | None]) -> None:
        self._pd_stats = pd_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._pd_stats()
        producers = stats.producers if stats is not None else []
        states = GaugeMetricFamily("atombatch_pd_producers", "PD producers in the pool by state.",
                                   labels=["state"])
        counts = {"live": 0, "suspect": 0, "retired": 0}
        for p in producers:
            counts["retired" if p.retired else "suspect" if p.suspect else "live"] += 1
        for state, value in counts.items():
            states.add_metric([state], value)
        yield states
        in_flight = GaugeMetricFamily("atombatch_pd_in_flight",
                                      "Requests in flight on each PD producer.",
                                      labels=["producer"])
        opened = CounterMetricFamily("atombatch_pd_opened", "Requests sent to each PD producer.",
                                     labels=["producer"])
        failed = CounterMetricFamily("atombatch_pd_failed",
                                     "KV sources of each PD producer that failed on the transport.",
                                     labels=["producer"])
        for p in producers:
            in_flight.add_metric([p.name], p.in_flight)
            opened.add_metric([p.name], p.opened)
            failed.add_metric([p.name], p.failed)
        yield in_flight
        yield opened
        yield failed
        yield CounterMetricFamily("atombatch_pd_native_fallbacks",
                                  "PD requests the decoder prefilled itself: no producer was up.",
                                  value=stats.native_fallbacks if stats is not None else 0)


def add_pd_metrics(app: Any, pd_stats: Callable[[], PDStats | None]) -> None:
    """Export a pool's metrics on `app`'s `/metrics` (an app of `atombatch.serve.create_app`)."""
    app.state.metrics_registry.register(PDCollector(pd_stats))
