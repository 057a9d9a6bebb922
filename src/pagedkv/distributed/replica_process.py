"""A data-parallel replica's process, and the pipe and shared-memory protocol its parent reads.

`replica_main` runs in each replica process that `DataParallelEngine` spawns: it owns one
`LLMEngine`, takes commands from its pipe, steps the engine, and sends outputs back:

    parent -> replica   ("add", (request_id, prompt, params, priority, block_hashes)), ("abort", id),
                        ("stats", None), ("check", None), ("stream", bool), ("stop", None)
    replica -> parent   ("ready", info) or ("failed", why) once at startup; then ("outputs", deltas),
                        ("failed", (request_ids, why)), ("rejected", (id, why)), ("stats", dict),
                        ("checked", error or None), and unasked ("load", stats) and ("keys", prefix keys)

Its queues go into a shared array after every step and every command (`LOAD_FIELDS` per replica),
which `ProcessReplica` reads as the router's view of the replica; `ReplicaStatsSum` sums the stats
the replicas push. Messages are pickled by the sender's caller and written through a `PipeWriter`
on either side, so neither side ever blocks on a full pipe while the other is not reading.
"""

from __future__ import annotations

import gc
import signal
import time
from multiprocessing.reduction import ForkingPickler

from pagedkv.distributed.output_deltas import DeltaEncoder
from pagedkv.distributed.pipe_writer import PipeWriter
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import PagedKVError, StepFailedError

LOAD_FIELDS = 5  # waiting, running, free blocks, alive, add commands consumed (written in this order)
#: A busy replica pushes its stats at most this often (and once more when it goes idle).
STATS_PUSH_S = 0.05
#: How often a busy replica pushes its prefix-cache keys, when asked to publish them (and once on going idle).
KEYS_PUSH_S = 0.5


def replica_main(config: EngineConfig, index: int, conn, load, engine_factory=None,
                  num_published_block_hashes: int = 0, send_prompt_token_ids: bool = True) -> None:
    """A replica process: serve commands from `conn`, step the engine, send outputs back; exit when the parent goes.

    `send_prompt_token_ids=False` leaves the prompt's ids out of the outputs (the parent forwards them to
    whoever sent the prompt)."""
    from pagedkv.engine.engine import LLMEngine

    # Ctrl-C reaches the whole process group; the parent handles it and stops the replicas in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = (engine_factory or LLMEngine)(config)
        engine.stream_outputs = True
        bm = engine.scheduler.block_manager
        # The engine's startup objects live as long as the process: keep full collections off them. Done
        # before "ready", so a replica that the parent sees ready enters its loop (and pushes its stats) at once.
        gc.collect()
        gc.freeze()
        conn.send(("ready", {"max_model_len": engine.max_model_len, "num_blocks": bm.num_blocks,
                             "device": str(engine.device), "vocab_size": engine.vocab_size,
                             "block_size": bm.block_size, "scheduler_config": engine.scheduler.config}))
    except BaseException as error:  # report, so the parent can refuse to start with a clear message
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    consumed = 0
    # Streamed outputs cross the pipe as what each request gained since its last.
    encoder = DeltaEncoder(send_prompt_token_ids)
    # Replies never block this loop (`PipeWriter`): the parent may be busy sending this replica a
    # burst of requests while not reading, and a loop blocked on its own send (its outputs filling
    # the pipe) would then never read them - both sides stuck for good.
    writer = PipeWriter(conn, "pagedkv-replica-send")

    def send(message) -> None:
        writer.send(pickled(message))

    def publish() -> None:
        sched = engine.scheduler
        load[index * LOAD_FIELDS:(index + 1) * LOAD_FIELDS] = [len(sched.waiting), len(sched.running),
                                                                   sched.block_manager.num_free_blocks, 1, consumed]
        # Idle, with blocks freed since the last push (an abort between steps, or a free the last step's
        # push came too early for): push again, or the parent's metrics would keep the stale count.
        if pushed_free != sched.block_manager.num_free_blocks and not engine.has_unfinished_requests():
            push_stats()

    last_push = last_keys_push = 0.0
    pushed_free = -1  # the free block count the last pushed stats carried
    publishes = bool(num_published_block_hashes) and bm.prefix_cache is not None

    def push_stats() -> None:  # the parent's `latest_stats()`: metrics that never wait on this process
        nonlocal last_push, last_keys_push, pushed_free
        last_push = time.perf_counter()
        pushed_free = bm.num_free_blocks
        send(("load", engine.stats().as_dict()))
        if publishes and (last_push - last_keys_push >= KEYS_PUSH_S or not engine.has_unfinished_requests()):
            last_keys_push = last_push
            send(("keys", bm.recent_keys(num_published_block_hashes)))  # GPU cache and host tier

    push_stats()
    while True:
        busy = engine.has_unfinished_requests()
        try:
            command, payload = conn.recv() if conn.poll(0 if busy else 0.05) else (None, None)
        except (EOFError, OSError):  # the parent is gone (killed, or its actor was): stop, leave no orphan
            break
        if command is not None:
            if command == "stop":
                break
            if command == "add":
                consumed += 1
                request_id, prompt, params, priority, block_hashes = payload
                try:
                    engine.add_request(request_id, prompt, params, priority, block_hashes=block_hashes)
                except PagedKVError as error:
                    send(("rejected", (request_id, f"{type(error).__name__}: {error}")))
            elif command == "abort":
                engine.abort(payload)
                encoder.forget(payload)
            elif command == "stats":
                send(("stats", engine.stats().as_dict()))
            elif command == "check":
                send(("checked", integrity_error(engine)))
            elif command == "stream":
                engine.stream_outputs = payload
            publish()
            continue
        if busy:
            try:
                outputs = engine.step()
            except StepFailedError as error:  # the engine failed that step's requests; the replica goes on
                send(("failed", (error.request_ids, str(error))))
                for request_id in error.request_ids:
                    encoder.forget(request_id)
                outputs = []
            # NOTE: stats before the outputs. A parent whose last request just finished reads until it has
            # these outputs and then waits for commands, reading nothing more: the stats must already be
            # in the pipe ahead of them, or its metrics keep the busy step's figures while it idles.
            if time.perf_counter() - last_push >= STATS_PUSH_S or not engine.has_unfinished_requests():
                push_stats()
            if outputs:
                send(("outputs", [encoder.encode_wire(output) for output in outputs]))
        publish()
    writer.close()
    writer.join(timeout_s=10)
    engine.shutdown()


