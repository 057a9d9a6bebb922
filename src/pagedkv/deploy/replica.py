"""One Ray Serve replica: one pagedkv engine (one GPU, or a tensor-parallel group) behind its engine thread.

The replica is `LLMEngine` driven by the server's own `AsyncEngine` (the thread that owns the
engine, contains failures to the requests they touch, and hands outputs to asyncio consumers),
so a request served through Ray runs exactly the code `pagedkv serve` runs. Ray Serve calls:

    generate(request_id, token_ids, params, block_hashes, sender)   an async generator of messages
    record_routing_stats()                                           the router's view of this replica
    check_health()                                                   raises once the engine loop died
    describe()                                                       what the ingress needs at startup

`generate` yields `("output", OutputDelta, load)` per output the engine thread delivers (a
request's new tokens and text only, `pagedkv.distributed.output_deltas`), and once the request
fails `("failed", message, status)`. `load` is `Load` below, so the ingress sees each replica's
queues and stats without asking. When the caller stops reading (its client went away, or it
cancelled the call), the generator is closed and the request is aborted, freeing its blocks at
once.

Routing stats (`record_routing_stats`, polled by the Serve controller and handed to every
router): the engine's waiting and running requests and free blocks, how many `generate` calls
each sender has started (so a router counts the requests it sent that this replica has not
taken yet), and the keys of the prefix-cache blocks most recently cached (capped), which tell a
router that did not send a prefix here (another ingress, or one that restarted) where it lives.

The constructor returns only once the engine is built: the model loaded, the KV pool sized and,
on CUDA, the decode graphs captured. Ray Serve sends no traffic to a replica before that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from pagedkv.distributed.output_deltas import DeltaEncoder
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import EngineDeadError
from pagedkv.server.async_engine import AsyncEngine, RequestFailedError, RequestStream

logger = logging.getLogger("pagedkv.deploy")

#: Prefix-cache keys a replica publishes to the routers (the most recently cached ones).
MAX_PUBLISHED_BLOCK_HASHES = 2048
#: A replica attaches its engine stats to an output at most this often.
STATS_PERIOD_S = 0.05


@dataclass(frozen=True)
class Load:
    """A replica's queues as of one output, with its engine stats when they are due (else None)."""

    replica: str
    node: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    stats: dict | None


def replica_identity() -> tuple[str, str]:
    """(replica id, node id) of the Ray Serve replica this code runs in ("local" outside one)."""
    try:
        import ray
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id, ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not inside a Serve replica (a unit test): any name will do
        return "local", "local"


class EngineReplica:
    """The body of the engine deployment (see the module docstring); `build_app` wraps it with `serve.deployment`."""

    def __init__(self, config: EngineConfig):
        from pagedkv.engine.engine import LLMEngine

        engine = LLMEngine(config)  # model, KV pool and (on CUDA) decode graphs: warm before any traffic
        engine.stream_outputs = True
        self._engine = engine
        self._async_engine = AsyncEngine(engine)
        self._async_engine.start()
        self._num_started: Counter[str] = Counter()  # sender -> generate calls started here
        self._replica, self._node = replica_identity()
        self._last_stats_s = 0.0

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       block_hashes: list[bytes] | None = None, sender: str = ""):
        """Serve one request: yield its outputs as deltas (see the module docstring); abort it if closed early."""
        self._num_started[sender] += 1
        stream = RequestStream(asyncio.get_running_loop())
        encoder = DeltaEncoder()
        finished = False
        try:
            self._async_engine.add_request(request_id, token_ids, params, stream, block_hashes=block_hashes)
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield ("output", encoder.encode(output), self._load())
        except RequestFailedError as error:
            finished = True  # the engine thread ended it and freed its blocks
            yield ("failed", str(error), error.status_code)
        except EngineDeadError as error:
            finished = True
            yield ("failed", f"the engine of replica {self._replica} died: {error}", 500)
        finally:
            if not finished:  # the caller went away (or cancelled): free the blocks now
                self._async_engine.abort(request_id)

    def _load(self) -> Load:
        engine = self._engine
        sched = engine.scheduler
        stats = None
        now = time.perf_counter()
        if now - self._last_stats_s >= STATS_PERIOD_S or not engine.has_unfinished_requests():
            self._last_stats_s = now
            try:  # read beside the engine thread: a torn read is skipped, the next output carries fresh ones
                stats = engine.latest_stats().as_dict()
            except Exception:  # noqa: BLE001 - see above
                logger.debug("stats read raced the engine thread", exc_info=True)
        return Load(self._replica, self._node, len(sched.waiting), len(sched.running),
                    sched.block_manager.num_free_blocks, stats)

    # ------------------------------------------------------------------ Ray Serve hooks
    async def record_routing_stats(self) -> dict:
        """The router's view of this replica, read on the engine thread (so it is consistent)."""
        started = dict(self._num_started)

        def read(engine) -> dict:
            sched = engine.scheduler
            bm = sched.block_manager
            cache = bm.prefix_cache
            keys = cache.recent_keys(MAX_PUBLISHED_BLOCK_HASHES) if cache is not None else []
            return {"num_waiting": len(sched.waiting), "num_running": len(sched.running),
                    "num_free_blocks": bm.num_free_blocks, "num_started": started, "block_hashes": keys}

        return await asyncio.wrap_future(self._async_engine.call(read))

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose health check raises: one whose engine loop has died."""
        if not self._async_engine.is_alive:
            raise EngineDeadError(f"the engine loop of replica {self._replica} has stopped: "
                                  f"{self._async_engine.error}")

    def describe(self) -> dict:
        """What the ingress needs before serving: limits, block size, the scheduler config and stats."""
        engine = self._engine
        bm = engine.scheduler.block_manager
        return {"max_model_len": engine.max_model_len, "block_size": bm.block_size, "vocab_size": engine.vocab_size,
                "scheduler_config": engine.scheduler.config, "stats": engine.latest_stats().as_dict(),
                "replica": self._replica, "node": self._node, "device": str(engine.device)}

    async def check_integrity(self) -> int:
        """Assert the engine's block accounting holds; returns the KV blocks in use (tests call it)."""

        def check(engine) -> int:
            engine.check_integrity()
            return engine.stats().num_used_blocks

        return await asyncio.wrap_future(self._async_engine.call(check))

    def __del__(self):
        async_engine = getattr(self, "_async_engine", None)
        if async_engine is not None:
            async_engine.stop()
            self._engine.shutdown()
