"""A victim stream timed while an attack is sent (its longest pause is the attack's stall of other
streams) and the bounds the adversarial tests assert on it and on the server's peak RSS."""

from __future__ import annotations

import itertools
import threading
import time

import httpx

from support.rss import MiB

NAME = "atombatch-tiny"


# Longest pause of a victim stream while an attack is parsed (the server's front holds the GIL
# for at most one msgspec decode of a max-size body and one bounded walk, well under a second;
# a machine running the whole suite on two cores adds scheduling noise: 2.3 s was seen once at
# load 8). 21fd0af: up to 20 s, 42 s and 70 s.
VICTIM_GAP = 3.0


# What one attack may add to the server's peak RSS: a max-size body (16 MiB) decoded into Python
# objects before it is refused (documented in docs/security.md). 21fd0af: +1.9 GiB and more.
RSS_BOUND = 320 * MiB


class Victim:
    """A streamed completion that runs while attacks are sent; records its event times.

    With `until_exit`, a stream that ends is followed by another until the `with` block exits,
    so the times cover the whole attack however long it takes (a new stream's first token
    counts as one more gap)."""

    def __init__(self, url: str, tokens: int = 400, until_exit: bool = False) -> None:
        self.url, self.tokens = url, tokens
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.until_exit = until_exit
        self.exiting = threading.Event()

    def _run(self) -> None:
        body = {"model": NAME, "prompt": "w1 w2", "max_tokens": self.tokens, "ignore_eos": True,
                "stream": True}
        try:
            while True:
                with httpx.stream("POST", self.url + "/v1/completions", json=body,
                                  timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.times.append(time.perf_counter())
                            self.started.set()
                if not self.until_exit or self.exiting.is_set():
                    return
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.started.set()

    def __enter__(self) -> Victim:
        self.thread.start()
        assert self.started.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.exiting.set()
        self.thread.join(120)

    def gap_during(self, start: float, end: float) -> float:
        """The longest time between two events that overlaps [start, end]."""
        times = self.times
        pairs = [(a, b) for a, b in itertools.pairwise(times) if b >= start and a <= end]
        return max((b - a for a, b in pairs), default=0.0)
