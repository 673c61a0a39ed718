"""LoRA adapters on the engine's rows (issue 41; docs/lora.md, "Scheduling adapters").

A request names its adapter at submit and carries its id (`Request.lora_id`, 0: the base model)
to every device call it is part of: the scheduler keeps one id per lane (`LoraRows.by_lane`,
set when a lane is bound, 0 when it is freed) and writes, next to each call's input arrays,
the ids of that call's rows (optimum-rbln's `lora_int_ids`: int32 `[1]` for a prefill chunk,
`[rows]` for a decode step, padding rows 0), packed the way the decode rows are. The ids live
in a buffer per input buffer (allocated once), so a decode built ahead while another is on the
device (`Batcher(overlap=True)`) has its own, as it has its own inputs. `LoraCall` hands them
to the runtime. Nothing here exists for a runtime without LoRA: the engine then calls the
runtime as before.

`--max-loras` (vLLM's meaning: the distinct adapters one step may hold; the base model is not
one): `fits` admits a request whose adapter already runs, or while fewer than the cap run.
A request that does not fit waits and the requests behind it are admitted; after
`bypass_limit` admissions past it nothing more is, until it fits (the running adapters'
requests end and free their places), so it waits a bounded time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from atombatch.engine.request import Request
from atombatch.errors import ConfigError, RequestError, StateError

BASE = 0  # the id of a row that runs the base model (`atombatch.artifact.lora.BASE_LORA_ID`)


class LoraRows:
    """The adapter id of every lane, and of every row of each device call's input buffer."""

    __slots__ = ("_buffers", "_calls", "by_lane")

    def __init__(self, batch_size: int) -> None:
        self.by_lane = np.zeros(batch_size, dtype=np.int32)  # lane -> its request's adapter id
        # id(inputs) -> (inputs, its ids buffer, the views of its first n rows by n)
        self._buffers: dict[int, tuple[Any, npt.NDArray[np.int32],
                                       dict[int, npt.NDArray[np.int32]]]] = {}
        self._calls: dict[Any, LoraCall] = {}

    def _buffer(self, inputs: Any) -> tuple[npt.NDArray[np.int32], dict[int, npt.NDArray[np.int32]]]:
        entry = self._buffers.get(id(inputs))
        if entry is None or entry[0] is not inputs:
            ids = np.zeros(len(self.by_lane), dtype=np.int32)
            entry = self._buffers[id(inputs)] = (inputs, ids, {})
        return entry[1], entry[2]

    def _rows(self, inputs: Any, n: int) -> npt.NDArray[np.int32]:
        ids, views = self._buffer(inputs)
        view = views.get(n)
        if view is None:
            view = views[n] = ids[:n]
        return view

    def fill_decode(self, inputs: Any, rows: int) -> None:
        """The ids of a decode step just built into `inputs`: rows 0..rows-1 are the decoding
        lanes' (`inputs.row_lanes`), the bucket's padding rows run the base model."""
        ids = self._rows(inputs, inputs.num_rows)
        # mode="clip": written straight into `ids` (the default "raise" mode with `out=` goes
        # through a temporary array each step); the kernel's row lanes are in range
        np.take(self.by_lane, inputs.row_lanes, out=ids, mode="clip")
        if rows < len(ids):
            ids[rows:] = BASE

    def fill_prefill(self, inputs: Any, lora_id: int) -> None:
        """The id of a prefill chunk just built into `inputs` (one row: its request's)."""
        self._rows(inputs, 1)[0] = lora_id

    def ids(self, inputs: Any) -> npt.NDArray[np.int32]:
        """What the call over `inputs` passes as `lora_int_ids` (a decode's bucket of rows, a
        prefill's one row)."""
        return self._rows(inputs, getattr(inputs, "num_rows", 1))

    def through(self, call: Callable[..., Any]) -> LoraCall:
        """`call` (a runtime's `prefill` or `decode`) with the ids of its inputs' rows."""
        wrapped = self._calls.get(call)
        if wrapped is None:
            if len(self._calls) >= 8:  # a runtime whose method was replaced (tests): bounded
                self._calls.clear()
            wrapped = self._calls[call] = LoraCall(call, self)
        return wrapped


class LoraCall:
    """A runtime call given the `lora_int_ids` of its inputs' rows."""

    def __init__(self, call: Callable[..., Any], rows: LoraRows) -> None:
        self.call = call
        self.rows = rows
        self.__name__ = getattr(call, "__name__", "call")

    def __call__(self, inputs: Any, **kwargs: Any) -> Any:
        return self.call(inputs, lora_int_ids=self.rows.ids(inputs), **kwargs)


def running_adapters(requests: Iterable[Request | None]) -> set[int]:
    """The distinct adapters (not the base) of `requests`."""
    return {r.lora_id for r in requests if r is not None and r.lora_id}


def fits(request: Request, running: set[int], max_loras: int | None) -> bool:
    """Whether `request` may start now under `--max-loras`: its adapter runs already, or fewer
    than `max_loras` do (the base model always fits; None: no cap)."""
    return max_loras is None or not request.lora_id or request.lora_id in running or \
        len(running) < max_loras


def check_max_loras(max_loras: int | None) -> None:
    """`max_loras` is None (no cap) or an int >= 1."""
    if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)
                                  or max_loras < 1):
        raise ConfigError(f"max_loras={max_loras!r} must be an int >= 1 (or None: no cap)")


def adapter_named(adapters: Mapping[str, Any], name: str, loadable: bool) -> Any:
    """The loaded adapter `name` (a `LoraAdapter`); a `RequestError` naming it and the loaded
    ones when there is none."""
    if not isinstance(name, str):
        raise RequestError(f"lora={name!r} must be the name of a loaded LoRA adapter (a string)")
    adapter = adapters.get(name)
    if adapter is None:
        loaded = ", ".join(sorted(adapters)) or "none"
        hint = "" if loadable or adapters else " (this runtime has no LoRA adapters)"
        raise RequestError(f"lora={name!r} is not a loaded LoRA adapter; loaded: {loaded}{hint}")
    return adapter


def adapter_in_use(name: str, lora_id: int, requests: Iterable[Request],
                   held: Iterable[Request] = ()) -> None:
    """Refuse to unload an adapter that an unfinished request runs under."""
    for request in (*requests, *held):
        if request.lora_id == lora_id:
            raise StateError(f"LoRA adapter {name!r} is in use by request "
                             f"{request.request_id!r}: unload it once its requests finished")


def next_lora_id(adapters: Mapping[str, Any]) -> int:
    """The smallest id (1..) no loaded adapter has."""
    taken = {adapter.lora_int_id for adapter in adapters.values()}
    lora_id = 1
    while lora_id in taken:
        lora_id += 1
    return lora_id
