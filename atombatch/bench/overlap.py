"""`python -m atombatch.bench overlap`: how much of an ideal device the serving path keeps busy.

    python -m atombatch.bench overlap --batch-sizes 16,64 --step-ms 5,20 --repeats 3 \\
        --json overlap.json

The device is `NullRuntime` (atombatch/runtime/null.py): every decode step sleeps `--step-ms` with
the GIL released, as a wait on the device does, and costs no host work of its own. Its ideal
throughput is a full batch every step, `B / step` tokens per second; a serving path delivers
`ratio` of it. For each batch size B and step time:

* engine: a `Batcher` on the NullRuntime driven in this process with `step_arrays()`, no HTTP.
* server: the real server, `python -m atombatch.serve --runtime null ...` in a subprocess (port 0,
  the address read from its startup line), without and with a tokenizer (a WordLevel
  `tokenizer.json` covering the whole vocabulary, written to a temporary directory: the server
  then detokenizes every token and streams text). When the server has `--engine-core`, both
  `inline` and `process` run, side by side.

One round is B requests submitted at once (concurrency c = B), each an `--prompt-len`-token prompt
with `max_tokens=--max-tokens`, greedy, `ignore_eos`, streamed; delivered tok/s = tokens received /
(first send -> last `[DONE]`). A round needs B prefill chunks and `max_tokens - 1` decode steps,
plus the decode steps the policy runs before the last prefill when all B arrive at once (the
default stall-free:8 admits 8 chunks per step: `ramp_steps`), so with the default `--prefill-ms
0` the best possible ratio is `max_tokens / (max_tokens - 1 + ramp)` (column `bound`); a
positive `--prefill-ms` lowers the bound by the prefill time the ideal ignores.
Each case runs one short warm-up round, then `--repeats` rounds; the table shows medians.

CPU per delivered token is read from /proc (`schedstat`, nanoseconds; `stat` ticks where that is
missing) around each round: `front` is the server's main thread (the event loop: HTTP, SSE,
detokenization) with `--engine-core inline` or without the flag, or the whole server process with
`--engine-core process`; `core` is the rest (the step thread inline, the engine-core child
processes otherwise). `client` is this process's own CPU (`time.process_time`): the load generator
writes each HTTP/1.1 request by hand on its own socket, reads every socket from one epoll loop that
naps while no stream can be near its end (so one read takes the events of several steps, and the
end times stay exact; see `client_round`), and counts `data:` events and `token_ids` entries by
scanning bytes, never parsing JSON. The 1/5/15-minute load average is recorded before and after
every case and the run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import os
import select
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from atombatch.bench import admission, provenance, sustained
from atombatch.bench.admission import AdmissionGap
from atombatch.bench.progress import CellProgress
from atombatch.bench.send_floor import EVENT_BYTES, SendFloor, send_floor
from atombatch.bench.sse_client import Stream, closed_loop, http_request, receive
from atombatch.bench.sustained import Span, Sustained

Path_ = Literal["engine", "server"]
Load = tuple[float, float, float]



# -- records ---------------------------------------------------------------------------------------
class Round(msgspec.Struct, frozen=True):
    """One measured round: B requests at once, to their last token."""

    requests: int                       # sent
    ok: int                             # ended with [DONE], HTTP 200 and no error event
    tokens: int                         # generated tokens received (token_ids entries)
    events: int                         # SSE data events carrying tokens
    duration_s: float                   # first send -> last [DONE]
    tok_per_s: float                    # tokens / duration_s
    ratio: float                        # tok_per_s / ideal (B / step)
    front_cpu_s: float                  # see the module docstring
    core_cpu_s: float
    client_cpu_s: float                 # this process (the server path's client)
    load_before: Load
    load_after: Load
    errors: tuple[str, ...] = ()        # what went wrong (first few)
    device_s: float | None = None       # engine path: wall seconds inside the runtime's calls
    decode_steps: int | None = None     # engine path: decode calls
    steady: float | None = None         # median over requests of its decode rate / 1 per step
    # the front over the middle half of the round's tokens (no request parsing or teardown):
    mid_tokens: int | None = None       # tokens the client received in that window
    mid_front_cpu_s: float | None = None
    mid_front_sys_s: float | None = None  # of which in the kernel (the socket writes)
    # the engine's own count (`EngineStats.host_gap_s`, server: from /metrics): wall time from a
    # device call's end to the next one's start while work was pending, and how many such gaps
    host_gap_s: float | None = None
    host_gaps: int | None = None


class Figures(msgspec.Struct, frozen=True):
    """Medians over a case's rounds; CPU in microseconds per delivered token."""

    tok_per_s: float
    ratio: float
    front_us_per_token: float
    core_us_per_token: float
    client_us_per_token: float
    steady: float | None = None              # see `steady_ratio`
    host_ms_per_step: float | None = None    # engine path: wall time outside the runtime / step
    device_ms_per_step: float | None = None  # engine path: wall time inside it (sleep overshoot)
    mid_front_us_per_token: float | None = None  # server path: the front while streaming only
    mid_front_sys_us_per_token: float | None = None  # of which in the kernel
    gap_us: float | None = None                # the engine's host time per gap between calls


class Case(msgspec.Struct, frozen=True):
    path: Path_                         # engine (in-process Batcher) | server (HTTP subprocess)
    batch_size: int
    step_ms: float
    prefill_ms: float
    tokenizer: bool                     # the server detokenized (WordLevel tokenizer.json)
    engine_core: str | None             # --engine-core value (None: the flag was not passed)
    ideal_tok_s: float                  # B / step
    bound_ratio: float                  # best ratio a round allows (prefill, the first token and
    #   the policy's admission ramp: `bound_ratio`)
    rounds: list[Round]
    median: Figures | None              # None: no round completed (see error)
    command: str | None = None          # the server's command line
    error: str | None = None            # why the case stopped early (server start, a dead server)
    #   or, prefixed "recovered by a restart:", why its server was started again (all rounds ran)
    overlap: bool | None = None         # Batcher(overlap=) / --overlap, --no-overlap (None: the
    #   server has no such flag, or a report from before it)
    sustained: Sustained | None = None  # --sustained G: B in flight, G x B requests
    lora_mix: int = 0                   # --lora-mix N: requests spread over the base and N
    #   adapters of a NullRuntime(lora_adapters=N) (engine path; 0: the base model only)


class Report(msgspec.Struct, frozen=True):
    command: str
    commit: str | None
    machine: str
    params: dict[str, Any]
    engine_core_flag: bool              # the server offers --engine-core
    load_before: Load
    load_after: Load
    cases: list[Case]
    admission: list[Any] | None = None  # --admission-stalls: bench micro's records (MicroRecord)
    # --admission-stalls: the device's idle time around an admitted chunk, pipeline on and off
    # (atombatch/bench/admission.py)
    pipeline_admission: list[AdmissionGap] | None = None
    # per B x step of the server cases: a bare loopback writer's CPU per write, the least a
    # front streaming each token as it comes spends per token (atombatch/bench/send_floor.py)
    send_floors: list[SendFloor] | None = None


MAX_LORA_MIX = 64  # --lora-mix: adapters of the null device
MID_WINDOW = (0.25, 0.75)  # shares of a round's tokens between which the front's streaming CPU is read
ADMISSION_OPS = ("prefix_admit", "prefix_admit_nocache", "prefix_steady")
ADMISSION_LANES = (4, 16)


