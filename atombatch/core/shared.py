"""One engine core, several fronts: `python -m atombatch.serve --api-server-count N`.

A single front's Python per request (HTTP parsing, validation, templates, detokenization, SSE)
bounds what one interpreter can stream; with N fronts that work runs on N cores while one core
process steps the device. The launcher (atombatch/serve/launcher.py) binds the listening socket,
starts the core with `run_shared_core` (atombatch/core/process.py, beside `run_core`), and then N
front processes that accept on that socket. This module holds what both sides share: where the
endpoints are, how a Step is split per front, and the front's handle on the core process.

The wire is the single front's (atombatch/core/messages.py) with three differences:

* The core binds one pair of IPC endpoints per front (`endpoints(directory, front)`) and each
  front connects to its pair, so a front that dies can be started again on the same pair.
* A front says `Hello(front, pid)` (again every `HELLO_INTERVAL` until answered) and the core
  answers `Ready` on that front's pair. The core watches the pid (a pidfd in its receiver's poll)
  and, when the front exits, aborts every request that front submitted; the others go on.
* The core remembers which front submitted each request id (`routes`, filled by the loop when a
  `Submit` arrives, emptied by the sender when the request's final output is routed) and the
  sender splits each `Step` by it: each front gets its own requests' tokens and outputs, and
  every front gets the step's engine stats. An id already in flight from any front is refused
  (`finish_reason="error"`). A front's `Shutdown` lets that front leave (it gets `Stopped` once
  its own requests are done); the core stops when the launcher stops it or exits.

Sends to a front never block the sender: a front that is gone (or not yet connected) drops what
was meant for it (`zmq.Again` on a bound PUSH without a peer). A PUSH socket tells nothing of
what its peer has read, so a front says it: `Consumed(count)`, the messages it has read since
its `Ready`, every `ACK_EVERY` messages (or on a read `ACK_INTERVAL` after its last one). A live
front more than `STALL_WINDOW` messages behind that acknowledges nothing for
`FRONT_STALL_SECONDS` (`--front-stall-timeout`) is stalled (a stopped process, a hung event
loop): the core aborts its requests so the other fronts' requests get their lanes, and each of
them ends with `finish_reason="error"` naming the stall when the front reads again; a front that
reads again serves on. A slow front is never stalled: anything it reads moves its count. One
that still reads nothing until `FRONT_QUEUE` messages wait unread is killed by the core (the
later, harsher step), and the launcher starts it again (`routed_delivery`). Its queue is
bounded, and its streams never silently lose a token. The queue bound (lanes + `max_waiting` choices) is split
evenly: each front admits `ceil((lanes + max_waiting) / N)` choices in flight (`queue_limit`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Any

import msgspec
import numpy as np

from atombatch.api.options import DEFAULT_FRONT_STALL_TIMEOUT
from atombatch.api.validation import queue_limit
from atombatch.core.messages import Step
from atombatch.errors import ConfigError

HELLO_INTERVAL = 0.2   # seconds between a front's Hellos until the core answers
ACK_EVERY = 32         # core messages a front reads between two `Consumed`...
ACK_INTERVAL = 0.5     # ...or, on a read, seconds since its last one (a front reading slowly)
STALL_WINDOW = 128     # messages a front may leave unacknowledged before it can count as stalled
FRONT_STALL_SECONDS = DEFAULT_FRONT_STALL_TIMEOUT  # that far behind, acknowledging nothing
                                                  #   this long: stalled (a float: seconds)


class SharedCore(msgspec.Struct, frozen=True):
    """Where a front finds the core it shares (given to `CoreClient(shared=...)`)."""

    directory: str      # the core's IPC endpoints (`endpoints`)
    fronts: int         # N: how many fronts share it
    front: int          # this front's index, 0..N-1
    core_pid: int       # watched: the core exiting fails what is in flight (and answers 503)

    def choice_limit(self, lanes: int, max_waiting: int) -> int:
        """The choices this front may have in flight: its share of lanes + max_waiting."""
        return queue_limit(lanes, max_waiting, self.fronts)


def endpoints(directory: str, front: int) -> tuple[str, str]:
    """(to the core, from the core) of front `front`."""
    return (f"ipc://{os.path.join(directory, f'in-{front}')}",
            f"ipc://{os.path.join(directory, f'out-{front}')}")


def split_step(step: Step, routes: dict[str, int], fronts: int) -> list[tuple[int, Step]]:
    """`step` cut into one Step per front that has anything in it (every front when it carries
    stats). A finished request's id leaves `routes`; an id without a route (its front is gone)
    is dropped."""
    get = routes.get
    rows: dict[int, tuple[list[str], list[int]]] = {}
    if step.ids:
        for j, request_id in enumerate(step.ids):
            front = get(request_id)
            if front is None:
                continue
            entry = rows.get(front)
            if entry is None:
                entry = rows[front] = ([], [])
            entry[0].append(request_id)
            entry[1].append(j)
    outputs: dict[int, list[Any]] = {}
    for out in step.outputs:
        front = routes.pop(out.request_id, None) if out.finished else get(out.request_id)
        if front is not None:
            outputs.setdefault(front, []).append(out)
    tokens = np.frombuffer(step.tokens, np.int64) if rows else None
    parts = []
    for front in range(fronts):
        entry = rows.get(front)
        mine = outputs.get(front, [])
        if entry is None and not mine and step.stats is None:
            continue
        if entry is None:
            ids, data = [], b""
        else:
            assert tokens is not None
            ids, data = entry[0], tokens[entry[1]].tobytes()
        parts.append((front, Step(ids=ids, tokens=data, outputs=mine, stats=step.stats,
                                  pd=step.pd)))
    return parts


class CorePeer:
    """A front's view of a shared core process it did not start: what `CoreClient` uses of a
    `multiprocessing.Process` (a readable `sentinel` when it exits, `is_alive`, `join`), over a
    pidfd. A front never stops the shared core (its launcher does), but kills a hung one."""

    exitcode = None   # not this process's child: its exit code is the launcher's to read

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except OSError as exc:
            raise ConfigError(f"the engine core (pid {pid}) is not running: {exc}") from None

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        """SIGKILL the core (a hung one: `CoreClient.hang_timeout`); its launcher then stops the
        server as when the core dies. Through the pidfd, so a reused pid is never hit."""
        if self.sentinel >= 0:
            with contextlib.suppress(OSError):  # (gone meanwhile)
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
