"""`Mailbox`: one request's outputs on their way to its one consumer, cheaper than an
`asyncio.Queue` on the per-token path.

An item is a `RequestOutput`, or a bare `int`: a *plain* token of choice 0 (not finished, no
text, no logprobs; what the engine core sends for a greedy n = 1 request without a tokenizer or
stop strings). A plain token costs the producer one list append, no struct, and the consumer
wakes once per step however many items wait (`take`).

    box.put_nowait(out)           # producer (the event loop's thread)
    items = await box.take()      # consumer: everything waiting, oldest first (waits for one)
    outs = as_outputs(request_id, items)   # ints as RequestOutputs, for consumers that need them

It is single-consumer (the `OutputStreams` one-consumer rule) and not thread-safe (as
`asyncio.Queue` is not).

A consumer parked in `take` may set a `sink`: a function that handles one plain token itself
(the server writes the token's event to its connection there and then: `_Generation.fast_lane`
in atombatch/serve/app.py) and returns False when it cannot (the item is then queued as usual).
`put_plain` offers a plain token to the sink only while the consumer waits and nothing is queued,
so the sink never overtakes an item, and the consumer is not woken for what the sink took.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

from atombatch.api.structs import RequestOutput

Item = RequestOutput | int


def plain_output(request_id: str, token: int) -> RequestOutput:
    """What a plain token item stands for."""
    return RequestOutput(request_id=request_id, new_token_ids=(token,), finished=False)


def as_outputs(request_id: str, items: Iterable[Item]) -> list[RequestOutput]:
    """`items` with every plain token as its `RequestOutput`."""
    return [plain_output(request_id, item) if isinstance(item, int) else item
            for item in items]


class Mailbox:
    """A request's waiting outputs (see the module docstring)."""

    __slots__ = ("_items", "_waiter", "sink")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[int], bool] | None = None

    def put_plain(self, token: int) -> None:
        """A plain token of choice 0: to the sink if the consumer waits with nothing queued and
        the sink takes it, else queued."""
        sink = self.sink
        if sink is not None and self._waiter is not None and not self._items and sink(token):
            return
        self.put_nowait(token)

    def put_nowait(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Item:
        """The oldest item (IndexError when empty)."""
        return self._items.popleft()

    async def _wait(self) -> None:
        """Until an item is there."""
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None

    async def take(self) -> list[Item]:
        """Every waiting item, oldest first; waits until there is one."""
        if not self._items:
            await self._wait()
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self) -> Item:
        """The oldest item; waits until there is one."""
        if not self._items:
            await self._wait()
        return self._items.popleft()