def admission_stalls(repeats: int) -> list[Any]:
    """The step admitting one request at a full prefix cache of 1k, 10k and 30k blocks beside a
    steady step and the same step without a cache, at B4 and B16, in this process: bench micro's
    admission cases (atombatch/bench/cases.py), the table of docs/overlap.md."""
    from atombatch.bench import micro

    return list(micro.run(lanes=ADMISSION_LANES, ops=ADMISSION_OPS, repeats=repeats))


# -- CPU from /proc --------------------------------------------------------------------------------
_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _task_cpu(pid: int, tid: int) -> float:
    """CPU seconds of one thread (0.0 once it is gone)."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{base}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return 0.0


def _task_sys(pid: int, tid: int) -> float:
    """Kernel-mode CPU seconds of one thread (`stime`, in clock ticks; 0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[12]) * _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (scans /proc for parent links)."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents[ppid].append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


class ServerCpu(msgspec.Struct, frozen=True):
    main: float                         # the server's main thread
    threads: float                      # its other threads
    children: float                     # every descendant process, all threads

    def __sub__(self, other: ServerCpu) -> ServerCpu:
        return ServerCpu(self.main - other.main, self.threads - other.threads,
                         self.children - other.children)


def server_cpu(pid: int) -> ServerCpu:
    """CPU seconds of a server process tree, split as the report needs it."""
    threads = sum(_task_cpu(pid, t) for t in _threads(pid) if t != pid)
    children = sum(_task_cpu(c, t) for c in _descendants(pid) for t in _threads(c))
    return ServerCpu(_task_cpu(pid, pid), threads, children)


def _load() -> Load:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # pragma: no cover - platforms without a load average
        return (-1.0, -1.0, -1.0)
    return (round(one, 2), round(five, 2), round(fifteen, 2))


# -- the client ------------------------------------------------------------------------------------
def steady_ratio(spans: list[tuple[float, float, int]], step_s: float) -> float | None:
    """The median over requests of its decode rate as a share of one token per device step.

    `spans` are (first-token time, end time, tokens) per request. A request decodes one token
    per step from its first token to its last, so `(tokens - 1) x step / (end - first)` is 1.0
    when no step of its stream waited for the host, whatever the admission order: the round's
    ratio also pays for the B prefills' ramp (a request admitted late ends late), which the
    scheduling policy decides (docs/scheduling.md); this one is the steady decode rate.
    """
    rates = [(tokens - 1) * step_s / (end - first) for first, end, tokens in spans
             if tokens > 1 and end > first > 0]
    return float(statistics.median(rates)) if rates else None


def request_bodies(model: str, prompts: list[list[int]], max_tokens: int) -> list[bytes]:
    return [msgspec.json.encode({"model": model, "prompt": p, "max_tokens": max_tokens,
                                 "temperature": 0.0, "stream": True, "ignore_eos": True})
            for p in prompts]


