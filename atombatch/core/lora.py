"""LoRA adapters loaded and unloaded through the engine core (docs/lora.md).

The front sends `LoadLora` / `UnloadLora`; the core answers each with one `LoraDone` carrying
the adapters loaded then (`Ready.loras` has them at start). A load reads and checks the
adapter's files on a worker thread of its own (`Batcher.load_lora` takes the engine's lock only
to hand the weights to the runtime), so the core's loop keeps stepping meanwhile; loads run one
at a time and at most `MAX_PENDING` wait. The answer goes back through the loop (`Loaded`, put
on the queue the receiver fills), which is the one thread that sends.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

from atombatch.core.messages import LoadLora, LoraDone, UnloadLora
from atombatch.errors import ConfigError, RequestError, UnavailableError
from atombatch.logs import logger

if TYPE_CHECKING:
    from atombatch.engine.batcher import Batcher

log = logger("atombatch.core")

MAX_PENDING = 16  # loads waiting for the loader; more are refused


class Loaded:
    """A load finished on the loader thread; the loop sends its answer."""

    __slots__ = ("done",)

    def __init__(self, done: LoraDone) -> None:
        self.done = done


class CoreLora:
    """The core's loader: `load` starts a load (answered later through `put`), `unload`
    answers at once."""

    def __init__(self, batcher: Batcher, put: Any) -> None:
        self.batcher = batcher
        self._put = put          # hands a `Loaded` (with its front, for a shared core) to the loop
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending = 0
        self._lock = threading.Lock()

    def loras(self) -> list[str]:
        return sorted(self.batcher.lora_adapters)

    def _done(self, seq: int, exc: BaseException | None) -> LoraDone:
        return LoraDone(seq=seq, error=None if exc is None else str(exc),
                        config=isinstance(exc, ConfigError), loras=self.loras())

    def load(self, message: LoadLora, front: int | None) -> LoraDone | None:
        """Start loading; None when started (the answer follows), else the refusal."""
        with self._lock:
            if self._pending >= MAX_PENDING:
                return LoraDone(seq=message.seq, error=f"{self._pending} LoRA loads wait "
                                f"already (at most {MAX_PENDING})", config=False,
                                loras=self.loras())
            self._pending += 1
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="atombatch-lora-loader")
        self._pool.submit(self._load, message, front)
        return None

    def _load(self, message: LoadLora, front: int | None) -> None:
        error: BaseException | None = None
        try:
            self.batcher.load_lora(message.name, message.path, max_loaded=message.max_loaded)
        except Exception as exc:  # answered to the front: the core carries on
            error = exc
            log.warning("core.lora_load_failed", name=message.name[:80], error=str(exc))
        finally:
            with self._lock:
                self._pending -= 1
        loaded = Loaded(self._done(message.seq, error))
        self._put(loaded if front is None else (front, loaded))

    def unload(self, message: UnloadLora) -> LoraDone:
        try:
            self.batcher.unload_lora(message.name)
        except Exception as exc:
            return self._done(message.seq, exc)
        return self._done(message.seq, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# -- the front's side (mixed into CoreClient) ------------------------------------------------------
class LoraFront:
    """A front's view of its core's adapters: `loras` (from `Ready`, then every `LoraDone`),
    the check of a request's adapter name, and `load_lora` / `unload_lora`. Call these from
    the event loop the client runs on (as `submit`)."""

    ready: Any = None
    _lora_names: list[str] | None = None

    if TYPE_CHECKING:  # PDFront's (a stub here would hide it: LoraFront comes first)
        def _send_to_core(self, message: Any) -> bool: ...

    @property
    def loras(self) -> list[str]:
        """The adapters requests may name, as the core last said."""
        if self._lora_names is not None:
            return self._lora_names
        return list(self.ready.loras) if self.ready is not None else []

    def check_lora(self, lora: str | None) -> None:
        """A request's adapter must be one the core has (a `RequestError` naming it and the
        loaded ones; another front may have changed them since: the core then fails it)."""
        if lora is None:
            return
        loras = self.loras
        if not isinstance(lora, str) or lora not in loras:
            raise RequestError(f"lora={str(lora)[:80]!r} is not a loaded LoRA adapter; loaded: "
                               f"{', '.join(loras) or 'none'}")

    async def load_lora(self, name: str, path: str, max_loaded: int | None = None) -> list[str]:
        """Load the PEFT adapter at `path` (a directory the core can read) under `name`;
        returns the adapters loaded then. `max_loaded`: refused when that many are loaded
        already (the core counts every front's).

        Raises:
            ConfigError: the adapter's files or the runtime refused it (named).
            RequestError: `name` is taken, or another refusal of the request itself.
            UnavailableError: the core is gone.
        """
        return await self._lora_call(lambda seq: LoadLora(seq, name, path, max_loaded))

    async def unload_lora(self, name: str) -> list[str]:
        """Unload adapter `name` (refused while a request uses it); returns the adapters left."""
        return await self._lora_call(lambda seq: UnloadLora(seq, name))

    async def _lora_call(self, make: Any) -> list[str]:
        import asyncio

        waiters = self.__dict__.setdefault("_lora_waiters", {})
        seq = self.__dict__.get("_lora_seq", 0) + 1
        self.__dict__["_lora_seq"] = seq
        future: asyncio.Future[LoraDone] = asyncio.get_running_loop().create_future()
        waiters[seq] = future
        if not self._send_to_core(make(seq)):
            waiters.pop(seq, None)
            raise UnavailableError("the engine core exited")
        try:
            done = await future
        finally:
            waiters.pop(seq, None)
        if done.error is not None:
            raise (ConfigError if done.config else RequestError)(done.error)
        return list(done.loras)

    def _on_message(self, message: Any) -> None:
        if isinstance(message, LoraDone):
            self._lora_names = list(message.loras)
            future = self.__dict__.get("_lora_waiters", {}).get(message.seq)
            if future is not None and not future.done():
                future.set_result(message)
            return
        super()._on_message(message)  # type: ignore[misc]

    def _fail_lora_calls(self) -> None:
        """The core is gone: every load or unload waiting for it ends."""
        for future in self.__dict__.get("_lora_waiters", {}).values():
            if not future.done():
                future.set_exception(UnavailableError("the engine core exited"))
