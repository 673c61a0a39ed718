"""The front never waits on a dead core: a ZeroMQ PUSH whose peer is gone blocks a plain send
for good, and the event loop blocked in it would never learn of the exit (the front then hangs
instead of answering 503 and exiting). A real core process is killed; the front sends to it
before it has noticed."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any

from support.engines import numpy_batcher

from atombatch import SamplingParams
from atombatch.core import CoreClient

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


async def test_sends_to_a_core_that_just_died_do_not_block() -> None:
    async with CoreClient(functools.partial(numpy_batcher)) as client:
        running = client.submit([5, 6, 7], LONG)
        outputs = client.outputs(running)
        assert (await outputs.__anext__()).new_token_ids
        assert client.core_pid is not None
        os.kill(client.core_pid, signal.SIGKILL)
        time.sleep(0.5)          # the loop does not run: the client has not noticed the exit
        assert not client.dead
        sent: dict[str, Any] = {}

        def send() -> None:
            sent["id"] = client.submit([1, 2, 3], LONG)
            client.abort(sent["id"])
            sent["summary"] = client.request_summary(32, 8, 4096)
            sent["producers"] = client.sync_producers({})

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(5)
        assert not sender.is_alive(), "a send to the dead core blocked"
        assert sent["summary"] is False and sent["producers"] is False
        # once the loop runs, the exit is noticed and both requests end in an error
        rest = [out async for out in outputs]
        assert rest[-1].finish_reason == "error"
        late = [out async for out in client.outputs(sent["id"])]
        assert late[-1].finish_reason == "error" and "engine core exited" in (late[-1].error or "")
        assert client.dead
