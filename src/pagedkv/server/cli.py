"""`pagedkv serve [MODEL]`: build an engine from the command line and serve it with uvicorn.

    pagedkv serve                                  # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    pagedkv serve HuggingFaceTB/SmolLM2-360M-Instruct --port 8080 --api-key sk-local --max-queue 64

Every flag is checked, and the port bound, before the model loads, so a typo or a busy port
costs one line on stderr (exit 2), not a model load and a traceback.

Exit status: 0 after a clean shutdown, 2 for bad arguments, 1 if the engine loop died, so
that a supervisor restarts the process instead of keeping a server that can only say 503.
On SIGTERM or Ctrl-C the server stops taking requests and gives open ones
`--shutdown-timeout` seconds; streams still open then get an error event and `[DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import socket

from pagedkv.cli import ArgumentParser, add_engine_arguments, offload_options, parse_memory, parse_size
from pagedkv.distributed.router import RouterConfig, RoutingPolicy
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError
from pagedkv.server.config import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerConfig

DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
logger = logging.getLogger("pagedkv.server")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in 0..65535, got {text!r}")
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return seconds


def build_parser(prog: str = "pagedkv serve") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description="OpenAI-compatible server: /v1/completions, "
                            "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /health, /metrics.")
    parser.add_argument("model", nargs="?", default=None,
                        help="HF id, local path, .gguf file or random:NAME (default: embedded SmolLM2-135M-Instruct)")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s: this machine only)")
    http.add_argument("--port", type=_port, default=8000, help="port (default %(default)s)")
    http.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
                           "(default: $PAGEDKV_API_KEY, else none; an empty key is an error)")
    http.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    http.add_argument("--served-model-name", default=None,
                      help="the model name clients send (default: MODEL, or SmolLM2-135M-Instruct)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                      help="log level of pagedkv and uvicorn (default %(default)s)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-request-body", type=parse_size, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="largest request body; larger ones get 413 before parsing (default 8MiB)")
    limits.add_argument("--max-prompt-chars", type=int, default=None,
                        help="longest text prompt in characters, refused before tokenizing (default: what "
                             "max_model_len tokens can hold, from the tokenizer's longest token)")
    limits.add_argument("--max-queue", type=int, default=None,
                        help="requests waiting for the engine beyond which new ones get 429 with Retry-After "
                             "(default: no limit)")
    limits.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="abort a request unfinished this long after it arrived: 504, or an error event "
                             "when streaming (default: no limit)")
    limits.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGTERM/Ctrl-C, how long open requests may finish before they get an error "
                             "event (default %(default)s)")
    limits.add_argument("--ignore-unknown-fields", action="store_true",
                        help="ignore request fields this API does not know (default: 400 naming the field)")
    engine = parser.add_argument_group("engine")
    add_engine_arguments(engine)
    engine.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step (default %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens per step (default %(default)s)")
    engine.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="what a preempted sequence does (default %(default)s)")
    engine.add_argument("--swap-space", type=parse_memory, default=256 * 2**20,
                        help="host memory for swapped blocks, swap mode (default 256MiB)")
    engine.add_argument("--watermark", type=float, default=0.01,
                        help="fraction of blocks kept free at admission (default %(default)s)")
    where = engine.add_mutually_exclusive_group()
    where.add_argument("--engine-process", dest="engine_process", action="store_true", default=None,
                       help="run the engine in a process of its own, so the HTTP event loop and the engine's "
                            "step loop do not share one interpreter lock (the default on CUDA; implied by "
                            "--data-parallel-size > 1)")
    where.add_argument("--in-process", dest="engine_process", action="store_false",
                       help="run the engine on a thread of the server's process (the default on CPU)")
    engine.add_argument("--routing", default="prefix", choices=[p.value for p in RoutingPolicy],
                        help="how a request picks its replica, with --data-parallel-size or --ray "
                             "(default %(default)s: the replica holding the longest cached prefix)")
    ray = parser.add_argument_group("Ray (replicas over a cluster: docs/multi-node.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: one engine replica per GPU (or TP group) anywhere in the cluster")
    ray.add_argument("--address", default=None,
                     help="Ray cluster to join: auto (the one this machine belongs to) or HOST:PORT "
                          "(default: start a Ray instance on this machine)")
    ray.add_argument("--min-replicas", type=int, default=1, help="fewest engine replicas (default %(default)s)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="most engine replicas; above --min-replicas, Ray Serve autoscales on requests in flight "
                          "(default: --min-replicas)")
    ray.add_argument("--target-ongoing-requests", type=float, default=64.0,
                     help="requests in flight per replica that autoscaling aims at (default %(default)s)")
    ray.add_argument("--ray-separate-loops", action="store_true",
                     help="run each replica's code and handle routers on Ray Serve's own thread and loop rather "
                          "than the replica's event loop (slower: docs/multi-node.md)")
    ray.add_argument("--ray-replica-on-loop", action="store_true",
                     help="drive each engine replica's engine process from the replica's event loop, without its "
                          "engine thread (docs/multi-node.md; not yet measured on a GPU)")
    ray.add_argument("--ray-no-lanes", action="store_true",
                     help="send requests to engine replicas only by Ray Serve calls, not also by a direct "
                          "connection from the ingress (slower first tokens: docs/multi-node.md)")
    ray.add_argument("--direct-ingress", action="store_true",
                     help="when this command starts Ray: serve HTTP from the ingress replica itself on --port + 1 "
                          "(Ray Serve's direct ingress), without the proxy's hop; the proxy stays on --port")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` that the parsed arguments describe."""
    if isinstance(args.swap_space, float):
        raise ConfigError(f"--swap-space must be a size such as 256MiB, got the fraction {args.swap_space}")
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        preemption_mode=args.preemption_mode, swap_space=args.swap_space, watermark=args.watermark,
                        tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
                        enforce_eager=args.enforce_eager, mixed_step_graphs=args.mixed_step_graphs,
                        **offload_options(args))


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` that the parsed arguments describe."""
    return ServerConfig(api_key=args.api_key, protect_metrics=args.protect_metrics,
                        max_request_body_bytes=args.max_request_body, max_prompt_chars=args.max_prompt_chars,
                        max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                        ignore_unknown_fields=args.ignore_unknown_fields)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening); `ConfigError` naming the address if that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            raise
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def freeze_heap() -> None:
    """Move everything allocated so far (torch, the model, the app) out of the garbage collector's reach.

    A full collection walks every tracked object; with torch and a model loaded that is millions,
    and the pass stops this process for hundreds of milliseconds to seconds: every stream stalls.
    Startup objects live as long as the process, so `gc.freeze` (after one collection) leaves the
    collector only what serving allocates.
    """
    gc.collect()
    gc.freeze()


def serve(app, sock: socket.socket, *, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
          log_level: str = "info", http: str = "auto", loop: str = "auto") -> int:
    """Serve `app` (from `create_app`) on `sock` until a signal or the engine loop's death.

    `http` and `loop` are uvicorn's: "auto" takes httptools and uvloop where they are installed,
    else h11 and asyncio. Returns 0 after a clean shutdown, 1 if the engine loop died (it has
    logged why).
    """
    import uvicorn

    from pagedkv.server.request_stream import ShuttingDownError

    async_engine = app.state.async_engine

    class Server(uvicorn.Server):
        """uvicorn that exits when the engine loop dies, and drains open requests on shutdown."""

        async def on_tick(self, counter: int) -> bool:
            if async_engine.error is not None and not isinstance(async_engine.error, ShuttingDownError):
                return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:
            # NOTE: uvicorn waits for open connections while the drain gives them shutdown_timeout_s;
            # then the engine ends what is left with an error event, and the connections close.
            drain = asyncio.ensure_future(asyncio.to_thread(async_engine.drain, shutdown_timeout_s))
            try:
                await super().shutdown(sockets)
            finally:
                await drain

    # uvicorn's own deadline is a backstop only: the drain ends every stream before it.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s + 5, http=http,
                            loop=loop)
    Server(config).run(sockets=[sock])
    error = async_engine.error
    if error is not None and not isinstance(error, ShuttingDownError):
        logger.critical("exiting with status 1: the engine loop died (%s: %s)", type(error).__name__, error)
        return 1
    return 0


def uses_engine_process(flag: bool | None, config: EngineConfig) -> bool:
    """--engine-process / --in-process, else the default: its own process on CUDA, where the engine process
    streamed 0.99x the offline engine's tok/s against 0.75x in-process (H200), and a thread on CPU."""
    if flag is not None:
        return flag
    if config.device is not None:
        return str(config.device).startswith("cuda")
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None, prog: str = "pagedkv serve") -> int:
    """Check the flags, bind the port, load the model, then serve until a signal (or the engine dies)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = engine_config(args)  # validate the flags before loading anything
    options = server_config(args)
    if args.ray:  # `pagedkv serve --ray` is dispatched to pagedkv.deploy.cli before it gets here
        raise ConfigError("spell out --ray in full (pagedkv serve ... --ray)")
    ray_only = [flag for flag, given in (("--direct-ingress", args.direct_ingress),
                                         ("--ray-separate-loops", args.ray_separate_loops),
                                         ("--ray-replica-on-loop", args.ray_replica_on_loop),
                                         ("--ray-no-lanes", args.ray_no_lanes)) if given]
    if ray_only:
        raise ConfigError(f"{ray_only[0]} is a Ray Serve setting: add --ray")
    sock = bind(args.host, args.port)  # a busy port fails now, not after the model has loaded
    try:
        from pagedkv.engine.engine import LLMEngine
        from pagedkv.server.app import DEFAULT_SERVED_MODEL_NAME, create_app

        if args.data_parallel_size > 1 or uses_engine_process(args.engine_process, config):
            from pagedkv.distributed.data_parallel import DataParallelEngine

            engine = DataParallelEngine(config, args.data_parallel_size, router_config=RouterConfig(args.routing))
        else:
            engine = LLMEngine(config)
        name = args.served_model_name or args.model or DEFAULT_SERVED_MODEL_NAME
        app = create_app(engine, name, config=options)
        freeze_heap()
        logger.info("serving %r on http://%s:%d/v1%s", name, args.host, sock.getsockname()[1],
                    " (API key required)" if options.api_key else "")
        return serve(app, sock, shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level)
    finally:
        sock.close()

