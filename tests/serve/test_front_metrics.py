"""The HTTP metrics of several fronts on one engine core (atombatch/serve/metrics.py,
`_FrontFamilies`): each front writes its own to a file in the core's directory, and any front's
scrape answers the sum. A file another front reads is always whole, whoever writes it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.engines import ART, numpy_batcher

from atombatch.core.shared import SharedCore
from atombatch.serve.metrics import ServerMetrics, front_metrics_path


def front_metrics(directory: Path, front: int, fronts: int = 2) -> ServerMetrics:
    shared = SharedCore(directory=str(directory), fronts=fronts, front=front,
                        core_pid=os.getpid())
    return ServerMetrics(numpy_batcher().stats, ART, "core-test", shared=shared)


def finished(text: str) -> float:
    families = {family.name: family for family in text_string_to_metric_families(text)}
    return sum(sample.value for sample in families["atombatch_requests_finished"].samples
               if sample.name.endswith("_total"))


def test_a_fronts_file_is_whole_while_its_timer_and_a_scrape_both_write_it(
        tmp_path: Path) -> None:
    metrics = front_metrics(tmp_path, 1)
    for reason in ("stop", "length", "abort", "error"):
        metrics.finished.labels(reason).inc(7)
    for i in range(200):  # a longer text: more time inside each write
        metrics.e2e.observe(i / 10)
        metrics.ttft.observe(i / 100)
    metrics.fronts.write()
    stop = threading.Event()

    def write() -> None:  # the every-second timer and a scrape, racing
        while not stop.is_set():
            metrics.fronts.write()

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    path, seen, torn = front_metrics_path(str(tmp_path), 1), 0, []
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # what another front's scrape reads
            try:
                with open(path) as handle:
                    text = handle.read()
            except FileNotFoundError:
                continue
            seen += 1
            try:
                if finished(text) != 28:
                    torn.append(len(text))
            except Exception:  # cut inside a line
                torn.append(len(text))
    finally:
        stop.set()
        for writer in writers:
            writer.join(10)
    assert seen > 50
    assert not torn, f"{len(torn)} of {seen} reads found a partial file"


def scraped(metrics: ServerMetrics) -> dict[str, float]:
    """What a scrape of this front answers: each sample by name and labels."""
    text = generate_latest(metrics.registry).decode()
    return {f"{sample.name}{sorted(sample.labels.items())}": sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_front_started_again_keeps_its_predecessors_counts_not_its_gauges(
        tmp_path: Path) -> None:
    first = front_metrics(tmp_path, 0)
    dead = front_metrics(tmp_path, 1)
    first.finished.labels("length").inc(2)
    dead.finished.labels("length").inc(5)
    dead.e2e.observe(0.3)
    dead.generation_tokens.inc(40)
    dead.in_flight.inc(3)  # in flight when it died
    first.in_flight.inc(1)
    dead.fronts.write()
    before = scraped(first)
    assert before["atombatch_requests_finished_total[('reason', 'length')]"] == 7
    assert before["atombatch_requests_in_flight[]"] == 4
    again = front_metrics(tmp_path, 1)  # the launcher started front 1 again
    again.finished.labels("length").inc(1)
    again.generation_tokens.inc(4)
    again.fronts.write()  # (its timer)
    for metrics in (first, again):  # either front's scrape
        after = scraped(metrics)
        # counters never go back (a drop would read as a reset: a false burst in rate())
        assert after["atombatch_requests_finished_total[('reason', 'length')]"] == 8
        assert after["atombatch_generation_tokens_total[]"] == 44
        assert after["atombatch_e2e_request_latency_seconds_count[]"] == 1
        assert after["atombatch_e2e_request_latency_seconds_sum[]"] == 0.3
        # the dead front's requests are not in flight any more
        assert after["atombatch_requests_in_flight[]"] == 1
        created = after["atombatch_requests_finished_created[('reason', 'length')]"]
        assert created == before["atombatch_requests_finished_created[('reason', 'length')]"]