def integrity_error(engine) -> str | None:
    """None if the engine's block accounting holds, else what `check_integrity` said was wrong."""
    try:
        engine.check_integrity()
    except AssertionError as error:
        return f"AssertionError: {error}"
    except PagedKVError as error:
        return f"{type(error).__name__}: {error}"
    return None


def pickled(message) -> bytes:
    """`message` as `Connection.send` would write it, pickled in the caller's thread (so errors reach the caller)."""
    return bytes(ForkingPickler.dumps(message))


class ReplicaStatsSum:
    """Summed engine stats with `as_dict()` like `EngineStats`, plus each replica's own."""

    def __init__(self, per_replica: list[dict | None]):
        self.per_replica = per_replica
        self._total: dict | None = None  # summed once, on first use: a server reads a dozen fields per step

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not a stat (and unpickling looks these up before __init__'s fields exist)
            raise AttributeError(name)
        total = self._totals()
        if name in total:
            return total[name]
        raise AttributeError(name)

    def as_dict(self) -> dict:
        return dict(self._totals())

    def _totals(self) -> dict:
        if self._total is None:
            self._total = self._sum()
        return self._total

    def _sum(self) -> dict:
        live = [s for s in self.per_replica if s]
        total: dict = {}
        for stats in live:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and key not in ("block_size", "tokens_per_second"):
                    total[key] = total.get(key, 0) + value
        if live:
            total["block_size"] = live[0]["block_size"]
        total["tokens_per_second"] = sum(s["tokens_per_second"] for s in live)
        total["replicas"] = self.per_replica
        return total


class ProcessReplica:
    """The router's view of one replica process (its load, from shared memory)."""

    def __init__(self, index: int, block_size: int, load):
        self.index = index
        self._block_size = block_size
        self._load = load
        self.sent = 0  # `add` commands sent to this replica; the ones not yet consumed count as waiting

    @property
    def block_size(self) -> int:
        return self._block_size

    def _field(self, k: int) -> int:
        return int(self._load[self.index * LOAD_FIELDS + k])

    @property
    def num_waiting(self) -> int:
        consumed = self._field(4)  # read before `waiting`, which the replica writes first: never an undercount
        return self._field(0) + max(0, self.sent - consumed)

    @property
    def num_running(self) -> int:
        return self._field(1)

    @property
    def num_free_blocks(self) -> int:
        return self._field(2)

    def num_cached_blocks(self, block_hashes) -> int:
        return 0  # not queried across processes: the router's memory of where it sent each block stands in
