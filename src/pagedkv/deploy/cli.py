"""`pagedkv serve --ray`: the same server, with its engine replicas spread over a Ray cluster.

    pagedkv serve Qwen/Qwen3-0.6B --ray --address auto --min-replicas 2 --max-replicas 8 --host 0.0.0.0
    serve run pagedkv.deploy.cli:build model=Qwen/Qwen3-0.6B max-replicas=8    # the same, with Ray's CLI

Joins the cluster at `--address` (or starts Ray on this machine), starts Ray Serve's HTTP proxy
on `--host:--port`, deploys `pagedkv.deploy.ray_serve.build_app` with the engine and server
flags `pagedkv serve` takes, and waits. On SIGTERM or Ctrl-C it deletes the application (its
replicas stop) and leaves the cluster running. Exit status: 0 after a clean shutdown, 2 for
flags that do not fit Ray, 1 if the application failed to deploy.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from pagedkv.deploy.ray_serve import DEFAULT_APP_NAME, RayServeConfig, build_app
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError
from pagedkv.server.cli import build_parser, engine_config, server_config
from pagedkv.server.config import ServerConfig

logger = logging.getLogger("pagedkv.deploy")


def ray_config(args: argparse.Namespace) -> RayServeConfig:
    """The `RayServeConfig` the parsed `pagedkv serve` flags describe; `ConfigError` for flags Ray does not take."""
    if args.data_parallel_size > 1:
        raise ConfigError("--data-parallel-size is the in-process replica count; with --ray use --min-replicas "
                          "and --max-replicas")
    if args.direct_ingress and (args.address is not None or os.environ.get("RAY_ADDRESS")):
        address = args.address if args.address is not None else os.environ.get("RAY_ADDRESS")
        raise ConfigError(f"--direct-ingress applies when `pagedkv serve --ray` starts Ray itself; on a running "
                          f"cluster (--address or RAY_ADDRESS {address}) set RAY_SERVE_ENABLE_DIRECT_INGRESS=1 "
                          f"in every node's environment before `ray start` (docs/multi-node.md)")
    max_replicas = args.max_replicas if args.max_replicas is not None else max(1, args.min_replicas)
    return RayServeConfig(routing=args.routing, min_replicas=args.min_replicas, max_replicas=max_replicas,
                          target_ongoing_requests=args.target_ongoing_requests, engine_process=args.engine_process,
                          shared_loop=not args.ray_separate_loops,
                          replica_engine_thread=not args.ray_replica_on_loop, lanes=not args.ray_no_lanes)


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment that turns on Ray Serve's direct ingress with the ingress replica on `port + 1`."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port + 1)}


def flags_to_argv(args: dict) -> list[str]:
    """`{"model": M, "max-replicas": 4, "protect-metrics": True}` as `pagedkv serve` arguments.

    The model is the positional argument; True is a bare switch, False and None leave a flag out.
    """
    argv = [str(args["model"])] if args.get("model") is not None else []
    for name, value in args.items():
        if name == "model" or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def build(args: dict):
    """`serve run pagedkv.deploy.cli:build model=M max-replicas=4 ...`, and a RayService's `args`.

    The keys are `pagedkv serve` flags without their dashes, parsed by `pagedkv serve`'s own
    parser, so a deployment file and the command line take the same flags, checked the same way.
    """
    parsed = build_parser().parse_args(flags_to_argv(dict(args)))
    return build_app(engine_config(parsed), ray_config(parsed), server_config(parsed), parsed.served_model_name)


def main(argv: list[str] | None = None, prog: str = "pagedkv serve") -> int:
    """`pagedkv serve ... --ray`: parse `pagedkv serve`'s flags, then deploy and serve on Ray."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return serve_on_ray(args, engine_config(args), server_config(args))


def serve_on_ray(args: argparse.Namespace, engine: EngineConfig, server: ServerConfig) -> int:
    """Deploy the app on the cluster and serve until a signal (see the module docstring)."""
    layout = ray_config(args)  # checked before Ray starts
    if args.direct_ingress:  # read by the Ray processes this starts (its controller, the ingress replica)
        os.environ.update(direct_ingress_env(args.port))
    import ray
    from ray import serve

    # With --direct-ingress a Ray of its own ("local"): one already running here would not see the variables above.
    ray.init(address="local" if args.direct_ingress else args.address, logging_level=args.log_level.upper())
    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        serve.run(build_app(engine, layout, server, args.served_model_name), name=DEFAULT_APP_NAME,
                  route_prefix="/", blocking=False)
    except Exception as error:  # noqa: BLE001 - Ray's deploy failure says why; exit 1 so a supervisor sees it
        logger.critical("the application failed to deploy: %s: %s", type(error).__name__, error)
        return 1
    if args.direct_ingress:
        logger.info("direct ingress: http://%s:%d/v1 (the ingress replica; Serve's proxy below)", args.host,
                    args.port + 1)
    logger.info("serving on http://%s:%d/v1 through Ray Serve (%s replicas, routing %s)", args.host, args.port,
                layout.min_replicas if not layout.autoscales else f"{layout.min_replicas}..{layout.max_replicas}",
                layout.routing.value)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    logger.info("deleting the application")
    serve.delete(DEFAULT_APP_NAME)
    return 0
