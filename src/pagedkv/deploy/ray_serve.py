"""The Ray Serve application: `pagedkv serve`'s HTTP app in front of engine replicas spread over a Ray cluster.

    client ─HTTP─► Serve proxy ─► Ingress replica: create_app(RayEngineClient)  (routes, validation, auth, metrics)
                                     │ handle.generate (streaming), routed by PagedKVRequestRouter
                                     ▼
                   EngineReplica × N (one engine each: one GPU, or a TP group packed on one node)

Two deployments. The ingress wraps, rather than copies, the FastAPI app `pagedkv serve` builds
(`serve.ingress` around `create_app`), so routes, validation, auth, 4xx bodies, streaming and
/metrics are the same code; its engine is a `RayEngineClient`. The engine deployment's replicas
each run one `LLMEngine` (`EngineReplica`); `PagedKVRequestRouter` picks one per request with
pagedkv's routing policy. Replica counts are fixed (`min_replicas == max_replicas`) or follow
Ray Serve's autoscaling on ongoing requests per replica.

A tensor-parallel replica's workers are its own child processes, so all its GPUs must be visible
to the replica's actor: the replica reserves one placement-group bundle of `tensor_parallel_size`
GPUs with the `STRICT_PACK` strategy, which keeps the group on one node (NVLink) and lets
replicas land on any node with that many free GPUs.

    from pagedkv.deploy.ray_serve import build_app
    serve.run(build_app(EngineConfig(model="Qwen/Qwen3-0.6B"), RayServeConfig(max_replicas=4)))

or `serve run pagedkv.deploy.ray_serve:app` (the embedded model with the defaults), or
`serve run pagedkv.deploy.cli:build model=M max-replicas=4` (any `pagedkv serve` flags; a
KubeRay RayService passes them the same way), or `pagedkv serve --ray` (`pagedkv.deploy.cli`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.distributed.router import DEFAULT_BALANCE_THRESHOLD, RoutingPolicy
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError, require_positive_int
from pagedkv.server.config import ServerConfig

ENGINE_DEPLOYMENT = "PagedKVEngine"
INGRESS_DEPLOYMENT = "PagedKVIngress"
DEFAULT_APP_NAME = "pagedkv"
HANDLE_TRANSPORTS = ("grpc", "ray")
#: Ray Serve's settings for a replica whose user code and handle routers run on the replica's own event loop
#: (`RayServeConfig.shared_loop`): read by Serve in each replica's process, so they travel in its runtime_env.
SHARED_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


@dataclass(frozen=True)
class RayServeConfig:
    """How the engine deployment is laid out on the cluster, routed and scaled.

    `min_replicas == max_replicas` fixes the count; otherwise Ray Serve autoscales between them,
    aiming at `target_ongoing_requests` per replica (requests in flight, waiting or running),
    after the load has held for `upscale_delay_s` (up) or `downscale_delay_s` (down).
    `max_ongoing_requests` caps what one replica is sent at once; an engine batches hundreds,
    so it is high. `routing_stats_period_s` is how often each replica's queues reach the routers.
    `cpus_per_replica` is the CPU share Ray reserves per engine replica (GPUs follow the engine
    config: one, or `tensor_parallel_size`, on CUDA; none on CPU). `engine_process` is where each
    replica runs its engine, as `pagedkv serve --engine-process/--in-process` (None: a process of
    its own on CUDA, the replica's own process on CPU). `handle_transport` is how the ingress's
    calls on the engine deployment travel: "grpc", Serve's gRPC channel to each replica (every
    replica serves it), or "ray", Ray's own actor calls and streaming generators (Serve's default
    for handles). On a CPU, gRPC halved an output's trip on an open stream, 1.3 to 0.6 ms
    (`benchmarks/tools/ray_hops.py`). `shared_loop` runs each replica's code (the app, the engine
    replica's calls) and its handle's router on the replica's own event loop instead of a thread and a
    loop of their own (`SHARED_LOOP_ENV` in both deployments' runtime_env): on an H200, with Serve's
    direct ingress, 1.10x direct serve's saturated throughput against 0.49x with separate loops.
    `ingress_engine_thread` False (with `shared_loop`) drives the ingress's engine client directly on
    the replica's loop, without the app's engine thread (`LoopAsyncEngine`): on a 2-core CPU it took
    1.5 ms of thread hops off a request's first token, but on an H200 host the added TTFT P50 stayed
    at +3.5 ms and the one run's saturated throughput was 0.82x direct serve's (against 0.96x and
    1.10x with the thread), so the thread stays the default. `replica_engine_thread` False drives
    each engine replica's engine process from the replica's loop, without its engine thread
    (`LoopProcessEngine`: requests written to the pipe at once, outputs read when it turns
    readable); it has no effect on an engine that runs in the replica's process. On one H200 the
    process boundary itself costs 0.3 ms of a first token (`benchmarks/tools/engine_process_hops.py`);
    the thread's hops are what this removes. Opt-in until measured on a GPU. `lanes` sends each
    request in by a TCP connection from the ingress to its replica (`pagedkv.deploy.lane`), routed by
    the ingress with the same policy once it has a lane to every running replica, and brings outputs
    back on it; the Serve call still goes out, pinned to that replica, for Serve's accounting.
    """

    routing: RoutingPolicy | str = RoutingPolicy.PREFIX
    balance_threshold: int | None = DEFAULT_BALANCE_THRESHOLD
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 64.0
    max_ongoing_requests: int = 1024
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    routing_stats_period_s: float = 0.5
    cpus_per_replica: float = 1.0
    ingress_cpus: float = 1.0
    max_attempts: int = 3  # calls per request when its replica fails before the first output
    health_check_period_s: float = 2.0
    engine_process: bool | None = None
    handle_transport: str = "grpc"
    shared_loop: bool = True
    ingress_engine_thread: bool = True
    replica_engine_thread: bool = True
    lanes: bool = True

    def __post_init__(self):
        try:
            object.__setattr__(self, "routing", RoutingPolicy(self.routing))
        except ValueError:
            raise ConfigError(f"routing must be one of {', '.join(p.value for p in RoutingPolicy)}; "
                              f"got {self.routing!r}") from None
        require_positive_int("min_replicas", self.min_replicas, allow_zero=True)
        require_positive_int("max_replicas", self.max_replicas)
        if self.handle_transport not in HANDLE_TRANSPORTS:
            raise ConfigError(f"handle_transport must be one of {', '.join(HANDLE_TRANSPORTS)}; "
                              f"got {self.handle_transport!r}")
        for name in ("shared_loop", "ingress_engine_thread", "replica_engine_thread", "lanes"):
            if getattr(self, name) not in (True, False):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.ingress_engine_thread and not self.shared_loop:
            raise ConfigError("ingress_engine_thread=False drives the ingress's engine client on the replica's own "
                              "loop, which needs shared_loop=True")
        if self.engine_process not in (None, True, False):
            raise ConfigError(f"engine_process must be True, False or None, got {self.engine_process!r}")
        if self.min_replicas > self.max_replicas:
            raise ConfigError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        require_positive_int("max_ongoing_requests", self.max_ongoing_requests)
        require_positive_int("max_attempts", self.max_attempts)
        for name in ("target_ongoing_requests", "routing_stats_period_s", "health_check_period_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        for name in ("upscale_delay_s", "downscale_delay_s", "cpus_per_replica", "ingress_cpus"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")

    @property
    def autoscales(self) -> bool:
        return self.min_replicas != self.max_replicas


def replica_resources(engine: EngineConfig, ray_config: RayServeConfig) -> dict:
    """The engine deployment's Ray resource options: actor CPUs and GPUs, and the STRICT_PACK bundle for TP."""
    on_gpu = engine.device != "cpu" and (engine.device is not None or _cuda_available())
    num_gpus = engine.tensor_parallel_size if on_gpu else 0
    options: dict = {"ray_actor_options": actor_options(ray_config, num_cpus=ray_config.cpus_per_replica,
                                                       num_gpus=num_gpus)}
    if num_gpus > 1:
        # NOTE: one bundle holding every GPU of the group: the TP workers are the replica's child
        # processes and must see all of them; STRICT_PACK keeps the group on one node.
        options["placement_group_bundles"] = [{"CPU": ray_config.cpus_per_replica, "GPU": num_gpus}]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def actor_options(ray_config: RayServeConfig, **resources) -> dict:
    """A deployment's `ray_actor_options`: its resources, and `SHARED_LOOP_ENV` when `shared_loop`.

    NOTE: Ray merges an actor's runtime_env env_vars into the job's, so the job's own variables
    (PYTHONPATH, OMP_NUM_THREADS) still reach the replica.
    """
    options = dict(resources)
    if ray_config.shared_loop:
        options["runtime_env"] = {"env_vars": dict(SHARED_LOOP_ENV)}
    return options


def _cuda_available() -> bool:
    # Decided where the app is built. A CPU-only head driving GPU workers passes --device cuda.
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def engine_deployment(engine: EngineConfig, ray_config: RayServeConfig):
    """The engine deployment (`EngineReplica` per replica, routed by `PagedKVRequestRouter`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedkv.deploy.replica import EngineReplica

    router = RequestRouterConfig(
        request_router_class="pagedkv.deploy.request_router.PagedKVRequestRouter",
        request_router_kwargs={"policy": ray_config.routing.value, "block_size": engine.block_size,
                               "balance_threshold": ray_config.balance_threshold},
        request_routing_stats_period_s=ray_config.routing_stats_period_s)
    # No access-log line per call: the ingress logs each HTTP request; the engine's calls are internal ones.
    options = dict(name=ENGINE_DEPLOYMENT, max_ongoing_requests=ray_config.max_ongoing_requests,
                   request_router_config=router, health_check_period_s=ray_config.health_check_period_s,
                   logging_config={"enable_access_log": False},
                   **replica_resources(engine, ray_config))
    if ray_config.autoscales:
        options["autoscaling_config"] = {
            "min_replicas": ray_config.min_replicas, "max_replicas": ray_config.max_replicas,
            "initial_replicas": max(1, ray_config.min_replicas),
            "target_ongoing_requests": ray_config.target_ongoing_requests,
            "upscale_delay_s": ray_config.upscale_delay_s, "downscale_delay_s": ray_config.downscale_delay_s,
            "metrics_interval_s": min(1.0, ray_config.upscale_delay_s or 1.0),
            "look_back_period_s": max(1.0, min(10.0, ray_config.upscale_delay_s or 1.0))}
    else:
        options["num_replicas"] = ray_config.max_replicas
    return serve.deployment(EngineReplica).options(**options)


class Ingress:
    """The ingress replica: `create_app` over a `RayEngineClient` (`serve.ingress` wraps it in `build_app`)."""

    async def __init__(self, engine_handle, model: str | None, served_model_name: str, server_config: ServerConfig,
                   routing: str, max_attempts: int, handle_transport: str = "grpc", engine_thread: bool = True,
                   lanes: bool = False, balance_threshold: int | None = None, max_ongoing_requests: int = 1 << 30):
        import asyncio

        from pagedkv.deploy.ray_client import RayEngineClient
        from pagedkv.models.loader import load_tokenizer
        from pagedkv.server.app import create_app
        from pagedkv.server.cli import freeze_heap
        from pagedkv.server.loop_engine import LoopAsyncEngine

        info = await engine_handle.describe.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, model)
        # The client's loop: the replica's own when Serve's router shares it (`RayServeConfig.shared_loop`, the
        # default), since a handle's calls are bound to that loop then; else a thread of its own. (With Serve's
        # separate loops, an H200 made 15.5k output tok/s with the client on a thread of its own, 10.4k with
        # it on the replica's loop.)
        loop = None if _router_in_separate_loop() else asyncio.get_running_loop()
        self._client = RayEngineClient(engine_handle, info, tokenizer, routing, max_attempts, loop=loop,
                                       grpc=handle_transport == "grpc", drive_on_loop=not engine_thread,
                                       lanes=lanes, balance_threshold=balance_threshold,
                                       max_ongoing_requests=max_ongoing_requests)
        self._app = create_app(self._client, served_model_name, config=server_config)
        if isinstance(self._app.state.async_engine, LoopAsyncEngine) == engine_thread:  # never a silent fallback
            raise ConfigError(f"the ingress asked for {'an engine thread' if engine_thread else 'no engine thread'} "
                              f"but its app built {type(self._app.state.async_engine).__name__} (is Serve's router "
                              f"on a loop of its own?)")
        freeze_heap()  # as `pagedkv serve` does once its app is built

    def __serve_build_asgi_app__(self):
        return self._app

    def __del__(self):
        client = getattr(self, "_client", None)
        if client is not None:
            client.shutdown()


def _router_in_separate_loop() -> bool:
    """Whether Ray Serve routes handle calls on a loop of its own (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP)."""
    try:
        from ray.serve._private import constants
    except ImportError:  # a Serve without the setting routes on the caller's loop
        return False
    return bool(getattr(constants, "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", False))


def build_app(engine: EngineConfig = EngineConfig(), ray_config: RayServeConfig = RayServeConfig(),
              server_config: ServerConfig = ServerConfig(), served_model_name: str | None = None):
    """The Serve application (pass it to `serve.run`): the ingress bound to the engine deployment."""
    from ray import serve

    from pagedkv.server.app import DEFAULT_SERVED_MODEL_NAME

    name = served_model_name or engine.model or DEFAULT_SERVED_MODEL_NAME
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name=INGRESS_DEPLOYMENT, ray_actor_options=actor_options(ray_config, num_cpus=ray_config.ingress_cpus),
        max_ongoing_requests=ray_config.max_ongoing_requests)
    engines = engine_deployment(engine, ray_config).bind(engine, ray_config.engine_process, freeze_heap=True,
                                                         engine_thread=ray_config.replica_engine_thread)
    return ingress.bind(engines, engine.model, name, server_config, ray_config.routing.value,
                        ray_config.max_attempts, ray_config.handle_transport, ray_config.ingress_engine_thread,
                        lanes=ray_config.lanes, balance_threshold=ray_config.balance_threshold,
                        max_ongoing_requests=ray_config.max_ongoing_requests)


def __getattr__(name: str):
    # `serve run pagedkv.deploy.ray_serve:app`: the embedded model with the defaults, built on first use
    # (not at import, so importing this module starts nothing).
    if name == "app":
        return build_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