def client_round(host: str, port: int, bodies: list[bytes], timeout: float, max_tokens: int,
                 step_s: float, max_nap: float = 0.25,
                 marks: tuple[float, ...] = (),
                 on_mark: Callable[[int], None] | None = None) -> tuple[list[Stream], float]:
    """Send every body at once over its own connection and read every stream to [DONE].

    The connections are opened before the clock starts; the requests then go out back to back.
    One epoll loop reads every socket that has data, then naps while no stream can be near its
    end: a stream gets at most one token per device step, so with `left` tokens still to come
    for the most advanced open stream, none ends within `left x step_s`. The loop naps half of
    that (at most `max_nap`), so one read takes the events of several steps (a read costs far
    more CPU than scanning its bytes) while the end times stay exact: near the end it polls
    without napping. Until every stream has its first token it naps at most half a step, so
    each stream's first-token time is exact to that (`steady_ratio`). Returns the streams and
    first send -> last end (seconds).

    `on_mark(tokens)` is called once the tokens received pass each share in `marks` (ascending)
    of `len(bodies) x max_tokens`, with the count at that moment (right after a read; the naps
    are not shortened for it, so a mark may come a nap late, but the count is exact, and a nap
    is at most half of what is left, so a quarter and three quarters never share a read).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in bodies:
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect((host, port))
        requests = [http_request(host, port, "/v1/completions", body) for body in bodies]
        streams = [Stream() for _ in bodies]
        by_fd: dict[int, tuple[socket.socket, Stream]] = {}
        most = 0  # tokens of the most advanced stream
        unstarted = len(streams)  # streams without their first token
        expected = len(bodies) * max_tokens
        pending = [int(m * expected) for m in marks] if on_mark is not None else []
        received = 0
        with select.epoll() as poller:
            started = time.perf_counter()
            for sock, request, stream in zip(socks, requests, streams, strict=True):
                sock.sendall(request)
                sock.setblocking(False)
                poller.register(sock.fileno(), select.EPOLLIN)
                by_fd[sock.fileno()] = (sock, stream)
            deadline = started + timeout
            while by_fd:
                ready = poller.poll(max(0.0, deadline - time.perf_counter()))
                now = time.perf_counter()
                if not ready and now >= deadline:
                    break
                for fd, _ in ready:
                    sock, stream = by_fd[fd]
                    had_first = stream.first
                    over = receive(sock, stream, now)
                    if over is None:
                        continue
                    if not over:
                        if stream.tokens > most:
                            most = stream.tokens
                        if stream.first and not had_first:
                            unstarted -= 1
                        continue
                    if stream.first and not had_first:
                        unstarted -= 1
                    poller.unregister(fd)
                    del by_fd[fd]
                if pending:
                    received = sum(s.tokens for s in streams)
                    while pending and received >= pending[0]:
                        pending.pop(0)
                        on_mark(received)  # type: ignore[misc]
                nap = min(max_nap, (max_tokens - most - 1) * step_s / 2)
                if unstarted > 0:
                    nap = min(nap, step_s / 2)
                if by_fd and nap > 0.001:
                    time.sleep(nap)
        for _, stream in by_fd.values():
            stream.error = f"no [DONE] within {timeout:g} s"
            stream.ended = time.perf_counter()
    finally:
        for sock in socks:
            sock.close()
    end = max((s.ended for s in streams), default=started)
    return streams, end - started


def host_gaps(host: str, port: int, wait_for_more: tuple[float, float] | None = None,
              timeout: float = 2.0) -> tuple[float, float] | None:
    """(atombatch_host_gap_seconds_total, atombatch_host_gaps_total) from the server's /metrics
    (None without them). With `wait_for_more`, reads again (for up to `timeout`) until the count
    passed that one and stopped moving: the front holds the core's stats as of its last Step."""
    deadline = time.perf_counter() + timeout
    last: tuple[float, float] | None = None
    while True:
        try:
            name = f"[{host}]" if ":" in host else host
            with urllib.request.urlopen(f"http://{name}:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("atombatch_host_gap_seconds_total", "atombatch_host_gaps_total"):
                values[name] = float(value)
        if len(values) < 2:
            return None
        now = (values["atombatch_host_gap_seconds_total"], values["atombatch_host_gaps_total"])
        if wait_for_more is None or (now[1] > wait_for_more[1] and now == last) or \
                time.perf_counter() > deadline:
            return now
        last = now
        time.sleep(0.06)  # longer than the core's stats interval


# -- the server ------------------------------------------------------------------------------------
class Server:
    """`python -m atombatch.serve` in a subprocess on port 0; its stderr is drained in a thread."""

    def __init__(self, argv: list[str], startup_timeout: float = 120.0) -> None:
        self.argv = argv
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.host, self.port = self._wait_for_banner(startup_timeout)
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _wait_for_banner(self, timeout: float) -> tuple[str, int]:
        assert self.proc.stderr is not None
        found: list[tuple[str, int]] = []

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                marker = line.rfind("listening on http://")
                if marker >= 0:
                    address = line[marker + len("listening on http://"):].strip()
                    host, _, port = address.rpartition(":")
                    found.append((host.strip("[]"), int(port)))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.stop()
            tail = "\n".join(list(self.lines)[-10:])
            raise RuntimeError(f"the server did not start within {timeout:g} s "
                               f"(exit status {self.proc.poll()}):\n{tail}")
        return found[0]

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _fronts_note(count: int) -> str:
    return f", process core with {count} front processes" if count > 1 else ""


def server_has_engine_core() -> bool:
    """Whether `python -m atombatch.serve --help` offers `--engine-core`."""
    return "--engine-core" in _server_help()


def server_has_overlap() -> bool:
    """Whether `python -m atombatch.serve --help` offers `--overlap`."""
    return "--overlap" in _server_help()


def server_has_prefix_default() -> bool:
    """Whether the server's prefix cache is on by default (it offers the flag that turns it
    off)."""
    return "--no-enable-prefix-caching" in _server_help()


@functools.cache
def _server_help() -> str:
    return subprocess.run([sys.executable, "-m", "atombatch.serve", "--help"],
                          capture_output=True, text=True, timeout=120).stdout


def write_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A WordLevel `tokenizer.json` whose words `w0 .. w{vocab-1}` cover every token id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    return directory


# -- cases -----------------------------------------------------------------------------------------
def _prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids from 3 up: clear of the tiny spec's bos (1) and eos (2)
    return [rng.integers(3, vocab_size, prompt_len).tolist() for _ in range(batch_size)]


def _figures(rounds: list[Round]) -> Figures:
    def med(values: list[float]) -> float:
        return float(statistics.median(values)) if values else float("nan")

    def per_token(get: Callable[[Round], float]) -> float:
        return med([1e6 * get(r) / r.tokens for r in rounds if r.tokens])

    timed = [r for r in rounds if r.device_s is not None and r.decode_steps]
    host = med([1e3 * (r.duration_s - r.device_s) / r.decode_steps  # type: ignore[operator]
                for r in timed]) if timed else None
    device = med([1e3 * r.device_s / r.decode_steps  # type: ignore[operator]
                  for r in timed]) if timed else None
    steady = [r.steady for r in rounds if r.steady is not None]
    mid = [r for r in rounds if r.mid_tokens]
    mid_front = med([1e6 * r.mid_front_cpu_s / r.mid_tokens  # type: ignore[operator]
                     for r in mid]) if mid else None
    mid_sys = med([1e6 * r.mid_front_sys_s / r.mid_tokens  # type: ignore[operator]
                   for r in mid]) if mid else None
    gapped = [r for r in rounds if r.host_gaps]
    gap = med([1e6 * r.host_gap_s / r.host_gaps  # type: ignore[operator]
               for r in gapped]) if gapped else None
    return Figures(mid_front_us_per_token=mid_front, mid_front_sys_us_per_token=mid_sys,
                   gap_us=gap, tok_per_s=med([r.tok_per_s for r in rounds]),
                   ratio=med([r.ratio for r in rounds]), steady=med(steady) if steady else None,
                   front_us_per_token=per_token(lambda r: r.front_cpu_s),
                   core_us_per_token=per_token(lambda r: r.core_cpu_s),
                   client_us_per_token=per_token(lambda r: r.client_cpu_s),
                   host_ms_per_step=host, device_ms_per_step=device)


def bound_ratio(batch_size: int, step_ms: float, prefill_ms: float, prompt_len: int,
                chunk: int, max_tokens: int, policy: str | None = None) -> float:
    """The best `ratio` a round allows: B prompts' prefill chunks, then max_tokens - 1 steps,
    plus the decode steps the policy runs before the round's last prefill (`ramp_steps`)."""
    chunks = batch_size * -(-prompt_len // chunk)
    steps = max_tokens - 1 + ramp_steps(policy, chunks, max_tokens)
    best = chunks * prefill_ms + steps * step_ms
    return float("inf") if best <= 0 else (batch_size * max_tokens / best) / (batch_size / step_ms)


def ramp_steps(policy: str | None, chunks: int, max_tokens: int) -> int:
    """Decode steps a round's B requests, all there before the first step, wait through before
    the last one's prefill has run, under `policy` (None: the engine's default; docs/
    scheduling.md): none for prefill-first and fill-first (a lane's own prefill runs at once),
    one per `prefill_chunks` chunks after the first group for stall-free, `decode_steps` per
    chunk after the first for interleave, and every earlier request's whole decode for
    decode-first (a prefill only when no lane decodes)."""
    from atombatch.api.policy import DEFAULT_POLICY, Policy

    rule = Policy.parse(policy or DEFAULT_POLICY)
    if rule.kind == "stall-free":
        return -(-chunks // rule.prefill_chunks) - 1
    if rule.kind == "interleave":
        return (chunks - 1) * rule.decode_steps
    if rule.kind == "decode-first":
        return (chunks - 1) * (max_tokens - 1)
    return 0


def _engine(batch_size: int, step_ms: float, prefill_ms: float, max_seq_len: int, chunk: int,
            policy: str | None, spec: Any, argmax_threads: int | None,
            overlap: bool, lora_mix: int = 0) -> tuple[Any, Any]:
    """A `Batcher` over a fresh NullRuntime (no HTTP), and the runtime; `spec` is the model (its
    vocabulary sizes the logits; default the server's tiny spec); `lora_mix` N > 0: the runtime
    has N adapters and every one may run in a step (no `max_loras` cap)."""
    from atombatch import ArtifactConfig, Batcher
    from atombatch.api.policy import DEFAULT_POLICY
    from atombatch.runtime.null import NullRuntime
    from atombatch.serve.cli import DEFAULT_SPEC

    art = ArtifactConfig(model=spec or DEFAULT_SPEC, batch_size=batch_size, max_seq_len=max_seq_len,
                         block_size=max_seq_len, num_blocks=batch_size + 1,
                         prefill_chunk_size=chunk)
    runtime = NullRuntime(art, step_ms=step_ms, prefill_ms=prefill_ms, lora_adapters=lora_mix)
    batcher = Batcher(runtime, max_waiting=None, policy=policy or DEFAULT_POLICY,
                      argmax_threads=argmax_threads, overlap=overlap)
    batcher.decide_late = overlap  # the loop below steps again at once, as the engine core's
    return batcher, runtime


def lora_names(count: int, lora_mix: int) -> list[str | None]:
    """The adapter of each of `count` requests spread over the base model (None) and the
    `lora_mix` adapters of a `NullRuntime(lora_adapters=lora_mix)`, in turn: request i runs
    under adapter i mod (N + 1), 0 being the base."""
    return [None if not lora_mix or not i % (lora_mix + 1) else f"null-{i % (lora_mix + 1)}"
            for i in range(count)]


def _drive_round(batcher: Any, prompts: list[list[int]], params: Any, max_tokens: int,
                 lora_mix: int = 0) -> tuple[int, int, int, list[tuple[float, float, int]]]:
    """Submit every prompt (over the base and `lora_mix` adapters: `lora_names`), then step
    until all end: (tokens, finished with every token, events, (first token, end, tokens) of
    each)."""
    for prompt, lora in zip(prompts, lora_names(len(prompts), lora_mix), strict=True):
        batcher.submit(prompt, params, lora=lora)
    tokens = events = finished = 0
    first: dict[str, float] = {}
    spans: list[tuple[float, float, int]] = []
    while batcher.has_unfinished():
        result = batcher.step_arrays()
        now = time.perf_counter()
        plain = int(np.count_nonzero(result.plain))
        tokens += plain
        events += plain
        for out in result.outputs:
            tokens += len(out.new_token_ids)
            events += 1
            first.setdefault(out.request_id, now)
            if out.finished and out.finish_reason == "length":
                finished += 1
                spans.append((first[out.request_id], now, max_tokens))
    return tokens, finished, events, spans


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Run the engine alone as the core process runs it: with the heap built so far frozen out
    of the collector's scans (`freeze_heap`), unfrozen after (so this case's engine can be
    collected once it is garbage)."""
    from atombatch.core.process import freeze_heap

    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def engine_round(batch_size: int, step_ms: float, prefill_ms: float, prompts: list[list[int]],
                 max_tokens: int, max_seq_len: int, chunk: int,
                 policy: str | None = None, spec: Any = None,
                 argmax_threads: int | None = None, overlap: bool = False,
                 lora_mix: int = 0) -> Round:
    """One round on an in-process Batcher over a NullRuntime (no HTTP): `step_arrays()`;
    `lora_mix` N > 0: the requests spread over the base and N adapters (`lora_names`)."""
    from atombatch import SamplingParams

    batcher, runtime = _engine(batch_size, step_ms, prefill_ms, max_seq_len, chunk, policy, spec,
                               argmax_threads, overlap, lora_mix)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    load_before = _load()
    with _frozen_heap():
        cpu0, started = time.process_time(), time.perf_counter()
        tokens, finished, events, spans = _drive_round(batcher, prompts, params, max_tokens,
                                                       lora_mix)
        duration, cpu = time.perf_counter() - started, time.process_time() - cpu0
    tok_s = tokens / duration
    stats = batcher.stats()
    return Round(host_gap_s=stats.host_gap_s, host_gaps=stats.host_gaps,
                 requests=len(prompts), ok=finished, tokens=tokens, events=events,
                 duration_s=duration, tok_per_s=tok_s, ratio=tok_s / (batch_size * 1e3 / step_ms),
                 front_cpu_s=0.0, core_cpu_s=cpu, client_cpu_s=0.0, load_before=load_before,
                 load_after=_load(), device_s=runtime.calls.decode_s + runtime.calls.prefill_s,
                 decode_steps=runtime.calls.decode_calls,
                 steady=steady_ratio(spans, step_ms / 1e3))


def engine_sustained(batch_size: int, step_ms: float, prefill_ms: float, prompts: list[list[int]],
                     max_tokens: int, max_seq_len: int, chunk: int, policy: str | None = None,
                     spec: Any = None, argmax_threads: int | None = None,
                     overlap: bool = False) -> Sustained:
    """`prompts` (G x B of them) on an in-process Batcher, B in flight: each request that ends
    is replaced by the next at once (atombatch/bench/sustained.py)."""
    from atombatch import SamplingParams

    batcher, _ = _engine(batch_size, step_ms, prefill_ms, max_seq_len, chunk, policy, spec,
                         argmax_threads, overlap)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spans: dict[str, list[float]] = {}   # request id -> [sent, first, ended, tokens]
    order: list[str] = []

    def submit() -> None:
        request_id = batcher.submit(prompts[len(order)], params)
        order.append(request_id)
        spans[request_id] = [time.perf_counter(), 0.0, 0.0, 0]

    ok = 0
    with _frozen_heap():
        cpu0 = time.process_time()
        while len(order) < min(batch_size, len(prompts)):
            submit()
        while batcher.has_unfinished():
            result = batcher.step_arrays()
            now = time.perf_counter()
            for out in result.outputs:  # (a plain row's token is not counted: not read per
                span = spans[out.request_id]  # row, as it would add to the host time measured)
                if not span[1]:
                    span[1] = now
                if out.finished:
                    span[2] = now
                    if out.finish_reason == "length":  # ignore_eos: every token was generated
                        span[3] = max_tokens
                        ok += 1
                    if len(order) < len(prompts):
                        submit()
        cpu = time.process_time() - cpu0
    return sustained.summarize([Span(spans[r][0], spans[r][1], spans[r][2], int(spans[r][3]))
                                for r in order],
                               batch_size, step_ms, ok, core_cpu_s=cpu)


def fronts_cpu(pid: int, core_pid: int) -> ServerCpu:
    """CPU seconds of a launcher's tree (`--api-server-count N`): `main` is every front (every
    process below it but the core), `children` the core."""
    fronts = [c for c in _descendants(pid) if c != core_pid]
    return ServerCpu(sum(_task_cpu(c, t) for c in fronts for t in _threads(c)), 0.0,
                     sum(_task_cpu(core_pid, t) for t in _threads(core_pid)))


def _fronts_sys(pid: int, core_pid: int) -> float:
    return sum(_task_sys(c, t) for c in _descendants(pid) if c != core_pid for t in _threads(c))


def core_pid_of(server: Server) -> int:
    """The engine core's pid, from the server's model card."""
    name = f"[{server.host}]" if ":" in server.host else server.host
    with urllib.request.urlopen(f"http://{name}:{server.port}/v1/models", timeout=10) as reply:
        card = msgspec.json.decode(reply.read())
    return int(card["data"][0]["atombatch"]["engine_core"]["pid"])


class _ServerSplit:
    """The server's CPU split into front and core by `split` (fronts: a launcher with several
    front processes on one core)."""

    def __init__(self, server: Server, split: Literal["thread", "process", "fronts"]) -> None:
        self.pid, self.split = server.pid, split
        self.core_pid = core_pid_of(server) if split == "fronts" else 0

    def now(self) -> ServerCpu:
        return fronts_cpu(self.pid, self.core_pid) if self.split == "fronts" else \
            server_cpu(self.pid)

    def front(self, cpu: ServerCpu) -> float:
        # inline core: the step thread(s) are the core; a core process: the server is the front
        return cpu.main if self.split in ("thread", "fronts") else cpu.main + cpu.threads

    def core(self, cpu: ServerCpu) -> float:
        return cpu.threads + cpu.children if self.split == "thread" else cpu.children

    def front_sys(self) -> float:
        if self.split == "fronts":
            return _fronts_sys(self.pid, self.core_pid)
        return _task_sys(self.pid, self.pid) if self.split == "thread" else \
            sum(_task_sys(self.pid, t) for t in _threads(self.pid))


def server_round(server: Server, bodies: list[bytes], max_tokens: int, batch_size: int,
                 step_ms: float, split: Literal["thread", "process", "fronts"],
                 timeout: float) -> Round:
    """One round of B streamed requests against the server; its CPU split by `split`."""
    load_before = _load()
    cpus = _ServerSplit(server, split)
    marks: list[tuple[int, float, float]] = []   # (tokens received, front CPU, its kernel part)
    mid: dict[str, Any] = {}

    def mark(tokens: int) -> None:
        marks.append((tokens, cpus.front(cpus.now()), cpus.front_sys()))

    gaps_before = host_gaps(server.host, server.port)
    cpu_before = cpus.now()
    client0 = time.process_time()
    streams, duration = client_round(server.host, server.port, bodies, timeout, max_tokens,
                                     step_ms / 1e3, marks=MID_WINDOW, on_mark=mark)
    client = time.process_time() - client0
    cpu = cpus.now() - cpu_before
    gaps_after = host_gaps(server.host, server.port, wait_for_more=gaps_before)
    if gaps_before is not None and gaps_after is not None:
        mid["host_gap_s"] = gaps_after[0] - gaps_before[0]
        mid["host_gaps"] = int(gaps_after[1] - gaps_before[1])
    if len(marks) == 2 and marks[1][0] > marks[0][0]:
        (t0, c0, s0), (t1, c1, s1) = marks
        mid |= {"mid_tokens": t1 - t0, "mid_front_cpu_s": c1 - c0, "mid_front_sys_s": s1 - s0}
    tokens = sum(s.tokens for s in streams)
    tok_s = tokens / duration if duration > 0 else 0.0
    errors = tuple(s.error for s in streams if s.error is not None)[:5]
    return Round(requests=len(bodies), ok=sum(s.finished and s.error is None for s in streams),
                 tokens=tokens, events=sum(s.events for s in streams), duration_s=duration,
                 tok_per_s=tok_s, ratio=tok_s / (batch_size * 1e3 / step_ms),
                 front_cpu_s=cpus.front(cpu), core_cpu_s=cpus.core(cpu), client_cpu_s=client,
                 load_before=load_before, load_after=_load(), errors=errors,
                 steady=steady_ratio([(s.first, s.ended, s.tokens) for s in streams
                                      if s.finished and s.error is None], step_ms / 1e3), **mid)


def server_sustained(server: Server, bodies: list[bytes], max_tokens: int, batch_size: int,
                     step_ms: float, split: Literal["thread", "process", "fronts"],
                     timeout: float) -> Sustained:
    """`bodies` (G x B) against the server with B in flight, each stream that ends replaced by
    the next request at once (`closed_loop`, atombatch/bench/sustained.py)."""
    cpus = _ServerSplit(server, split)
    cpu_before = cpus.now()
    client0 = time.process_time()
    streams = closed_loop(server.host, server.port, "/v1/completions", bodies, batch_size,
                          timeout, tokens_each=max_tokens)
    client = time.process_time() - client0
    cpu = cpus.now() - cpu_before
    ok = sum(s.finished and s.error is None and s.tokens == max_tokens for s in streams)
    return sustained.summarize([Span(s.sent, s.first, s.ended, s.tokens) for s in streams],
                               batch_size, step_ms, ok,
                               tuple(s.error for s in streams if s.error is not None),
                               front_cpu_s=cpus.front(cpu), core_cpu_s=cpus.core(cpu),
                               client_cpu_s=client)


@contextlib.contextmanager
def _tokenizer_dir(vocab_size: int) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="atombatch-overlap-") as tmp:
        yield write_tokenizer(Path(tmp), vocab_size)


# -- the run ---------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atombatch.bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=_ints, default=(16, 64, 256),
                   help="decode lanes B, also the concurrency (default 16,64,256)")
    p.add_argument("--step-ms", type=_floats, default=(5.0, 20.0, 70.0),
                   help="device milliseconds per decode step (default 5,20,70)")
    p.add_argument("--prefill-ms", type=float, default=0.0,
                   help="device milliseconds per prefill chunk (default 0: the ratio is the host's "
                   "alone; see `bound`)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request (default 256)")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    p.add_argument("--repeats", type=int, default=1, help="rounds per case; medians (default 1)")
    p.add_argument("--tokenizers", type=_modes, default=("none", "wordlevel"),
                   help="comma list of none (token ids) and wordlevel (default both)")
    p.add_argument("--engine-cores",
                   help="comma list of --engine-core values for the server (default: inline,process "
                   "when the server has the flag, else the server's default)")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="front processes of the server with --engine-core process (N > 1: `front` "
                   "is all of them, `core` the core; default 1)")
    p.add_argument("--overlap", type=_overlaps, default=None, metavar="on,off",
                   help="comma list of on (Batcher(overlap=True), the server's --overlap) and off "
                   "(synchronous steps, --no-overlap), each a row (default on,off; off alone when "
                   "the server has no --overlap)")
    p.add_argument("--sustained", type=int, default=0, metavar="G",
                   help="also run each case under sustained load: B requests in flight, each "
                   "one that ends replaced at once, G x B in all (G >= "
                   f"{sustained.MIN_GENERATIONS}; default 0: off)")
    p.add_argument("--lora-mix", type=int, default=0, metavar="N",
                   help="engine cases: also run each with the requests spread over the base "
                   "model and N LoRA adapters of the null device (request i under adapter i mod "
                   "N+1), rounds in turn with the base-only ones; the host time per step of "
                   "both is tabled (docs/lora.md, \"Measuring adapters\"; default 0: off)")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine cases")
    p.add_argument("--no-server", action="store_true", help="skip the HTTP server cases")
    p.add_argument("--admission-stalls", action="store_true",
                   help="also measure the step that admits one request at a full prefix cache "
                   "of 1k/10k/30k blocks against a steady step (B4, B16; bench micro's cases), "
                   "and the device's idle time around that request's chunk, pipeline on and off")
    p.add_argument("--timeout", type=float,
                   help="seconds per round (default: 10 x the ideal round time + 60)")
    p.add_argument("--policy", help="scheduling policy of the engine and the server (default: "
                   "the engine's, stall-free:8; docs/scheduling.md)")
    p.add_argument("--model", choices=sorted(_presets()), type=str.lower,
                   help="a model preset for the null device's shapes (its vocabulary sizes "
                        "every step's logits, which the host reads); default the server's tiny "
                        "spec (vocabulary 1024)")
    p.add_argument("--argmax-threads", type=int, default=None, metavar="N",
                   help="the engine's and the server's --argmax-threads (default: theirs)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--json", help="write the report (msgspec JSON) to this path")
    p.add_argument("--no-progress", action="store_true", help="no per-case progress on stderr")
    return p


def _presets() -> list[str]:
    from atombatch.artifact.config import PRESETS

    return list(PRESETS)


def run(args: argparse.Namespace, engine_core_flag: bool, overlap_flag: bool = True) -> Report:
    from atombatch.artifact.config import ModelSpec
    from atombatch.serve.cli import DEFAULT_SPEC

    spec = ModelSpec.preset(args.model) if args.model else DEFAULT_SPEC
    chunk = 128
    max_seq_len = max(1024, args.prompt_len + args.max_tokens)
    if args.engine_cores:
        cores: list[str | None] = list(args.engine_cores.split(","))
    else:
        cores = ["inline", "process"] if engine_core_flag else [None]
    overlaps: list[bool] = list(args.overlap or ((True, False) if overlap_flag else (False,)))
    cells = [(b, s, o) for b in args.batch_sizes for s in args.step_ms for o in overlaps]
    total = len(cells) * ((0 if args.no_engine else 2 if args.lora_mix else 1) +
                          (0 if args.no_server else len(args.tokenizers) * len(cores)))
    progress = CellProgress(total, enabled=not args.no_progress)
    commit = provenance.git_commit()  # what runs: taken before any case
    load_before = _load()
    cases: list[Case] = []
    floors: dict[tuple[int, float], SendFloor] = {}

    def finish(what: str, case: Case) -> None:
        cases.append(case)
        m = case.median
        bad = sum(r.requests - r.ok for r in case.rounds)
        outcome = "no round" if m is None else f"ratio {m.ratio:.3f}, {m.tok_per_s:.0f} tok/s"
        outcome += (f", {bad} requests failed" if bad else "") + \
            (f"; {case.error}" if case.error else "")
        progress.finish(what, outcome)

    with contextlib.ExitStack() as stack:
        tok_dir = stack.enter_context(_tokenizer_dir(spec.vocab_size)) \
            if "wordlevel" in args.tokenizers and not args.no_server else None
        for batch, step, overlap in cells:
            ideal = batch * 1e3 / step
            tag = " overlap" if overlap else " no-overlap"
            bound = bound_ratio(batch, step, args.prefill_ms, args.prompt_len, chunk,
                                args.max_tokens, args.policy)
            prompts = _prompts(batch, args.prompt_len, spec.vocab_size, args.seed)
            many = _prompts(batch * args.sustained, args.prompt_len, spec.vocab_size,
                            args.seed) if args.sustained else []
            timeout = args.timeout or 10 * (args.max_tokens * step / 1e3 + batch *
                                            args.prefill_ms / 1e3) + 60
            if not args.no_engine:
                what = f"B{batch} step {step:g} ms engine{tag}"
                progress.start(what)
                mixes = (0, args.lora_mix) if args.lora_mix else (0,)
                for mix in mixes:  # (warm: the adapters' path too)
                    engine_round(batch, step, args.prefill_ms, prompts, 4, max_seq_len, chunk,
                                 args.policy, spec, args.argmax_threads, overlap, mix)
                by_mix: dict[int, list[Round]] = {mix: [] for mix in mixes}
                for _ in range(args.repeats):  # base and mixed rounds in turn: the same load
                    for mix in mixes:
                        by_mix[mix].append(engine_round(
                            batch, step, args.prefill_ms, prompts, args.max_tokens, max_seq_len,
                            chunk, args.policy, spec, args.argmax_threads, overlap, mix))
                rounds = by_mix[0]
                held = engine_sustained(batch, step, args.prefill_ms, many, args.max_tokens,
                                        max_seq_len, chunk, args.policy, spec,
                                        args.argmax_threads, overlap) if many else None
                finish(what, Case(path="engine", batch_size=batch, step_ms=step,
                                  prefill_ms=args.prefill_ms, tokenizer=False, engine_core=None,
                                  ideal_tok_s=ideal, bound_ratio=bound, rounds=rounds,
                                  median=_figures(rounds), overlap=overlap, sustained=held))
                if args.lora_mix:
                    mixed = by_mix[args.lora_mix]
                    progress.start(f"{what} lora-mix {args.lora_mix}")
                    finish(f"{what} lora-mix {args.lora_mix}", Case(
                        path="engine", batch_size=batch, step_ms=step, prefill_ms=args.prefill_ms,
                        tokenizer=False, engine_core=None, ideal_tok_s=ideal, bound_ratio=bound,
                        rounds=mixed, median=_figures(mixed), overlap=overlap,
                        lora_mix=args.lora_mix))
            if args.no_server:
                continue
            if (batch, step) not in floors:
                floors[(batch, step)] = send_floor(batch, step)
            for mode in args.tokenizers:
                for core in cores:
                    what = f"B{batch} step {step:g} ms server tokenizer {mode}" + \
                        (f" --engine-core {core}" if core else "") + tag
                    progress.start(what)
                    argv = [sys.executable, "-m", "atombatch.serve", "--runtime", "null",
                            "--null-step-ms", f"{step:g}", "--null-prefill-ms",
                            f"{args.prefill_ms:g}", "--batch-size", str(batch),
                            "--max-seq-len", str(max_seq_len), "--prefill-chunk-size",
                            str(chunk), "--max-waiting", str(max(256, batch)), "--port", "0",
                            "--log-level", "warning"]
                    if mode == "wordlevel":
                        argv += ["--tokenizer", str(tok_dir)]
                    if args.model:
                        argv += ["--model", args.model]
                    if args.argmax_threads:
                        argv += ["--argmax-threads", str(args.argmax_threads)]
                    if args.policy:
                        argv += ["--policy", args.policy]
                    if core:
                        argv += ["--engine-core", core]
                    if overlap_flag:
                        argv += ["--overlap" if overlap else "--no-overlap"]
                    if server_has_prefix_default():  # every round repeats its prompts: with
                        #   the cache (the server's default) they would skip their prefill
                        argv += ["--no-enable-prefix-caching"]
                    split: Literal["thread", "process", "fronts"] = \
                        "process" if core == "process" else "thread"
                    if core == "process" and args.api_server_count > 1:
                        argv += ["--api-server-count", str(args.api_server_count)]
                        split = "fronts"
                    rounds = []
                    held = None
                    error: str | None = None
                    restarts = 0
                    # (a case is done with every round and, if asked, its sustained run)
                    while (len(rounds) < args.repeats or (many and held is None)) and \
                            restarts <= 1:
                        server: Server | None = None
                        try:
                            server = Server(argv)
                            warm = request_bodies(spec.name, prompts, 4)
                            server_round(server, warm, 4, batch, step, split, timeout)
                            bodies = request_bodies(spec.name, prompts, args.max_tokens)
                            while len(rounds) < args.repeats:
                                rounds.append(server_round(server, bodies, args.max_tokens,
                                                           batch, step, split, timeout))
                            if many and held is None:
                                held = server_sustained(
                                    server, request_bodies(spec.name, many, args.max_tokens),
                                    args.max_tokens, batch, step, split,
                                    timeout)
                        except (OSError, RuntimeError) as exc:  # did not start, or went away
                            time.sleep(0.5)
                            status = None if server is None else server.proc.poll()
                            error = f"{type(exc).__name__}: {exc}" + (
                                "" if server is None else f" (server exit status {status}; "
                                "stderr: " + " | ".join(list(server.lines)[-5:]) + ")")
                            if server is None or status is None:
                                break     # a live server that refused: no second try
                            restarts += 1  # a server that exited mid-case: one fresh start
                        finally:
                            if server is not None:
                                server.stop()
                    if len(rounds) == args.repeats and (not many or held is not None):
                        error = None if error is None else f"recovered by a restart: {error}"
                    finish(what, Case(path="server", batch_size=batch, step_ms=step,
                                      prefill_ms=args.prefill_ms, tokenizer=mode == "wordlevel",
                                      engine_core=core, ideal_tok_s=ideal, bound_ratio=bound,
                                      rounds=rounds, median=_figures(rounds) if rounds else None,
                                      command=shlex.join(["python", *argv[1:]]), error=error,
                                      overlap=overlap if overlap_flag else None,
                                      sustained=held))
    progress.close()
    params = {"batch_sizes": list(args.batch_sizes), "step_ms": list(args.step_ms),
              "prefill_ms": args.prefill_ms, "max_tokens": args.max_tokens,
              "prompt_len": args.prompt_len, "repeats": args.repeats,
              "sustained": args.sustained,
              "tokenizers": list(args.tokenizers), "engine_cores": cores, "seed": args.seed,
              "overlap": overlaps, "lora_mix": args.lora_mix,
              "policy": args.policy or "stall-free:8 (default)",
              "model": spec.name, "vocab_size": spec.vocab_size, "max_seq_len": max_seq_len,
              "argmax_threads": args.argmax_threads, "api_server_count": args.api_server_count,
              "prefill_chunk_size": chunk, "concurrency": "B", "temperature": 0.0,
              "ignore_eos": True, "cpu_clock": "schedstat" if
              os.path.exists("/proc/self/schedstat") else "stat ticks"}
    return Report(command=shlex.join(["python", "-m", "atombatch.bench", "overlap", *args.argv]),
                  commit=commit, machine=provenance.machine(), params=params,
                  engine_core_flag=engine_core_flag, load_before=load_before,
                  load_after=_load(), cases=cases, send_floors=list(floors.values()) or None)


def format_table(report: Report) -> str:
    """One row per B x step x tokenizer: the engine alone beside each server column."""
    cores = report.params["engine_cores"]
    head = f"{'B':>4} {'step':>5} {'ideal':>7} {'bound':>5} | {'engine':>6} {'steady':>6} " \
        f"{'cpu':>5} {'host':>5} {'sleep':>5} {'gap':>5} | {'tok':<4} {'ov':<3}"
    for core in cores:
        label = core or "server"
        head += f" | {label + ' ratio':>13} {'steady':>6} {'tok/s':>7} {'front':>6} " \
            f"{'mid':>5} {'sys':>5} {'core':>6} {'gap':>5} {'client':>6}"
    lines = ["bench overlap: delivered / ideal throughput on the null device "
             f"(prefill {report.params['prefill_ms']:g} ms, {report.params['prompt_len']} in / "
             f"{report.params['max_tokens']} out, c = B, medians of {report.params['repeats']}, "
             f"policy {report.params.get('policy', 'stall-free:8 (default)')}, model "
             f"{report.params.get('model', '?')} vocab {report.params.get('vocab_size', '?')}"
             f"{_fronts_note(report.params.get('api_server_count', 1))}); "
             "CPU in us per delivered token", head, "-" * len(head)]
    engines = {(c.batch_size, c.step_ms, bool(c.overlap)): c
               for c in report.cases if c.path == "engine" and not c.lora_mix}
    servers = {(c.batch_size, c.step_ms, c.tokenizer, c.engine_core, bool(c.overlap)): c
               for c in report.cases if c.path == "server"}
    keys = sorted({(c.batch_size, c.step_ms, bool(c.overlap)) for c in report.cases},
                  key=lambda k: (k[0], k[1], not k[2]))
    tokenizers = [t == "wordlevel" for t in report.params["tokenizers"]] or [False]
    for batch, step, overlap in keys:
        for i, tokenizer in enumerate(tokenizers):
            engine = engines.get((batch, step, overlap))
            some = engine or next(c for c in report.cases
                                  if (c.batch_size, c.step_ms) == (batch, step))
            row = f"{batch:>4} {step:>5g} {some.ideal_tok_s:>7.0f} {some.bound_ratio:>5.3f} | "
            em = engine.median if engine is not None else None
            if em is not None and i == 0:
                row += f"{em.ratio:>6.3f} {_ratio(em.steady)} {em.core_us_per_token:>5.1f} " \
                    f"{_ms(em.host_ms_per_step)} {_ms(em.device_ms_per_step)} {_us(em.gap_us)} | "
            else:
                row += f"{'':>6} {'':>6} {'':>5} {'':>5} {'':>5} {'':>5} | "
            row += f"{'wl' if tokenizer else 'ids':<4} {'on' if overlap else 'off':<3}"
            for core in cores:
                case = servers.get((batch, step, tokenizer, core, overlap))
                if case is None or case.median is None:
                    row += f" | {'-':>13} {'':>6} {'':>7} {'':>6} {'':>5} {'':>5} {'':>6} " \
                        f"{'':>5} {'':>6}"
                    continue
                m = case.median
                failed = sum(r.requests - r.ok for r in case.rounds) + _failed(case)
                ratio = f"{m.ratio:.3f}" + ("!" if failed else "")
                row += f" | {ratio:>13} {_ratio(m.steady)} {m.tok_per_s:>7.0f} " \
                    f"{m.front_us_per_token:>6.1f} {_us(m.mid_front_us_per_token)} " \
                    f"{_us(m.mid_front_sys_us_per_token)} " \
                    f"{m.core_us_per_token:>6.1f} {_us(m.gap_us)} {m.client_us_per_token:>6.1f}"
            lines.append(row)
    failures = [e for c in report.cases for r in c.rounds for e in r.errors] + \
        [c.error for c in report.cases if _failed(c)]
    restarted = [c for c in report.cases if c.error and not _failed(c)]
    lb, la = report.load_before, report.load_after
    lines += ["",
              "ideal = B / step (tok/s); bound = the best ratio a round allows (B prefills, "
              "max_tokens - 1 steps, and the decode steps the policy runs before the last "
              "prefill when all B arrive at once: stall-free:K admits K chunks per step); "
              "steady = median over requests of (tokens - 1) x step / "
              "(last - first token time): 1.0 when no decode step waited for the host (the round "
              "ratio also pays the admission ramp the policy sets)",
              "engine = in-process Batcher.step_arrays(): cpu = its process CPU (us/token), "
              "host = ms per decode step outside the device calls (the round's wall time less the "
              "device's, per decode step), sleep = ms per step inside them, gap = us per device "
              "call from the previous call's end (EngineStats.host_gap_s / host_gaps)",
              "tok = ids (no tokenizer) or wl (WordLevel tokenizer: detokenized text); ov = on: "
              "decodes run as a pipeline (Batcher(overlap=True), the server's --overlap), off: "
              "one synchronous step at a time; front = "
              "the server's main thread (with a core process: the whole server process) over the "
              "round, mid = the front over the middle half of the round's tokens (streaming only: "
              "no request parsing, no teardown), sys = mid's kernel part (socket writes); core = "
              "the rest, gap = the core's host time per device call (us: from one call's end to "
              "the next one's start, atombatch_host_gap_seconds_total / atombatch_host_gaps_total), "
              "client = this process (us/token); ! = failed requests",
              f"commit {report.commit}; load average {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f} before, "
              f"{la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} after; {report.machine}"]
    if failures:
        lines.append(f"! requests failed ({len(failures)}), e.g.: {failures[0]}")
    for c in restarted:
        lines.append(f"B{c.batch_size} step {c.step_ms:g} ms tokenizer "
                     f"{'wl' if c.tokenizer else 'ids'}: {c.error}")
    held = [c for c in report.cases if c.sustained is not None]
    if held:
        lines += ["", sustained_table(report, held)]
    if report.send_floors:
        lines += ["", f"send floor (a bare loopback writer, one {EVENT_BYTES}-byte write per "
                  "stream per step, read as the client reads: the least CPU a front streaming "
                  "each token as it comes spends per token here; `mid` less this is the "
                  "front's own): " + "; ".join(
                      f"B{f.batch_size} x {f.step_ms:g} ms {f.us_per_write:.1f} us"
                      for f in report.send_floors)]
    if report.admission:
        from types import SimpleNamespace

        from atombatch.bench import micro

        lines += ["", "admission stalls (the step admitting one request vs a steady step, "
                  "wall / CPU):", micro.admission_section(
                      SimpleNamespace(records=report.admission))]  # type: ignore[arg-type]
    if report.pipeline_admission:
        lines += ["", "admission in the pipeline (device idle around the admitted request's "
                  f"chunk, each call waiting {report.pipeline_admission[0].step_ms:g} ms; "
                  "medians):", admission.section(report.pipeline_admission)]
    return "\n".join(lines)


def lora_pairs(report: Report) -> list[tuple[Case, Case]]:
    """(base-only, mixed-adapter) engine cases of each B x step x overlap (`--lora-mix`)."""
    base = {(c.batch_size, c.step_ms, bool(c.overlap)): c for c in report.cases
            if c.path == "engine" and not c.lora_mix}
    return [(base[key], c) for c in report.cases if c.path == "engine" and c.lora_mix
            for key in [(c.batch_size, c.step_ms, bool(c.overlap))] if key in base]


def lora_table(report: Report) -> str:
    """The engine's host cost per step, base-only beside mixed-adapter (`--lora-mix`)."""
    head = f"{'B':>4} {'step':>5} {'ov':<3} | {'ratio':>6} {'host':>5} {'gap':>5} | " \
        f"{'mixed':>6} {'host':>5} {'gap':>5} | {'gap +':>6}"
    lines = [f"host cost per step, base only | requests over the base and "
             f"{report.params.get('lora_mix')} adapters (engine path, medians of "
             f"{report.params['repeats']}; host ms / step, gap us)", head, "-" * len(head)]
    for base, mixed in lora_pairs(report):
        b, m = base.median, mixed.median
        if b is None or m is None:
            continue
        more = f"{m.gap_us - b.gap_us:>+6.1f}" if m.gap_us is not None and \
            b.gap_us is not None else f"{'-':>6}"
        lines.append(f"{base.batch_size:>4} {base.step_ms:>5g} "
                     f"{'on' if base.overlap else 'off':<3} | {b.ratio:>6.3f} "
                     f"{_ms(b.host_ms_per_step)} {_us(b.gap_us)} | {m.ratio:>6.3f} "
                     f"{_ms(m.host_ms_per_step)} {_us(m.gap_us)} | {more}")
    return "\n".join(lines)


