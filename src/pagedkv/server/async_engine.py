"""The engine thread: one thread owns the `EngineClient`; asyncio handlers reach it through queues.

    HTTP handlers (event loop thread)                  engine thread
    ─────────────────────────────────                  ─────────────
    validate (in the tokenizer thread)
    add_request / abort / call ── queue.Queue ───────► engine.add_request / abort / fn(engine)
                                                       engine.step() ─► RequestOutputs
    await stream.get()  ◄── loop.call_soon_threadsafe ─┘  (and metrics, by deltas)

Every call that changes engine state happens on the engine thread, so the engine needs no
lock. The handlers only read: `tokenize` reads the tokenizer and the model config, and
`scheduler.check_fits` reads the scheduler config, neither of which changes after startup.

The thread blocks on the command queue whenever the engine has no unfinished request, so an
idle server sleeps instead of spinning. Between steps it drains every queued command, so an
abort frees its blocks before the next step.

Failures are contained to the requests they touch:

- an exception while adding one request, or while delivering its output, fails that request
  alone (`RequestFailedError`; a 400 if the engine refused it, else a 500);
- the engine fails a request alone when resolving, sampling or detokenizing it raises: its
  output carries `error`, and it answers 500 while its step-mates go on;
- an exception from `step()` that names its request (an attribute `request_id`) fails that
  request alone; a `StepFailedError` (the forward pass failed) fails the requests of that step,
  which the engine names; any other fails the requests in flight, since they shared the step
  and the engine cannot say which one broke it. Their blocks are freed, the engine's
  integrity is checked, and the loop goes on with new requests;
- `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row (a broken device fails every step), a
  failed integrity check, or any error in the loop itself end the loop: it logs why, fails
  every open stream with `EngineDeadError`, and calls `on_dead`, which `pagedkv serve` uses to
  exit non-zero so that a supervisor restarts it. A process answering 503 forever helps nobody.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.engine.client import EngineClient
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import EngineDeadError, PagedKVError, StepFailedError
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.request_stream import RequestFailedError, RequestStream, ShuttingDownError, deliver_threadsafe

logger = logging.getLogger("pagedkv.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Tracked:
    """A request the engine thread is serving, with the server-side timestamps metrics need."""

    stream: RequestStream
    arrival_s: float
    first_token_s: float | None = None
    is_waiting: bool = True  # no token generated yet: it counts against max_queue


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    arrival_s: float
    block_hashes: list[bytes] | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[EngineClient], object]
    future: concurrent.futures.Future


_STOP = object()


class AsyncEngine:
    """Runs an `EngineClient` on its own thread and streams its outputs to asyncio handlers.

    `on_dead(error)` is called on the engine thread once, if the loop dies (not on shutdown).
    """

    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None,
                 on_dead: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self._on_dead = on_dead
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: list | None = None  # a step's (stream, item) hand-offs while _dispatch runs
        self._lock = threading.Lock()  # orders "is it dead / draining?" against "put a command"; guards counts
        self._dead: BaseException | None = None
        self._draining = False
        self._num_waiting = 0
        self._num_failed_steps = 0  # in a row
        self._thread: threading.Thread | None = None
        # An engine whose step() waits for outputs from elsewhere (`RayEngineClient`) offers `wake()`,
        # so a command queued meanwhile is taken at once rather than after that wait.
        self._wake = getattr(engine, "wake", None)
        self.num_iterations = 0  # loop turns; an idle server adds none (it sleeps on the queue)

    # ------------------------------------------------------------------ handler side
    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running and can take requests."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def is_draining(self) -> bool:
        """Whether shutdown has begun: no new requests, open ones may finish."""
        return self._draining

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread stopped, or None while it runs."""
        return self._dead

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not generating yet (queued to the thread, waiting, or in prefill)."""
        return self._num_waiting

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            raise EngineDeadError("the engine thread was already started")
        if self.metrics is not None:
            self.metrics.update_from_engine(self.engine)  # baseline: counters start at zero
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float) -> None:
        """Begin shutdown: refuse new requests, give open ones `timeout_s` to finish, then stop.

        Requests still open at the deadline end with `ShuttingDownError` (streams get an error
        event, then [DONE]). Blocks the calling thread; call it off the event loop.
        """
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        while self.is_alive and (self._tracked or self._num_waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop()

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Abort what is in flight, fail open streams and join the thread."""
        self._put(_STOP, raise_if_dead=False)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams, stream: RequestStream,
                    arrival_s: float | None = None, block_hashes: list[bytes] | None = None) -> None:
        """Queue a validated request; its outputs go to `stream`.

        `block_hashes` (the prompt's prefix-cache keys, from a router) go to `LLMEngine.add_request`.
        Raises `ShuttingDownError` while draining, `EngineDeadError` if the loop died.
        """
        self._put(_Add(request_id, token_ids, params, stream, arrival_s or time.perf_counter(), block_hashes))

    def abort(self, request_id: str) -> None:
        """Abort a request; the engine thread frees its blocks before its next step. Idempotent."""
        self._put(_Abort(request_id), raise_if_dead=False)

    def call(self, fn: Callable[[EngineClient], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (e.g. `stats`, `check_integrity`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Call(fn, future))
        return future

    def _put(self, command, raise_if_dead: bool = True) -> None:
        with self._lock:  # queued under the lock, so that _die drains every command it let in
            if not self._admit(command, raise_if_dead):
                return
            self._commands.put(command)
        if self._wake is not None:
            self._wake()

    def _admit(self, command, raise_if_dead: bool) -> bool:
        """With `_lock` held: whether `command` may go to the engine (False: drop it, the loop is dead); raises
        for a dead loop when `raise_if_dead`, and for a request while draining. Counts an admitted request."""
        if self._dead is not None:
            if raise_if_dead:
                if isinstance(self._dead, ShuttingDownError):
                    raise ShuttingDownError(str(self._dead))
                raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
            return False
        if isinstance(command, _Add):
            if self._draining:
                raise ShuttingDownError("the server is shutting down")
            self._num_waiting += 1
        return True

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self.num_iterations += 1
                # NOTE: block only when idle; with work in flight, take what is queued and step.
                if not self._drain_commands(block=not engine.has_unfinished_requests()):
                    self._die(ShuttingDownError("the server is shutting down"))
                    persist = getattr(engine, "persist_kv", None)  # a KV disk tier keeps its prefixes
                    if persist is not None:
                        persist()
                    return
                outputs = self._step() if engine.has_unfinished_requests() else []
                # NOTE: metrics first, so a client that has its answer also sees it counted.
                if self.metrics is not None:
                    self.metrics.update_from_engine(engine)
                self._dispatch(outputs)
        except BaseException as error:  # the loop must report whatever killed it
            logger.critical("the engine loop died: %s: %s", type(error).__name__, error, exc_info=error)
            self._die(error)
            if self._on_dead is not None:
                try:
                    self._on_dead(error)
                except Exception:  # noqa: BLE001 - the loop is already dead; say so, do not raise again
                    logger.exception("on_dead failed")

    def _drain_commands(self, block: bool) -> bool:
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
            self._add(command)
        elif isinstance(command, _Abort):
            tracked = self._tracked.pop(command.request_id, None)
            if tracked is not None:
                self._stop_waiting(tracked)
                self.engine.abort(command.request_id)
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as error:  # noqa: BLE001 - handed to the caller
                command.future.set_exception(error)

    def _add(self, command: _Add) -> None:
        try:
            if command.block_hashes is None:
                self.engine.add_request(command.request_id, command.token_ids, command.params)
            else:
                self.engine.add_request(command.request_id, command.token_ids, command.params,
                                        block_hashes=command.block_hashes)
        except PagedKVError as error:  # the handler validated it; the engine still refused it
            failure = RequestFailedError(str(error), 400, code="invalid_request", request_id=command.request_id)
        except Exception as error:  # noqa: BLE001 - this request fails, the loop goes on
            logger.error("request %s failed when added: %s: %s", command.request_id, type(error).__name__, error,
                         exc_info=error)
            self.engine.abort(command.request_id)  # in case it got half in; unknown ids are a no-op
            failure = RequestFailedError(f"the engine failed to add this request: {type(error).__name__}: {error}",
                                         request_id=command.request_id)
        else:
            self._tracked[command.request_id] = _Tracked(command.stream, command.arrival_s)
            return
        with self._lock:
            self._num_waiting -= 1
        if self.metrics is not None and failure.status_code >= 500:
            self.metrics.observe_abort("error")
        command.stream.put_threadsafe(failure)

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - contained to the requests it touched, or fatal below
            self._step_failed(error)
            return []
        self._num_failed_steps = 0
        return outputs

    def _step_failed(self, error: Exception) -> None:
        """Fail the request the error names, else every request in flight; re-raise if the engine looks broken."""
        if isinstance(error, StepFailedError):
            # The engine failed the step's requests itself and freed their blocks; the rest go on.
            failed_ids = [request_id for request_id in error.request_ids if request_id in self._tracked]
        else:
            failed_ids = list(self._tracked)  # the step's requests cannot be told apart: fail all in flight
        request_id = getattr(error, "request_id", None)
        if request_id in self._tracked:
            logger.error("request %s failed in a step: %s: %s", request_id, type(error).__name__, error,
                         exc_info=error)
            self._fail(request_id, RequestFailedError(f"this request failed in the engine: {error}"))
            return
        self._num_failed_steps += 1
        if self._num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise error  # every step fails: the engine is broken, not one request
        logger.error("an engine step failed (%d in a row); failing the %d requests in it: %s: %s",
                     self._num_failed_steps, len(failed_ids), type(error).__name__, error, exc_info=error)
        failure = f"the engine step serving this request failed: {type(error).__name__}: {error}"
        for request_id in failed_ids:
            self._fail(request_id, RequestFailedError(failure))
        # A failed step must leave no block behind; if it did, the engine is not safe to keep using.
        self.engine.check_integrity()
        if not self.engine.has_unfinished_requests() and self.engine.stats().num_used_blocks:
            raise EngineDeadError(f"a failed step left {self.engine.stats().num_used_blocks} KV blocks in use")

    def _fail(self, request_id: str, error: RequestFailedError) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self._stop_waiting(tracked)
        self.engine.abort(request_id)
        if self.metrics is not None:
            self.metrics.observe_abort("error")
        error.request_id = request_id
        self._send(tracked.stream, error)

    def _stop_waiting(self, tracked: _Tracked) -> None:
        if tracked.is_waiting:
            tracked.is_waiting = False
            with self._lock:
                self._num_waiting -= 1

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one event-loop wake-up per step, in order."""
        now = time.perf_counter()
        self._outbox = []
        try:
            for output in outputs:
                try:
                    self._deliver(output, now)
                except Exception as error:  # noqa: BLE001 - this request fails, the others are delivered
                    logger.error("delivering request %s failed: %s: %s", output.request_id, type(error).__name__,
                                 error, exc_info=error)
                    self._fail(output.request_id, RequestFailedError(f"delivering this request's output failed: "
                                                                     f"{type(error).__name__}: {error}"))
        finally:
            pairs, self._outbox = self._outbox, None
            by_loop: dict = {}
            for stream, item in pairs:
                by_loop.setdefault(stream.loop, []).append((stream, item))
            for loop, loop_pairs in by_loop.items():
                deliver_threadsafe(loop, loop_pairs)

    def _send(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        """Queue `item` for this step's one hand-off (see `_dispatch`), or hand it over now outside a step."""
        if self._outbox is not None:
            self._outbox.append((stream, item))
        else:
            stream.put_threadsafe(item)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        # `output` may also be an `OutputDelta` (an engine that forwards its deltas: a Ray Serve replica, whose
        # streams forward them too): read only what both answer alike, request_id, finished, error, and each
        # completion's finish_reason and num_tokens (a delta's token_ids and text hold only what is new).
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return
        if output.error is not None and not any(c.finish_reason == "rejected" for c in output.outputs):
            # The engine failed this request alone (its step-mates go on): a 500 for it, not an output.
            self._fail(output.request_id, RequestFailedError(output.error))
            return
        completions = output.outputs  # (one completion, the common case, without a generator per output)
        num_tokens = (completions[0].num_tokens if len(completions) == 1
                      else max((c.num_tokens for c in completions), default=0))
        if tracked.first_token_s is None and num_tokens:
            tracked.first_token_s = now
        if num_tokens or output.finished:
            self._stop_waiting(tracked)
        if output.finished:
            del self._tracked[output.request_id]
            if self.metrics is not None:
                reason = output.outputs[0].finish_reason if output.outputs else "abort"
                self.metrics.observe_request(tracked.arrival_s, tracked.first_token_s, now, num_tokens,
                                             reason or "abort")
        self._send(tracked.stream, output)

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
        reason = "shutdown" if isinstance(error, ShuttingDownError) else "error"
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the streams must still end
                logger.debug("abort of %s failed in a dead engine", request_id, exc_info=True)
            if self.metrics is not None:
                self.metrics.observe_abort(reason)
            tracked.stream.put_threadsafe(dead)
        self._tracked.clear()
