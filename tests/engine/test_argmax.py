"""`RowArgmax`: numpy's row argmax, split over threads when the logits are large."""

from __future__ import annotations

import numpy as np
import pytest

from atombatch.errors import ConfigError
from atombatch.sampling.argmax import RowArgmax, auto_threads


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_split_argmax_is_numpys_including_nan_and_inf_rows(threads: int, rows: int) -> None:
    rng = np.random.default_rng(rows * 10 + threads)
    logits = rng.standard_normal((rows, 1000), dtype=np.float32)
    logits[0, 17] = np.nan                    # where numpy's argmax lands: the kernel relies on it
    if rows > 2:
        logits[2, 5] = np.inf
        logits[1, ::2] = -np.inf
    argmax = RowArgmax(threads, min_elements=0)  # split however small
    out = np.full(rows, -1, dtype=np.int64)
    argmax(logits, out)
    assert out.tolist() == np.argmax(logits, axis=1).tolist()
    assert out[0] == 17
    argmax.close()


def test_a_step_below_the_threshold_takes_one_thread() -> None:
    argmax = RowArgmax(4, min_elements=10_000)
    out = np.zeros(3, dtype=np.int64)
    argmax(np.eye(3, 7, 2, dtype=np.float32), out)
    assert out.tolist() == [2, 3, 4] and argmax._pool is None  # no workers were started


def test_thread_counts_are_checked_and_the_default_leaves_room() -> None:
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="argmax_threads="):
            RowArgmax(bad)  # type: ignore[arg-type]
    assert [auto_threads(c) for c in (1, 2, 4, 6, 8, 64)] == [1, 1, 1, 3, 4, 4]


def test_a_batcher_whose_steps_split_the_argmax_decodes_the_same_tokens() -> None:
    import msgspec

    from atombatch import ArtifactConfig, Batcher, SamplingParams
    from atombatch.runtime.null import NullRuntime
    from atombatch.serve.cli import DEFAULT_SPEC

    spec = msgspec.structs.replace(DEFAULT_SPEC, vocab_size=1 << 17)  # 64 rows: 8M logits
    art = ArtifactConfig(model=spec, batch_size=64, max_seq_len=64, block_size=64,
                         num_blocks=65, prefill_chunk_size=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 7 + 2 * i] for i in range(64)]
    tokens = {}
    for threads in (1, 3):
        batcher = Batcher(NullRuntime(art, step_ms=0.0), argmax_threads=threads)
        tokens[threads] = [c.token_ids for c in batcher.generate(prompts, params)]
        assert (batcher._argmax._pool is not None) == (threads > 1)  # the split really ran
    assert tokens[1] == tokens[3] and len(set(map(tuple, tokens[1]))) > 1


class _Blocks(np.ndarray):
    """Logits whose row blocks take their time (np.argmax calls the array's own `argmax`), and
    whose first block fails: what a failure in one part of the split looks like."""

    finished: list[int] = []

    def argmax(self, axis=None, out=None, **kwargs):  # type: ignore[no-untyped-def, override]
        import time

        if self[0, 0] == -1.0:
            raise ValueError("block 0 broke")
        time.sleep(0.2)
        result = np.asarray(self).argmax(axis=axis, out=out)
        _Blocks.finished.append(int(self[0, 0]))
        return result


def test_a_failing_block_still_waits_for_every_other_block() -> None:
    """The caller reuses `out` right after a failure (the engine's next step): no worker may
    still be writing it then."""
    logits = np.zeros((4, 8), dtype=np.float32)
    logits[:, 0] = [-1.0, 5.0, 6.0, 7.0]             # each block's first logit names it
    blocks = logits.view(_Blocks)
    _Blocks.finished = []
    argmax = RowArgmax(4, min_elements=0)
    with pytest.raises(ValueError, match="block 0 broke"):
        argmax(blocks, np.zeros(4, dtype=np.int64))
    assert sorted(_Blocks.finished) == [5, 6, 7]      # the other three were done by then
    argmax.close()


def test_the_default_counts_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core pinned to two CPUs of a 64-core host (taskset, a cpuset) must not start 4 threads."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert auto_threads() == 1 and RowArgmax().threads == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(12)))
    assert auto_threads() == 4


class _Counted(np.ndarray):
    """Logits that count the calls of their own `argmax` (numpy's path, not the compiled one)."""

    calls = 0

    def argmax(self, axis=None, out=None, **kwargs):  # type: ignore[no-untyped-def, override]
        _Counted.calls += 1
        return np.asarray(self).argmax(axis=axis, out=out)


def test_below_the_threshold_only_a_plain_float32_step_takes_the_compiled_kernel() -> None:
    """A subclass keeps its own `argmax`, a wider array numpy's (a float32 copy would tie what it
    tells apart); a plain float32 step is `argmax_rows`, with the same result."""
    argmax = RowArgmax(1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 300)).astype(np.float32)
    out = np.zeros(8, dtype=np.int64)
    _Counted.calls = 0
    argmax(x.view(_Counted), out)
    assert _Counted.calls == 1 and out.tolist() == np.argmax(x, axis=1).tolist()
    argmax(x, out)
    assert _Counted.calls == 1 and out.tolist() == np.argmax(x, axis=1).tolist()
    wide = np.zeros((2, 5), dtype=np.float64)
    wide[:, 1] = 1.0
    wide[:, 3] = 1.0 + 1e-12                       # equal once rounded to float32
    argmax(wide, out[:2])
    assert out[:2].tolist() == [3, 3]


def test_pick_takes_the_token_from_the_wide_array_and_the_logit_from_the_float32_one() -> None:
    argmax = RowArgmax(1)
    wide = np.zeros((2, 5), dtype=np.float64)
    wide[:, 1] = 1.0
    wide[:, 3] = 1.0 + 1e-12
    logits = wide.astype(np.float32)
    out = np.zeros(4, dtype=np.int64)
    best = np.zeros(4, dtype=np.float32)
    argmax.pick(logits, wide, out, best, 2)
    assert out[:2].tolist() == [3, 3] and best[:2].tolist() == [1.0, 1.0]
    argmax.pick(logits, logits, out, best, 2)     # the float32 array itself: its first maximum
    assert out[:2].tolist() == [1, 1]
