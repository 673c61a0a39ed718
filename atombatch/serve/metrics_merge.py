"""Merge several servers' Prometheus exposition texts into one, each sample labelled with its
source (`replica="..."`): what `/metrics` of the Ray Serve ingress answers (docs/cluster.md)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_metrics(texts: Mapping[str, bytes | str], label: str = "replica") -> bytes:
    """One exposition text holding every family of every source, samples labelled by source."""
    merged: dict[str, Metric] = {}
    for source, text in sorted(texts.items()):
        if isinstance(text, bytes):
            text = text.decode()
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            for sample in family.samples:
                labels = {label: source, **sample.labels}
                target.samples.append(Sample(sample.name, labels, sample.value,
                                             sample.timestamp, sample.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return bytes(generate_latest(registry))
