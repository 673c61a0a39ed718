"""`AsyncBatcher`: the asyncio adapter. One background step loop, an async iterator per request.

Only the loop task touches the `Batcher`; `submit`/`abort` called from other tasks go through an
inbox the loop drains between steps, so a step running in a worker thread never races with them.

Output contract: each request's outputs have exactly one consumer (`outputs(id)` a second time
raises `StateError`). A request whose outputs nobody claimed by the time it finished is kept,
compacted into one output per choice carrying its every token, piece of text and logprob, for at
most `max_unclaimed` requests and `max_unclaimed_bytes` bytes (estimated: ids, text, logprob
entries); past either the oldest unclaimed results are dropped (logged as
`request.unclaimed_dropped`) and `outputs(id)` for them raises `RequestError`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Self

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.mailbox import Mailbox, as_outputs, plain_output
from atombatch.api.structs import Completion, RequestOutput, SamplingParams
from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.batcher import Batcher, EngineStats, KVSource
from atombatch.engine.lora import adapter_named
from atombatch.errors import (
    AtomBatchError,
    CapacityError,
    ConfigError,
    RequestError,
    StateError,
    UnavailableError,
)
from atombatch.logs import log

# Finished requests whose outputs nobody claimed yet, kept by default (oldest dropped first).
DEFAULT_MAX_UNCLAIMED = 1024
DEFAULT_MAX_UNCLAIMED_BYTES = 64 * 1024 * 1024
_LOGPROB_BYTES = 64  # a TokenLogprobs candidate kept in memory (id, float, rank, object)


def output_bytes(out: RequestOutput) -> int:
    """About what a finished output holds in memory (its ids, text and logprob candidates)."""
    size = 8 * len(out.new_token_ids) + len(out.text or "")
    for entries in (out.logprobs, out.prompt_logprobs):
        if entries:
            size += sum(_LOGPROB_BYTES * (1 + len(lp.top)) for lp in entries if lp is not None)
    return size


class OutputStreams(abc.ABC):
    """The consumer side shared by `AsyncBatcher` and the engine-core client
    (`atombatch.core.CoreClient`): one asyncio queue per request, the one-consumer rule, and
    the bounded keep of finished results nobody claimed yet. Subclasses queue requests
    (`submit`, `abort`) and feed `_deliver` with what the engine produced."""

    def __init__(self, max_unclaimed: int,
                 max_unclaimed_bytes: int = DEFAULT_MAX_UNCLAIMED_BYTES,
                 stream_interval: int = 1) -> None:
        for name, value in (("max_unclaimed", max_unclaimed),
                            ("max_unclaimed_bytes", max_unclaimed_bytes),
                            ("stream_interval", stream_interval - 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                shown = stream_interval if name == "stream_interval" else value
                rule = ">= 1" if name == "stream_interval" else ">= 0"
                raise ConfigError(f"{name}={shown!r} must be an int {rule}")
        # Tokens a request's consumer is woken for at most once (its first output and any that
        # ends a choice always go at once): SGLang's --stream-interval. 1 = every token.
        self.stream_interval = stream_interval
        self._held: dict[str, list[RequestOutput]] = {}  # outputs waiting for the interval
        self._streaming: set[str] = set()  # requests whose first output went out
        self.max_unclaimed = max_unclaimed
        self.max_unclaimed_bytes = max_unclaimed_bytes
        self._unclaimed_bytes: dict[str, int] = {}
        self.unclaimed_bytes = 0
        self._queues: dict[str, Mailbox] = {}
        # finished before anyone called outputs(): one compacted output each, oldest first
        self._unclaimed: OrderedDict[str, tuple[RequestOutput, ...]] = OrderedDict()
        self.unclaimed_dropped = 0
        self._claimed: set[str] = set()

    @abc.abstractmethod
    def submit(self, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, request_id: str | None = None,
               kv: KVSource | None = None, *, lora: str | None = None,
               validated: bool = False) -> str:
        """What the subclass does (see AsyncBatcher and CoreClient)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """What the subclass does (see AsyncBatcher and CoreClient)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """What the subclass does (see AsyncBatcher and CoreClient)."""

    @abc.abstractmethod
    async def close(self, drain: bool = True) -> None:
        """What the subclass does (see AsyncBatcher and CoreClient)."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _open(self, request_id: str) -> None:
        """Give a request about to be queued its output queue."""
        if request_id in self._queues:
            raise RequestError(f"request_id={request_id!r} is already in flight")
        self._forget_unclaimed(request_id)
        self._claimed.discard(request_id)
        self._held.pop(request_id, None)
        self._streaming.discard(request_id)
        self._queues[request_id] = Mailbox()

    def _forget_unclaimed(self, request_id: str) -> tuple[RequestOutput, ...] | None:
        self.unclaimed_bytes -= self._unclaimed_bytes.pop(request_id, 0)
        return self._unclaimed.pop(request_id, None)

    def outputs(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Iterate a submitted request's outputs; leaving the iteration early aborts it.

        A request that finished before this call (or before the first `__anext__`) still yields
        its outputs: while it is among the last `max_unclaimed` unclaimed results, as one
        output per choice carrying that choice's every token (the request's final one last).

        Raises:
            StateError: the outputs of this request are already being consumed (one consumer).
            RequestError: no request with this id was submitted, its outputs were taken, or it
                finished unclaimed and was dropped under `max_unclaimed` or
                `max_unclaimed_bytes`.
        """
        return self._iterate(request_id, self._claim(request_id))

    def output_box(self, request_id: str) -> Mailbox:
        """The request's `Mailbox` itself, for a consumer that reads plain tokens as ints
        (the server's streaming path; `outputs` and `output_batches` build a `RequestOutput`
        of each). The same one-consumer rule and errors as `outputs`; the caller aborts the
        request if it stops reading before the finished output."""
        return self._claim(request_id)

    def _claim(self, request_id: str) -> Mailbox:
        """The mailbox `outputs` / `output_batches` / `output_box` read (the errors are
        theirs)."""
        if request_id in self._claimed:
            raise StateError(f"outputs({request_id!r}) is already being consumed: each "
                             "request's outputs have one consumer (docs/rules.md)")
        queue = self._queues.get(request_id)
        if queue is None:
            finals = self._forget_unclaimed(request_id)
            if finals is None:
                raise RequestError(f"request_id={request_id!r} is unknown or its outputs were "
                                   f"taken (an unclaimed finished request is kept only while "
                                   f"among the last max_unclaimed={self.max_unclaimed} and "
                                   f"within max_unclaimed_bytes={self.max_unclaimed_bytes})")
            queue = Mailbox()
            for final in finals:
                queue.put_nowait(final)
        else:
            self._claimed.add(request_id)
        return queue

    def output_batches(self, request_id: str) -> AsyncGenerator[list[RequestOutput], None]:
        """`outputs(request_id)`, but each wakeup yields every output that is waiting (oldest
        first) as one list: a consumer that fell behind catches up in one step, with one write.
        The same one-consumer rule and errors as `outputs`."""
        return self._batches(request_id, self._claim(request_id))

    async def _batches(self, request_id: str, queue: Mailbox
                       ) -> AsyncGenerator[list[RequestOutput], None]:
        finished = False
        try:
            while not finished:
                # nothing follows a request's finished output: everything waiting is one batch
                batch = as_outputs(request_id, await queue.take())
                finished = batch[-1].finished
                yield batch
        finally:
            if not finished:
                self.abort(request_id)

    async def _iterate(self, request_id: str, queue: Mailbox
                       ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                out = plain_output(request_id, item) if isinstance(item, int) else item
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    async def stream(self, prompt: Sequence[int] | npt.NDArray[np.integer],
                     params: SamplingParams | None = None, request_id: str | None = None,
                     kv: KVSource | None = None, *,
                     lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit and iterate; cancelling the consuming task aborts the request (`lora`: the
        adapter it runs under, by name)."""
        request_id = self.submit(prompt, params, request_id, kv, lora=lora)
        async with contextlib.aclosing(self.outputs(request_id)) as outs:
            async for out in outs:
                yield out

    async def generate(self, prompt: Sequence[int] | npt.NDArray[np.integer],
                       params: SamplingParams | None = None, *,
                       lora: str | None = None) -> Completion:
        """Submit and wait for the whole completion (one choice; `generate_choices` for n > 1).

        Raises:
            RequestError: `params.n > 1` (nothing is submitted).
        """
        if params is not None and params.n > 1:
            raise RequestError(f"n={params.n}: generate returns one completion; use "
                               "generate_choices for n > 1")
        [completion] = await self.generate_choices(prompt, params, lora=lora)
        return completion

    async def generate_choices(self, prompt: Sequence[int] | npt.NDArray[np.integer],
                               params: SamplingParams | None = None, *,
                               lora: str | None = None) -> list[Completion]:
        """Submit and wait for every choice of the request: `params.n` completions in choice
        order (`Completion.index`). A request that failed ends with `finish_reason="error"` and
        the failure in `error`, also when the engine failed before a choice produced anything."""
        done: dict[int, Completion] = {}
        tokens: dict[int, list[int]] = {}
        n = 1 if params is None else params.n
        async for out in self.stream(prompt, params, lora=lora):
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.completion is not None:
                done[out.index] = out.completion
            if out.finished:
                # A request failed as a whole (the step loop failed, or the engine refused it
                # after the front had accepted it) ends without a completion per choice: each
                # missing one is an error completion carrying that failure.
                for index in range(n):
                    if index not in done:
                        done[index] = Completion(
                            request_id=out.request_id, prompt_len=len(prompt),
                            token_ids=tuple(tokens.get(index, ())), finish_reason="error",
                            error=out.error or "the request ended without a result",
                            timings=None, index=index)
                return [done[index] for index in sorted(done)]
        raise AtomBatchError("stream ended without a final output")  # pragma: no cover

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is None:
            return
        if self.stream_interval > 1 and not self._hold(queue, out):
            return
        queue.put_nowait(out)
        if out.finished:
            del self._queues[out.request_id]
            if out.request_id in self._claimed:
                self._claimed.discard(out.request_id)
            else:
                self._keep_unclaimed(out.request_id, queue)

    def _hold(self, queue: Mailbox, out: RequestOutput) -> bool:
        """With `stream_interval` N > 1: keep a plain token output back until N tokens wait
        (they then reach the queue together, so the consumer wakes once and writes once).
        Returns True when `out` is to be queued now, after what was held."""
        held = self._held.get(out.request_id)
        if held is None:
            if queue.empty() and out.finish_reason is None and not out.finished and \
                    out.request_id in self._streaming:
                self._held[out.request_id] = [out]
                return False
            if out.finished:
                self._streaming.discard(out.request_id)
            else:
                self._streaming.add(out.request_id)  # its first output goes at once
            return True
        held.append(out)
        if out.finish_reason is None and not out.finished and \
                sum(len(o.new_token_ids) for o in held) < self.stream_interval:
            return False
        del self._held[out.request_id]
        for early in held[:-1]:
            queue.put_nowait(early)
        if out.finished:
            self._streaming.discard(out.request_id)
        return True

    def _keep_unclaimed(self, request_id: str, queue: Mailbox) -> None:
        """Compact a finished, unclaimed request's outputs into one and bound how many are kept."""
        by_choice: dict[int, list[RequestOutput]] = {}
        while not queue.empty():
            item = queue.get_nowait()
            out = plain_output(request_id, item) if isinstance(item, int) else item
            by_choice.setdefault(out.index, []).append(out)
        kept = [compact_outputs(outs) for outs in by_choice.values()]
        kept.sort(key=lambda out: out.finished)  # the request's last output stays last
        assert kept and kept[-1].finished
        self._unclaimed[request_id] = tuple(kept)
        size = sum(output_bytes(out) for out in kept)
        self._unclaimed_bytes[request_id] = size
        self.unclaimed_bytes += size
        while len(self._unclaimed) > self.max_unclaimed or \
                self.unclaimed_bytes > self.max_unclaimed_bytes:
            dropped, _ = self._unclaimed.popitem(last=False)
            self.unclaimed_bytes -= self._unclaimed_bytes.pop(dropped)
            self.unclaimed_dropped += 1
            if self.unclaimed_dropped % 1000 == 1:  # a flood of them must not flood the log
                log.warning("request.unclaimed_dropped", request_id=dropped,
                            dropped=self.unclaimed_dropped, max_unclaimed=self.max_unclaimed,
                            max_unclaimed_bytes=self.max_unclaimed_bytes)


