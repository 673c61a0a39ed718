"""What admitting a request costs the device in the pipeline: the idle time around its chunk.

`python -m atombatch.bench overlap --admission-stalls` runs it after bench micro's admission
cases (which time the admitting `step()` itself, synchronously). Here a `Batcher` at a full
prefix cache (bench micro's `full_cache_batcher`: 16-token blocks, 2 048-token context, every
lane decoding) runs on a device whose calls wait `step_ms` with the GIL released, as a device
wait does; one lane's request is aborted, a new 128-token request arrives (hashed, queued) and
the engine steps until it has decoded. From the device's own call log: the idle time before the
admitted chunk (since the decode before it ended), after it (until the next decode starts), and
between two steady decodes. With `overlap` the chunk is planned while a decode runs and the
device thread launches it, then the other lanes' decode (docs/overlap.md); without, the
admission, the chunk's inputs, its first token and the next decode's inputs are all between
device calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import msgspec
import numpy as np

CACHED = (1_000, 10_000, 30_000)
LANES = (4, 16)
SPIN_S = 0.0003  # the last 0.3 ms of a wait are spun (GIL released), not slept


class AdmissionGap(msgspec.Struct, frozen=True):
    lanes: int
    cached: int                 # blocks in the prefix cache
    overlap: bool
    step_ms: float              # every device call's wait
    cycles: int                 # admissions measured
    before_us: float            # median device idle before the admitted chunk
    after_us: float             # median device idle after it, until the next decode
    steady_us: float            # median device idle between two steady decodes
    ahead: int                  # of those chunks, the ones the device thread launched


class _Waiting:
    """A device whose calls wait `wait_s` (numpy's instant logits from bench micro's null
    device), logging (kind, start, end) of each call."""

    def __init__(self, inner: Any, wait_s: float) -> None:
        self.inner, self.wait_s = inner, wait_s
        self.artifact = inner.artifact
        self.log: list[tuple[str, float, float]] = []

    def _call(self, kind: str, call: Any, inputs: Any) -> Any:
        clock = time.perf_counter
        started = clock()
        out = call(inputs)
        end = started + self.wait_s
        while (left := end - clock()) > 0:
            time.sleep(left - SPIN_S if left > 2 * SPIN_S else 0)
        self.log.append((kind, started, clock()))
        return out

    def prefill(self, inputs: Any) -> Any:
        return self._call("prefill", self.inner.prefill, inputs)

    def decode(self, inputs: Any) -> Any:
        return self._call("decode", self.inner.decode, inputs)


def measure(lanes: int, cached: int, overlap: bool, step_ms: float = 2.0,
            cycles: int = 40) -> AdmissionGap:
    """`cycles` admissions at B=`lanes` with `cached` blocks in the prefix cache."""
    import atombatch.kernel._blocks as impl
    from atombatch.api.structs import SamplingParams
    from atombatch.bench import cases

    batcher = cases.full_cache_batcher(impl, lanes, num_blocks=cases.admit_num_blocks(lanes, cached))
    device = _Waiting(batcher.runtime, step_ms / 1000.0)
    batcher.runtime = device
    batcher.overlap = overlap
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=cases.ADMIT_MAX_SEQ_LEN - cases.ADMIT_PROMPT - 8,
                            temperature=0.0, ignore_eos=True)

    def fresh() -> str:
        return batcher.submit(rng.integers(1, cases.ENGINE_VOCAB, size=cases.ADMIT_PROMPT).tolist(),
                              params)

    ids = [fresh() for _ in range(lanes)]
    while batcher.scheduler.lanes.num_decoding() < lanes:
        batcher.step()
    before, after, steady = [], [], []
    ahead = 0
    for cycle in range(cycles + 2):  # two to warm up (lanes rotate: none nears its limit)
        batcher.abort(ids.pop(0))
        for _ in range(6):  # the abort lands; no step in the air has a row for that lane
            batcher.step()
        del device.log[:-1]
        launched = batcher.stats().overlapped_prefills
        ids.append(fresh())
        request = batcher.scheduler.requests[ids[-1]]
        while len(request.output) < 2:
            batcher.step()
        for _ in range(6):
            batcher.step()
        log = device.log
        chunk = next(i for i, entry in enumerate(log) if entry[0] == "prefill")
        if cycle < 2:
            continue
        ahead += batcher.stats().overlapped_prefills - launched
        before.append(log[chunk][1] - log[chunk - 1][2])
        after.append(log[chunk + 1][1] - log[chunk][2])
        steady += [log[i][1] - log[i - 1][2] for i in range(chunk + 3, len(log))]
    for request_id in ids:
        batcher.abort(request_id)
    while batcher.has_unfinished():
        batcher.step()
    return AdmissionGap(lanes=lanes, cached=cached, overlap=overlap, step_ms=step_ms,
                        cycles=len(before), before_us=1e6 * statistics.median(before),
                        after_us=1e6 * statistics.median(after),
                        steady_us=1e6 * statistics.median(steady),
                        ahead=ahead)


def run(cycles: int = 40, step_ms: float = 2.0) -> list[AdmissionGap]:
    """Every B x cached-blocks case, pipeline on and off side by side."""
    return [measure(lanes, cached, overlap, step_ms, cycles)
            for lanes in LANES for cached in CACHED for overlap in (True, False)]


def section(gaps: list[AdmissionGap]) -> str:
    """The table: device idle before / after the admitting chunk and between steady decodes,
    pipeline on / off."""
    lines = ["| B | cached blocks | idle before the chunk (on / off) | idle after it (on / off) | "
             "steady idle (on / off) | chunks launched ahead |", "|---|---|---|---|---|---|"]
    by = {(g.lanes, g.cached, g.overlap): g for g in gaps}
    for lanes in sorted({g.lanes for g in gaps}):
        for cached in sorted({g.cached for g in gaps if g.lanes == lanes}):
            on, off = by.get((lanes, cached, True)), by.get((lanes, cached, False))

            def pair(field: str, on: Any = on, off: Any = off) -> str:
                return " / ".join("-" if g is None else f"{getattr(g, field):.0f} µs"
                                  for g in (on, off))

            launched = f"{on.ahead} of {on.cycles}" if on is not None else "-"
            lines.append(f"| {lanes} | {cached // 1000}k | {pair('before_us')} | "
                         f"{pair('after_us')} | {pair('steady_us')} | {launched} |")
    return "\n".join(lines)
