"""One Ray Serve replica: one pagedkv engine (one GPU, or a tensor-parallel group) behind the server's engine front.

The replica drives its engine with the server's own `AsyncEngine` (which owns the engine,
contains failures to the requests they touch, and hands outputs to asyncio consumers), so a
request served through Ray runs exactly the code `pagedkv serve` runs. Where the engine runs is
`pagedkv serve`'s choice too (`uses_engine_process`): on CUDA, in a process of its own
(`DataParallelEngine` with one replica), so the engine's step loop never waits for the
interpreter lock that Ray's streaming holds (driven by an engine thread, or, opted in, from the
replica's event loop with no thread between: `LoopAsyncEngine` over `LoopProcessEngine`, the loop
writing to the pipe and reading it when it turns readable); on CPU, in the replica's process on
`AsyncEngine`'s engine thread. That child process exits when the replica's actor dies. Ray Serve calls:

    generate(request_id, token_ids, params, block_hashes, sender, replica)   streaming, one item per request
    outputs(sender, replica)                                          a streaming call, one per ingress
    lane_address(replica)                                             where the ingress's lane connects
    record_routing_stats()                                           the router's view of this replica
    check_health()                                                   raises once the engine loop (or process) died
    describe()                                                       what the ingress needs at startup

Outputs do not travel on the request's own call. A Ray streaming item costs the two processes
a few hundred microseconds, so one item per request per step (256 streams at 150 steps/s) is
more than Ray delivers, and a saturated replica would stream a fifth of what its engine makes.
Instead each ingress (`sender`) holds one `outputs` stream per replica, and every message the
replica has for that ingress since its last item goes out as one list: one item per step per
ingress, whatever the batch size. The list travels pickled, in items of at most `MAX_ITEM_BYTES`
(several items when more is queued): Serve's gRPC channel refuses a message over 4 MiB
(`RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH`), and at saturation a step's first outputs (each
carrying its prompt's ids) can pass that; a stream cut by a refused message would lose every
request it carried.

`generate` adds the request, then yields one item, this replica's id (so the ingress opens its
`outputs` stream here if it has none yet), and ends once the request ended, its
last message queued for the sender. It stays open meanwhile, which keeps Ray Serve's count of
ongoing requests (autoscaling, `max_ongoing_requests`) and its cancellation honest: when the
caller cancels it (its client went away), the request is aborted and its blocks freed at once.

The messages: `("output", delta)` (an `OutputDelta` in its wire form, `to_wire`) per output the
engine front delivers (a request's new tokens and text only, `pagedkv.distributed.output_deltas`;
not the prompt's ids, which the sender sent; an engine process's deltas pass through as it made
them, never rebuilt here), and `("failed", request_id, message, status)` once a request fails. Each
`outputs` item is `(packed messages, load)` (`unpack_messages` reads them), `load` being `Load`
below, so the ingress sees each replica's queues and stats without asking. An `outputs` stream that
ends (the ingress went away) cancels that sender's requests here. A sender that opens a second
`outputs` stream (its first one broke) takes its messages over from the first, which ends: two
readers never split one sender's messages. A stream whose sender has had no request here and nothing
queued for `OUTPUTS_IDLE_S` ends, and the sender opens another with its next request: Ray Serve
counts an open stream as an ongoing request, and a replica being drained (scaled down, redeployed)
waits for its ongoing requests.

Routing stats (`record_routing_stats`, polled by the Serve controller and handed to every
router): the engine's waiting and running requests and free blocks, how many `generate` calls
each sender has started (so a router counts the requests it sent that this replica has not
taken yet), and the keys of the prefix-cache blocks most recently cached (capped), which tell a
router that did not send a prefix here (another ingress, or one that restarted) where it lives.

Lanes (`pagedkv.deploy.lane`): an ingress may also send a request in by a TCP connection of its
own, ahead of its `generate` call (pinned here by `replica`), and read its outputs on it instead of
an `outputs` stream. Each request id runs here once, whichever copy comes first: the call that finds
its lane's copy running waits for it (and aborts it if cancelled), a copy of a request that ended
here lately is dropped, and a call pinned to a replica that is not this one yields None and starts
nothing. A lane that ends while it carries its sender's outputs cancels that sender's requests, as an
`outputs` stream does.

The constructor returns only once the engine is built: the model loaded, the KV pool sized and,
on CUDA, the decode graphs captured. Ray Serve sends no traffic to a replica before that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from pagedkv.deploy.lane import LaneAddress, LaneError, LaneServer, read_message
from pagedkv.deploy.lane import pack as lane_pack
from pagedkv.deploy.loop_process import LoopProcessEngine
from pagedkv.deploy.outbox import Outbox, OutboxStream
from pagedkv.distributed.data_parallel import DataParallelEngine
from pagedkv.distributed.router import RouterConfig, RoutingPolicy
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import EngineDeadError
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.cli import freeze_heap as gc_freeze_heap
from pagedkv.server.cli import uses_engine_process
from pagedkv.server.loop_engine import LoopAsyncEngine
from pagedkv.server.request_stream import RequestFailedError

logger = logging.getLogger("pagedkv.deploy")

#: Prefix-cache keys a replica publishes to the routers (the most recently cached ones).
MAX_PUBLISHED_BLOCK_HASHES = 2048
#: A replica attaches its engine stats to an output at most this often.
STATS_PERIOD_S = 0.05
#: An `outputs` stream ends after this long with no request of its sender here and nothing queued.
OUTPUTS_IDLE_S = 5.0
#: A sender's output items carry the replica's published prefix keys at most this often.
HASHES_PERIOD_S = 1.0
#: How many ended request ids a replica remembers, so that a late copy of one (see `generate`) does not run it again.
MAX_REMEMBERED_ENDED = 65536
#: An `outputs` item's pickled messages stay under this many bytes unless one message alone is larger (a
#: quarter of the 4 MiB that Serve's gRPC channel to a replica accepts by default).
MAX_ITEM_BYTES = 1 << 20


def pack_messages(messages: list, limit: int = MAX_ITEM_BYTES) -> list[bytes]:
    """`messages` pickled, in order, in pieces of at most `limit` bytes each (a message is never split).

    Pickled once; when that is too large, cut by count into as many pieces as its size asks for (each
    pickled once more), and a piece still too large (its messages were larger than the average) is cut again."""
    blob = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    if len(blob) <= limit or len(messages) == 1:
        return [blob]
    num_pieces = min(len(messages), -(-len(blob) // limit) + 1)
    step = -(-len(messages) // num_pieces)
    return [piece for start in range(0, len(messages), step)
            for piece in pack_messages(messages[start:start + step], limit)]


def unpack_messages(blob: bytes) -> list:
    """The messages of one `outputs` item (`pack_messages`' inverse)."""
    return pickle.loads(blob)


@dataclass(frozen=True)
class Load:
    """A replica's queues as of one output, with its engine stats when they are due (else None)."""

    replica: str
    node: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    stats: dict | None
    num_started: int = 0  # the reader's sender's requests started here so far
    block_hashes: list | None = None  # the replica's published prefix keys, every HASHES_PERIOD_S per sender


def _pump_ended(task: asyncio.Task, writer) -> None:
    """A lane's output pump that failed closes its lane, so both ends take the lane-ended paths (not a silent
    stop of that sender's outputs)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("a lane's output pump failed: %r", task.exception())
        writer.close()


def replica_identity() -> tuple[str, str]:
    """(replica id, node id) of the Ray Serve replica this code runs in ("local" outside one)."""
    try:
        import ray
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id, ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not inside a Serve replica (a unit test): any name will do
        return "local", "local"


def _published_block_hashes(engine) -> list:
    """The keys of the prefix blocks `engine` cached most recently, in its GPU cache or host tier (at most
    MAX_PUBLISHED_BLOCK_HASHES); where the engine's calls run."""
    if hasattr(engine, "published_block_hashes"):  # an engine process's, as it last pushed them
        return engine.published_block_hashes()
    return engine.scheduler.block_manager.recent_keys(MAX_PUBLISHED_BLOCK_HASHES)


def _engine_stats(engine) -> dict:
    """The engine's latest stats as a plain dict (one engine's, not a one-replica sum); where the engine's calls run."""
    stats = engine.latest_stats()
    per_replica = getattr(stats, "per_replica", None)  # an engine process's: a sum over its one replica
    return (per_replica[0] or {}) if per_replica is not None else stats.as_dict()


class EngineReplica:
    """The body of the engine deployment (see the module docstring); `build_app` wraps it with `serve.deployment`.

    `engine_process`: True runs the engine in a child process, False on a thread of this one,
    None decides as `pagedkv serve` does (a child process on CUDA). `freeze_heap` (the deployment
    sets it) moves what startup allocated out of the garbage collector's reach once the replica is
    built, as `pagedkv serve` does, so no full collection walks the model's objects mid-serving.
    `engine_thread` False drives an engine process from the replica's event loop instead of an
    engine thread (`RayServeConfig.replica_engine_thread`).
    """

    def __init__(self, config: EngineConfig, engine_process: bool | None = None, freeze_heap: bool = False,
                 engine_thread: bool = True):
        from pagedkv.engine.engine import LLMEngine

        # The model, KV pool and (on CUDA) decode graphs are built here: the replica is warm before any traffic.
        if uses_engine_process(engine_process, config):
            # One replica, so nothing to route; the prompt hashes come with each request (see generate).
            engine = DataParallelEngine(config, 1, router_config=RouterConfig(RoutingPolicy.ROUND_ROBIN),
                                        num_published_block_hashes=MAX_PUBLISHED_BLOCK_HASHES, decode_outputs=False)
            self._process = engine.replicas[0]
        else:
            engine = LLMEngine(config)
            engine.stream_outputs = True
            self._process = None
        self._engine = engine
        # An engine thread for an engine that computes here; an engine process may instead be driven from the
        # loop that runs this replica's calls (`engine_thread=False`: `LoopProcessEngine`), made there by the
        # first call that needs it (`_front`).
        self._async_engine: AsyncEngine | None = None
        if self._process is None or engine_thread:
            self._async_engine = AsyncEngine(engine)
            self._async_engine.start()
        self._num_started: Counter[str] = Counter()  # sender -> requests started here (by a call or a lane)
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> the task serving it here
        self._gone: OrderedDict[str, None] = OrderedDict()  # request ids ended here lately (see _end)
        self._joined: set[str] = set()  # lane copies whose Serve call has come (it aborts them if cancelled)
        self._lane_server = LaneServer(self._on_lane)
        self._published: list = []  # the prefix keys of the latest routing stats
        self._hashes_sent_s: dict[str, float] = {}  # sender -> when its lane's items last carried them
        self._outboxes: dict[str, Outbox] = {}  # sender -> what it has yet to read
        self._replica, self._node = replica_identity()
        self._last_stats_s = 0.0
        self.outputs_idle_s = OUTPUTS_IDLE_S
        if freeze_heap:
            gc_freeze_heap()

    def _front(self) -> AsyncEngine:
        """The engine's front; an engine process's is made on the event loop of the first call that needs it.

        Not in the constructor: Ray Serve may build a replica on another thread and loop than the one that
        runs its calls, and the front's pipe reader and its streams belong to the calls' loop."""
        if self._async_engine is None:
            self._async_engine = LoopAsyncEngine(LoopProcessEngine(self._engine, asyncio.get_running_loop()))
            self._async_engine.start()
        return self._async_engine

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       block_hashes: list[bytes] | None = None, sender: str = "", replica: str = ""):
        """Serve one request (see the module docstring): yield this replica's id, queue its messages for
        `sender`, end when it ended; abort it if the caller cancels.

        A request its sender's lane started here already (`pagedkv.deploy.lane`) is not started again: this
        call waits for it instead. `replica` pins the call to the replica the sender's lane sent it to: if this
        is another one, the call yields None and ends at once (the request runs where the lane took it)."""
        if replica and replica != self._replica:
            yield None
            return
        task, started = self._start(request_id, token_ids, params, block_hashes, sender)
        if task is not None and not started:
            self._joined.add(request_id)  # its lane's copy: this call owns it from here on
        yield self._replica
        if task is None:  # it ran here already (its lane's copy), or its sender aborted it
            return
        try:
            await asyncio.shield(task)
        finally:
            if not task.done():  # the caller went away (or cancelled): abort it, free the blocks now
                task.cancel()

    def _start(self, request_id: str, token_ids: list[int], params: SamplingParams, block_hashes, sender: str):
        """(the task serving `request_id` here, whether this call started it): its running one if a lane or a call
        started it already, None if it ran or was aborted here lately, else a new one (added to the engine before
        this returns)."""
        task = self._tasks.get(request_id)
        if task is not None or request_id in self._gone:
            return task, False
        self._num_started[sender] += 1
        outbox = self._outbox(sender)
        stream = OutboxStream(asyncio.get_running_loop(), outbox)
        try:  # added first: the engine starts on it while the replica's id travels back
            self._front().add_request(request_id, token_ids, params, stream, block_hashes=block_hashes)
        except (RequestFailedError, EngineDeadError) as error:
            stream.end(error)
        task = self._tasks[request_id] = asyncio.get_running_loop().create_task(
            self._serve_request(request_id, stream, outbox))
        outbox.requests.add(task)
        return task, True

    async def _serve_request(self, request_id: str, stream: OutboxStream, outbox: Outbox) -> None:
        try:
            await stream.ended
            if stream.error is not None:
                outbox.put(self._failure(request_id, stream.error))
        finally:
            outbox.leave(asyncio.current_task())
            self._end(request_id)
            if not stream.ended.done():  # cancelled: free the blocks now
                self._front().abort(request_id)

    def _end(self, request_id: str) -> None:
        """`request_id` is over here: a late copy of it (its lane's, or its call's) will not start it again."""
        self._tasks.pop(request_id, None)
        self._joined.discard(request_id)
        self._gone[request_id] = None
        while len(self._gone) > MAX_REMEMBERED_ENDED:
            self._gone.popitem(last=False)

    def _abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()
        else:
            self._end(request_id)

    # ------------------------------------------------------------------ lanes
    async def lane_address(self, replica: str = "") -> LaneAddress | None:
        """Where the sender's lane to this replica connects (the server starts on the first call); None if the
        call was meant for another replica (`replica`), which is gone."""
        if replica and replica != self._replica:
            return None
        if self._lane_server.address is None:
            self._front()  # an engine process's front lives on this loop (the lanes' too)
            await self._lane_server.start()
        return self._lane_server.address

    async def _on_lane(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One sender's lane: start and abort its requests as its messages say; once it asks, carry its outputs
        as `outputs` would, until the lane ends or another reader takes the sender's outbox over."""
        pump: asyncio.Task | None = None
        token = object()
        started: set[str] = set()  # what this lane started here
        try:
            while (message := await read_message(reader)) is not None:
                kind = message[0]
                if kind == "add":
                    _, request_id, token_ids, params, block_hashes = message
                    if self._start(request_id, token_ids, params, block_hashes, sender)[1]:
                        started.add(request_id)
                elif kind == "abort":
                    started.discard(message[1])
                    self._abort(message[1])
                elif kind == "attach" and (pump is None or pump.done()):
                    pump = asyncio.get_running_loop().create_task(self._pump(sender, token, writer))
                    pump.add_done_callback(lambda task: _pump_ended(task, writer))
        except (ConnectionError, asyncio.IncompleteReadError, LaneError) as error:
            logger.warning("the lane of sender %s ended: %s: %s", sender, type(error).__name__, error)
        finally:
            if pump is not None:
                pump.cancel()
            writer.close()
            self._reader_gone(sender, token)
            # Its copies that no Serve call joined have nobody left to end them (a call queued in Serve's router,
            # or sent to another replica, never will): abort them.
            for request_id in started:
                if request_id in self._tasks and request_id not in self._joined:
                    self._abort(request_id)

    async def _pump(self, sender: str, token: object, writer: asyncio.StreamWriter) -> None:
        outbox = self._outbox(sender)
        outbox.attach(token)
        while (messages := await outbox.take(token, None)) is not None:
            load = self._load(sender)
            for blob in pack_messages(messages):
                writer.write(lane_pack((blob, load)))
            await writer.drain()

    def _failure(self, request_id: str, error: Exception) -> tuple:
        """The message that ends a failed request: its text and HTTP status."""
        if isinstance(error, EngineDeadError):
            return ("failed", request_id, f"the engine of replica {self._replica} died: {error}", 500)
        return ("failed", request_id, str(error), getattr(error, "status_code", 500))

    async def outputs(self, sender: str, replica: str = ""):
        """`sender`'s messages from this replica, as `(messages, load)` items (see the module docstring).

        `replica` is the replica the caller asked for (the request router pins the call to it);
        if this is another one, that replica is gone and the stream ends at once."""
        if replica and replica != self._replica:
            return
        outbox = self._outbox(sender)
        reader = object()
        outbox.attach(reader)
        try:
            while (messages := await outbox.take(reader, self.outputs_idle_s)) is not None:
                load = self._load(sender)
                for blob in pack_messages(messages):
                    yield blob, load
        finally:
            self._reader_gone(sender, reader)

    def _reader_gone(self, sender: str, reader: object) -> None:
        """`sender`'s reader `reader` went away: if it was still the outbox's, nobody can receive the requests'
        outputs any more, so they are cancelled (aborted, blocks freed)."""
        outbox = self._outboxes.get(sender)
        if outbox is not None and outbox.reader is reader:
            del self._outboxes[sender]
            for task in list(outbox.requests):
                task.cancel()

    def _outbox(self, sender: str) -> Outbox:
        outbox = self._outboxes.get(sender)
        if outbox is None:
            outbox = self._outboxes[sender] = Outbox()
        return outbox

    def _queues(self) -> tuple[int, int, int]:
        """(waiting, running, free blocks), read beside the engine thread."""
        if self._process is not None:  # the child process publishes them in shared memory
            view = self._process.view
            return view.num_waiting, view.num_running, view.num_free_blocks
        sched = self._engine.scheduler
        return len(sched.waiting), len(sched.running), sched.block_manager.num_free_blocks

    def _load(self, sender: str) -> Load:
        stats = block_hashes = None
        now = time.perf_counter()
        if now - self._hashes_sent_s.get(sender, 0.0) >= HASHES_PERIOD_S and self._published:
            self._hashes_sent_s[sender] = now
            block_hashes = self._published
        if now - self._last_stats_s >= STATS_PERIOD_S or not self._engine.has_unfinished_requests():
            self._last_stats_s = now
            if self._process is not None:
                stats = self._process.latest_stats  # what the child last pushed
            else:
                try:  # read beside the engine thread: a torn read is skipped, the next output carries fresh ones
                    stats = self._engine.latest_stats().as_dict()
                except Exception:  # noqa: BLE001 - see above
                    logger.debug("stats read raced the engine thread", exc_info=True)
        return Load(self._replica, self._node, *self._queues(), stats, self._num_started[sender], block_hashes)

    # ------------------------------------------------------------------ Ray Serve hooks
    async def record_routing_stats(self) -> dict:
        """The router's view of this replica, read where the engine's calls run (so it is consistent), and its engine's
        pid."""
        started = dict(self._num_started)

        def read(engine) -> dict:
            num_waiting, num_running, num_free_blocks = self._queues()
            return {"num_waiting": num_waiting, "num_running": num_running, "num_free_blocks": num_free_blocks,
                    "num_started": started, "block_hashes": _published_block_hashes(engine),
                    "engine_pid": self._process.process.pid if self._process is not None else os.getpid()}

        stats = await asyncio.wrap_future(self._front().call(read))
        self._published = stats["block_hashes"]
        return stats

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose health check raises: one whose engine loop (or process) has died."""
        front = self._async_engine  # None: an engine process whose loop front is not made yet (no call so far)
        if front is not None and not front.is_alive:
            raise EngineDeadError(f"the engine loop of replica {self._replica} has stopped: {front.error}")
        if self._process is not None and not self._process.process.is_alive():
            raise EngineDeadError(f"the engine process of replica {self._replica} has exited "
                                  f"(exit code {self._process.process.exitcode})")

    async def describe(self) -> dict:
        """What the ingress needs before serving: limits, block size, the scheduler config and stats."""

        def read(engine) -> dict:
            if self._process is not None:
                info = self._process.info
                facts = {key: info[key] for key in ("block_size", "vocab_size", "scheduler_config", "device")}
            else:
                facts = {"block_size": engine.scheduler.block_manager.block_size, "vocab_size": engine.vocab_size,
                         "scheduler_config": engine.scheduler.config, "device": str(engine.device)}
            return {**facts, "max_model_len": engine.max_model_len, "stats": _engine_stats(engine),
                    "replica": self._replica, "node": self._node}

        return await asyncio.wrap_future(self._front().call(read))

    async def check_integrity(self) -> int:
        """Assert the engine's block accounting holds; returns the KV blocks in use (tests call it)."""

        def check(engine) -> int:
            engine.check_integrity()
            return engine.stats().num_used_blocks

        return await asyncio.wrap_future(self._front().call(check))

    def __del__(self):
        lane_server = getattr(self, "_lane_server", None)
        if lane_server is not None:
            lane_server.close()
        async_engine = getattr(self, "_async_engine", None)
        if async_engine is not None:
            async_engine.stop()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            if isinstance(async_engine, LoopAsyncEngine):
                async_engine.engine.shutdown()  # its pipe off the loop first
            else:
                engine.shutdown()