class AsyncBatcher(OutputStreams):
    """Serve a `Batcher` from asyncio.

    Args:
        batcher: the engine to drive.
        offload: run each step in a worker thread so the event loop stays responsive while the
            runtime computes (True for real compute; False for the simulator).
        idle_poll: seconds between source polls while every unfinished request waits on a KV
            producer (the loop sleeps instead of spinning).
        max_unclaimed: finished requests whose outputs were never claimed that are kept for a
            late `outputs(id)`; the oldest are dropped past it.
        max_unclaimed_bytes: the same, bounded by their estimated size (`output_bytes`):
            prompt logprobs make one result weigh megabytes.
        stream_interval: wake a request's consumer at most once per this many tokens (its first
            output and any output that ends a choice go at once); 1 = every token. Fewer wakeups
            and writes per token for more tokens per SSE event (SGLang's --stream-interval).

    Use as `async with AsyncBatcher(b) as ab:` or call `start()` / `close()`. `start()` after
    `close()` starts the loop again on the same Batcher (e.g. in a new event loop).
    """

    def __init__(self, batcher: Batcher, *, offload: bool = True,
                 idle_poll: float = 0.002, max_unclaimed: int = DEFAULT_MAX_UNCLAIMED,
                 max_unclaimed_bytes: int = DEFAULT_MAX_UNCLAIMED_BYTES,
                 stream_interval: int = 1) -> None:
        super().__init__(max_unclaimed, max_unclaimed_bytes, stream_interval)
        self.batcher = batcher
        self.offload = offload
        self.idle_poll = idle_poll
        self._inbox: list[tuple[str, Any]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._next_id = 0

    async def start(self) -> None:
        """Start the step loop (a no-op while it runs); after `close()` it starts again."""
        if self._task is None:
            self._closing = False
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="atombatch-loop")

    async def close(self, drain: bool = True) -> None:
        """Stop the loop; with `drain`, let in-flight requests finish first, else abort them."""
        if self._task is None:
            return
        if not drain:
            for request_id in list(self._queues):
                self.abort(request_id)
        self._closing = True
        self._poke()
        await self._task
        self._task = None

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, request_id: str | None = None,
               kv: KVSource | None = None, *, lora: str | None = None,
               validated: bool = False) -> str:
        """Validate and queue a request; its outputs arrive through `outputs(request_id)`.
        `validated`: the caller checked it with `validate` already (it is not checked again;
        the engine's loop never checks it: each request is validated once).

        `kv` is a PD source (see `Batcher.submit`): the KV and first token come from a producer.
        `lora`: a loaded LoRA adapter (`Batcher.lora_adapters`) by name; None: the base model.

        Raises:
            RequestError: the request is invalid, the batcher is closing, or the id is in use.
            CapacityError: `max_waiting` requests already wait (submits not yet drained count).
        """
        if self._task is None or self._closing:
            raise UnavailableError("AsyncBatcher is not running (call start() or use async with)")
        params = params or SamplingParams()
        tokens = np.asarray(prompt, dtype=np.int64) if validated else \
            self.batcher.validate(prompt, params)
        if lora is not None:  # an unknown name is refused here, not in the loop
            adapter_named(self.batcher.lora_adapters, lora,
                          self.batcher.capabilities.lora_loadable)
        limit = self.batcher.waiting_limit
        if limit is not None:
            waiting = self.batcher.num_waiting + \
                sum(payload[1].n for kind, payload in self._inbox if kind == "submit")
            if waiting + params.n > limit:  # each of n choices waits for a lane
                raise CapacityError(f"queue is full: {waiting} requests wait, "
                                    f"max_waiting={self.batcher.max_waiting}")
        if request_id is None:
            request_id = f"areq-{self._next_id}"
            self._next_id += 1
        self._open(request_id)
        self._inbox.append(("submit", (tokens, params, request_id, kv, lora)))
        self._poke()
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it finished); its lane and blocks free before next step."""
        if request_id in self._queues:
            self._inbox.append(("abort", request_id))
            self._poke()

    def stats(self) -> EngineStats:
        return self.batcher.stats()

    @property
    def loras(self) -> list[str]:
        """The LoRA adapters requests may name."""
        return sorted(self.batcher.lora_adapters)

    async def load_lora(self, name: str, path: str, max_loaded: int | None = None) -> list[str]:
        """`Batcher.load_lora` on a worker thread (the files are read off the event loop and
        the step loop); returns the adapters loaded then."""
        await asyncio.to_thread(self.batcher.load_lora, name, path, max_loaded=max_loaded)
        return self.loras

    async def unload_lora(self, name: str) -> list[str]:
        """`Batcher.unload_lora`; returns the adapters left."""
        await asyncio.to_thread(self.batcher.unload_lora, name)
        return self.loras

    # -- what a front asks of the engine it serves (the same on `CoreClient`) ---------------------
    @property
    def artifact(self) -> ArtifactConfig:
        return self.batcher.artifact

    @property
    def max_waiting(self) -> int | None:
        return self.batcher.max_waiting

    @property
    def policy_label(self) -> str:
        return self.batcher.policy.label

    @property
    def running(self) -> bool:
        """The step loop runs and takes requests."""
        return self._task is not None and not self._task.done() and not self._closing

    def validate(self, prompt: Sequence[int] | npt.NDArray[np.integer],
                 params: SamplingParams) -> npt.NDArray[np.int64]:
        return self.batcher.validate(prompt, params)

    # -- the loop ---------------------------------------------------------------------------------
    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "submit":
                tokens, params, request_id, kv, lora = payload
                try:
                    self.batcher.submit(tokens, params, request_id=request_id, kv=kv,
                                        lora=lora, validated=True)
                except Exception as exc:  # one bad request must not stop the loop
                    if kv is not None:  # the engine never took the source: release it here
                        with contextlib.suppress(Exception):
                            kv.close()
                    self._deliver(RequestOutput(request_id=request_id, new_token_ids=(),
                                                finished=True, finish_reason="error",
                                                error=str(exc)))
            else:
                self.batcher.abort(payload)

    async def _run(self) -> None:
        assert self._wake is not None
        batcher = self.batcher
        while True:
            self._drain_inbox()
            if not batcher.has_unfinished():
                if self._closing and not self._inbox:
                    return
                self._wake.clear()
                if not self._inbox:
                    await self._wake.wait()
                continue
            try:
                if self.offload:
                    outputs = await asyncio.to_thread(batcher.step)
                else:
                    outputs = batcher.step()
                    await asyncio.sleep(0)  # let clients submit and consume between steps
            except Exception as exc:  # a bug, not a request failure: fail everything in flight
                log.exception("engine.step_loop_failed")
                for out in fail_all(batcher, list(self._queues), exc):
                    self._deliver(out)
                continue
            for out in outputs:
                self._deliver(out)
            if batcher.idle and not outputs and not self._inbox:
                # Unfinished requests but nothing runnable (PD requests waiting for their
                # producers): wait for a submit/abort or poll the sources again shortly.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.idle_poll)


def fail_all(batcher: Batcher, request_ids: list[str], exc: Exception) -> list[RequestOutput]:
    """After a step raised (a bug, not a request's failure): abort every request in flight and
    return the error output each one ends with."""
    outputs = []
    for request_id in request_ids:
        batcher.abort(request_id)
        outputs.append(RequestOutput(request_id=request_id, new_token_ids=(), finished=True,
                                     finish_reason="error", error=f"engine failure: {exc}"))
    with contextlib.suppress(Exception):
        batcher.step()  # drain the abort outputs
    return outputs


def compact_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One choice's outputs as one: its last output with every token, piece of text and logprob."""
    last = outs[-1]
    text = None if all(o.text is None for o in outs) else "".join(o.text or "" for o in outs)
    logprobs = None if all(o.logprobs is None for o in outs) else \
        tuple(lp for o in outs for lp in o.logprobs or ())
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None),
                           None)
    cached = next((o.cached_tokens for o in outs if o.cached_tokens is not None), None)
    return msgspec.structs.replace(last, new_token_ids=tuple(t for o in outs
                                                             for t in o.new_token_ids),
                                   text=text, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                   cached_tokens=cached)