def sustained_table(report: Report, cases: list[Case]) -> str:
    """`--sustained`: one row per case that ran it."""
    g = report.params.get("sustained", "?")
    head = f"{'B':>4} {'step':>5} {'path':<24} {'ov':<3} | {'ratio':>6} {'decode':>6} " \
        f"{'ttft':>6} {'front':>6} {'core':>6} {'client':>6} {'window':>6}"
    lines = [f"sustained load: B requests in flight, each one that ends replaced at once, {g} x B "
             "in all; ratio = tokens delivered in the window (from the last of the first B "
             "requests' ends to the last send) / window / (B / step); decode = median per request "
             "of (tokens - 1) x step / decode time; ttft = median send -> first token (ms); CPU "
             "in us per delivered token over the whole run; window in s", head, "-" * len(head)]
    for c in sorted(cases, key=lambda c: (c.batch_size, c.step_ms, c.path, c.tokenizer,
                                           c.engine_core or "", not c.overlap)):
        h = c.sustained
        assert h is not None
        path = "engine" if c.path == "engine" else \
            f"server {'wl' if c.tokenizer else 'ids'}" + (f" {c.engine_core}" if c.engine_core
                                                         else "")
        def per(cpu_s: float, tokens: int = h.total_tokens) -> str:
            return f"{1e6 * cpu_s / tokens:>6.1f}" if tokens else f"{'-':>6}"

        bad = "!" if h.ok < h.requests else ""
        lines.append(f"{c.batch_size:>4} {c.step_ms:>5g} {path:<24} "
                     f"{'on' if c.overlap else 'off':<3} | {h.ratio:>6.3f}{bad} "
                     f"{_ratio(h.decode_share)} "
                     f"{_ms1(h.ttft_ms)} "
                     f"{per(h.front_cpu_s)} {per(h.core_cpu_s)} {per(h.client_cpu_s)} "
                     f"{h.window_s:>6.2f}")
    return "\n".join(lines)


