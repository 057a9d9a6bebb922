"""A request's outputs on their way from the engine thread to the asyncio handler that streams them.

The engine thread never touches the event loop's objects: it hands a whole step's outputs over
with one `call_soon_threadsafe` (`deliver_threadsafe`), and each `RequestStream` queues its items
for its one consumer, which awaits `get`. A consumer that falls behind gets a request's newest
output only, which holds everything the ones before it did. A stream ends with its request's
last output, or with the error put in its place: `RequestFailedError` (that request alone failed),
`ShuttingDownError`, or another `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import collections

from pagedkv.engine.outputs import RequestOutput
from pagedkv.errors import EngineDeadError, PagedKVError


class ShuttingDownError(EngineDeadError):
    """The server is shutting down: it takes no new request, and open ones end with this error."""


class RequestFailedError(PagedKVError):
    """One request failed on the engine thread; the loop and the other requests go on.

    `status_code` 400 when the engine refused the request as invalid, 500 for anything else.
    """

    def __init__(self, message: str, status_code: int = 500, code: str = "request_failed",
                 request_id: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.request_id = request_id


class RequestStream:
    """Outputs of one or more engine requests, delivered to one asyncio consumer.

    The engine thread puts items with `put_threadsafe` (or, for a whole step's outputs at once,
    `deliver_threadsafe`); the consumer awaits `get`. Items sit in a deque and a future only
    signals, so a `get` that times out or is cancelled loses nothing.

    An output carries its request's whole state so far (text, token ids, logprobs), so when the
    consumer falls behind, `get` returns only the newest of a request's queued outputs: a slow
    client, or an event loop at its limit, gets one chunk covering several tokens instead of
    falling further behind one token at a time (vLLM v1's output collector merges the same way).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        """Hand an output (or the error that ends the stream) to the consumer's event loop."""
        deliver_threadsafe(self.loop, [(self, item)])

    def put(self, item: RequestOutput | BaseException) -> None:
        """On the event loop: queue an item and wake the consumer."""
        self._items.append(item)
        self._wake()

    async def get(self, timeout_s: float | None = None) -> RequestOutput:
        """The next output (the newest queued one of its request); raises the stream's error, or
        `TimeoutError` after `timeout_s`."""
        return await self.get_until(None if timeout_s is None else self.loop.time() + timeout_s)

    async def get_until(self, wake_at: float | None) -> RequestOutput:
        """`get`, with `TimeoutError` at `wake_at` (the loop's clock) if nothing came by then.

        NOTE: a bare future, and a timer kept for as long as the consumer asks for the same
        `wake_at`: this runs once per stream per step, and `asyncio.wait_for` (a task or a
        timeout context each time) or a fresh timer per wait cost the event loop more than the
        chunk it waits for.
        """
        if not self._items:
            waiter = self._waiter = self.loop.create_future()
            if wake_at is not None and (self._timer is None or self._timer_at != wake_at):
                if self._timer is not None:
                    self._timer.cancel()
                self._timer, self._timer_at = self.loop.call_at(wake_at, self._expire), wake_at
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._items:
                raise TimeoutError
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        items = self._items
        while items and isinstance(items[0], RequestOutput) and items[0].request_id == item.request_id:
            item = items.popleft()  # supersedes the one before: it holds everything that one did
        return item

    def _expire(self) -> None:
        self._timer = self._timer_at = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _put_all(pairs: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in pairs:
        stream.put(item)


def deliver_threadsafe(loop: asyncio.AbstractEventLoop,
                       pairs: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Hand many streams their items with one wake-up of `loop` (one per step, not one per output)."""
    if not pairs:
        return
    try:
        loop.call_soon_threadsafe(_put_all, pairs)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass
