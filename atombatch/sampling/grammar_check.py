"""Client constraints checked where they cannot hurt the server: in worker processes.

Theory of operation:

- **Why a process.** llguidance parses a Lark grammar recursively in native code: a chain of
  ~4 000 rules (58 KB) overflows an 8 MiB stack and the process dies with SIGSEGV, whatever
  thread it runs on; and the GBNF -> Lark conversion is pure Python, quadratic in the chain, and
  holds the interpreter lock for seconds. So a front never converts or compiles a constraint a
  client sent in its own process: `GrammarWorkers.check` hands it to a worker process, which
  lowers it (`grammar.grammar_text`) and compiles it against the model's tokenizer on a thread
  whose stack is `stack_bytes`, under a memory limit (`RLIMIT_AS`, its size after start-up plus
  `memory_bytes`), at `nice` 10 (the device's loop and the streams come first).
- **Budgets.** A check whose worker spends more than `seconds` of CPU time on it, or that does
  not answer within `wall_seconds` (a library that waits forever; a worker starved of CPU for
  that long), is killed with its worker: the request is a `GrammarBudgetError` naming the limit.
  CPU time, not wall time, is the budget: a busy host slows a check without refusing it. A
  worker that dies on a constraint (a stack overflow, the memory limit, a native fault) costs
  that request a `GrammarBudgetError` naming the budgets, and nothing else: the worker is started
  again on the next check. A worker whose front is gone exits (it looks every second).
- **What the engine gets.** A constraint that passes comes back with `lowered` set: the grammar
  text llguidance compiles. The engine compiles exactly that text on its own compile thread,
  whose stack (`grammar.COMPILE_STACK_BYTES`) is larger than a worker's: what compiled within a
  worker's stack compiles there too, and no conversion runs in the engine's process.
- **Remembered.** Checks are kept (`CHECKED_COUNT` constraints, `CHECKED_CHARS` characters of
  constraint and grammar text), so a client sending the same schema with every request pays
  once: a segmented LRU, whose protected half holds the constraints seen twice, so a stream of
  one-off constraints cannot push out the ones in use. Requests that bring the same new
  constraint at once share one check.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import multiprocessing
import os
import queue
import resource
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from atombatch.api.structured import StructuredOutput
from atombatch.errors import ConfigError, RequestError
from atombatch.logs import logger

log = logger("atombatch.sampling.grammar")

GRAMMAR_SECONDS = 10.0              # CPU time of one check before its worker is killed
GRAMMAR_WALL_SECONDS = 60.0         # wall time of one check at most (a worker that waits, or starves)
GRAMMAR_MEMORY_BYTES = 1 << 30      # address space a check may add to its worker's
CHECK_STACK_BYTES = 64 << 20        # the stack a worker compiles on (~25 000 chained Lark rules)
CHECKED_COUNT = 256                 # checks remembered (a constraint seen again is not checked again)
CHECKED_CHARS = 16 << 20            # ... and their constraint and grammar text, in characters
START_SECONDS = 120.0               # a worker's start-up (imports, llguidance's tokenizer) at most
POLL_SECONDS = 0.1                  # how often a check's CPU time is read while it runs
PARENT_POLL_SECONDS = 1.0           # how often a worker looks for its parent (it exits when orphaned)

# what a worker answers: ("ok", lowered grammar) or ("error", message, param, limit, kind), kind
# "request" (the constraint is wrong), "budget" (it costs too much) or "config" (the server's)
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class GrammarBudgetError(RequestError):
    """A constraint cost more than a check's budget (time, memory, stack): refused, 400."""


