"""`bench overlap --sustained G`: the window's token count against schedules whose answer is
known, and the engine's closed loop on the null device."""

from __future__ import annotations

import pytest

from atombatch.bench import overlap, sustained
from atombatch.bench.sustained import Span

STEP_MS = 10.0


def schedule(batch: int, generations: int, tokens: int, idle_steps: int,
             step_ms: float = STEP_MS) -> list[Span]:
    """B lanes, each running requests back to back: a request sent at t gets its first token
    `idle_steps` steps later and one token per step after that; the next is sent at its end."""
    step = step_ms / 1e3
    spans: list[tuple[int, Span]] = []
    for lane in range(batch):
        t = lane * step / batch  # lanes out of phase, as a real load is
        for g in range(generations):
            first = t + idle_steps * step
            ended = first + (tokens - 1) * step
            spans.append((g, Span(t, first, ended, tokens)))
            t = ended
    return [s for _, s in sorted(spans, key=lambda x: x[1].sent)]


@pytest.mark.parametrize("idle", [0, 1, 4])
def test_a_lane_that_waits_k_steps_per_request_delivers_n_of_n_plus_k(idle: int) -> None:
    """Each lane delivers `tokens` tokens per `tokens - 1 + idle` steps: the window's ratio is
    that share (exactly, up to the window's cut through one request per lane)."""
    tokens = 64
    spans = schedule(8, 6, tokens, idle)
    held = sustained.summarize(spans, 8, STEP_MS, ok=len(spans))
    expected = tokens / (tokens - 1 + idle)
    assert held.ratio == pytest.approx(expected, rel=0.01)
    assert held.ttft_ms == pytest.approx(idle * STEP_MS)
    assert held.decode_share == pytest.approx(1.0)
    assert held.window_s > 2 * (tokens - 1 + idle) * STEP_MS / 1e3
    assert held.total_tokens == len(spans) * tokens


def test_a_slow_decode_shows_in_the_ratio_and_the_decode_share() -> None:
    spans = schedule(4, 5, 33, 0, step_ms=2 * STEP_MS)   # every step took two device steps
    held = sustained.summarize(spans, 4, STEP_MS, ok=len(spans))
    assert held.decode_share == pytest.approx(0.5)
    assert held.ratio == pytest.approx(0.5 * 33 / 32, rel=0.01)


def test_tokens_at_grows_one_per_step_between_first_and_last() -> None:
    span = Span(0.0, 1.0, 2.0, 11)
    assert sustained.tokens_at(span, 0.5) == 0
    assert sustained.tokens_at(span, 1.0) == 1
    assert sustained.tokens_at(span, 1.5) == pytest.approx(6)
    assert sustained.tokens_at(span, 3.0) == 11
    assert sustained.tokens_at(Span(0.0, 0.0, 1.0, 0), 5.0) == 0   # never started


def test_too_few_requests_leave_no_window() -> None:
    with pytest.raises(ValueError, match="at least 3 x 4"):
        sustained.window(schedule(4, 2, 16, 0), 4)


def test_the_engine_closed_loop_keeps_b_in_flight_and_every_request_completes() -> None:
    from atombatch.serve.cli import DEFAULT_SPEC

    batch, generations, tokens = 4, 3, 24
    prompts = overlap._prompts(batch * generations, 8, DEFAULT_SPEC.vocab_size, 0)
    for pipeline in (False, True):
        held = overlap.engine_sustained(batch, 1.0, 0.0, prompts, tokens, 1024, 128, None,
                                        DEFAULT_SPEC, None, pipeline)
        assert held.requests == held.ok == batch * generations
        assert held.total_tokens == batch * generations * tokens
        assert held.window_s > 0 and held.tokens > 0
        # the device cannot beat one token per lane per step; the linear count is off by less
        # than one token per stream at each end of the window
        assert 0 < held.ratio <= 1.0 + 2 * 1e-3 / held.window_s
        assert held.decode_share is not None and held.decode_share <= 1.0 + 1e-6
        assert held.ttft_ms is not None and held.core_cpu_s > 0


def test_sustained_needs_three_generations(capsys: pytest.CaptureFixture[str]) -> None:
    assert overlap.main(["--sustained", "2", "--no-server", "--batch-sizes", "1"]) == 2
    assert "--sustained 2: G must be 0 (off) or >= 3" in capsys.readouterr().err
