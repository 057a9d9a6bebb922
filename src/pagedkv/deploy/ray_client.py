"""`RayEngineClient`: the `EngineClient` the ingress's FastAPI app drives, backed by the Ray Serve engine deployment.

The ingress runs the very app `pagedkv serve` runs (`pagedkv.server.app.create_app`), whose
engine thread calls `add_request`, `abort` and `step` as it would on one `LLMEngine`. Here
those become streaming calls on the engine deployment's handle:

    engine thread                        client loop (a thread of its own)           engine replica
    add_request: tokens, block hashes ─► handle.generate.remote(...) ── router ───► generate(): deltas
    step(): outputs from the queue   ◄── decode deltas, note each replica's load ◄─┘
    abort: cancel the call          ───► gen.cancel() ─────────────────────────────► closes: abort, blocks freed

The prompt is hashed here, once (when routing by prefix): the request router matches on
those keys and the replica's engine reuses them.

Faults: a replica that fails (its actor killed, its node gone) before a request's first
output is retried on another replica, up to `max_attempts` calls in all: its client has seen
nothing, so nothing is lost. A request that had already streamed output ends with an error
output, which the app turns into an error event and `[DONE]` (or a 500). Ray Serve restarts
the replica; the router takes it back once the controller reports it running.

`health()` lists the engine deployment's replicas as the Serve controller reports them
(refreshed every `REPLICA_POLL_S` in the background, so a /health request never waits on Ray),
with each one's queues as its latest output reported them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading

from pagedkv.deploy.replica import Load
from pagedkv.distributed.data_parallel import ReplicaStatsSum
from pagedkv.distributed.output_deltas import DeltaDecoder
from pagedkv.distributed.router import RoutingPolicy, prompt_block_hashes
from pagedkv.engine.client import QueueSizes
from pagedkv.engine.output_processor import chat_token_ids, tokenize_prompt
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import InvalidArgumentError

logger = logging.getLogger("pagedkv.deploy")

REPLICA_POLL_S = 1.0
DEFAULT_MAX_ATTEMPTS = 3
_RETRY_BACKOFF_S = 0.2
_WAKE = None  # put in the output queue to end a waiting step() early (a new command arrived)


def failed_output(request_id: str, message: str, reason: str = "error") -> RequestOutput:
    """The final output of a request that ended without an answer ("rejected" makes it a 400)."""
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], reason)], True, error=message)


class RayEngineClient:
    """The engine deployment behind one handle, as an `EngineClient` (see the module docstring)."""

    def __init__(self, handle, info: dict, tokenizer, policy: RoutingPolicy | str = RoutingPolicy.PREFIX,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS):
        from pagedkv.engine.scheduler import Scheduler

        self.tokenizer = tokenizer
        self.max_model_len = info["max_model_len"]
        self.stream_outputs = True
        self._vocab_size = info["vocab_size"]
        self._block_size = info["block_size"]
        self._hashes_prompts = RoutingPolicy(policy) is RoutingPolicy.PREFIX
        self._fits = Scheduler(info["scheduler_config"])  # bookkeeping only: admission checks
        self._handle = handle.options(stream=True)
        self._app_name, self._deployment_name = handle.app_name, handle.deployment_name
        self._max_attempts = max_attempts
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, concurrent.futures.Future] = {}  # engine thread only
        self._decoder = DeltaDecoder()  # client loop only
        self._loads: dict[str, Load] = {}
        self._stats: dict[str, dict] = {info["replica"]: info["stats"]}
        self._replicas: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedkv-ray-client", daemon=True)
        self._thread.start()
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
        self._requests[request_id] = asyncio.run_coroutine_threadsafe(
            self._serve(request_id, token_ids, params, block_hashes), self._loop)

    def abort(self, request_id: str) -> bool:
        future = self._requests.pop(request_id, None)
        if future is None:
            return False
        self._loop.call_soon_threadsafe(future.cancel)  # the call's cancellation reaches the replica
        return True

    def wake(self) -> None:
        """End a `step()` that is waiting for outputs (called by the engine thread's owner on a new command)."""
        self._outputs.put(_WAKE)

    def step(self, timeout_s: float = 0.05) -> list[RequestOutput]:
        """Outputs that arrived since the last call; waits up to `timeout_s` (or a `wake()`) for the first."""
        items = []
        try:
            items.append(self._outputs.get(timeout=timeout_s))
            while True:
                items.append(self._outputs.get_nowait())
        except queue.Empty:
            pass
        outputs = []
        for output in items:
            if output is _WAKE or output.request_id not in self._requests:
                continue  # a wake-up, or the output of a request aborted since
            if output.finished:
                del self._requests[output.request_id]
            outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ client loop
    async def _serve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     block_hashes: list[bytes] | None) -> None:
        from ray.exceptions import RayActorError

        for attempt in range(1, self._max_attempts + 1):
            call = self._handle.generate.remote(request_id, token_ids, params, block_hashes=block_hashes)
            started = False
            try:
                async for message in call:
                    started = True
                    self._take(request_id, message)
                return
            except asyncio.CancelledError:
                call.cancel()
                self._decoder.forget(request_id)
                raise
            except Exception as error:  # noqa: BLE001 - whatever ended the call ends (or retries) this request
                self._decoder.forget(request_id)
                if started or attempt == self._max_attempts or not isinstance(error, RayActorError):
                    logger.warning("request %s failed on its replica: %s: %s", request_id, type(error).__name__,
                                   error)
                    self._outputs.put(failed_output(request_id, f"the replica serving this request failed: "
                                                                f"{type(error).__name__}: {error}"))
                    return
                logger.warning("request %s: its replica failed before the first output (%s); retrying on another",
                               request_id, type(error).__name__)
                await asyncio.sleep(_RETRY_BACKOFF_S)

    def _take(self, request_id: str, message: tuple) -> None:
        if message[0] == "output":
            _, delta, load = message
            self._loads[load.replica] = load
            if load.stats is not None:
                self._stats[load.replica] = load.stats
            self._outputs.put(self._decoder.decode(delta))
        else:
            _, text, status = message
            self._decoder.forget(request_id)
            self._outputs.put(failed_output(request_id, text, "rejected" if status < 500 else "error"))

    async def _watch_replicas(self) -> None:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = None
        while ray.is_initialized():  # in an ingress replica; a client outside Ray (a unit test) has no controller
            try:
                if controller is None:
                    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
                details = await controller.get_serve_instance_details.remote()
                app = details["applications"][self._app_name]
                self._replicas = app["deployments"][self._deployment_name]["replicas"]
            except Exception as error:  # noqa: BLE001 - /health shows the last snapshot; try again later
                logger.debug("reading the replica list failed: %s", error)
                controller = None
            await asyncio.sleep(REPLICA_POLL_S)

    # ------------------------------------------------------------------ reporting
    def health(self) -> list[dict]:
        """Per replica (as the Serve controller last reported them): id, node, state, alive, queues."""
        report = []
        for replica in list(self._replicas):
            key = replica["replica_id"]
            load = self._loads.get(key)
            state = getattr(replica.get("state"), "value", replica.get("state"))
            report.append({"replica": key, "node": replica.get("node_id"), "state": state, "alive": state == "RUNNING",
                           "waiting": load.num_waiting if load else 0, "running": load.num_running if load else 0,
                           "free_blocks": load.num_free_blocks if load else 0})
        return report

    def _live_keys(self) -> set[str]:
        return {r["replica_id"] for r in self._replicas} or set(self._stats) | set(self._loads)

    def queue_sizes(self) -> QueueSizes:
        """Requests waiting and running, summed over live replicas as their latest outputs reported them."""
        live = self._live_keys()
        loads = [load for key, load in list(self._loads.items()) if key in live]
        return QueueSizes(sum(x.num_waiting for x in loads), sum(x.num_running for x in loads), 0)

    def latest_stats(self):
        """The live replicas' stats as their outputs last carried them, summed (`ReplicaStatsSum`)."""
        live = self._live_keys()
        per_replica = [stats for key, stats in list(self._stats.items()) if key in live]
        return ReplicaStatsSum(per_replica or list(self._stats.values())[-1:])

    def check_integrity(self) -> None:
        """Each replica's engine checks its own blocks; nothing is shared to check here."""

    def shutdown(self) -> None:
        """Cancel what is in flight and stop the client loop (idempotent)."""
        for request_id in list(self._requests):
            self.abort(request_id)
        self._watcher.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
