"""Where the decoder gets one request's KV from: the `KVSource` protocol and the in-process source.

Every transport fault becomes a `KVTransferError` (a `RequestError`) for that request alone: a
producer exception, a garbled frame, a disconnect, or a stream that ended with layers missing or
extra. Sources never read a clock: the engine owns the timeout that catches a silent producer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from atombatch.api.structs import SamplingParams
from atombatch.errors import KVTransferError, RequestError
from atombatch.pd.wire import MODES, KVHeader, LayerKV, Mode, check_header, clip

if TYPE_CHECKING:
    from atombatch.pd.producer import Producer


class KVSource(Protocol):
    """Where the decoder gets one request's KV from; the engine polls it once per step (the one
    declaration: `atombatch.KVSource`, `atombatch.engine.batcher.KVSource` and the engine's PD intake are
    this class).

    A source may also have `expect(artifact, prompt, require_full)`: `Batcher.submit` calls it so
    the source can check the header on arrival, before it accepts any layer.
    """

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        """Non-blocking: the header once known (the same object every call after that) and the
        layers that arrived since the previous poll (possibly none).

        Raises:
            KVTransferError: producer failure, disconnect, garbled data, or a stream that ended
                with layers missing or extra. Errors are sticky: every later poll raises again.
        """
        ...

    def done(self) -> bool:
        """The producer has said all layers are sent and poll has handed every one of them out."""
        ...

    def close(self) -> None:
        """Release resources; idempotent (the engine calls it when the request ends, any reason)."""
        ...


class LayerStream:
    """Accounting shared by the sources: header first, then each layer once, then the end.

    The header's fields are bounded (`check_header`) before it is accepted, and nothing here is
    sized from it: what is kept grows with the layers that actually arrived.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.header: KVHeader | None = None
        self.received: set[int] = set()
        self.count = 0
        self.ended = False

    def on_header(self, header: KVHeader) -> None:
        if self.header is not None:
            raise KVTransferError(f"{self.where}: a second header arrived")
        check_header(header, f"{self.where}: header")
        self.header = header

    def on_layer(self, layer: LayerKV) -> None:
        if self.header is None:
            raise KVTransferError(f"{self.where}: layer {layer.layer} arrived before the header")
        if self.count >= self.header.num_layers:
            raise KVTransferError(f"{self.where}: layer {clip(repr(layer.layer))} is extra, the "
                                  f"header announced num_layers={self.header.num_layers}")
        self.count += 1
        self.received.add(layer.layer)

    def on_end(self, sent: int | None = None) -> None:
        if self.header is None:
            raise KVTransferError(f"{self.where}: the stream ended before the header")
        total = self.header.num_layers
        if sent is not None and sent != self.count:
            raise KVTransferError(f"{self.where}: the producer says it sent {sent} layers, "
                                  f"{self.count} arrived")
        if self.count != total or len(self.received) != total:
            missing = [i for i in range(total) if i not in self.received]  # total <= MAX_LAYERS
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise KVTransferError(f"{self.where}: the stream ended after {self.count} of "
                                  f"num_layers={total} layers (missing [{shown}])")
        self.ended = True


class InProcessSource:
    """A `KVSource` over items in memory: a producer in the same process, or a test's fault list.

    Items are `KVHeader`, `LayerKV` or an `Exception` (raised from `poll` as `KVTransferError`:
    fault injection). "whole" hands out the header and every layer in one poll; "layer-stream"
    hands out the header and at most one layer per poll, so decode steps interleave with the import.
    `items` is consumed lazily (a generator producer runs on the first poll).
    """

    def __init__(self, items: Iterable[KVHeader | LayerKV | BaseException],
                 mode: Mode = "layer-stream") -> None:
        if mode not in MODES:
            raise RequestError(f"mode={mode!r} is not one of {MODES}")
        self.mode = mode
        self._items = iter(items)
        self._stream = LayerStream("in-process KV source")
        self._peeked: KVHeader | LayerKV | BaseException | None = None
        self._exhausted = False
        self._error: KVTransferError | None = None
        self._closed = False
        self.polls = 0

    @classmethod
    def from_producer(cls, producer: Producer, request_id: str, prompt: Sequence[int],
                      params: SamplingParams | None = None, mode: Mode = "layer-stream",
                      covered_len: int | None = None) -> InProcessSource:
        """A source whose producer runs (prefills) on the first poll."""
        return cls(producer.stream(request_id, prompt, params, mode=mode, covered_len=covered_len),
                   mode)

    def _next(self) -> KVHeader | LayerKV | BaseException | None:
        """The next item, None when exhausted; a raising iterator counts as a producer error."""
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        if self._exhausted:
            return None
        try:
            return next(self._items)
        except StopIteration:
            self._exhausted = True
            return None
        except Exception as exc:  # the producer itself raised
            self._exhausted = True
            return exc

    def _fail(self, exc: BaseException) -> KVTransferError:
        if isinstance(exc, KVTransferError):
            error = exc
        else:
            error = KVTransferError(f"KV producer failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._error = error
        return error

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise self._fail(KVTransferError("in-process KV source was closed"))
        self.polls += 1
        stream = self._stream
        if stream.ended:
            return stream.header, []
        layers: list[LayerKV] = []
        want = None if self.mode == "whole" else 1
        try:
            while want is None or len(layers) < want:
                item = self._next()
                if item is None:
                    stream.on_end()
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, KVHeader):
                    stream.on_header(item)
                elif isinstance(item, LayerKV):
                    stream.on_layer(item)
                    layers.append(item)
                else:
                    raise KVTransferError(f"in-process KV source got a {type(item).__name__}, "
                                          "not a KVHeader or LayerKV")
            if not stream.ended and want is not None:
                # Peek so done() turns True with the last layer; a fault found here is raised
                # on the next poll, after this poll's layer was handed out.
                self._peeked = self._next()
                if self._peeked is None:
                    try:
                        stream.on_end()
                    except KVTransferError as exc:
                        self._peeked = exc
        except Exception as exc:
            error = self._fail(exc)
            raise error from error.__cause__
        if self.mode == "whole" and not stream.ended:
            return None, []
        return stream.header, layers

    def done(self) -> bool:
        return self._stream.ended and self._error is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self._items, "close", None)
        if close is not None:
            close()
