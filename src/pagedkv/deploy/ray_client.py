"""`RayEngineClient`: the `EngineClient` the ingress's FastAPI app drives, backed by the Ray Serve engine deployment.

The ingress runs the very app `pagedkv serve` runs (`pagedkv.server.app.create_app`), whose
engine thread calls `add_request`, `abort` and `step` as it would on one `LLMEngine`. Here
those become streaming calls on the engine deployment's handle:

    engine thread                 client loop (a thread of its own*)                engine replica
    add_request: tokens, hashes ─► handle.generate.remote(..., sender) ── router ──► generate(): its replica id
    step(): outputs from the queue ◄─ decode deltas ◄─ outputs(sender) stream, one per replica ◄─┘ (lists of messages)
    abort: cancel the call        ───► the generate call's cancellation ─────────────────► abort, blocks freed

* or the ingress replica's event loop, when Ray Serve's router runs on it (`ray_serve.Ingress`, the
  default). With `drive_on_loop` (`RayServeConfig.ingress_engine_thread=False`) the app then drives
  this client from that loop with no engine thread at all (`pagedkv.server.loop_engine.LoopAsyncEngine`:
  `add_request` and `abort` come on the loop, and each output goes to the attached sink as it arrives
  rather than to a queue for `step()`).

A request's outputs come on the stream this client holds with its replica (opened when a
replica first names itself), many requests' messages per item: see `pagedkv.deploy.replica`
for why. A request is over when its last message arrived on that stream.

Lanes (`lanes=True`, the app's default): once this client has a lane to every running replica
(opened after each poll of the replica list), it routes each request itself, with the same policy
module as the request router (queues from each replica's items, what it sent there and not yet
started, the keys each replica publishes, its memory of recent decisions), writes the request to
that replica's lane and makes the Serve call pinned there, which the replica joins to the copy it
already runs. The lane also brings that replica's outputs once no `outputs` stream is open there. A
lane that ends is a broken output stream (below); requests go by Serve calls alone until it reopens.

The prompt is hashed here, once (when routing by prefix): the request router matches on
those keys and the replica's engine reuses them.

Faults: a replica that fails (its actor killed, its node gone) before a request's first
output is retried, up to `max_attempts` calls in all: its client has seen nothing, so nothing is
lost. Each attempt has an id of its own at the replicas, so a late message of an attempt given up
on is dropped, never taken for the next one's. A request that had already streamed output ends
with an error output, which the app turns into an error event and `[DONE]` (or a 500). Ray Serve
restarts the replica; the router takes it back once the controller reports it running. An output
stream can also break while its replica lives on (a message the transport refused): every request
in flight there may have lost a message with it, so each is cancelled at the replica (which frees
its blocks) and fails if it had output or is retried if not, at once rather than when its call
ends; a new stream then takes the replica's queue over from the broken one's reader. Outputs are
deltas, and one that continues from a lost message fails its request rather than show a gap. A
replica ends a stream that has been idle a while (`replica.OUTPUTS_IDLE_S`): the next request
opens another.

`health()` lists the engine deployment's replicas as the Serve controller reports them
(`ReplicaView`: refreshed every `REPLICA_POLL_S` in the background, so a /health request never waits on Ray),
with each one's queues as its latest output reported them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import math
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from pagedkv.deploy.lane import LaneClient
from pagedkv.deploy.replica import Load, unpack_messages
from pagedkv.deploy.replica_view import ReplicaView, replica_state
from pagedkv.distributed.output_deltas import DeltaDecoder, OutputGapError
from pagedkv.distributed.router import (DEFAULT_BALANCE_THRESHOLD, LoadedReplica, Router, RouterConfig, RoutingPolicy,
                                       prompt_block_hashes)
from pagedkv.engine.output_processor import chat_token_ids, tokenize_prompt
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import InvalidArgumentError, PagedKVError

logger = logging.getLogger("pagedkv.deploy")

DEFAULT_MAX_ATTEMPTS = 3
_RETRY_BACKOFF_S = 0.2
#: How long asking a replica where its lane listens may take.
LANE_OPEN_TIMEOUT_S = 10.0
#: After a lane failed to open, the next try at that replica waits this long.
LANE_RETRY_S = 10.0
_WAKE = None  # put in the output queue to end a waiting step() early (a new command arrived)


def failed_output(request_id: str, message: str, reason: str = "error") -> RequestOutput:
    """The final output of a request that ended without an answer ("rejected" makes it a 400)."""
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], reason)], True, error=message)


@dataclass
class _Live:
    """A request in flight, as the client loop tracks it."""

    request_id: str
    done: asyncio.Future  # set once its last message (final output, or failure) arrived
    task: asyncio.Task  # its `_serve`
    prompt_token_ids: list[int]  # the replica does not send them back
    wire_id: str = ""  # the current attempt's id at the replicas (the request id, then one per retry)
    started: bool = False  # an output arrived: a retry elsewhere would repeat it
    replica: str | None = None  # the replica serving the current attempt, once it named itself (or its lane's)
    lane: LaneClient | None = None  # the lane the current attempt went in by, if any
    lost: str | None = None  # why that replica's output stream ended under it (its messages may be lost)


def take_queued(items: queue.SimpleQueue, timeout_s: float) -> list:
    """Everything in `items`, waiting up to `timeout_s` for the first (an empty list if none came)."""
    taken = []
    try:
        taken.append(items.get(timeout=timeout_s))
        while True:
            taken.append(items.get_nowait())
    except queue.Empty:
        return taken


class ReplicaStreamEndedError(PagedKVError):
    """A replica's output stream ended before a request's last message came on it."""


class RayEngineClient(ReplicaView):
    """The engine deployment behind one handle, as an `EngineClient` (see the module docstring)."""

    def __init__(self, handle, info: dict, tokenizer, policy: RoutingPolicy | str = RoutingPolicy.PREFIX,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, loop: asyncio.AbstractEventLoop | None = None,
                 grpc: bool = True, drive_on_loop: bool = False, lanes: bool = False,
                 balance_threshold: int | None = DEFAULT_BALANCE_THRESHOLD, max_ongoing_requests: int = 1 << 30):
        from pagedkv.engine.scheduler import Scheduler

        self.tokenizer = tokenizer
        self.max_model_len = info["max_model_len"]
        self.stream_outputs = True
        self._vocab_size = info["vocab_size"]
        self._block_size = info["block_size"]
        self._hashes_prompts = RoutingPolicy(policy) is RoutingPolicy.PREFIX
        self._fits = Scheduler(info["scheduler_config"])  # bookkeeping only: admission checks
        # NOTE: `grpc` takes Serve's gRPC channel to each replica for this handle's calls (a replica's
        # death then surfaces as ActorUnavailableError, a RayActorError, so the retry in _serve holds);
        # else Ray's actor calls, Serve's default. See RayServeConfig.handle_transport.
        self._handle = handle.options(stream=True, _by_reference=not grpc)
        self._unary = handle.options(stream=False, _by_reference=not grpc)
        self._sender = uuid.uuid4().hex  # names this client's output streams at every replica
        self._app_name, self._deployment_name = handle.app_name, handle.deployment_name
        self._max_attempts = max_attempts
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, concurrent.futures.Future | asyncio.Task] = {}  # engine thread (or loop) only
        self._sink = None  # see attach()
        self._drive_on_loop = drive_on_loop
        self._decoder = DeltaDecoder()  # client loop only
        self._live: dict[str, _Live] = {}  # request id -> its state here (client loop only)
        self._channels: dict[str, asyncio.Task] = {}  # replica -> the task reading its output stream (client loop)
        self._loads: dict[str, Load] = {}
        self._stats: dict[str, dict] = {info["replica"]: info["stats"]}
        self._replicas: list[dict] = []
        # Lanes (`pagedkv.deploy.lane`): replica -> its open lane, and the task reading it; the policy that routes
        # requests going in by lane (the same module as the request router's), what went to each replica (lanes
        # and calls) and each replica's published prefix keys.
        self._use_lanes = lanes
        self._lanes: dict[str, LaneClient] = {}
        self._lane_readers: dict[str, asyncio.Task] = {}
        self._lane_paused: dict[str, float] = {}  # replica -> when a call pinned there found it gone from Serve
        self._lane_tasks: set[asyncio.Task] = set()  # lanes being opened (held here, so none is collected)
        self._lane_opening: dict[str, float] = {}  # replica -> when its lane was last tried (or is being opened)
        self._policy = Router([], RouterConfig(policy, balance_threshold), block_size=self._block_size)
        self._num_sent: Counter[str] = Counter()
        self._published: dict[str, frozenset] = {}
        self._num_lane_sent: Counter[str] = Counter()  # replica -> requests that went in by its lane (/health)
        self._lane_in_flight: Counter[str] = Counter()  # replica -> this client's requests there that came by lane
        self._max_ongoing_requests = max_ongoing_requests
        # NOTE: in an ingress replica, the replica's own event loop (`loop`): Ray Serve binds a handle's calls to
        # the loop that makes them when its router shares the replica's loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0),
        # and it saves a thread hop each way. Otherwise (Serve's separate loops, tests) a loop on a thread of its own.
        self._closed = False
        self._thread = None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="pagedkv-ray-client", daemon=True)
            self._thread.start()
        self._loop = loop
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch_replicas(), self._loop)

    # ------------------------------------------------------------------ thread-safe reads
    def tokenize(self, prompt):
        return tokenize_prompt(self.tokenizer, self._vocab_size, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """`RequestRejectedError` if a request of this size fits no replica (all share one config)."""
        self._fits.check_fits(num_prompt_tokens, max_tokens, n)

    # ------------------------------------------------------------------ engine thread
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0) -> None:
        """Send a request to the deployment (the request router picks the replica); raises if it is malformed."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        _, token_ids = self.tokenize(prompt)
        params.check_token_ids(self._vocab_size)
        self.check_fits(len(token_ids), params.max_tokens, params.n)
        block_hashes = prompt_block_hashes(token_ids, self._block_size) if self._hashes_prompts else None
        call = self._serve(request_id, token_ids, params, block_hashes)
        # NOTE: on the loop, the call starts in a context of its own, as one from another thread does: in the
        # HTTP handler's context Serve takes every engine call of one HTTP request (two prompts) for one request,
        # and the second never reaches a replica.
        self._requests[request_id] = (self._loop.create_task(call, context=contextvars.Context())
                                      if self._sink is not None else asyncio.run_coroutine_threadsafe(call, self._loop))

    def abort(self, request_id: str) -> bool:
        future = self._requests.pop(request_id, None)
        if future is None:
            return False
        try:  # driven on the loop (LoopAsyncEngine), or from shutdown() on any thread
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            future.cancel()  # the call's cancellation reaches the replica
        else:
            self._loop.call_soon_threadsafe(future.cancel)
        return True

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop this client's calls run on when it is its owner's (an ingress replica's) and `drive_on_loop`
        lets the owner drive it there (`LoopAsyncEngine`), else None (an engine thread drives it)."""
        return self._loop if self._thread is None and self._drive_on_loop else None

    def attach(self, sink) -> None:
        """From now on pass each output to `sink(output)` on `event_loop` as it arrives, instead of queueing
        it for `step()`; `add_request` and `abort` are then called on that loop (`LoopAsyncEngine`)."""
        self._sink = sink

    def _emit(self, output: RequestOutput) -> None:
        if self._sink is None:
            self._outputs.put(output)  # step() takes it
        elif self._accept(output):
            self._sink(output)

    def wake(self) -> None:
        """End a `step()` that is waiting for outputs (called by the engine thread's owner on a new command)."""
        self._outputs.put(_WAKE)

    def step(self, timeout_s: float = 0.05) -> list[RequestOutput]:
        """Outputs that arrived since the last call; waits up to `timeout_s` (or a `wake()`) for the first."""
        return [output for output in take_queued(self._outputs, timeout_s)
                if output is not _WAKE and self._accept(output)]

    def _accept(self, output: RequestOutput) -> bool:
        """Whether `output` goes on to the engine's owner (not if its request was aborted since); a finished
        request is forgotten here."""
        if output.request_id not in self._requests:
            return False
        if output.finished:
            del self._requests[output.request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ client loop
    async def _serve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     block_hashes: list[bytes] | None) -> None:
        from ray.exceptions import RayActorError

        live = _Live(request_id, self._loop.create_future(), asyncio.current_task(), token_ids)
        try:
            for attempt in range(1, self._max_attempts + 1):
                # NOTE: each attempt has an id of its own at the replicas. A retry may land on the replica that
                # is still aborting the attempt before it, whose late messages must not pass for this one's.
                live.wire_id = f"{request_id}#{attempt}-{uuid.uuid4().hex[:12]}"
                live.replica = live.lost = live.lane = None
                self._live[live.wire_id] = live
                call = None
                try:
                    pin = self._send_by_lane(live, token_ids, params, block_hashes)
                    call = self._handle.generate.remote(live.wire_id, token_ids, params, block_hashes=block_hashes,
                                                        sender=self._sender, **({"replica": pin} if pin else {}))
                    async for replica in call:  # one item: the replica that took it (None: not the pinned one)
                        if replica is None:
                            # Serve's router no longer has the lane's replica (draining, or gone): the lane's copy
                            # has nothing keeping it there; before its first output it goes elsewhere.
                            self._lane_paused[pin] = time.monotonic()  # Serve calls route for a while
                            if not live.started:
                                raise ReplicaStreamEndedError(f"replica {pin} left Ray Serve's routing")
                            continue
                        if pin is None:
                            live.replica = replica
                            self._num_sent[replica] += 1
                        if not self._closed:
                            self._channel(replica)
                    await self._last_message(live)
                    return
                except asyncio.CancelledError:
                    if call is not None:
                        call.cancel()  # the replica aborts it
                    self._abort_by_lane(live)
                    # Cancelled by `_ended` or a gap (`lost`): this attempt is over. A second cancellation (an
                    # abort in the same turn) leaves the count above zero: that one wins.
                    if live.lost is None or asyncio.current_task().uncancel():
                        raise
                    error, retry = ReplicaStreamEndedError(live.lost), True
                except Exception as raised:  # noqa: BLE001 - whatever ended the call ends (or retries) this request
                    self._abort_by_lane(live)
                    error, retry = raised, isinstance(raised, (RayActorError, ReplicaStreamEndedError))
                if self._end_or_retry(request_id, live, attempt, error, retry):
                    return
                self._forget(live)  # from here on, this attempt's late messages are dropped
                await asyncio.sleep(_RETRY_BACKOFF_S)
        finally:
            self._forget(live)

    # ------------------------------------------------------------------ lanes (client loop)
    def _send_by_lane(self, live: _Live, token_ids: list[int], params: SamplingParams,
                      block_hashes: list[bytes] | None) -> str | None:
        """Route `live`'s attempt here and send it in by that replica's lane; the replica, or None (no lane to
        every running replica, or the write failed: the Serve call routes and carries it)."""
        if not self._use_lanes or self._closed or not self._lanes:
            return None
        replica = self._route_by_lane(token_ids, block_hashes)
        lane = self._lanes.get(replica) if replica is not None else None
        if lane is None or self._lane_in_flight[replica] >= self._max_ongoing_requests:
            return None  # that replica holds as many of this client's requests as Serve lets it: the call waits
        if not lane.send(("add", live.wire_id, token_ids, params, block_hashes)):
            return None
        live.replica, live.lane = replica, lane
        self._lane_in_flight[replica] += 1
        self._num_sent[replica] += 1
        self._num_lane_sent[replica] += 1
        self._channel(replica)
        return replica

    def _route_by_lane(self, token_ids: list[int], block_hashes: list[bytes] | None) -> str | None:
        """The policy's choice among the running replicas, if this client has a lane to each (else None: it does
        not see them all, and Ray Serve's request router decides)."""
        running = [r["replica_id"] for r in self._replicas if replica_state(r) == "RUNNING"]
        if not running or any(key not in self._lanes for key in running):
            return None
        now = time.monotonic()
        if any(now - self._lane_paused.get(key, -math.inf) < LANE_RETRY_S for key in running):
            return None  # Serve's router and this client's list disagree on a replica lately: let Serve route
        views = {}
        for key in running:
            load = self._loads.get(key)
            num_unconsumed = max(0, self._num_sent[key] - (load.num_started if load else 0))
            views[key] = LoadedReplica(self._block_size, (load.num_waiting if load else 0) + num_unconsumed,
                                       load.num_running if load else 0, load.num_free_blocks if load else 0,
                                       self._published.get(key, frozenset()))
        return self._policy.choose(views, token_ids, block_hashes).replica

    def _abort_by_lane(self, live: _Live) -> None:
        """An attempt that went in by lane is over unfinished: abort it at its replica (its call's cancellation
        does too, when the call got there)."""
        if live.lane is not None:
            live.lane.send(("abort", live.wire_id))

    def _replicas_changed(self) -> None:
        """After each poll of the replica list: open a lane to each running replica that has none (a replica whose
        lane failed to open is tried again after `LANE_RETRY_S`)."""
        if not self._use_lanes or self._closed:
            return
        now = time.monotonic()
        listed = {replica["replica_id"] for replica in self._replicas}
        for key in [key for key in self._lanes if key not in listed]:
            self._lanes[key].close()  # that replica left the list: its reader ends, and what was in flight there
        for replica in self._replicas:
            key = replica["replica_id"]
            if replica_state(replica) != "RUNNING" or key in self._lanes:
                continue
            last = self._lane_opening.get(key)
            if last is not None and now - last < LANE_RETRY_S:
                continue
            self._lane_opening[key] = math.inf  # being opened
            task = self._loop.create_task(self._open_lane(key))
            self._lane_tasks.add(task)
            task.add_done_callback(self._lane_tasks.discard)

    async def _open_lane(self, replica: str) -> None:
        try:
            address = await asyncio.wait_for(self._unary.lane_address.remote(replica=replica), LANE_OPEN_TIMEOUT_S)
            if address is None:
                raise ReplicaStreamEndedError(f"replica {replica} is gone")
            lane = await LaneClient.connect(replica, address, self._sender)
        except Exception as error:  # noqa: BLE001 - requests there go by Serve calls; tried again later
            logger.warning("no lane to replica %s (its requests go by Ray Serve calls): %s: %s", replica,
                           type(error).__name__, error)
            return
        finally:
            self._lane_opening[replica] = time.monotonic()
        if self._closed:
            lane.close()
            return
        self._lanes[replica] = lane
        self._lane_readers[replica] = self._loop.create_task(self._read_lane(replica, lane))
        task = self._channels.get(replica)
        if task is None or task.done():  # nothing streams from there now: the lane carries its outputs from here on
            self._channel(replica)

    async def _read_lane(self, replica: str, lane: LaneClient) -> None:
        """Read what `replica` sends back on `lane` (its outputs, once attached) until the lane ends; a lane that
        ends under requests is a broken output stream (`_ended`)."""
        broke, num_items = "the lane closed", 0
        try:
            async for blob, load in lane.messages():
                num_items += 1
                self._take_item(blob, load)
        except asyncio.CancelledError:
            num_items = -1  # closed here: nothing to recover
            raise
        except Exception as error:  # noqa: BLE001 - the replica is gone, or the connection broke
            broke = f"{type(error).__name__}: {error}"
        finally:
            lane.close()
            if self._lanes.get(replica) is lane:
                del self._lanes[replica]
            task = asyncio.current_task()
            if self._lane_readers.get(replica) is task:
                del self._lane_readers[replica]
            self._lane_opening[replica] = time.monotonic()
            if num_items >= 0:
                logger.warning("the lane to replica %s ended: %s", replica, broke)
                if self._channels.get(replica) is task:
                    del self._channels[replica]
                    self._ended(replica, broke, num_items)
                # The requests that went in by it: the replica aborts those no Serve call joined yet.
                why = f"the lane to replica {replica} ended before the request's last output ({broke})"
                for live in list(self._live.values()):
                    if live.lane is lane and not live.done.done() and live.lost is None:
                        live.lost = why
                        live.task.cancel()

    def _forget(self, live: _Live) -> None:
        if self._live.get(live.wire_id) is live:  # (a new request may have taken an aborted one's id already)
            del self._live[live.wire_id]
            self._decoder.forget(live.wire_id)
            if live.lane is not None:
                self._lane_in_flight[live.lane.replica] -= 1

    async def _last_message(self, live: _Live) -> None:
        """Once a request's call has ended (its last message is queued at the replica): wait for that message on
        the replica's stream, or on the one that replaced it, which took the queue over; raise if neither
        brought it (the stream before lost it)."""
        for _ in range(2):
            channel = self._channels.get(live.replica) if live.replica is not None else None
            if live.done.done() or channel is None or channel.done():
                break
            await asyncio.wait((live.done, channel), return_when=asyncio.FIRST_COMPLETED)
        if not live.done.done():
            raise ReplicaStreamEndedError("the replica's output stream ended before the request's last output")

    def _end_or_retry(self, request_id: str, live: _Live, attempt: int, error: Exception, retry: bool) -> bool:
        """After an attempt failed: True once the request ended with an error output, False to try again (only
        a request that has shown nothing, after a fault that may not be its own)."""
        if live.started or attempt == self._max_attempts or not retry:
            logger.warning("request %s failed on its replica: %s: %s", request_id, type(error).__name__, error)
            self._emit(failed_output(request_id, f"the replica serving this request failed: "
                                                        f"{type(error).__name__}: {error}"))
            return True
        logger.warning("request %s: its attempt failed before the first output (%s: %s); retrying",
                       request_id, type(error).__name__, error)
        return False

    def _channel(self, replica: str) -> asyncio.Task:
        """The task reading this client's output stream from `replica` (started on first use)."""
        task = self._channels.get(replica)
        if task is None or task.done():
            lane, reader = self._lanes.get(replica), self._lane_readers.get(replica)
            if lane is not None and reader is not None and not reader.done() and lane.send(("attach",)):
                task = reader  # the lane carries the outputs (the stream before it, if any, has ended)
            else:
                task = self._loop.create_task(self._read(replica))
            self._channels[replica] = task
        return task

    async def _read(self, replica: str) -> None:
        call = self._handle.outputs.remote(self._sender, replica=replica)
        broke, num_items = None, 0
        try:
            async for blob, load in call:
                num_items += 1
                self._take_item(blob, load)
        except asyncio.CancelledError:
            call.cancel()
            num_items = -1  # closed here: nothing to recover
            raise
        except Exception as error:  # noqa: BLE001 - the replica is gone, or the stream broke
            broke = f"{type(error).__name__}: {error}"
            logger.warning("the output stream of replica %s ended: %s", replica, broke)
        finally:
            if self._channels.get(replica) is asyncio.current_task():
                del self._channels[replica]
            if num_items >= 0:
                self._ended(replica, broke, num_items)

    def _take_item(self, blob: bytes, load: Load) -> None:
        """One item of a replica's output stream or lane: its load, then each of its messages."""
        self._loads[load.replica] = load
        if load.stats is not None:
            self._stats[load.replica] = load.stats
        if load.block_hashes is not None:
            self._published[load.replica] = frozenset(load.block_hashes)
        for message in unpack_messages(blob):
            self._take(message)

    def _ended(self, replica: str, broke: str | None, num_items: int) -> None:
        """`replica`'s output stream ended, not closed by this client (see the module docstring's Faults).

        It ended by itself (the replica's idle end) after bringing items: nothing was lost; a new stream for
        anything still in flight there. It broke: the messages of the requests there may be lost with it, so
        each one is cancelled at the replica, then fails if it had output or is retried if not; and a new
        stream at once, so that the replica's still-running reader of the broken one stops taking messages.
        It brought nothing (the replica is gone, or never had this stream): the requests there are cancelled
        and fail or are retried, with no new stream (which would only end the same way)."""
        in_flight = [live for live in self._live.values()
                     if live.replica == replica and not live.done.done() and live.lost is None]
        if broke is not None or not num_items:
            why = f"the output stream of replica {replica} ended before the request's last output" + (
                f" ({broke})" if broke else " (it brought nothing)")
            for live in in_flight:
                live.lost = why
                live.task.cancel()
        if num_items and not self._closed and (broke is not None or in_flight):
            self._channel(replica)

    def _cancel_channels(self) -> list[asyncio.Task]:
        tasks = list({*self._channels.values(), *self._lane_readers.values()})
        for task in tasks:
            task.cancel()
        return tasks

    async def _close_channels(self) -> None:
        await asyncio.gather(*self._cancel_channels(), return_exceptions=True)

    def _take(self, message: tuple) -> None:
        live = self._live.get(message[1][0] if message[0] == "output" else message[1])  # [0]: a delta's id
        if live is None or live.done.done() or live.lost is not None:
            return  # aborted, failed over, ended or given up since: nobody waits for it
        if message[0] == "output":
            delta = message[1]
            try:
                output = self._decoder.decode(delta, live.prompt_token_ids)
            except OutputGapError as error:  # a message of this attempt was lost: it cannot go on (retried if
                live.lost = str(error)  # nothing was shown yet, else failed)
                live.task.cancel()
                return
            live.started = True
            output.request_id = live.request_id
            self._emit(output)
            if output.finished:
                live.done.set_result(None)
        else:
            _, wire_id, text, status = message
            self._decoder.forget(wire_id)
            self._emit(failed_output(live.request_id, text, "rejected" if status < 500 else "error"))
            live.done.set_result(None)

    def shutdown(self) -> None:
        """Cancel what is in flight and stop the client loop if it owns one (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for request_id in list(self._requests):
            self.abort(request_id)
        self._watcher.cancel()
        if self._thread is None:  # the replica's loop: cancel the streams on it, leave it running
            self._loop.call_soon_threadsafe(self._cancel_channels)
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_channels(), self._loop).result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("the output streams did not close in 10 s")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
