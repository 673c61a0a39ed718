"""A fake producer closed while its peer drops does not abort the test process (libzmq#3442).

CI died once with SIGABRT in tests/adversarial/test_hostile_pd.py: a fake producer with LINGER 0
was closed just after the source it was sending layers to had dropped the connection. The race
runs here a few hundred times in a child process, with the sockets tests bind
(`support.zmq_peers.bound_router`); with LINGER 0 the child aborts within the first rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, time
import zmq
from support.zmq_peers import bound_router

linger = None if sys.argv[1] == "bound_router" else int(sys.argv[1])
context = zmq.Context.instance()
frame = b"x" * 300_000
for i in range(int(sys.argv[2])):
    router, endpoint = bound_router()
    if linger is not None:
        router.setsockopt(zmq.LINGER, linger)
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVBUF, 4096)  # reads nothing: the router stalls mid-message
    peer.connect(endpoint)
    peer.send_multipart([b"R", b"x"])
    routing_id, *_ = router.recv_multipart()
    for _ in range(4):
        router.send_multipart([routing_id, b"L", frame, frame], copy=False)
    time.sleep(0.002)
    peer.close()  # the connection fails while the router is half-way through a message
    if i % 2:
        time.sleep(0.0002 * (i % 7))
    router.close()
print("closed", i + 1)
"""


def run_child(linger: str, rounds: int) -> subprocess.CompletedProcess[str]:
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), *sys.path])}
    return subprocess.run([sys.executable, "-c", CHILD, linger, str(rounds)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_bound_router_closed_as_its_peer_drops_mid_message_does_not_abort() -> None:
    done = run_child("bound_router", 300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "closed 300"
