"""A replica's outputs for one sender (an ingress), queued until its `outputs` stream takes them.

`EngineReplica` keeps an `Outbox` per sender and hands each request an `OutboxStream`, the
`RequestStream` its engine front delivers into: the replica module's docstring says why outputs
travel this way (one item per step per ingress, not one per request).
"""

from __future__ import annotations

import asyncio

from pagedkv.distributed.output_deltas import DeltaEncoder, OutputDelta, to_wire
from pagedkv.server.request_stream import RequestStream


class Outbox:
    """What one sender (an ingress) has not read yet from this replica: its messages in order, and its requests."""

    def __init__(self):
        self.messages: list = []
        self.requests: set[asyncio.Task] = set()  # the `generate` calls of this sender running here
        self.reader: object | None = None  # the `outputs` call reading it now (a newer one takes over)
        self._ready = asyncio.Event()

    def put(self, message: tuple) -> None:
        self.messages.append(message)
        self._ready.set()

    def leave(self, task: asyncio.Task) -> None:
        """A `generate` call of this sender is over; the last one's leaving wakes the reader (it may idle out)."""
        self.requests.discard(task)
        if not self.requests:
            self._ready.set()

    def attach(self, reader: object) -> None:
        """Make `reader` the one `take` serves; a reader it replaces gets None from its next `take`."""
        self.reader = reader
        self._ready.set()  # wake the old reader, so that it ends

    async def take(self, reader: object, idle_s: float | None) -> list | None:
        """Every message queued since the last call (waits for the first); None once another reader took over,
        or once `idle_s` passed with no request of this sender here and nothing queued (never, if None)."""
        while True:
            if self.requests or self.messages:
                await self._ready.wait()
            else:
                try:
                    await asyncio.wait_for(self._ready.wait(), idle_s)
                except TimeoutError:
                    if not self.requests and not self.messages:
                        return None
                    continue
            if self.reader is not reader:
                return None
            self._ready.clear()
            if self.messages:
                messages, self.messages = self.messages, []
                return messages


class OutboxStream(RequestStream):
    """One request's outputs, queued for its sender as the engine front delivers them (on the replica's loop).

    A `RequestStream` whose consumer is the sender's outbox itself: each step's outputs go in as
    they arrive, with no task woken per request per step (256 running requests would be 256
    wake-ups of the replica's loop each step); `generate` waits only for `ended`. An error the
    engine front delivers (the request failed, or the engine died) ends it with `error` set."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: Outbox):
        super().__init__(loop)
        self._outbox = outbox
        self._encoder = DeltaEncoder(send_prompt_token_ids=False)  # the sender has them: it sent them
        self.error: Exception | None = None
        self.ended: asyncio.Future = loop.create_future()

    def put(self, item) -> None:
        """On the replica's loop: queue an output's delta for the sender, or end on an error."""
        if self.ended.done():
            return
        if isinstance(item, BaseException):
            self.end(item)
            return
        # The engine process's deltas go on as they came (without the prompt's ids); an engine thread's
        # outputs, and a rejection, are whole outputs to encode here.
        wire = to_wire(item) if isinstance(item, OutputDelta) else self._encoder.encode_wire(item)
        self._outbox.put(("output", wire))
        if item.finished:
            self.ended.set_result(None)

    def end(self, error: Exception) -> None:
        """The request failed (its failure message is `generate`'s to send)."""
        if not self.ended.done():
            self.error = error
            self.ended.set_result(None)
