"""Running a Batcher to the end in tests, checking the ownership invariants after every step."""

from __future__ import annotations

from atombatch import Batcher, RequestOutput


def run_to_end(batcher: Batcher, check: bool = True) -> dict[str, RequestOutput]:
    """Step until every request finished; returns each request's final output by id."""
    finals: dict[str, RequestOutput] = {}
    while batcher.has_unfinished():
        for out in batcher.step():
            assert out.request_id not in finals, f"{out.request_id} produced output after finishing"
            if out.finished:
                finals[out.request_id] = out
        if check:
            batcher.check_invariants()
    return finals
