"""LoRA loads and unloads in the engine core's loop (issue 41), as a core shared by several fronts
runs it (`--api-server-count N`): each answer goes to the front that asked, loads run on the
loader thread while the loop goes on, refusals come back as `LoraDone` errors, and a `Submit`
under the adapter is served exactly.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from support.lora_engine import ADAPTERS, LoraFamily, greedy, make_family

from atombatch.core.messages import LoadLora, LoraDone, Submit, UnloadLora
from atombatch.core.process import CoreLoop, To

A, B = ADAPTERS


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> LoraFamily:
    return make_family("llama", tmp_path_factory.mktemp("lora-core-llama"))


class Outbox:
    """Where the loop's sender would take messages (the test reads them)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.sent = [0, 0]

    def put(self, message: Any) -> None:
        self.messages.append(message)


def answers(loop: CoreLoop, outbox: Outbox, count: int) -> list[To]:
    """Apply what arrives until `count` LoraDone answers went out; returns them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loop.take(50)
        loop.hand_over()
        done = [m for m in outbox.messages if isinstance(m, To) and
                isinstance(m.message, LoraDone)]
        if len(done) >= count:
            return done
    raise AssertionError(f"fewer than {count} LoraDone answers: {outbox.messages}")


def test_shared_core_answers_each_front(llama: LoraFamily) -> None:
    batcher = llama.engine(llama.runtime(2), adapters=(A,))
    outbox = Outbox()
    loop = CoreLoop(batcher, [None, None], outbox, os.getpid(), routes={})
    assert loop.ready().loras == [A]
    loop.apply(LoadLora(7, B, str(llama.adapter_dirs[B])), front=1)
    loop.apply(LoadLora(8, A, str(llama.adapter_dirs[A])), front=0)  # taken already
    loop.apply(LoadLora(9, "broken", str(llama.adapter_dirs[A] / "missing")), front=0)
    done = {t.message.seq: t for t in answers(loop, outbox, 3)}
    assert done[7].front == 1 and done[7].message.error is None
    assert done[7].message.loras == sorted(ADAPTERS)
    assert done[8].front == 0 and "is loaded already" in str(done[8].message.error)
    assert done[9].front == 0 and done[9].message.config
    prompt = np.random.default_rng(3).integers(3, 512, size=30).tolist()
    loop.apply(Submit("s1", np.asarray(prompt, dtype=np.int64).tobytes(), greedy(5), lora=B),
               front=1)
    loop.apply(UnloadLora(10, B), front=1)  # in use: refused
    loop.hand_over()
    refused = [t for t in outbox.messages if isinstance(t, To) and
               isinstance(t.message, LoraDone) and t.message.seq == 10]
    assert refused and "in use by request 's1'" in str(refused[0].message.error)
    tokens: list[int] = []
    while batcher.has_unfinished():
        for out in batcher.step():
            tokens.extend(out.new_token_ids)
    assert llama.reference(B, prompt, 5) == tokens
    loop.apply(UnloadLora(11, B), front=0)
    loop.hand_over()
    last = outbox.messages[-1]
    assert isinstance(last, To) and last.front == 0 and last.message.error is None
    assert last.message.loras == [A]
    loop.lora.close()
