"""The engine thread: one thread owns the `LLMEngine`; asyncio handlers reach it through queues.

    HTTP handlers (event loop thread)                  engine thread
    ─────────────────────────────────                  ─────────────
    validate: tokenize, SamplingParams, check_fits
    add_request / abort / call ── queue.Queue ───────► engine.add_request / abort / fn(engine)
                                                       engine.step() ─► RequestOutputs
    await stream.get()  ◄── loop.call_soon_threadsafe ─┘  (and metrics, by deltas)

Every call that changes engine state happens on the engine thread, so the engine needs no
lock. The handlers only read: `tokenize` reads the tokenizer and the model config, and
`scheduler.check_fits` reads the scheduler config, neither of which changes after startup.

The thread blocks on the command queue whenever the engine has no unfinished request, so an
idle server sleeps instead of spinning. Between steps it drains every queued command, so an
abort frees its blocks before the next step. If `step()` raises, the thread records the
error, fails every open stream with `EngineDeadError` and exits; `is_alive` turns False.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling import SamplingParams
from pagedkv.errors import PagedKVError
from pagedkv.server.metrics import ServerMetrics

logger = logging.getLogger("pagedkv.server")


class EngineDeadError(PagedKVError):
    """The engine thread has stopped (a step raised, or the server is shutting down)."""


class RequestStream:
    """Outputs of one or more engine requests, delivered to one asyncio consumer.

    The engine thread puts items with `put_threadsafe`; the consumer awaits `get`. Items sit in
    a deque and an `asyncio.Event` only signals, so a `get` cancelled by its timeout loses nothing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        """Hand an output (or the error that ends the stream) to the consumer's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self, timeout_s: float | None = None) -> RequestOutput:
        """The next output; raises the stream's error, or `TimeoutError` after `timeout_s`."""
        while not self._items:
            self._ready.clear()
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Tracked:
    """A request the engine thread is serving, with the server-side timestamps metrics need."""

    stream: RequestStream
    arrival_s: float
    first_token_s: float | None = None


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    arrival_s: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future


_STOP = object()


class AsyncEngine:
    """Runs an `LLMEngine` on its own thread and streams its outputs to asyncio handlers."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()  # orders "is it dead?" against "put a command"
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.num_iterations = 0  # loop turns; an idle server adds none (it sleeps on the queue)

    # ------------------------------------------------------------------ handler side
    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running and can take requests."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread stopped, or None while it runs."""
        return self._dead

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            raise EngineDeadError("the engine thread was already started")
        if self.metrics is not None:
            self.metrics.update_from_engine(self.engine)  # baseline: counters start at zero
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Abort what is in flight, fail open streams and join the thread."""
        self._put(_STOP, raise_if_dead=False)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams, stream: RequestStream,
                    arrival_s: float | None = None) -> None:
        """Queue a validated request; its outputs go to `stream`. Raises `EngineDeadError` if the loop died."""
        self._put(_Add(request_id, token_ids, params, stream, arrival_s or time.perf_counter()))

    def abort(self, request_id: str) -> None:
        """Abort a request; the engine thread frees its blocks before its next step. Idempotent."""
        self._put(_Abort(request_id), raise_if_dead=False)

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (e.g. `stats`, `check_integrity`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Call(fn, future))
        return future

    def _put(self, command, raise_if_dead: bool = True) -> None:
        with self._lock:
            if self._dead is not None:
                if raise_if_dead:
                    raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
                return
            self._commands.put(command)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self.num_iterations += 1
                # NOTE: block only when idle; with work in flight, take what is queued and step.
                if not self._drain(block=not engine.has_unfinished_requests()):
                    self._die(EngineDeadError("the server is shutting down"))
                    return
                outputs = engine.step() if engine.has_unfinished_requests() else []
                # NOTE: metrics first, so a client that has its answer also sees it counted.
                if self.metrics is not None:
                    self.metrics.update_from_engine(engine)
                self._dispatch(outputs)
        except BaseException as error:  # the loop must report whatever killed it
            logger.exception("the engine loop died")
            self._die(error)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`). False once asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.request_id, command.token_ids, command.params)
            except PagedKVError as error:  # validated by the handler already; report, do not die
                command.stream.put_threadsafe(error)
                return
            self._tracked[command.request_id] = _Tracked(command.stream, command.arrival_s)
        elif isinstance(command, _Abort):
            if self._tracked.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as error:  # noqa: BLE001 - handed to the caller
                command.future.set_exception(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if tracked.first_token_s is None and num_tokens:
                tracked.first_token_s = now
            if output.finished:
                del self._tracked[output.request_id]
                if self.metrics is not None:
                    reason = output.outputs[0].finish_reason if output.outputs else "abort"
                    self.metrics.observe_request(tracked.arrival_s, tracked.first_token_s, now, num_tokens,
                                                 reason or "abort")
            tracked.stream.put_threadsafe(output)

    def _die(self, error: BaseException) -> None:
        """Stop taking commands, abort what is in flight and fail every stream and pending call."""
        with self._lock:
            self._dead = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine loop died: {type(error).__name__}: {error}")
        for command in pending:
            if isinstance(command, _Add):
                command.stream.put_threadsafe(dead)
            elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(dead)
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be broken; the streams must still end
                logger.debug("abort of %s failed in a dead engine", request_id, exc_info=True)
            tracked.stream.put_threadsafe(dead)
        self._tracked.clear()
