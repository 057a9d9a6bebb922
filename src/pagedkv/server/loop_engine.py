"""`LoopAsyncEngine`: the app's engine front for a client that already lives on the app's event loop.

`AsyncEngine` gives the engine a thread of its own: handlers queue commands to it, and it
hands each step's outputs back to the loop. That is right for an engine that computes (its
steps would block the loop), and costs a thread hop each way. A client whose work happens
elsewhere and whose calls are themselves asynchronous, the Ray Serve ingress's
`RayEngineClient` on the ingress replica's own loop, gains nothing from the thread and pays
the hops on every request's way in and every output's way out: on a 2-core CPU, 1.0 ms from
the handler to the engine thread, 0.4 ms from it back to the loop to make the call, and
0.3 ms more for the first output. (On an H200 host those hops were already cheap: the added
TTFT did not move, so the Ray app keeps the thread unless `ingress_engine_thread=False`.)

    HTTP handlers ── add_request / abort / call ──► client.add_request / abort / fn(client)  (at once)
    await stream.get() ◄── stream.put ◄── the client's outputs, handed over as they arrive (`attach`)

The client offers `event_loop` (the loop its calls run on, or None when it keeps a thread of
its own) and `attach(sink)`, after which it passes each output to `sink` on that loop instead
of queueing it for `step()`. Everything else is `AsyncEngine`'s: the same bookkeeping, the
same failure containment for one request, the same drain and shutdown. A command from another
thread (a drain or a stats call off the loop) is handed to the loop first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from pagedkv.engine.outputs import RequestOutput
from pagedkv.errors import EngineDeadError
from pagedkv.server.async_engine import AsyncEngine, _Add, _Call
from pagedkv.server.request_stream import RequestFailedError, RequestStream, ShuttingDownError

logger = logging.getLogger("pagedkv.server")


def runs_on_this_loop(engine) -> bool:
    """Whether `engine` runs its calls on the event loop running here (so `LoopAsyncEngine` fits it)."""
    loop = getattr(engine, "event_loop", None)
    if loop is None or not hasattr(engine, "attach"):
        return False
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # built outside a loop (a test, a script): the engine thread it is
        return False


class LoopAsyncEngine(AsyncEngine):
    """`AsyncEngine` without its thread, for an engine on the app's own loop (see the module docstring)."""

    def __init__(self, engine, metrics=None, on_dead=None):
        super().__init__(engine, metrics, on_dead)
        self._loop: asyncio.AbstractEventLoop = engine.event_loop
        self._loop_thread: int | None = None
        self._started = False
        self._metrics_due = False

    @property
    def is_alive(self) -> bool:
        return self._started and self._dead is None

    def start(self) -> None:
        if self._started:
            raise EngineDeadError("the engine front was already started")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:  # every later call is judged "on the loop" by this thread
            raise EngineDeadError("LoopAsyncEngine must start on its engine's event loop (the app's lifespan there)")
        if self.metrics is not None:
            self.metrics.update_from_engine(self.engine)
        self._loop_thread = threading.get_ident()  # start() runs on the loop (the app's lifespan)
        self.engine.attach(self._on_output)
        self._started = True

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Fail what is open (`ShuttingDownError`) and take no more commands; on the loop, or handed to it."""
        if self._on_loop():
            self._shut()
            return
        done = concurrent.futures.Future()

        def shut():
            try:
                self._shut()
            finally:
                done.set_result(None)

        try:
            self._loop.call_soon_threadsafe(shut)
            done.result(timeout_s)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the loop is closed, or stuck
            logger.warning("the engine front did not stop on its event loop")

    def _shut(self) -> None:
        if self._dead is None:
            self._die(ShuttingDownError("the server is shutting down"))

    def _on_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def _put(self, command, raise_if_dead: bool = True) -> None:
        with self._lock:  # the thread's checks; then the command runs now, or on the loop for another thread
            if not self._admit(command, raise_if_dead):
                return
        if self._on_loop():
            self._run_command(command)
        else:
            self._loop.call_soon_threadsafe(self._run_command, command)

    def _run_command(self, command) -> None:
        if self._dead is not None and isinstance(command, _Add):  # stopped while it was handed over
            with self._lock:
                self._num_waiting -= 1
            command.stream.put(ShuttingDownError(str(self._dead)))
            return
        if self._dead is None:
            self._apply(command)
            self._update_metrics_soon()
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            command.future.set_exception(EngineDeadError(f"the engine front has stopped: {self._dead}"))

    def _send(self, stream: RequestStream, item) -> None:
        # A stream of another loop (a caller on a thread and loop of its own) takes its items through that loop:
        # a stream, and anything its consumer shares with it, is not safe to touch from this one.
        if self._on_loop() and stream.loop is self._loop:
            stream.put(item)
        else:
            stream.put_threadsafe(item)

    def _on_output(self, output: RequestOutput) -> None:
        """The client's sink: one output, on the loop, delivered to its stream at once."""
        if self._dead is not None:
            return
        try:
            try:
                self._deliver(output, time.perf_counter())
            except Exception as error:  # noqa: BLE001 - this request fails, the others are delivered
                logger.error("delivering request %s failed: %s: %s", output.request_id, type(error).__name__,
                             error, exc_info=error)
                self._fail(output.request_id, RequestFailedError(f"delivering this request's output failed: "
                                                                 f"{type(error).__name__}: {error}"))
            self._update_metrics_soon()
        except Exception:  # noqa: BLE001 - never into the client, which would take it for a broken replica stream
            logger.exception("failing request %s after a delivery error failed too", output.request_id)

    def _update_metrics_soon(self) -> None:
        """Metrics once per turn of the loop, however many outputs it delivered (the thread: once per step)."""
        if self.metrics is None or self._metrics_due:
            return
        self._metrics_due = True

        def update():
            self._metrics_due = False
            self.metrics.update_from_engine(self.engine)

        self._loop.call_soon(update)
