"""Sustained load for `bench overlap --sustained G`: c = B streams in flight, a new request as
soon as one ends, G x B requests in all.

A burst round (`overlap.client_round`) starts with every lane idle, so its ratio also pays the
policy's admission ramp and the last request's tail. Under sustained load the lanes never empty:
what the serving path loses is what each request costs as it passes through (its intake, its
prefill chunk, the steps its lane waits for its first token) and any decode step that waits for
the host. That is the throughput an operator who keeps B streams per device sees.

The window runs from the end of the last of the first B requests (from then on every stream in
flight was sent as a refill) to the send of the last request (from then on a stream that ends is
not replaced). The tokens delivered inside it are counted per stream from its first-token and
end times: a stream gets one token per device step, so its count grows linearly between them
(`tokens_at`). ratio = those tokens / window / (B / step).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

MIN_GENERATIONS = 3  # fewer leave no window in which every stream in flight is a refill


class Span(NamedTuple):
    sent: float       # the request went out
    first: float      # its first token arrived (0: never)
    ended: float      # its last token / [DONE] arrived
    tokens: int       # tokens it delivered


class Sustained(msgspec.Struct, frozen=True):
    """One sustained run (see the module docstring)."""

    requests: int
    ok: int                              # ended with every token and no error
    window_s: float
    tokens: float                        # delivered inside the window
    ratio: float                         # tokens / window_s / (B / step)
    ttft_ms: float | None                # median send -> first token of the refills
    decode_share: float | None           # median per request of (tokens - 1) x step / decode time
    front_cpu_s: float = 0.0             # over the whole run (server: see overlap.server_round)
    core_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    total_tokens: int = 0                # delivered over the whole run (the CPU's denominator)
    errors: tuple[str, ...] = ()


def tokens_at(span: Span, t: float) -> float:
    """Tokens `span`'s stream had delivered at time `t` (linear between its first and last)."""
    if not span.first or t < span.first:
        return 0.0
    if t >= span.ended or span.tokens <= 1 or span.ended <= span.first:
        return float(span.tokens)
    return 1.0 + (span.tokens - 1) * (t - span.first) / (span.ended - span.first)


def window(spans: Sequence[Span], batch_size: int) -> tuple[float, float]:
    """(start, stop) of the window; stop <= start when the run had no such window."""
    if len(spans) < MIN_GENERATIONS * batch_size:
        raise ValueError(f"{len(spans)} requests at concurrency {batch_size}: a sustained run "
                         f"needs at least {MIN_GENERATIONS} x {batch_size}")
    return max(s.ended for s in spans[:batch_size]), spans[-1].sent


def summarize(spans: Sequence[Span], batch_size: int, step_ms: float, ok: int,
              errors: tuple[str, ...] = (), **cpu: float) -> Sustained:
    """`spans` in send order; `cpu`: the CPU fields of `Sustained`."""
    start, stop = window(spans, batch_size)
    tokens = sum(tokens_at(s, stop) - tokens_at(s, start) for s in spans) if stop > start else 0.0
    length = max(0.0, stop - start)
    ideal = batch_size * 1e3 / step_ms
    step_s = step_ms / 1e3
    refills = [s for s in spans[batch_size:] if s.first]
    shares = [(s.tokens - 1) * step_s / (s.ended - s.first) for s in spans
              if s.tokens > 1 and s.ended > s.first > 0]
    return Sustained(requests=len(spans), ok=ok, window_s=length, tokens=tokens,
                     ratio=tokens / length / ideal if length > 0 else 0.0,
                     ttft_ms=1e3 * statistics.median(s.first - s.sent for s in refills)
                     if refills else None,
                     decode_share=statistics.median(shares) if shares else None,
                     total_tokens=sum(s.tokens for s in spans), errors=errors[:5], **cpu)