class GrammarWorkers:
    """Worker processes that check clients' constraints for one front (see the module docstring).

    `check` is blocking and thread-safe: run it from as many threads as there are workers (the
    front's check threads); each call borrows an idle worker for one constraint.

    Args:
        tokenizer: the model's `tokenizers.Tokenizer` (sent to each worker as its JSON).
        vocab_size, eos_token_ids: the model's (what the engine masks with).
        workers: processes; checks beyond them wait for one.
        seconds, wall_seconds, memory_bytes, stack_bytes: one check's budgets (CPU seconds,
            wall seconds, address space, stack).
        target: `module:function` a worker checks with instead of `check_in_worker` (the tests'
            fault injection: a function that crashes or hangs on some constraints).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 workers: int = 1, seconds: float = GRAMMAR_SECONDS,
                 wall_seconds: float = GRAMMAR_WALL_SECONDS,
                 memory_bytes: int = GRAMMAR_MEMORY_BYTES,
                 stack_bytes: int = CHECK_STACK_BYTES, target: str | None = None) -> None:
        if workers < 1:
            raise ConfigError(f"grammar workers={workers} must be at least 1")
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "to_str"):
            raise ConfigError(f"structured output needs a Hugging Face `tokenizers` tokenizer, "
                              f"got {type(tokenizer).__name__}")
        self.setup = _Setup(tokenizer=backend.to_str(), vocab_size=vocab_size,
                            eos_token_ids=tuple(int(t) for t in eos_token_ids),
                            memory_bytes=memory_bytes, stack_bytes=stack_bytes,
                            target=target or "")
        self.seconds = seconds
        self.wall_seconds = wall_seconds
        self.workers = workers
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for index in range(workers):
            self._idle.put(_Worker(index, self.setup))
        # a segmented LRU: checked once (probation), checked and asked for again (protected)
        self._probation: collections.OrderedDict[StructuredOutput, StructuredOutput] = \
            collections.OrderedDict()
        self._protected: collections.OrderedDict[StructuredOutput, StructuredOutput] = \
            collections.OrderedDict()
        self._checked_chars = 0
        self._inflight: dict[StructuredOutput, concurrent.futures.Future[StructuredOutput]] = {}
        self._lock = threading.Lock()
        self.restarts = 0                 # workers started again after a death or a kill
        self.refused = 0                  # checks refused for a budget (killed or died)
        self.checks = 0                   # constraints sent to a worker
        self._closed = False

    # -- the cache ---------------------------------------------------------------------------------
    def known(self, structured: StructuredOutput) -> StructuredOutput | None:
        """The checked constraint (with `lowered`) if it was checked lately, else None."""
        with self._lock:
            checked = self._protected.get(structured)
            if checked is not None:
                self._protected.move_to_end(structured)
                return checked
            checked = self._probation.pop(structured, None)
            if checked is not None:  # asked for again: protected from one-off churn
                self._protected[structured] = checked
                self._evict()
            return checked

    def _remember(self, structured: StructuredOutput, checked: StructuredOutput) -> None:
        with self._lock:
            if structured in self._probation or structured in self._protected:
                return
            self._probation[structured] = checked
            self._checked_chars += _size(structured, checked)
            self._evict()

    def _evict(self) -> None:
        """Past a bound: the probation's oldest first, then the protected's (lock held)."""
        while (len(self._probation) + len(self._protected) > CHECKED_COUNT or
               self._checked_chars > CHECKED_CHARS):
            if self._probation and (len(self._protected) <= CHECKED_COUNT // 2 or
                                    not self._protected):
                old, old_checked = self._probation.popitem(last=False)
            elif self._protected:
                old, old_checked = self._protected.popitem(last=False)
            else:
                return
            self._checked_chars -= _size(old, old_checked)

    # -- checking ----------------------------------------------------------------------------------
    def warm(self) -> None:
        """Start every worker now (each builds llguidance's tokenizer: about a second for a 152k
        vocabulary), on a background thread."""
        threading.Thread(target=self._warm, name="atombatch-grammar-warm", daemon=True).start()

    def _warm(self) -> None:
        taken = []
        try:
            for _ in range(self.workers):
                worker = self._idle.get()
                taken.append(worker)
                worker.start()
        except Exception as exc:  # answered as a 400 by the first constrained request
            log.warning("structured.unavailable", error=str(exc))
        finally:
            for worker in taken:
                self._idle.put(worker)

    def check(self, structured: StructuredOutput) -> StructuredOutput:
        """`structured` checked and lowered (`lowered` set), from the cache or a worker.

        Raises:
            RequestError: it does not compile, or no token can start it (naming its field).
            GrammarBudgetError: it cost more than a check's budget (naming the limit).
            ConfigError: no worker can start (llguidance missing, a tokenizer it cannot read).
        """
        checked = self.known(structured)
        if checked is not None:
            return checked
        with self._lock:  # the same new constraint in several requests at once: one check
            shared = self._inflight.get(structured)
            if shared is None:
                mine: concurrent.futures.Future[StructuredOutput] = concurrent.futures.Future()
                self._inflight[structured] = mine
        if shared is not None:
            return shared.result()
        try:
            checked = self._check_now(structured)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        else:
            mine.set_result(checked)
            return checked
        finally:
            with self._lock:
                del self._inflight[structured]

    def _check_now(self, structured: StructuredOutput) -> StructuredOutput:
        if self._closed:
            raise ConfigError("the grammar workers are closed")
        worker = self._idle.get()
        try:
            if self._closed:
                raise ConfigError("the grammar workers are closed")
            checked = self._run(worker, structured)
        finally:
            if self._closed:  # closed meanwhile: this worker is not handed out again
                worker.stop()
            self._idle.put(worker)
        self._remember(structured, checked)
        return checked

    def _run(self, worker: _Worker, structured: StructuredOutput) -> StructuredOutput:
        worker.start()
        self.checks += 1
        param = structured.param
        started = time.monotonic()
        try:
            worker.conn.send_bytes(msgspec.msgpack.encode(structured))
            reply, over = self._wait(worker, started)
        except (EOFError, OSError):  # the worker died on it
            code = worker.stop()
            self.restarts += 1
            self.refused += 1
            log.warning("structured.worker_died", param=param, kind=structured.kind,
                        chars=structured.chars, exit=code)
            raise GrammarBudgetError(
                f"{param}: compiling the {structured.kind} ({structured.chars} characters) "
                f"killed the grammar compiler's worker process ({_exit_name(code)}): it needs more "
                f"than a check's stack of {self.setup.stack_bytes >> 20} MiB or memory of "
                f"{self.setup.memory_bytes >> 20} MiB (deeply nested or long-chained rules); "
                "simplify it", param=param, limit=self.setup.stack_bytes) from None
        if reply is None:  # past its time: killed, started again on the next check
            worker.stop()
            self.restarts += 1
            self.refused += 1
            log.warning("structured.check_timeout", param=param, kind=structured.kind,
                        chars=structured.chars, seconds=round(time.monotonic() - started, 3),
                        budget=over)
            if over == "cpu":
                raise GrammarBudgetError(
                    f"{param}: compiling the {structured.kind} ({structured.chars} characters) "
                    f"took more than the budget of {self.seconds:g} s of CPU time per "
                    "constraint; simplify it", param=param, limit=self.seconds)
            raise GrammarBudgetError(
                f"{param}: compiling the {structured.kind} ({structured.chars} characters) did "
                f"not finish within the budget of {self.wall_seconds:g} s per constraint; "
                "simplify it", param=param, limit=self.wall_seconds)
        if reply[0] == "ok":
            return msgspec.structs.replace(structured, lowered=reply[1])
        _, message, error_param, limit, kind = reply
        if kind == "config":
            raise ConfigError(message)
        if kind == "budget":
            self.refused += 1
            raise GrammarBudgetError(message, param=error_param, limit=limit)
        raise RequestError(message, param=error_param, limit=limit)

    def _wait(self, worker: _Worker, started: float) -> tuple[Any, str]:
        """The worker's reply, or (None, "cpu" / "wall") past a budget.

        Raises:
            EOFError, OSError: the worker died.
        """
        cpu_start = worker.cpu_seconds()
        while True:
            if worker.conn.poll(POLL_SECONDS):
                return _decode(worker.conn.recv_bytes()), ""
            cpu = worker.cpu_seconds()
            if cpu is not None and cpu_start is not None and cpu - cpu_start > self.seconds:
                return None, "cpu"
            if time.monotonic() - started > self.wall_seconds:
                return None, "wall"

    def idle_processes(self) -> int:
        """Worker processes alive among the idle workers (0 after `close`)."""
        workers = []
        while True:
            try:
                workers.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for worker in workers:
            self._idle.put(worker)
        return sum(1 for w in workers if w.process is not None and w.process.is_alive())

    def close(self) -> None:
        """Stop every worker (idle ones now; a busy one when its check returns)."""
        self._closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            worker.stop()


def _size(structured: StructuredOutput, checked: StructuredOutput) -> int:
    """What a remembered check counts against `CHECKED_CHARS`."""
    return structured.chars + len(checked.lowered)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _exit_name(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit status {code}"


class _Setup(msgspec.Struct, frozen=True):
    tokenizer: str                     # the tokenizer's JSON
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    memory_bytes: int
    stack_bytes: int
    target: str                        # "module:function", or "" for check_in_worker


class _Worker:
    """One worker process and the parent's end of its pipe (started on first use)."""

    def __init__(self, index: int, setup: _Setup) -> None:
        self.index = index
        self.setup = setup
        self.process: Any = None
        self.conn: Any = None

    def start(self) -> None:
        if self.process is not None and self.process.is_alive():
            return
        self.stop()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker_main, args=(child,),
                              name=f"atombatch-grammar-{self.index}", daemon=True)
        process.start()
        child.close()
        try:
            parent.send_bytes(msgspec.msgpack.encode(self.setup))
            if not parent.poll(START_SECONDS):
                raise ConfigError(f"a grammar worker did not start within {START_SECONDS:g} s")
            ready = _decode(parent.recv_bytes())
        except (EOFError, OSError):
            process.join(5)
            raise ConfigError(f"a grammar worker exited at start "
                              f"({_exit_name(process.exitcode)})") from None
        except ConfigError:
            process.kill()
            process.join(5)
            raise
        if ready[0] != "ready":
            process.join(5)
            raise ConfigError(f"structured output is unavailable: {ready[1]}")
        self.process, self.conn = process, parent

    def cpu_seconds(self) -> float | None:
        """The process's CPU time so far (user + system, /proc), or None where unreadable."""
        process = self.process
        if process is None or process.pid is None:
            return None
        try:
            with open(f"/proc/{process.pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> int | None:
        """Kill the process (if alive) and return its exit code."""
        process, conn = self.process, self.conn
        self.process = self.conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.is_alive():
            process.kill()
        process.join(5)
        return int(process.exitcode) if process.exitcode is not None else None


# -- the worker process --------------------------------------------------------------------------
def _worker_main(conn: Any) -> None:
    """A worker's main: read its setup, build the tokenizer, then check constraints one at a
    time on a thread with the setup's stack."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its parent decides when it stops
    _name_process(b"atombatch-gramm")
    with contextlib.suppress(OSError):
        os.nice(10)
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True,
                     name="atombatch-grammar-parent").start()
    setup = msgspec.msgpack.decode(conn.recv_bytes(), type=_Setup)
    threading.stack_size(setup.stack_bytes)
    thread = threading.Thread(target=_serve, args=(conn, setup), name="atombatch-grammar-check")
    thread.start()
    thread.join()


def _exit_when_orphaned(parent: int) -> None:
    """Exit at once when the front that started this worker is gone (killed mid-check, its
    budget went with it)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def _serve(conn: Any, setup: _Setup) -> None:
    try:
        check = _target(setup.target)
        from tokenizers import Tokenizer

        from atombatch.sampling.grammar import build_tokenizer
        tokenizer = build_tokenizer(Tokenizer.from_str(setup.tokenizer), setup.vocab_size,
                                    setup.eos_token_ids)
        # one compile before the limit is set: the allocator's arenas of this thread exist
        check(tokenizer, StructuredOutput.regex("a"), setup.vocab_size)
    except Exception as exc:
        conn.send_bytes(_encode(("failed", str(exc))))
        return
    _limit_memory(setup.memory_bytes)
    conn.send_bytes(_encode(("ready", "")))
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the parent closed it
            return
        param = "structured"
        try:
            structured = msgspec.msgpack.decode(frame, type=StructuredOutput)
            param = structured.param
            reply: tuple[Any, ...] = ("ok", check(tokenizer, structured, setup.vocab_size))
        except RequestError as exc:
            reply = ("error", str(exc), exc.param, exc.limit, "request")
        except ConfigError as exc:
            reply = ("error", str(exc), None, None, "config")
        except MemoryError:
            reply = ("error", f"{param}: compiling it needed more than a check's memory of "
                     f"{setup.memory_bytes >> 20} MiB; simplify it", param, setup.memory_bytes,
                     "budget")
        except RecursionError:
            reply = ("error", f"{param}: it nests deeper than the grammar converter can follow; "
                     "simplify it", param, None, "budget")
        except Exception as exc:  # a library's error on a client's input: that input's fault
            reply = ("error", f"{param}: it does not compile: {type(exc).__name__}: {exc}"[:600],
                     param, None, "request")
        conn.send_bytes(_encode(reply))


def check_in_worker(tokenizer: Any, structured: StructuredOutput, vocab_size: int) -> str:
    """What a worker does with one constraint: lower it, compile it against the tokenizer, check
    a token can start it; returns the lowered grammar text.

    Raises:
        RequestError: naming the constraint's field (see `grammar.grammar_text`,
            `grammar.check_matcher`).
    """
    from atombatch.sampling import grammar

    text = grammar.grammar_text(structured)
    grammar.compile_matcher(tokenizer, text, structured, vocab_size)
    return text


def _target(name: str) -> Any:
    if not name:
        return check_in_worker
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _name_process(name: bytes) -> None:
    """Name this process for `ps -o comm` and /proc/PID/comm (Linux; 15 bytes at most)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME


def _limit_memory(extra: int) -> None:
    """Cap this process's address space at its present size plus `extra` bytes."""
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
