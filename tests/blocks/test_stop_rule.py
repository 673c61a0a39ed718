"""The one stop rule and the one output limit (atombatch/engine/request.py): the decode-step kernel's
decisions, compiled and twin, equal `check_stop` over random requests; the limit is resolved once."""

from __future__ import annotations

import random
from array import array
from typing import Any

import atombatch.kernel._blocks as c_impl
import numpy as np
import pytest

import atombatch.kernel._blocks_py as py_impl
from atombatch.api.structs import SamplingParams
from atombatch.engine.request import Request, check_stop, output_limit, stop_ids
from atombatch.kernel.blocks import LANE, ROW_CHECK, ROW_LENGTH, ROW_OK, ROW_STOP

VOCAB = 12
DECISION = {ROW_OK: None, ROW_STOP: "stop", ROW_LENGTH: "length"}


def random_case(rnd: random.Random) -> tuple[Request, tuple[int, ...], int, int]:
    """A request with some output, the model's EOS ids, its next token and max_seq_len."""
    max_seq_len = rnd.randint(4, 40)
    prompt_len = rnd.randint(1, max_seq_len - 2)
    room = max_seq_len - prompt_len
    max_tokens = None if rnd.random() < 0.3 else rnd.randint(2, room)
    # few stop ids (a tuple), or many with repeats (a set in the Request; past the kernel's
    # MAX_STOP_IDS the kernel hands the lane to check_stop: a client may send 2**18 of them)
    count = rnd.randint(0, 4) if rnd.random() < 0.6 else rnd.randint(9, 40)
    stops = rnd.choices(range(VOCAB), k=count)
    eos = tuple(rnd.sample(range(VOCAB), rnd.randint(0, 2)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops,
                            ignore_eos=rnd.random() < 0.5)
    request = Request("r", np.arange(1, prompt_len + 1, dtype=np.int64), params, 0.0,
                      np.random.default_rng(0), max_seq_len)
    done = rnd.randint(1, request.max_tokens - 1)  # tokens out before this step
    request.output.extend(rnd.randrange(VOCAB) for _ in range(done))
    return request, eos, rnd.randrange(VOCAB), max_seq_len


@pytest.mark.parametrize("impl", [c_impl, py_impl], ids=["c", "py"])
def test_the_kernel_decides_as_check_stop(impl: Any) -> None:
    rnd = random.Random(21)
    seen = set()
    checked = 0
    for _ in range(600):
        request, eos, token, max_seq_len = random_case(rnd)
        pool, lanes = impl.BlockPool(3), impl.LaneTable(1, 1, max_seq_len)
        kernel = impl.StepKernel(pool, lanes, impl.DecodeInputs(1, 1))
        lane = lanes.assign()
        lanes.push_block(lane, pool.allocate(LANE, lane))
        out = len(request.output)
        lanes.start_decode(lane, len(request.prompt) + out - 1, request.output[-1])
        kernel.bind(lane, "r", request.output, array("d", [0.0] * out), request.max_tokens,
                    stop_ids(request.params, eos), 0)
        kernel.build(pool.reserve_spare())
        logits = np.zeros((1, VOCAB), dtype=np.float32)
        logits[0, token] = 1.0
        kernel.pick(logits, logits.argmax(axis=1))
        kernel.complete(1.0)
        assert list(request.output[-1:]) == [token]
        want = check_stop(request, token, frozenset(eos))
        params = request.params  # the rule spelled out on the client's list (a set inside)
        naive = "stop" if token in params.stop_token_ids or \
            (not params.ignore_eos and token in eos) else \
            "length" if len(request.output) >= request.max_tokens else None
        assert want == naive
        status = int(kernel.status[0])
        if status == ROW_CHECK:  # more stop ids than the kernel holds: the scheduler decides
            assert len(stop_ids(request.params, eos)) > kernel.max_stop_ids
            checked += 1
        else:
            assert DECISION[status] == want, (request.params, eos, token, out)
        seen.add(want)
    assert checked > 0
    assert seen == {None, "stop", "length"}


def test_the_limit_is_resolved_once_on_the_request() -> None:
    prompt = np.arange(1, 6, dtype=np.int64)
    rng = np.random.default_rng(0)
    to_the_end = Request("a", prompt, SamplingParams(max_tokens=None), 0.0, rng, 16)
    assert to_the_end.max_tokens == 11 == output_limit(5, SamplingParams(max_tokens=None), 16)
    assert Request("b", prompt, SamplingParams(max_tokens=4), 0.0, rng, 16).max_tokens == 4
    assert output_limit(5, SamplingParams(max_tokens=30), 16) == 11  # capped at the context end
    later = Request("c", prompt, SamplingParams(max_tokens=None), 0.0, rng)
    assert later.max_tokens == -1  # the scheduler resolves it for its artifact on `add`
    later.resolve_limit(8)
    later.resolve_limit(64)  # once
    assert later.max_tokens == 3
    assert later.params.max_tokens is None  # the caller's SamplingParams is left as it was


def test_a_stop_string_wins_over_the_limit_and_ids_over_the_limit() -> None:
    params = SamplingParams(max_tokens=2, stop_token_ids=[7], ignore_eos=True)
    request = Request("a", np.array([1], dtype=np.int64), params, 0.0,
                      np.random.default_rng(0), 16)
    request.output.extend([5, 6])
    assert check_stop(request, 6, {6}) == "length"  # ignore_eos
    assert check_stop(request, 6, {6}, stop_string=True) == "stop"
    request.output[-1] = 7
    assert check_stop(request, 7, ()) == "stop"
    request.output.pop()
    assert check_stop(request, 5, ()) is None
