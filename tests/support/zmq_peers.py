"""ZeroMQ sockets that tests bind to play a producer, closed without aborting the process.

libzmq 4.3.5 aborts the whole process (`Resource temporarily unavailable
(src/session_base.cpp:233)`, zeromq/libzmq#3442, still open) when three things meet: a socket is
half-way through sending a multipart message, the socket is closed so that its pipe stops being
readable, and the peer's connection then fails. `clean_pipes` tries to read the rest of the
message, cannot, and asserts. A LINGER of 0 makes the pipe unreadable at once, so a fake producer
closed just after its peer dropped (a source that failed on a bad header, a frame over
MAXMSGSIZE) aborts pytest; a finite LINGER moves the same window to the moment it expires. A
bound socket with an infinite LINGER keeps the pipe readable until the peer has read everything
or gone, so the rest of the message is always there to discard. It never reconnects (it is the
bound side), so nothing outlives the last peer.
"""

from __future__ import annotations

from typing import Any

import zmq


def bound_router(context: Any = None) -> tuple[Any, str]:
    """A ROUTER on a free loopback port, safe to close at any moment: (socket, endpoint)."""
    socket = (context or zmq.Context.instance()).socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, -1)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    return socket, f"tcp://127.0.0.1:{port}"
