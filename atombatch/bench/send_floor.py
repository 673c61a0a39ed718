"""The kernel's price of one streamed token: a bare loopback writer beside `bench overlap`'s server.

A front that writes each stream's token as it comes makes one `send` per stream per device step,
and on loopback TCP that `send` also runs the receiving side's stack (and the ACKs of the last
write) in the sender's context. `send_floor(B, step)` measures that price alone: a child process
holds B loopback connections to this process and, once per `step`, writes `EVENT_BYTES` to each
(Python's `socket.send`, TCP_NODELAY as the server sets it), while this process reads them the
way `bench overlap`'s client does (one epoll loop that naps, then drains every socket). It
returns the child's CPU per write in microseconds (user and kernel, `time.process_time`; their
split is only sampled at the clock tick, so it is not reported): the least any front that
streams each token as it comes spends per token on this machine at this step time, so `bench
overlap` prints it beside the front's own `mid` figure (docs/overlap.md).
"""

from __future__ import annotations

import multiprocessing
import select
import socket
import time
from typing import Any

import msgspec

EVENT_BYTES = 256        # about one plain SSE chunk with its HTTP/1.1 chunk framing
FLOOR_SECONDS = 2.0      # how long the writer streams (at least MIN_STEPS steps)
MIN_STEPS = 40
MAX_STEPS = 400
READER_NAP = 0.25        # the client's longest nap (`client_round`'s max_nap)


class SendFloor(msgspec.Struct, frozen=True):
    """CPU of the bare writer per write (microseconds)."""

    batch_size: int
    step_ms: float
    writes: int
    us_per_write: float


def _writer(port: int, batch_size: int, step_s: float, steps: int, conn: Any) -> None:
    """The child: B connections, one write to each per step; sends back its CPU (seconds)."""
    socks = []
    for _ in range(batch_size):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    conn.recv()  # every connection accepted
    event = b"x" * EVENT_BYTES
    start_cpu = time.process_time()
    deadline = time.perf_counter()
    for _ in range(steps):
        deadline += step_s
        pause = deadline - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        for sock in socks:
            sock.send(event)
    conn.send(time.process_time() - start_cpu)
    conn.recv()  # the reader has everything: close
    for sock in socks:
        sock.close()


def send_floor(batch_size: int, step_ms: float) -> SendFloor:
    """Measure the bare writer at B connections and `step_ms` (module docstring)."""
    step_s = step_ms / 1e3
    steps = max(MIN_STEPS, min(MAX_STEPS, int(FLOOR_SECONDS / step_s) if step_s > 0 else MAX_STEPS))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(batch_size + 8)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    writer = multiprocessing.get_context("spawn").Process(
        target=_writer, args=(listener.getsockname()[1], batch_size, step_s, steps, child),
        daemon=True)
    writer.start()
    accepted: list[socket.socket] = []
    poller = select.epoll()
    try:
        listener.settimeout(60)
        for _ in range(batch_size):
            sock, _ = listener.accept()
            sock.setblocking(False)
            poller.register(sock.fileno(), select.EPOLLIN)
            accepted.append(sock)
        by_fd = {s.fileno(): s for s in accepted}
        parent.send(None)
        expected = batch_size * steps * EVENT_BYTES
        received = 0
        cpu: float | None = None
        while received < expected:  # nap, then read what every socket holds
            if cpu is None and parent.poll():
                cpu = parent.recv()
            if cpu is None and not writer.is_alive():
                raise RuntimeError(f"the floor's writer exited with code {writer.exitcode}")
            for fd, _ in poller.poll(READER_NAP if cpu is None else 0.01):
                try:
                    while chunk := by_fd[fd].recv(1 << 20):
                        received += len(chunk)
                except BlockingIOError:
                    pass
            if cpu is None:
                time.sleep(READER_NAP)
        if cpu is None:
            cpu = parent.recv()
        parent.send(None)
    finally:
        writer.join(10)
        if writer.is_alive():
            writer.kill()
        poller.close()
        for sock in accepted:
            sock.close()
        listener.close()
    writes = batch_size * steps
    return SendFloor(batch_size=batch_size, step_ms=step_ms, writes=writes,
                     us_per_write=1e6 * cpu / writes)


def main() -> None:  # python -m atombatch.bench.send_floor: a quick look
    for batch in (16, 64, 256):
        for step in (5.0, 20.0):
            floor = send_floor(batch, step)
            print(f"B{batch} step {step:g} ms: {floor.us_per_write:.1f} us per write")


if __name__ == "__main__":
    main()