def _failed(case: Case) -> bool:
    """The case did not run all its rounds (a restart that recovered is not a failure)."""
    return case.error is not None and not case.error.startswith("recovered by a restart")


def _ratio(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:>6.3f}"


def _ms1(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:>6.1f}"


def _us(value: float | None) -> str:
    return f"{value:>5.1f}" if value is not None else f"{'-':>5}"


def _ms(value: float | None) -> str:
    return f"{'-':>5}" if value is None else f"{value:>5.2f}"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None
    if not values or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every step time must be > 0 ms")
    return values


def _overlaps(text: str) -> tuple[bool, ...]:
    values = tuple(text.split(","))
    bad = [v for v in values if v not in ("on", "off")]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{(bad or [text])[0]!r} is not on or off")
    return tuple(v == "on" for v in values)


def _modes(text: str) -> tuple[str, ...]:
    values = tuple(text.split(","))
    bad = [v for v in values if v not in ("none", "wordlevel")]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not none or wordlevel")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    for name in ("max_tokens", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            print(f"bench overlap: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.prefill_ms < 0:
        print("bench overlap: --prefill-ms must be >= 0", file=sys.stderr)
        return 2
    if args.sustained and args.sustained < sustained.MIN_GENERATIONS:
        print(f"bench overlap: --sustained {args.sustained}: G must be 0 (off) or >= "
              f"{sustained.MIN_GENERATIONS} (a window in which every stream in flight is a "
              "refill)", file=sys.stderr)
        return 2
    flag = False if args.no_server else server_has_engine_core()
    if args.engine_cores and not flag:
        print("bench overlap: --engine-cores needs a server with --engine-core; this one has "
              "none", file=sys.stderr)
        return 2
    overlap_flag = True if args.no_server else server_has_overlap()
    if args.overlap and True in args.overlap and not overlap_flag:
        print("bench overlap: --overlap on needs a server with --overlap; this one has none",
              file=sys.stderr)
        return 2
    if not 0 <= args.lora_mix <= MAX_LORA_MIX:
        print(f"bench overlap: --lora-mix {args.lora_mix} must be in 0..{MAX_LORA_MIX}",
              file=sys.stderr)
        return 2
    if args.lora_mix and args.no_engine:
        print("bench overlap: --lora-mix runs on the engine cases; --no-engine skips them",
              file=sys.stderr)
        return 2
    report = run(args, flag, overlap_flag)
    if args.admission_stalls:
        report = msgspec.structs.replace(report, admission=admission_stalls(max(3, args.repeats)),
                                         pipeline_admission=admission.run())
    print(format_table(report))
    if args.lora_mix:
        print()
        print(lora_table(report))
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        print(f"wrote {args.json}")
    failed = any(r.ok < r.requests for c in report.cases for r in c.rounds) or \
        any(_failed(c) for c in report.cases)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
