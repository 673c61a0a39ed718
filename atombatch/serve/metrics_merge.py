"""Merge several servers' Prometheus exposition texts into one, each sample labelled with its
source (`replica="..."`): what `/metrics` of the Ray Serve ingress answers (docs/cluster.md).
`sum_metrics` adds them up instead: the fronts of one shared engine core (atombatch/core/shared.py)
expose one set of HTTP metrics."""

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
    return exposition(list(merged.values()))


def exposition(families: list[Metric]) -> bytes:
    """`families` as Prometheus exposition text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families))
    return bytes(generate_latest(registry))


def sum_metrics(texts: list[bytes | str]) -> list[Metric]:
    """The families of every text with the samples of equal name and labels added up (counters,
    gauges, histogram buckets, sums and counts); a `_created` sample keeps the earliest."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        if isinstance(text, bytes):
            text = text.decode()
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type,
                                               family.unit)
                values[family.name] = {}
            totals = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in totals:
                    totals[key] = sample.value
                elif sample.name.endswith("_created"):
                    totals[key] = min(totals[key], sample.value)
                else:
                    totals[key] += sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.samples.append(Sample(sample_name, dict(labels), value))
    return list(families.values())
